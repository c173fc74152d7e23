"""Blocked time of a background checkpoint save against a synchronous save of the same model, on the local executor.

One ~27M-parameter GPT (Megatron-core, 8 layers x 512 hidden, vocabulary 4096, distributed optimizer, DP2 on 2 CPU
ranks: the recipes/gpt_3d.yaml local profile resized) is trained twice for ``--steps`` steps with a checkpoint every
``--every`` steps: once with ``checkpoint.async_save: true`` and once without. Both runs are made by this one
invocation, one after the other on the same machine. What is printed comes from the runs' own records (the
``checkpoint_save`` events that ``status --json`` lists as ``checkpoints``): per save, the time training was blocked
(``blocked_s``) and the time to the end of its write (``write_s``). The last save of the async run is synchronous
by design (the end of a run waits for its write): it is listed but not counted with the background ones.

Goal (issue 24): the median background save blocks training for at most a quarter of the median synchronous save.

    PYTHONPATH=. python benchmarks/bench_async_checkpoint.py [--steps 20] [--every 5] [--dir /tmp/x] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODEL = ["model.num_layers=8", "model.hidden_size=512", "model.num_attention_heads=8", "model.seq_length=128",
         "model.vocab_size=4096"]
LAYOUT = ["parallel.tensor_size=1", "parallel.sequence_parallel=false", "parallel.pipeline_size=1",
          "parallel.virtual_pipeline_size=null", "cluster.gpus_per_node=2", "training.micro_batch_size=2",
          "training.global_batch_size=4", "training.eval_interval=null"]


def run(root: Path, steps: int, every: int, background: bool) -> tuple[list[dict], int, float]:
    """One local run; (its rank-0 saves, the model's parameter count, the run's wall seconds)."""
    from hpc_tools.analysis.live import checkpoint_saves
    from hpc_tools.executors.local import run_local
    from hpc_tools.layout import ParallelLayout
    from hpc_tools.planner.arch import arch_for, total_parameters
    from hpc_tools.recipe.load import load_recipe
    from hpc_tools.submission import new_run

    sets = [*MODEL, *LAYOUT, f"training.train_iters={steps}", f"checkpoint.interval_iters={every}",
            f"checkpoint.keep_last={steps}", f"checkpoint.async_save={str(background).lower()}",
            "training.log_interval=100"]
    recipe = load_recipe(REPO / "recipes" / "gpt_3d.yaml", sets, profile="local")
    folder = new_run(recipe, root, "local", source="gpt_3d.yaml")
    t0 = time.perf_counter()
    rc = run_local(folder, ParallelLayout.from_recipe(recipe).world_size, extra_env={"PYTHONPATH": str(REPO)})
    wall = time.perf_counter() - t0
    if rc != 0:
        sys.exit(f"the {'async' if background else 'sync'} run failed (exit {rc}): see {folder.logs_dir}")
    return checkpoint_saves(folder), total_parameters(arch_for(recipe)), wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--dir", default=None, help="keep the runs here (default: a temporary folder, removed)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(args.dir) if args.dir else Path(tmp)
        bg, params, wall_bg = run(where / "async", args.steps, args.every, True)
        sync, _, wall_sync = run(where / "sync", args.steps, args.every, False)
    print(f"model: {params / 1e6:.1f} M parameters, DP2 on 2 CPU ranks (gloo), a save every {args.every} of "
          f"{args.steps} steps")
    print(f"{'run':<6} {'step':>4} {'tier':<7} {'async':<5} {'blocked_s':>9} {'write_s':>8}")
    for name, saves in (("async", bg), ("sync", sync)):
        for c in saves:
            print(f"{name:<6} {c['iteration']:>4} {c['tier']:<7} {str(c['async']):<5} {c['blocked_s']:>9.3f} "
                  f"{c['write_s']:>8.3f}")
    background = [c for c in bg if c["async"] and c["verified"]]
    steady = background[1:] or background  # the first one also pays the writer's first fork
    synchronous = [c for c in sync if not c["async"]]
    blocked = statistics.median(c["blocked_s"] for c in steady)
    written = statistics.median(c["write_s"] for c in steady)
    sync_s = statistics.median(c["blocked_s"] for c in synchronous)
    figures = {"params": params, "async_blocked_s_median": blocked, "async_write_s_median": written,
               "sync_save_s_median": sync_s, "blocked_over_sync": blocked / sync_s,
               "blocked_over_own_write": blocked / written, "first_async_blocked_s": background[0]["blocked_s"],
               "run_wall_s": {"async": wall_bg, "sync": wall_sync}, "saves": {"async": bg, "sync": sync}}
    print(f"background save (median of {len(steady)}, after the first): blocked {blocked:.3f} s, written in "
          f"{written:.3f} s; synchronous save (median of {len(synchronous)}): {sync_s:.3f} s")
    verdict = "met" if blocked / sync_s <= 0.25 else "NOT met"
    print(f"blocked / synchronous save = {blocked / sync_s:.2f} (goal <= 0.25: {verdict}); blocked / its own "
          f"write = {blocked / written:.2f}; first background save blocked "
          f"{background[0]['blocked_s']:.3f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
