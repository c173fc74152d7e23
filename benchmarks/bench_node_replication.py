"""Blocked time per local save of the node-local checkpoint tier on 2 nodes, the copy to the next node included.

Each rank writes a shard of ``--mb`` MB (what torch_dist leaves: ``__<rank>_0.distcp``, rank 0's ``.metadata``)
through the real ``checkpointing.saver.Saver`` into its node's ``local_dir``, synchronously, ``--saves`` times, with
``--steps`` steps of ``--step-s`` seconds (a sleep and a world all-reduce each) between saves, each step ending in
the saver's one per-step call (``Saver.save``, as the training loop does); ``checkpoint.verify: size`` by default, so
that the figures are the write, the commit and the replication. ``--background`` writes each shard in a thread
(``checkpoint.async_save``: the save call returns at once, a later step's poll commits it) and ``--verify checksum``
records xxh3 checksums: together they measure what a background save's checksums cost training (issue 31 item 13).
Prints one JSON line: each save's ``blocked_s`` (the slowest rank's: training stood still that long), their median,
the wait at the end of the run (``finish``) and the wall time of the whole loop.

    # 2 "nodes" on this machine (2 processes, each its own folder; loopback TCP)
    python3 benchmarks/bench_node_replication.py --mb 256
    # the 2-node test cluster (bash environment/slurm-dev/up.sh --nodes 2): one rank per node
    srun -N2 -n2 python3 benchmarks/bench_node_replication.py --mb 256
    # background saves with checksums, no replication: the checksums' share of the blocked time
    srun -N2 -n2 python3 benchmarks/bench_node_replication.py --mb 1024 --background --verify checksum --no-replicate

``HPC_TOOLS_CHECKOUT=<folder>`` imports hpc_tools from another checkout (a ``git worktree`` of an older commit), to
measure the same loop before and after a change.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, os.environ.get("HPC_TOOLS_CHECKOUT") or str(Path(__file__).resolve().parents[1]))


class BackgroundWrite:
    """The ``Write`` a background save returns (``hpc_tools.train.engine.Write``): the shard written in a thread."""

    def __init__(self, write):
        self.ended, self.error = None, None
        self._thread = threading.Thread(target=self._run, args=(write,), name="bench-writer", daemon=True)
        self._thread.start()

    def _run(self, write) -> None:
        try:
            write()
        except BaseException as e:  # handed to finish()
            self.error = e
        self.ended = time.perf_counter()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def finish(self) -> None:
        self._thread.join()
        if self.error is not None:
            raise self.error

    def abort(self) -> None:
        self._thread.join()

    kill = abort


class Engine:
    checkpoints = True

    def __init__(self, rank: int, mb: int):
        self.rank, self.data = rank, os.urandom(mb << 20)

    def _write(self, folder: Path, step: int) -> None:
        with open(folder / f"__{self.rank}_0.distcp", "wb") as f:
            f.write(self.data)
            f.flush()
            os.fsync(f.fileno())
        if self.rank == 0:
            (folder / ".metadata").write_text(json.dumps({"step": step}))

    def write_checkpoint(self, folder: Path, step: int, background: bool):
        if background:
            return BackgroundWrite(lambda: self._write(folder, step))
        self._write(folder, step)
        return None

    def checkpoint_meta(self, step: int) -> dict:
        return {"format": "bench"}

    def start_background_writer(self) -> None:
        pass


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from hpc_tools.recipe.checkpoint import CheckpointConfig
    from hpc_tools.runtime.distenv import DistEnv, join_world
    from hpc_tools.train.checkpointing.agree import gather
    from hpc_tools.train.checkpointing.saver import LOCAL, Saver

    env = DistEnv.from_environ()
    env.export()
    if "SLURM_PROCID" in os.environ and "NODE_DIR" not in os.environ:
        node = os.environ.get("SLURMD_NODENAME") or os.uname().nodename  # a folder per node: the test cluster's
        os.environ["NODE_DIR"] = f"/tmp/bench-node-replication-{os.environ.get('SLURM_JOB_ID', 'x')}/{node}"
    join_world("gloo", env)
    fields = {"local_dir": "$NODE_DIR/ckpt", "local_interval_iters": args.steps, "interval_iters": 0,
              "keep_last": 2, "verify": args.verify, "local_replicate": not args.no_replicate,
              "async_save": args.background}
    if args.interface:
        fields["local_replicate_interface"] = args.interface
    config = CheckpointConfig(**fields)
    work = Path(os.environ["NODE_DIR"])
    ctx = SimpleNamespace(recipe=SimpleNamespace(checkpoint=config, cluster=SimpleNamespace(hang_timeout_min=0)),
                          checkpoint_dir=work / "shared", run_dir=work / "run", rank=env.rank,
                          is_rank0=env.rank == 0, device="cpu", dist=env, info=lambda *a: None)
    engine = Engine(env.rank, args.mb)
    saver = Saver(ctx, engine)
    records, t0, last = [], time.perf_counter(), args.saves * args.steps
    for step in range(1, last + 1):
        time.sleep(args.step_s)
        dist.all_reduce(torch.ones(1))
        if step < last:
            records += saver.save(step, last)
        else:  # the run's end would save to the shared tier (each bench "node" has its own): the local one instead
            records += saver.save_to(step, LOCAL, final=True)
    t_end = time.perf_counter()
    records += saver.finish()
    end_wait = time.perf_counter() - t_end
    blocked = [r.blocked_s for r in sorted(records, key=lambda r: r.iteration)]
    wall = time.perf_counter() - t0
    every = gather((blocked, end_wait, wall, env.node_rank))
    if env.rank == 0:
        per_save = [round(max(b[i] for b, _, _, _ in every), 3) for i in range(args.saves)]
        line = json.dumps({"mb_per_rank": args.mb, "ranks": env.world_size,
                          "nodes": len({n for *_, n in every}), "replicate": not args.no_replicate,
                          "background": args.background, "verify": args.verify,
                          "blocked_s": per_save, "median_blocked_s": round(statistics.median(per_save), 3),
                          # the run's last save is always synchronous: the background saves are the ones before it
                          **({"median_background_blocked_s": round(statistics.median(per_save[:-1]), 3)}
                             if args.background and len(per_save) > 1 else {}),
                          "end_wait_s": round(max(e for _, e, _, _ in every), 3),
                          "wall_s": round(max(w for _, _, w, _ in every), 3),
                          "checkout": os.environ.get("HPC_TOOLS_CHECKOUT") or "this one"})
        print(line, flush=True)
        if os.environ.get("BENCH_OUT"):  # the local launcher's ranks log to files: it prints this
            Path(os.environ["BENCH_OUT"]).write_text(line + "\n")
    dist.barrier()
    dist.destroy_process_group()
    if "SLURM_PROCID" in os.environ and env.local_rank == 0:
        import shutil

        shutil.rmtree(work.parent, ignore_errors=True)  # this job's node-local folders


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="MB per rank's shard")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="steps between local saves")
    parser.add_argument("--step-s", type=float, default=0.5, help="seconds of one step")
    parser.add_argument("--interface", default=None, help="checkpoint.local_replicate_interface")
    parser.add_argument("--no-replicate", action="store_true")
    parser.add_argument("--background", action="store_true",
                        help="checkpoint.async_save: each shard written in a thread, committed at a later step")
    parser.add_argument("--verify", choices=("size", "checksum"), default="size", help="checkpoint.verify")
    args = parser.parse_args()
    if "RANK" in os.environ or "SLURM_PROCID" in os.environ:
        rank_main(args)
        return 0
    from hpc_tools.testing.spawn import spawn_exit_code

    with tempfile.TemporaryDirectory(prefix="bench_replication_") as work:
        # 2 ranks as 2 nodes, each its own "node-local disk" (NODE_RANK and NODE_DIR per rank: set by the wrapper)
        wrapper = Path(work) / "rank.sh"
        wrapper.write_text(f'export NODE_RANK=$RANK LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 NODE_DIR={work}/node$RANK '
                           f'BENCH_OUT={work}/result.json\n'
                           f'exec {sys.executable} {Path(__file__).resolve()} {" ".join(sys.argv[1:])}\n')
        code = spawn_exit_code(["bash", str(wrapper)], 2, timeout_s=1800, log_tail=3000)
        if code == 0:
            print((Path(work) / "result.json").read_text(), end="")
        return code


if __name__ == "__main__":
    sys.exit(main())
