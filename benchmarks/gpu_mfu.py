"""MFU of a 1-3B GPT on one GPU with the Megatron-core backend, next to the planner's prediction.

    python benchmarks/gpu_mfu.py --size 1.3b                 # on a GPU node: trains, prints the figures
    python benchmarks/gpu_mfu.py --size 2.7b --min-mfu 0.45   # exit 1 below the floor
    python benchmarks/gpu_mfu.py --size 1.3b --dry-run        # anywhere: the recipe, layer plan and prediction only
    python benchmarks/gpu_mfu.py --size 1.3b --layers local   # no Transformer Engine: local layers, unfused attention

MFU uses the Megatron FLOPs convention (``profiling/flops.py``: model FLOPs = 3 x forward FLOPs of the dense
matrices, attention scores counted for the causal half, logits over the padded vocabulary, no recomputation), over
the peak of ``profiling/peaks.py`` for the detected GPU and bf16. Step time = the median of the timed steps after
the warm-up, each bracketed by ``torch.cuda.synchronize()``. The run is TP1 x PP1 on one GPU, bf16, Transformer
Engine layers with TE's own choice of attention (``attention: auto``; the script refuses to report a figure unless TE
chose its flash or cuDNN fused attention: anything else measures the slow path), no recomputation, synthetic data.
``--layers local`` measures Megatron-core's local layers with unfused attention instead (for a GPU machine without
Transformer Engine): a figure of the slow path, reported as such, not the MFU the recipes are planned for.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SIZES = {  # name -> (layers, hidden, heads): GPT-3 paper shapes
    "1.3b": (24, 2048, 16),
    "2.7b": (32, 2560, 32),
}
DEFAULT_GPU = "H100-SXM"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="1.3b", help="model shape (default 1.3b)")
    parser.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    parser.add_argument("--micro-batch", type=int, default=4, help="micro-batch size (default 4)")
    parser.add_argument("--accum", type=int, default=8, help="micro-batches per step (default 8)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--gpu-type", default=None,
                        help=f"GPU model for the planner and the peak (default: the detected GPU, else {DEFAULT_GPU})")
    parser.add_argument("--layers", choices=("te", "local"), default="te",
                        help="te: Transformer Engine layers and fused attention (default); local: Megatron-core's "
                             "local layers and unfused attention (no Transformer Engine needed; the slow path)")
    parser.add_argument("--min-mfu", type=float, default=None, help="exit 1 when the measured MFU is below this")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    parser.add_argument("--dry-run", action="store_true",
                        help="build the recipe, the layer plan and the planner's prediction; train nothing")
    return parser.parse_args(argv)


def build_recipe(args: argparse.Namespace, gpu_type: str):
    """gpt_3d's recipe reshaped to one GPU: TP1 x PP1, bf16, TE layers, flash-style attention, no recompute."""
    from hpc_tools.recipe.load import load_recipe

    layers_impl = (["backend.megatron.transformer_impl=transformer_engine", "backend.megatron.use_flash_attention=true"]
                   if args.layers == "te" else
                   ["backend.megatron.transformer_impl=local", "backend.megatron.use_flash_attention=false"])

    layers, hidden, heads = SIZES[args.size]
    return load_recipe(REPO / "recipes" / "gpt_3d.yaml", overrides=[
        f"model.num_layers={layers}", f"model.hidden_size={hidden}", f"model.num_attention_heads={heads}",
        f"model.seq_length={args.seq}", "parallel.tensor_size=1", "parallel.pipeline_size=1",
        "parallel.virtual_pipeline_size=null", "parallel.sequence_parallel=false", "parallel.data_size=-1",
        "cluster.nodes=1", "cluster.gpus_per_node=1", f"cluster.gpu_type={gpu_type}", "cluster.partition=null",
        f"training.micro_batch_size={args.micro_batch}", f"training.global_batch_size={args.micro_batch * args.accum}",
        f"training.train_iters={args.warmup + args.steps}", "training.lr_warmup_iters=1",
        "training.recompute_granularity=none",
        "training.precision=bf16", "backend.megatron.distributed_optimizer=false",
        "backend.megatron.overlap_grad_reduce=false", "backend.megatron.overlap_param_gather=false", *layers_impl])


def model_flops(recipe) -> float:
    """Model FLOPs of one step, Megatron convention, over the padded vocabulary (as the step collector counts)."""
    from profiling.flops import model_flops_per_step

    vocab = recipe.model.padded_vocab_size(1)
    return model_flops_per_step(recipe.model, recipe.training.global_batch_size, convention="megatron",
                                vocab_size=vocab)


def prediction(recipe) -> dict:
    from hpc_tools.planner import plan_recipe

    plan = plan_recipe(recipe, use_calibration=False)
    t = plan.time
    return {"step_s": t.total_s if t else None, "mfu": t.mfu if t else None,
            "memory_gb": plan.memory.total / 1e9, "efficiency": plan.efficiency}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(recipe, args: argparse.Namespace) -> dict:
    """Train warmup + steps steps on GPU 0; the figures of the timed steps."""
    import torch
    import torch.distributed as dist

    from hpc_tools.layout import ParallelLayout
    from hpc_tools.train.data import build_samples, microbatches_for_step
    from hpc_tools.train.megatron.engine import Engine
    from hpc_tools.train.megatron.layers import te_attention_choice
    from profiling.peaks import peak_for_recipe

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    layout = ParallelLayout.from_recipe(recipe)
    engine = Engine(recipe, layout, torch.device("cuda", 0))
    plan = engine.plan
    if args.layers == "te" and not (plan.transformer_engine and plan.flash_style):
        raise SystemExit(f"gpu_mfu: {plan.describe()}: not the fast path (Transformer Engine with flash/fused "
                         "attention); no figure reported")
    samples = build_samples(recipe)
    times, losses = [], []
    attention = "unfused (local layers)"
    torch.cuda.reset_peak_memory_stats()
    for step in range(1, args.warmup + args.steps + 1):
        batch = microbatches_for_step(samples, step, 0, layout)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = engine.train_step(step, batch)
        torch.cuda.synchronize()
        if step > args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(result.loss)
        if step == 1 and args.layers == "te":
            attention = te_attention_choice()  # TE chose at the first forward (attention=auto)
            if not attention or not attention.startswith(("flash", "fused")):
                raise SystemExit(f"gpu_mfu: Transformer Engine runs {attention or 'no recorded'} attention: not the "
                                 "fast path; no figure reported (run with NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 for TE's "
                                 "reasons)")
    engine.close()
    dist.destroy_process_group()
    step_s = statistics.median(times)
    name = torch.cuda.get_device_name(0)
    peak = peak_for_recipe(recipe, device_name=name)
    flops = model_flops(recipe)
    return {"device": name, "peak_tflops": peak, "layer_plan": plan.describe(), "attention": attention,
            "step_s": step_s,
            "tokens_per_s": recipe.training.global_batch_size * recipe.model.seq_length / step_s,
            "mfu": flops / step_s / (peak * 1e12) if peak else None, "model_flops": flops,
            "peak_memory_gib": torch.cuda.max_memory_allocated(0) / 2**30, "losses": losses}


def report(args: argparse.Namespace, recipe, predicted: dict, measured: dict | None) -> list[str]:
    m = recipe.model
    lines = [f"gpu_mfu: GPT {args.size} ({m.num_layers} layers x {m.hidden_size}, {m.num_attention_heads} heads), "
             f"seq {m.seq_length}, micro {args.micro_batch} x {args.accum}, bf16, TP1 x PP1 on "
             f"{recipe.cluster.gpu_type}",
             f"MFU convention: Megatron (profiling/flops.py), {model_flops(recipe):.3e} model FLOPs per step"]
    if measured:
        lines.append(f"layers: {measured['layer_plan']}; attention: {measured['attention']}")
        mfu = f"{measured['mfu']:.1%}" if measured["mfu"] is not None else "n/a (GPU not in the peak table)"
        lines.append(f"measured:  step {measured['step_s']:.3f} s (median of {args.steps}), "
                     f"{measured['tokens_per_s']:,.0f} tok/s, MFU {mfu}, "
                     f"peak memory {measured['peak_memory_gib']:.1f} GiB on {measured['device']}")
    if predicted["step_s"] is not None:
        lines.append(f"predicted: step {predicted['step_s']:.3f} s, MFU {predicted['mfu']:.1%}, memory "
                     f"{predicted['memory_gb']:.1f} GB (planner, efficiency {predicted['efficiency']:.2f})")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpu_type = args.gpu_type
    if not args.dry_run and gpu_type is None:
        import torch

        from profiling.peaks import canonical_gpu

        if not torch.cuda.is_available():
            print("gpu_mfu: no CUDA device (use --dry-run for the prediction only)", file=sys.stderr)
            return 2
        gpu_type = canonical_gpu(torch.cuda.get_device_name(0))
    recipe = build_recipe(args, gpu_type or DEFAULT_GPU)
    predicted = prediction(recipe)
    measured = None if args.dry_run else measure(recipe, args)
    for line in report(args, recipe, predicted, measured):
        print(line)
    if args.json:
        args.json.write_text(json.dumps({"size": args.size, "predicted": predicted, "measured": measured}, indent=2))
    if measured and args.min_mfu is not None and (measured["mfu"] or 0.0) < args.min_mfu:
        print(f"gpu_mfu: MFU {measured['mfu']} below the floor {args.min_mfu}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
