"""Planner figures: the configuration search's time for 1024 GPUs, and the step-time model against Narayanan et al.

    python benchmarks/bench_planner_search.py [--repeat 5] [--json]

1. ``search`` for 128 nodes x 8 H100-SXM (1024 GPUs) on three models: GPT-3 175B (Megatron), a LLaMA-70B-shaped
   model with GQA and SwiGLU (Megatron), a LLaMA-7B-shaped model under DeepSpeed ZeRO. Wall time per search
   (median / min / max over --repeat runs, one process), configurations scored, the winner. Budget: under 1 s.
2. Predicted vs published TFLOP/s per GPU for Narayanan et al. 2021 Table 1 (A100-80GB, their TP/PP/GPUs/batch,
   full recomputation, micro batch 1, no interleaving; FLOPs by their eq. 3 = profiling.flops korthikanti + full), at
   the planner's default efficiency. Nothing is calibrated on these numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hpc_tools.planner.estimate import make_plan  # noqa: E402
from hpc_tools.planner.search import search  # noqa: E402
from hpc_tools.recipe.load import load_recipe  # noqa: E402

CLUSTER_1024 = ["cluster.nodes=128", "cluster.gpus_per_node=8", "cluster.gpu_type=H100-SXM"]
SEARCHES = {
    "GPT-3 175B, megatron, B=1536 x 2048": ("gpt_3d.yaml", [
        "model.num_layers=96", "model.hidden_size=12288", "model.num_attention_heads=96", "model.seq_length=2048",
        "training.global_batch_size=1536"]),
    "LLaMA-70B shape (GQA 8, SwiGLU), megatron, B=1024 x 4096": ("gpt_3d.yaml", [
        "model.family=llama", "model.num_layers=80", "model.hidden_size=8192", "model.num_attention_heads=64",
        "model.num_query_groups=8", "model.ffn_hidden_size=28672", "model.seq_length=4096",
        "model.vocab_size=128256", "training.global_batch_size=1024"]),
    "LLaMA-7B shape, deepspeed ZeRO, B=2048 x 4096": ("gpt_zero.yaml", [
        "model.num_layers=32", "model.hidden_size=4096", "model.num_attention_heads=32", "model.num_query_groups=32",
        "model.ffn_hidden_size=11008", "model.seq_length=4096", "training.global_batch_size=2048"]),
}
# Narayanan et al. 2021 Table 1: billions, heads, hidden, layers, TP, PP, GPUs, batch, published TFLOP/s per GPU
NARAYANAN = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
             (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
             (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
             (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
             (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]


def bench_search(repeat: int) -> list[dict]:
    rows = []
    for label, (name, sets) in SEARCHES.items():
        recipe = load_recipe(REPO / "recipes" / name, sets + CLUSTER_1024, check=False)
        times, result = [], None
        for _ in range(repeat):
            started = time.perf_counter()
            result = search(recipe, top=5, losers=5, use_calibration=False)
            times.append(time.perf_counter() - started)
        best = result.best
        rows.append({"search": label, "enumerated": result.enumerated, "fitting": result.fitting,
                     "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
                     "best": best.knobs.describe() if best else None, "best_step_s": best.step_s if best else None,
                     "best_mfu": best.time.mfu if best else None})
    return rows


def bench_narayanan() -> list[dict]:
    rows = []
    for billions, heads, hidden, layers, t, p, gpus, batch, published in NARAYANAN:
        sets = [f"model.num_layers={layers}", f"model.hidden_size={hidden}", f"model.num_attention_heads={heads}",
                "model.seq_length=2048", "model.vocab_size=51200", f"parallel.tensor_size={t}",
                f"parallel.pipeline_size={p}", "parallel.virtual_pipeline_size=null", "parallel.data_size=-1",
                "parallel.sequence_parallel=false", f"cluster.nodes={gpus // 8}", "cluster.gpu_type=A100-80GB",
                "training.micro_batch_size=1", f"training.global_batch_size={batch}",
                "training.recompute_granularity=full", "profiling.flops_convention=korthikanti",
                "backend.megatron.distributed_optimizer=false", "backend.megatron.overlap_grad_reduce=false",
                "backend.megatron.overlap_param_gather=false"]
        plan = make_plan(load_recipe(REPO / "recipes/gpt_3d.yaml", sets))
        predicted = plan.time.hardware_flops / plan.time.total_s / gpus / 1e12
        rows.append({"billions": billions, "tp": t, "pp": p, "gpus": gpus, "batch": batch,
                     "published_tflops": published, "predicted_tflops": predicted, "ratio": predicted / published,
                     "memory_gb": plan.memory.total / 1e9, "fits_80gb": plan.fits})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    searches, narayanan = bench_search(args.repeat), bench_narayanan()
    if args.json:
        print(json.dumps({"search_1024_gpus": searches, "narayanan_table1": narayanan}, indent=2))
        return
    print("Search over 128 x 8 H100-SXM = 1024 GPUs (budget < 1 s per search)")
    for r in searches:
        print(f"  {r['search']}: {r['enumerated']} configurations ({r['fitting']} fit), median {r['median_s']:.3f} s "
              f"(min {r['min_s']:.3f}, max {r['max_s']:.3f}); best {r['best']}: {r['best_step_s']:.2f} s/step, "
              f"MFU {r['best_mfu']:.1%}")
    print("Narayanan et al. 2021 Table 1 on A100-80GB: predicted vs published TFLOP/s per GPU (default efficiency)")
    print(f"  {'params':>8} {'TP':>3} {'PP':>3} {'GPUs':>5} {'batch':>5} {'published':>9} {'predicted':>9} "
          f"{'ratio':>6} {'GB/GPU':>7}")
    for r in narayanan:
        print(f"  {r['billions']:>7.1f}B {r['tp']:>3} {r['pp']:>3} {r['gpus']:>5} {r['batch']:>5} "
              f"{r['published_tflops']:>9.0f} {r['predicted_tflops']:>9.1f} {r['ratio']:>6.2f} {r['memory_gb']:>7.1f}")


if __name__ == "__main__":
    main()
