"""Host syncs per training step on the default path (README command 1: gpt_3d's local profile, Megatron-core TP2 x
PP2 on 4 CPU ranks), before and after the changes that took them off the step's critical path.

Each rank runs under a ``sitecustomize`` (put first on PYTHONPATH by this script) that wraps, in every rank process:

* host reads of tensor values: ``Tensor.item``, ``float()``, ``int()``, ``bool()``, ``tolist`` (on a GPU each one
  waits for the device);
* blocking ``torch.distributed`` collectives (called without ``async_op=True``);
* step-record file writes (``profiling.records.RecordWriter``'s writes to its JSON-lines file);

and counts them between consecutive ``StepCollector.start_step`` calls, by caller: hpc_tools' own code (the loop,
the stop agreement, the engines, the collectors) apart from the libraries' (Megatron's optimizer, its schedules and
layers: model work, not the harness's). The figure per configuration is the median over the run's steps (a typical
step, neither a log line's nor a checkpoint's).

"before" re-creates the previous behaviour inside the rank processes: the stop agreement as a blocking all-reduce
plus ``.item()`` every step, and a record file write (line-buffered) every step.

    PYTHONPATH=. python benchmarks/bench_host_syncs.py [--steps 12] [--recipe recipes/gpt_moe.yaml]

``--recipe`` measures another recipe's local profile (gpt_moe's: EP2 on 4 CPU ranks, with the router figures).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "gpt_3d.yaml"

SITECUSTOMIZE = r'''
import atexit, functools, json, os, sys

OUT = os.environ["HPC_TOOLS_BENCH_SYNC_OUT"]
MODE = os.environ.get("HPC_TOOLS_BENCH_SYNC_MODE", "after")
counts, steps = {}, []


SKIP = ("torch", "profiling.comm", "sitecustomize", "functools", "contextlib")


def _owner(depth=2):
    """The first caller outside torch and the wrappers (the communication tracer's too): an hpc_tools module by
    name, else "libraries" (Megatron, DeepSpeed...)."""
    frame = sys._getframe(depth)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not name.startswith(SKIP):
            return name if name.startswith(("hpc_tools", "profiling")) else "libraries"
        frame = frame.f_back
    return "libraries"


def _count(kind, depth=3):
    key = f"{kind} ({_owner(depth)})"
    counts[key] = counts.get(key, 0) + 1


def _patch_torch():
    import torch
    import torch.distributed as dist

    def wrap_read(name):
        orig = getattr(torch.Tensor, name)

        def read(self, *a, **k):
            _count("host read")
            return orig(self, *a, **k)

        setattr(torch.Tensor, name, read)

    def wrap_collective(orig):
        @functools.wraps(orig)  # keeps the signature: the communication tracer binds arguments by name
        def coll(*a, **k):
            if not k.get("async_op"):
                _count("blocking collective")
            return orig(*a, **k)

        return coll

    for name in ("item", "__float__", "__int__", "__bool__", "tolist"):
        wrap_read(name)
    for name in ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                 "barrier", "send", "recv", "reduce"):
        setattr(dist, name, wrap_collective(getattr(dist, name)))


def _patch_hpc_tools():
    from profiling import collector, records
    from hpc_tools.runtime import context

    start = collector.StepCollector.start_step

    def start_step(self, step):
        steps.append(dict(counts))
        return start(self, step)

    collector.StepCollector.start_step = start_step
    flush = records.RecordWriter.flush

    def counted_flush(self):
        if self._buffer:
            counts["record file write (profiling.records)"] = counts.get(
                "record file write (profiling.records)", 0) + 1
        return flush(self)

    records.RecordWriter.flush = counted_flush
    if MODE == "before":
        init = records.RecordWriter.__init__

        def per_step_init(self, *a, **k):
            init(self, *a, **k)
            self.flush_every = 1

        records.RecordWriter.__init__ = per_step_init

        def agree_stop(self, final=False):
            import torch
            import torch.distributed as dist

            flag = torch.tensor([1.0 if self.stop.requested else 0.0], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0:
                self.stop.requested = True
                return True
            return False

        context.RankContext.agree_stop = agree_stop


import builtins
_real_import = builtins.__import__
_done = set()


_depth = [0]


def _import(name, *a, **k):
    _depth[0] += 1
    try:
        module = _real_import(name, *a, **k)
    finally:
        _depth[0] -= 1
    if _depth[0]:  # patch only once an outermost import statement is done (no half-imported torch)
        return module
    if "torch" not in _done and "torch.distributed" in sys.modules and "torch" in sys.modules:
        _done.add("torch")
        _patch_torch()
    if "hpc" not in _done and "profiling.collector" in sys.modules and "hpc_tools.runtime.context" in sys.modules:
        _done.add("hpc")
        _patch_hpc_tools()
    return module


if os.environ.get("RANK") is not None:
    builtins.__import__ = _import

    @atexit.register
    def _write():
        steps.append(dict(counts))
        with open(os.path.join(OUT, f"rank{os.environ['RANK']}.json"), "w") as f:
            json.dump(steps, f)
'''


def per_step(snapshots: list[dict[str, int]]) -> dict[str, float]:
    """Median per-step count of each kind, from the cumulative snapshots taken at each step start (the first step,
    which pays the warm-up, left out)."""
    deltas = []
    for a, b in zip(snapshots[1:], snapshots[2:]):
        deltas.append({k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b)})
    kinds = sorted({k for d in deltas for k in d})
    return {k: statistics.median(d.get(k, 0) for d in deltas) for k in kinds}


def measure(mode: str, steps: int, tmp: Path, recipe: Path = RECIPE) -> dict[int, dict[str, float]]:
    site = tmp / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    out = tmp / mode
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")]),
           "HPC_TOOLS_BENCH_SYNC_OUT": str(out), "HPC_TOOLS_BENCH_SYNC_MODE": mode}
    cmd = [sys.executable, "-m", "hpc_tools", "submit", str(recipe), "--executor", "local", "--json",
           "--runs-dir", str(tmp / f"runs-{mode}"), "--set", f"training.train_iters={steps}",
           "--set", "checkpoint.interval_iters=0", "--set", f"training.log_interval={steps}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        logs = "".join(p.read_text()[-3000:] for p in sorted((tmp / f"runs-{mode}").glob("*/logs/rank*.out")))
        raise SystemExit(f"{mode}: the run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}\n{logs}")
    return {int(p.stem[4:]): per_step(json.loads(p.read_text())) for p in sorted(out.glob("rank*.json"))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="training steps per run (default 12)")
    parser.add_argument("--recipe", type=Path, default=RECIPE, help="the recipe whose local profile runs "
                        "(default recipes/gpt_3d.yaml: TP2 x PP2, 4 CPU ranks)")
    args = parser.parse_args()
    recipe = args.recipe.resolve()
    with tempfile.TemporaryDirectory(prefix="bench-host-syncs-") as tmp:
        results = {mode: measure(mode, args.steps, Path(tmp), recipe) for mode in ("before", "after")}
    kinds = sorted({k for per_rank in results.values() for counts in per_rank.values() for k in counts})
    print(f"host syncs per step (median over steps 2..{args.steps}), {recipe.stem} local profile, 4 CPU ranks")
    print(f"{'kind (caller)':<42} {'rank':>4} {'before':>7} {'after':>7}")
    for kind in kinds:
        for rank in sorted(results["after"]):
            b = results["before"].get(rank, {}).get(kind, 0)
            a = results["after"].get(rank, {}).get(kind, 0)
            print(f"{kind:<42} {rank:>4} {b:>7g} {a:>7g}")
    for mode in ("before", "after"):
        own = {rank: sum(v for k, v in c.items() if "(libraries)" not in k) for rank, c in results[mode].items()}
        print(f"{mode}: hpc_tools' own host syncs per step, by rank: {own}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
