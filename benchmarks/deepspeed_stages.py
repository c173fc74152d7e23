"""The DeepSpeed stage table: ZeRO stage x precision x offload -> first/last loss and step time, one launch.

    python benchmarks/deepspeed_stages.py [--ranks 2] [--steps 20] [--out DIR]

Every configuration trains the local profile's model of recipes/gpt_zero.yaml (LLaMA-style, 2 layers, h64, GQA 4/2)
from the same initial weights on the same data, through the real trainer, in one launch of ``--ranks`` gloo CPU ranks.
Step time is the median over steps 2.. (step 1 carries one-off costs). On a shared CPU the times are indicative only.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hpc_tools.recipe.load import read_yaml  # noqa: E402
from hpc_tools.testing.matrix import launch  # noqa: E402

CONFIGS = [  # name, stage, precision, offload_optimizer, offload_param, pipeline
    ("z0 fp32", 0, "fp32", "none", "none", 1),
    ("z1 fp32", 1, "fp32", "none", "none", 1),
    ("z2 fp32", 2, "fp32", "none", "none", 1),
    ("z3 fp32", 3, "fp32", "none", "none", 1),
    ("z2 fp32 +opt-offload", 2, "fp32", "cpu", "none", 1),
    ("z3 fp32 +opt+param-offload", 3, "fp32", "cpu", "cpu", 1),
    ("z0 bf16", 0, "bf16", "none", "none", 1),
    ("z1 bf16", 1, "bf16", "none", "none", 1),
    ("z2 bf16", 2, "bf16", "none", "none", 1),
    ("z3 bf16", 3, "bf16", "none", "none", 1),
    ("z3 bf16 +opt+param-offload", 3, "bf16", "cpu", "cpu", 1),
    ("pp2 z1 fp32", 1, "fp32", "none", "none", 2),
]


def variants(ranks: int, steps: int) -> list[dict]:
    raw = read_yaml(REPO / "recipes" / "gpt_zero.yaml")
    local = raw["local"]
    out = []
    for name, stage, precision, off_opt, off_param, pipeline in CONFIGS:
        if ranks % pipeline:
            continue
        recipe = {"name": name.replace(" ", "_").replace("+", ""), "model": {**raw["model"], **local["model"]},
                  "parallel": {"pipeline_size": pipeline},
                  "training": {**local["training"], "train_iters": steps, "precision": precision},
                  "backend": {"kind": "deepspeed", "deepspeed": {
                      "zero_stage": stage, "offload_optimizer": off_opt, "offload_param": off_param,
                      "config_overrides": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
                      if stage == 3 else {}}},
                  "checkpoint": {"interval_iters": 0},
                  "cluster": {**local["cluster"], "gpus_per_node": ranks},
                  "profiling": {"summary_interval": 1000}}
        out.append({"name": recipe["name"], "label": name, "recipe": recipe})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None, help="keep the run folders here (default: a temporary folder)")
    args = parser.parse_args()
    vs = variants(args.ranks, args.steps)
    workdir = Path(args.out or tempfile.mkdtemp(prefix="ds_stages_"))
    t0 = time.perf_counter()
    results = launch(vs, args.ranks, workdir)
    wall = time.perf_counter() - t0
    print(f"DeepSpeed stage table: {args.ranks} CPU ranks (gloo), {args.steps} steps, global batch 8 x seq 64, "
          f"launch wall {wall:.1f} s")
    print(f"{'config':30s} {'loss@1':>8s} {f'loss@{args.steps}':>8s} {'step s (median)':>16s} {'engine+run s':>13s}")
    for v in vs:
        r = results[v["name"]]
        times = sorted(r["step_time_s"][1:])
        median = times[len(times) // 2]
        print(f"{v['label']:30s} {r['loss'][0]:8.4f} {r['loss'][-1]:8.4f} {median:16.4f} {sum(r['wall_s']):13.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
