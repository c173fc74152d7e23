"""The node-local checkpoint tier across nodes, in ONE launch of 4 gloo ranks made to look like 2 nodes x 2 ranks.

    python tests/integration/node_tier_driver.py --out results.json

Without RANK in the environment it starts 4 copies of itself (``hpc_tools.testing.spawn``) and waits. Each rank
takes node ``rank // 2`` (NODE_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE as a launcher on 2 nodes sets them) and its own
"node-local disk" ``<work>/node<N>``: ``checkpoint.local_dir: $NODE_DIR/ckpt`` is expanded per rank, so the two
nodes' folders are two different folders of the same path string, as on a cluster. Through the real ``Saver`` and the
real ``checkpointing.resume``, with an engine that writes what torch_dist writes (a shard per rank,
``__<rank>_0.distcp``, and rank 0's ``.metadata``) and, at load, reads every rank's shard (as a replicated tensor is
read from the rank that saved it):

1. ``replicated``: shared save at step 3, local saves at 2 and 4 (step 4 in the background), each replicated in the
   background after its commit (the run's end waits for the last); what each node holds;
2. ``wiped``: node 1's disk emptied (a lost node, or a spare in its place); the resume takes step 4 (local, newer than
   the shared 3), copied back onto node 1 from node 0's replica; what node 1 holds after;
3. ``unreplicated``: with ``local_replicate: false`` a local save at step 6 keeps each node's own files only; node
   1's disk emptied again: step 6 cannot be restored (its node-1 files are gone), the resume takes step 4, which node
   0 still holds whole;
4. ``corrupt``: a byte of node 1's copy of step 4 changed: node 1's verification fails, every node sets its step 4
   aside, the resume falls back to the shared step 3;
5. ``one_folder``: a ``local_dir`` that is the same folder for both nodes (a shared file system given as the local
   tier): the tier is off, no step is due on it;
6. ``slow``: a local save at step 8 whose replication is slowed (``replica.INJECT_DELAY_S``, a pause per chunk):
   the save returns at once and the ranks go on stepping (a world all-reduce each) while the leaders' threads copy;
   the end of the run waits for the copy, which is then complete;
7. ``stalled``: a local save at step 10 whose replication stalls longer than its bound (the recipe's hang timeout,
   3 s here; a pause of 6 s per chunk): given up and told, replication off, the receiving folders' replica stays
   partial (never counted at resume), the ranks unharmed.

Rank 0 writes ``{case: {...}}`` as JSON; tests/integration/test_node_tier.py asserts on it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import _checkout  # noqa: F401  (this checkout on sys.path, before any hpc_tools import)

WORLD, PER_NODE = 4, 2
SHARD_BYTES = 50_000  # several transfer chunks (CHUNK is lowered below)


def shard(step: int, rank: int) -> bytes:
    return bytes((step * 31 + rank * 7 + i) % 251 for i in range(SHARD_BYTES + rank))


class Write:
    ended = None

    def done(self) -> bool:
        return True

    def finish(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def kill(self) -> None:
        pass


class Engine:
    """What torch_dist leaves on disk: one shard per rank and rank 0's metadata; a load reads every rank's shard."""

    checkpoints = True

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def write_checkpoint(self, folder: Path, step: int, background: bool):
        (folder / f"__{self.rank}_0.distcp").write_bytes(shard(step, self.rank))
        if self.rank == 0:
            (folder / ".metadata").write_text(json.dumps({"step": step, "world": self.world}))
        return Write() if background else None

    def checkpoint_meta(self, step: int) -> dict:
        return {"format": "fake_torch_dist"}

    def start_background_writer(self) -> None:
        pass

    def resume(self, source: Path) -> int:
        step = json.loads((source / ".metadata").read_text())["step"]
        for r in range(self.world):
            if (source / f"__{r}_0.distcp").read_bytes() != shard(step, r):
                raise RuntimeError(f"shard of rank {r} differs")
        return step


def held(root: Path) -> dict[str, list[str]]:
    """{checkpoint folder: its files} under one node's local tier."""
    if not root.is_dir():
        return {}
    return {p.name: sorted(f.name for f in p.iterdir()) for p in sorted(root.iterdir()) if p.is_dir()}


def rank_main(out: Path) -> None:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    node = rank // PER_NODE
    work = Path(os.environ["NODE_TIER_WORK"])
    os.environ.update({"NODE_RANK": str(node), "LOCAL_RANK": str(rank % PER_NODE),
                       "LOCAL_WORLD_SIZE": str(PER_NODE), "NODE_DIR": str(work / f"node{node}")})

    from hpc_tools.checkpoints.dirs import CheckpointDirs
    from hpc_tools.recipe.checkpoint import CheckpointConfig
    from hpc_tools.runtime.distenv import DistEnv, join_world
    from hpc_tools.train.checkpointing import node_tier
    from hpc_tools.train.checkpointing.resume import resume
    from hpc_tools.train.checkpointing.saver import LOCAL, SHARED, Saver

    node_tier.CHUNK = 4096
    assert join_world("gloo").world_size == WORLD
    infos: list[str] = []
    logged: list[str] = []  # the hpc_tools logger's warnings (rank 0 tells them)
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("hpc_tools").addHandler(handler)

    def ctx_for(hang_timeout_min: float = 0.0, **ck):
        config = CheckpointConfig(**{"keep_last": 5, "local_dir": "$NODE_DIR/ckpt", "local_interval_iters": 2,
                                     "interval_iters": 3, "async_save": True, **ck})
        recipe = SimpleNamespace(checkpoint=config, cluster=SimpleNamespace(hang_timeout_min=hang_timeout_min))
        return SimpleNamespace(recipe=recipe, checkpoint_dir=work / "shared",
                               run_dir=work / "run", rank=rank, is_rank0=rank == 0, device="cpu",
                               dist=DistEnv.from_environ(), info=lambda msg, *a: infos.append(msg % a))

    mine = Path(os.environ["NODE_DIR"]) / "ckpt" / "run"  # <local_dir>/<run folder name>
    engine = Engine(rank, WORLD)
    results: dict = {}

    def wipe(node_index: int) -> None:
        if node == node_index and rank % PER_NODE == 0:
            shutil.rmtree(mine)
        dist.barrier()

    def nodes_hold() -> list:
        return [x for r, x in enumerate(node_tier.gather(held(mine))) if r % PER_NODE == 0]

    # 1. replicated saves
    ctx = ctx_for()
    saver = Saver(ctx, engine)
    recs = saver.save_to(2, LOCAL, final=True) + saver.save_to(3, SHARED, final=True)
    recs += saver.save_to(4, LOCAL, final=False)
    recs += saver.finish()  # the end of a run: the background write committed, its replica waited for
    results["replicated"] = {"records": [r.as_dict() for r in recs], "nodes": nodes_hold(),
                             "nodes_count": saver.nodes.count, "leaders": saver.nodes.leaders}
    # 2. node 1 wiped: step 4 from node 0's replica
    wipe(1)
    results["wiped"] = {"resumed": resume(ctx, engine), "nodes": nodes_hold()}
    # 3. no replication: step 6 lost with node 1's disk
    ctx6 = ctx_for(local_replicate=False)
    saver = Saver(ctx6, engine)
    recs = saver.save_to(6, LOCAL, final=True)
    before = nodes_hold()
    wipe(1)
    results["unreplicated"] = {"records": [r.as_dict() for r in recs], "nodes_before": before,
                               "resumed": resume(ctx6, engine), "nodes": nodes_hold()}
    # 4. node 1's copy of step 4 corrupted
    if node == 1 and rank % PER_NODE == 0:
        victim = mine / "iter_0000004" / "__0_0.distcp"
        data = bytearray(victim.read_bytes())
        data[100] ^= 0xFF
        victim.write_bytes(bytes(data))
    dist.barrier()
    infos.clear()
    results["corrupt"] = {"resumed": resume(ctx, engine), "nodes": nodes_hold(), "log": list(infos)}
    # 5. one folder for both nodes
    saver = Saver(ctx_for(local_dir=str(work / "one" / "ckpt")), engine)
    results["one_folder"] = {"local": saver.local is not None, "due_at_2": saver.tier_due(2, 10, False),
                             "left": sorted(p.name for p in (work / "one" / "ckpt" / "run").iterdir())}
    # 6. a slowed replication: the ranks step on meanwhile
    import threading
    import time

    import torch

    from hpc_tools.train.checkpointing import replica

    def replicating() -> bool:  # this leader's copy still running (the others: never)
        return any(t.name.startswith("ckpt-replica-") and t.is_alive() for t in threading.enumerate())

    os.environ[replica.INJECT_DELAY_ENV] = "0.02"  # ~13 chunks per shard: ~1 s per node's files
    saver = Saver(ctx_for(), engine)
    t0 = time.perf_counter()
    recs = saver.save_to(8, LOCAL, final=True)
    steps = 0
    while node_tier.gather(replicating())[0] and steps < 10_000:  # rank 0 (node 0's leader) decides for all
        t = torch.ones(1)
        dist.all_reduce(t)  # a training step's collective on the run's group, beside the thread's sends
        steps += 1
        time.sleep(0.01)
    stepping_s = time.perf_counter() - t0
    infos.clear()
    saver.finish()
    results["slow"] = {"records": [r.as_dict() for r in recs], "steps_while_replicating": steps,
                       "stepping_s": stepping_s, "nodes": nodes_hold(), "log": list(infos)}
    # 7. a stalled replication: given up within its bound, told, never counted
    os.environ[replica.INJECT_DELAY_ENV] = "6"
    saver = Saver(ctx_for(hang_timeout_min=0.05), engine)  # the bound: 3 s
    recs = saver.save_to(10, LOCAL, final=True)
    t0 = time.perf_counter()
    saver.finish()
    waited = time.perf_counter() - t0
    os.environ.pop(replica.INJECT_DELAY_ENV)
    for t in threading.enumerate():  # the abandoned threads end with their group's timeout
        if t.name.startswith("ckpt-replica-"):
            t.join(60)
    holds = node_tier.holdings(CheckpointDirs(mine), skip=[]) if rank % PER_NODE == 0 else {}
    counted = {n for n in holds.get(10, ({}, {}))[1] if n.endswith(".distcp") or n == ".metadata"}
    results["stalled"] = {"waited_s": waited, "replicator_off": saver.replicator is None,
                          "nodes": nodes_hold(), "warnings": [ln for ln in logged if "not complete" in ln],
                          "counted": [c for r, c in enumerate(node_tier.gather(sorted(counted))) if r % PER_NODE == 0]}
    if rank == 0:
        out.write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def launch(out: Path, timeout_s: float = 300) -> int:
    from hpc_tools.testing.spawn import spawn_exit_code

    with tempfile.TemporaryDirectory(prefix="node_tier_") as work:
        return spawn_exit_code([sys.executable, __file__, "--out", str(out)], WORLD,
                               env={"NODE_TIER_WORK": work}, timeout_s=timeout_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the results (written by rank 0)")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        return launch(args.out)
    rank_main(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
