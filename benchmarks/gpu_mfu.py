"""MFU of a 1-3B model on one GPU with the Megatron-core or the FSDP backend, next to the planner's prediction.

    python benchmarks/gpu_mfu.py --size 1.3b                 # on a GPU node: trains, prints the figures
    python benchmarks/gpu_mfu.py --size 2.7b --min-mfu 0.45   # exit 1 below the floor
    python benchmarks/gpu_mfu.py --size 1.3b --dry-run        # anywhere: the recipe, layer plan and prediction only
    python benchmarks/gpu_mfu.py --size 1.3b --layers sdpa    # no Transformer Engine: local layers, SDPA attention
    python benchmarks/gpu_mfu.py --size 1.3b --layers local   # no Transformer Engine: local layers, unfused attention
    python benchmarks/gpu_mfu.py --backend fsdp --size 1.3b [--liger] [--no-compile]   # the Hugging Face path

MFU uses the Megatron FLOPs convention (``profiling/flops.py``: model FLOPs = 3 x forward FLOPs of the dense
matrices, attention scores counted for the causal half, logits over the vocabulary the model holds (Megatron's padded
one), no recomputation), over the peak of ``profiling/peaks.py`` for the detected GPU and bf16. Step time = the median
of the timed steps after the warm-up, each bracketed by ``torch.cuda.synchronize()``. Synthetic data, bf16, no
recomputation, one GPU.

``--backend megatron`` (default): gpt_3d's recipe as TP1 x PP1, Transformer Engine layers with TE's own choice of
attention (``attention: auto``; the script refuses to report a figure unless TE chose its flash or cuDNN fused
attention: anything else measures the slow path). ``--layers sdpa`` measures Megatron-core's local layers with
attention on torch's scaled_dot_product_attention (a GPU without Transformer Engine); ``--layers local`` the local
layers with unfused attention (the slow path, reported as such).

``--backend fsdp``: llama_fsdp's recipe on one GPU, the size's shape as a Llama (RMSNorm, SwiGLU with an 8/3 h
hidden size rounded up to 256, RoPE), Hugging Face's LlamaForCausalLM with SDPA attention, FSDP2 full_shard (one rank:
``reshard_after_forward: false``, one gather per step), bf16 MixedPrecisionPolicy, each block compiled
(``backend.fsdp.compile``; ``--no-compile`` for eager) and, with ``--liger``, Liger Kernel's RMSNorm, SwiGLU, RoPE and
fused linear cross entropy (``backend.fsdp.liger``). The step is the backend's own (``FSDPJob.step``: forward/backward
of every microbatch, the loss all-reduce, the clipped gradient norm, AdamW). ``--size llama-1b`` is Llama 3.2 1B's
shape (16 x 2048, 32 heads, 8 key-value groups, ffn 8192, vocabulary 128256, tied embeddings), for either backend:
``benchmarks/gpu_side_by_side.py`` runs it beside torchtitan's. ``--cpu`` runs the same code on the CPU (gloo, fp32
for the tiny size: a check of the script, no figure of any use).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SIZES = {  # name -> the model section's shape: GPT-3 paper shapes, Llama 3.2 1B, and a tiny one for --cpu checks
    "1.3b": {"num_layers": 24, "hidden_size": 2048, "num_attention_heads": 16, "vocab_size": 50257},
    "2.7b": {"num_layers": 32, "hidden_size": 2560, "num_attention_heads": 32, "vocab_size": 50257},
    "llama-1b": {"family": "llama", "num_layers": 16, "hidden_size": 2048, "num_attention_heads": 32,
                 "num_query_groups": 8, "ffn_hidden_size": 8192, "vocab_size": 128256, "rotary_base": 500000,
                 "untie_embeddings": False},
    "tiny": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 512},
}
DEFAULT_GPU = "H100-SXM"
LAYERS = {  # --layers -> Megatron's layer implementation and use_flash_attention
    "te": ("transformer_engine", True), "sdpa": ("local", True), "local": ("local", False)}


def llama_ffn(hidden: int) -> int:
    """SwiGLU's hidden size for a Llama of width ``hidden``: 8/3 h rounded up to a multiple of 256 (Llama's rule)."""
    return -(-8 * hidden // 3 // 256) * 256


def model_overrides(args: argparse.Namespace) -> list[str]:
    """``model.*`` overrides of the size: as given, and as a Llama for the FSDP backend (which has no GPT-3 shape:
    its gpt family is GPT-2 with learned positions)."""
    shape = dict(SIZES[args.size], seq_length=args.seq)
    if args.backend == "fsdp" and shape.get("family") != "llama":
        shape.update(family="llama", num_query_groups=None, ffn_hidden_size=llama_ffn(shape["hidden_size"]))
    if shape.get("family") == "llama":
        shape.setdefault("num_query_groups", None)
        shape.setdefault("rotary_base", 10000)
    return [f"model.{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}"
            for k, v in shape.items()]


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
    parser.add_argument("--backend", choices=("megatron", "fsdp"), default="megatron",
                        help="megatron: Megatron-core GPT (default); fsdp: Hugging Face Llama under FSDP2")
    parser.add_argument("--layers", choices=tuple(LAYERS), default="te",
                        help="megatron only. te: Transformer Engine layers and fused attention (default); sdpa: "
                             "Megatron-core's local layers, attention on torch's SDPA (no Transformer Engine); "
                             "local: local layers and unfused attention (the slow path)")
    parser.add_argument("--no-compile", action="store_true", help="fsdp only: eager blocks (default: compiled)")
    parser.add_argument("--liger", action="store_true",
                        help="fsdp only: Liger Kernel's RMSNorm, SwiGLU, RoPE and fused linear cross entropy")
    parser.add_argument("--cpu", action="store_true",
                        help="run on the CPU (gloo): a check of the script itself, with --size tiny")
    parser.add_argument("--min-mfu", type=float, default=None, help="exit 1 when the measured MFU is below this")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    parser.add_argument("--dry-run", action="store_true",
                        help="build the recipe, the layer plan and the planner's prediction; train nothing")
    return parser.parse_args(argv)


def build_recipe(args: argparse.Namespace, gpu_type: str):
    """The backend's recipe reshaped to one GPU: TP1 x PP1, bf16 (fp32 for --cpu), no recompute, synthetic data."""
    from hpc_tools.recipe.load import load_recipe

    common = [*model_overrides(args), "parallel.tensor_size=1", "parallel.pipeline_size=1", "parallel.data_size=-1",
              "cluster.nodes=1", "cluster.gpus_per_node=1", f"cluster.gpu_type={'cpu' if args.cpu else gpu_type}",
              "cluster.partition=null", f"training.micro_batch_size={args.micro_batch}",
              f"training.global_batch_size={args.micro_batch * args.accum}",
              f"training.train_iters={args.warmup + args.steps}", "training.lr_warmup_iters=1",
              "training.recompute_granularity=none", f"training.precision={'fp32' if args.cpu else 'bf16'}",
              "checkpoint.interval_iters=0"]
    if args.backend == "fsdp":
        return load_recipe(REPO / "recipes" / "llama_fsdp.yaml", overrides=[
            *common, "backend.fsdp.strategy=full_shard", "backend.fsdp.reshard_after_forward=false",
            f"backend.fsdp.compile={str(not args.no_compile).lower()}",
            f"backend.fsdp.liger={str(args.liger).lower()}"])
    impl, flash = LAYERS[args.layers]
    return load_recipe(REPO / "recipes" / "gpt_3d.yaml", overrides=[
        *common, "parallel.virtual_pipeline_size=null", "parallel.sequence_parallel=false",
        "backend.megatron.distributed_optimizer=false", "backend.megatron.overlap_grad_reduce=false",
        "backend.megatron.overlap_param_gather=false", f"backend.megatron.transformer_impl={impl}",
        f"backend.megatron.use_flash_attention={str(flash).lower()}"])


def model_flops(recipe) -> float:
    """Model FLOPs of one step, Megatron convention, over the vocabulary the model holds (Megatron pads it; the
    Hugging Face model does not), as the step collector counts."""
    from hpc_tools import backends
    from profiling.flops import model_flops_per_step

    pads = backends.of(recipe).pads_vocab
    vocab = recipe.model.padded_vocab_size(1) if pads else recipe.model.vocab_size
    return model_flops_per_step(recipe.model, recipe.training.global_batch_size, convention="megatron",
                                vocab_size=vocab)


def prediction(recipe) -> dict:
    from hpc_tools.planner import plan_recipe

    plan = plan_recipe(recipe, use_calibration=False)
    t = plan.time
    return {"step_s": t.total_s if t else None, "mfu": t.mfu if t else None,
            "memory_gb": plan.memory.total / 1e9, "efficiency": plan.efficiency}


def _join(cpu: bool):
    """One-rank process group on GPU 0 (nccl) or the CPU (gloo); the device. It joins as every rank does
    (``distenv.join_world``), serving its store on a port held from the moment it is chosen (``listening_socket``):
    the CPU check runs beside other tests' ranks, which could take a port chosen and let go."""
    import torch

    from hpc_tools.runtime.distenv import STORE_FD_ENV, join_world, listening_socket

    sock = listening_socket()
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(sock.getsockname()[1]), "RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_RANK": "0", STORE_FD_ENV: str(sock.fileno())})
    if cpu:
        join_world("gloo")
        return torch.device("cpu")
    torch.cuda.set_device(0)
    join_world("nccl")
    torch.cuda.reset_peak_memory_stats()
    return torch.device("cuda", 0)


def _timed(args: argparse.Namespace, device, run_step, after_first=None) -> tuple[list[float], list[float]]:
    """(times of the steps after the warm-up, every step's loss): ``run_step(step) -> loss``, each step bracketed by
    a device synchronisation."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, losses = [], []
    for step in range(1, args.warmup + args.steps + 1):
        sync()
        t0 = time.perf_counter()
        losses.append(run_step(step))
        sync()
        if step > args.warmup:
            times.append(time.perf_counter() - t0)
        if step == 1 and after_first:
            after_first()
    return times, losses


def measure_megatron(recipe, args: argparse.Namespace, device) -> tuple[dict, list[float], list[float]]:
    """Megatron-core's engine on this device: (what ran, step times, losses)."""
    from hpc_tools.layout import ParallelLayout
    from hpc_tools.train.data import build_samples, microbatches_for_step
    from hpc_tools.train.megatron.engine import MegatronCore
    from hpc_tools.train.megatron.layers import te_attention_choice

    layout = ParallelLayout.from_recipe(recipe)
    engine = MegatronCore(recipe, layout, device)
    plan = engine.plan
    if args.layers == "te" and not (plan.transformer_engine and plan.flash_style):
        raise SystemExit(f"gpu_mfu: {plan.describe()}: not the fast path (Transformer Engine with flash/fused "
                         "attention); no figure reported")
    if args.layers == "sdpa" and not plan.sdpa:
        raise SystemExit(f"gpu_mfu: {plan.describe()}: not the SDPA path; no figure reported")
    samples = build_samples(recipe)
    ran = {"layer_plan": plan.describe(), "attention": plan.path}

    def check_te():  # TE chose its kernel at the first forward (attention=auto)
        choice = te_attention_choice()
        ran["attention"] = choice
        if not choice or not choice.startswith(("te-flash", "te-fused")):
            raise SystemExit(f"gpu_mfu: Transformer Engine runs {choice or 'no recorded'} attention: not the fast "
                             "path; no figure reported (run with NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 for TE's reasons)")

    times, losses = _timed(args, device, lambda step: engine.train_step(
        step, microbatches_for_step(samples, step, 0, layout)).loss, check_te if args.layers == "te" else None)
    engine.close()
    return ran, times, losses


def measure_fsdp(recipe, args: argparse.Namespace, device) -> tuple[dict, list[float], list[float]]:
    """The FSDP backend's own job (``FSDPJob``: model, FSDP2, optimizer, prefetched batches, ``step``) on this
    device, given the one-rank context it reads: (what ran, step times, losses)."""
    from types import SimpleNamespace

    from hpc_tools.layout import ParallelLayout
    from hpc_tools.train.fsdp.trainer import FSDPJob

    notes: list[str] = []
    ctx = SimpleNamespace(recipe=recipe, layout=ParallelLayout.from_recipe(recipe), device=device, rank=0,
                          dist=SimpleNamespace(world_size=1), info=lambda fmt, *a: notes.append(fmt % a))
    job = FSDPJob(ctx)
    times, losses = _timed(args, device, lambda step: job.step(step, job.batch(step)).loss)
    ran = {"layer_plan": job.describe(), "attention": "sdpa (Hugging Face)", "notes": notes}
    job.close()
    return ran, times, losses


def measure(recipe, args: argparse.Namespace) -> dict:
    """Train warmup + steps steps; the figures of the timed steps."""
    import torch
    import torch.distributed as dist

    from profiling.peaks import peak_for_recipe

    device = _join(args.cpu)
    ran, times, losses = (measure_fsdp if args.backend == "fsdp" else measure_megatron)(recipe, args, device)
    dist.destroy_process_group()
    step_s = statistics.median(times)
    on_gpu = device.type == "cuda"
    name = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    peak = peak_for_recipe(recipe, device_name=name) if on_gpu else None
    flops = model_flops(recipe)
    return {**ran, "device": name, "peak_tflops": peak, "step_s": step_s,
            "tokens_per_s": recipe.training.global_batch_size * recipe.model.seq_length / step_s,
            "mfu": flops / step_s / (peak * 1e12) if peak else None, "model_flops": flops,
            "peak_memory_gib": torch.cuda.max_memory_allocated(0) / 2**30 if on_gpu else None, "losses": losses}


def describe_model(args: argparse.Namespace, recipe) -> str:
    m = recipe.model
    kind = "Llama" if m.family == "llama" else "GPT"
    groups = f", {m.num_query_groups} kv groups" if (m.num_query_groups or m.num_attention_heads) < \
        m.num_attention_heads else ""
    how = (f"FSDP2 1 rank, {'compiled blocks' if not args.no_compile else 'eager'}"
           f"{', Liger' if args.liger else ''}" if args.backend == "fsdp" else f"Megatron-core {args.layers} layers")
    return (f"gpu_mfu: {kind} {args.size} ({m.num_layers} layers x {m.hidden_size}, {m.num_attention_heads} heads"
            f"{groups}, vocab {m.vocab_size}), seq {m.seq_length}, micro {args.micro_batch} x {args.accum}, "
            f"{recipe.training.precision}, {how}, TP1 x PP1 on {recipe.cluster.gpu_type}")


def report(args: argparse.Namespace, recipe, predicted: dict, measured: dict | None) -> list[str]:
    lines = [describe_model(args, recipe),
             f"MFU convention: Megatron (profiling/flops.py), {model_flops(recipe):.3e} model FLOPs per step"]
    if measured:
        lines.append(f"layers: {measured['layer_plan']}; attention: {measured['attention']}")
        mfu = f"{measured['mfu']:.1%}" if measured["mfu"] is not None else "n/a (no GPU peak)"
        memory = (f", peak memory {measured['peak_memory_gib']:.1f} GiB" if measured["peak_memory_gib"] is not None
                  else "")
        lines.append(f"measured:  step {measured['step_s']:.3f} s (median of {args.steps}), "
                     f"{measured['tokens_per_s']:,.0f} tok/s, MFU {mfu}{memory} on {measured['device']}")
    if predicted["step_s"] is not None:
        lines.append(f"predicted: step {predicted['step_s']:.3f} s, MFU {predicted['mfu']:.1%}, memory "
                     f"{predicted['memory_gb']:.1f} GB (planner, efficiency {predicted['efficiency']:.2f})")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpu_type = args.gpu_type
    if not (args.dry_run or args.cpu) and gpu_type is None:
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
        args.json.write_text(json.dumps({"size": args.size, "backend": args.backend, "layers": args.layers,
                                         "seq": args.seq, "global_batch": recipe.training.global_batch_size,
                                         "model_flops": model_flops(recipe), "predicted": predicted,
                                         "measured": measured}, indent=2))
    if measured and args.min_mfu is not None and (measured["mfu"] or 0.0) < args.min_mfu:
        print(f"gpu_mfu: MFU {measured['mfu']} below the floor {args.min_mfu}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
