"""One model shape trained three ways on one GPU in one run: torchtitan 0.3.0, this project's Megatron-core path and its
FSDP path; tok/s, MFU under one FLOPs convention, and each path's ratio to torchtitan (the baseline).

    python benchmarks/gpu_side_by_side.py --out DIR            # on a GPU node: the three runs, one after another
    python benchmarks/gpu_side_by_side.py --dry-run --out DIR  # anywhere: torchtitan's config and the commands

The shape is Llama 3.2 1B (torchtitan's ``llama3`` flavor ``1B``: 16 layers x 2048, 32 heads, 8 key-value groups,
SwiGLU 8192, vocabulary 128256, tied embeddings, RoPE base 500000), sequence 2048, micro-batch 4 x 2 accumulated
(16,384 tokens a step), bf16, no activation checkpointing, synthetic tokens, one GPU:

- torchtitan: ``torch.distributed.run --standalone --nproc_per_node 1 -m torchtitan.train --module
  hpc_side_by_side_titan --config side_by_side``; the module is written here (``titan_module``): its ``1B`` model spec
  with torchtitan's default attention (FlexAttention, causal per sequence), ``torch.compile`` of the model and loss,
  its chunked cross entropy, AdamW, a synthetic tokenizer and data loader (nothing downloaded), metrics every step.
  On one GPU torchtitan applies no FSDP: bf16 autocast over fp32 weights. Its tok/s is the median of the ``tps`` it
  logs for the steps after the warm-up.
- Megatron: ``benchmarks/gpu_mfu.py --backend megatron --size llama-1b`` with Transformer Engine layers where TE
  imports, else Megatron-core's local layers with SDPA attention (``--layers sdpa``).
- FSDP: ``benchmarks/gpu_mfu.py --backend fsdp --size llama-1b``: Hugging Face's LlamaForCausalLM, SDPA, FSDP2 on one
  rank, bf16, compiled blocks (``--fsdp-liger`` adds Liger Kernel).

MFU for all three is the same arithmetic: tok/s x model FLOPs per token of ``profiling/flops.py`` (Megatron convention:
dense matrices x 3, the causal half of the attention scores, logits over the 128256-entry vocabulary, which no path
pads) over the bf16 peak of ``profiling/peaks.py`` for the detected GPU; torchtitan's own MFU (its 6N + attention
count over its own peak table) is printed beside it for reference only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SIZE = "llama-1b"  # gpu_mfu.py's name of the shape; torchtitan's flavor below
TITAN_FLAVOR = "1B"
TITAN_MODULE = "hpc_side_by_side_titan"
PATHS = ("torchtitan", "megatron", "fsdp")
BASELINE = "torchtitan"
TITAN_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.naif]+).*?tps:\s*([\d,]+).*?mfu:\s*([\d.]+%|N/A)")

TITAN_TEMPLATE = '''"""torchtitan 0.3.0 config written by benchmarks/gpu_side_by_side.py (rewritten each run).

The llama3 "{flavor}" model spec, torchtitan's default attention, compiled model and loss, no activation checkpointing,
synthetic tokens (nothing downloaded), metrics every step without colours (the script reads the "tps:" of each step).
"""

from dataclasses import dataclass

import torch

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config import CompileConfig, TrainingConfig
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import model_registry
from torchtitan.trainer import Trainer

SHAPE = {shape!r}
MICRO_BATCH, ACCUM, SEQ, STEPS, SEED = {micro_batch}, {accum}, {seq}, {steps}, {seed}
FOLDER = {folder!r}


class SyntheticTokenizer(BaseTokenizer):
    """The vocabulary size only: the data are token ids already."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = SHAPE["vocab_size"]

    def __init__(self, config, tokenizer_path=None, **_):
        super().__init__()
        self.vocab_size = config.vocab_size
        self.eos_id = 0

    def encode(self, *args, **kwargs):
        raise NotImplementedError("synthetic tokens: nothing to encode")

    def decode(self, *args, **kwargs):
        raise NotImplementedError("synthetic tokens: nothing to decode")

    def get_vocab_size(self) -> int:
        return self.vocab_size


class SyntheticLoader(BaseDataLoader):
    """Uniform random token ids, one document per sequence (positions 0..seq-1: a causal mask), seeded per rank."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        vocab_size: int = SHAPE["vocab_size"]
        seed: int = SEED

    def __init__(self, config, *, dp_rank=0, local_batch_size=MICRO_BATCH, seq_len=SEQ, **_):
        self.config, self.rank, self.batch, self.seq = config, dp_rank, local_batch_size, seq_len

    def __iter__(self):
        gen = torch.Generator().manual_seed(self.config.seed + self.rank)
        positions = torch.arange(self.seq).expand(self.batch, self.seq).contiguous()
        while True:
            tokens = torch.randint(0, self.config.vocab_size, (self.batch, self.seq + 1), generator=gen)
            yield {{"input": tokens[:, :-1], "positions": positions}}, tokens[:, 1:]

    def state_dict(self):
        return {{}}

    def load_state_dict(self, state_dict):
        pass


def check_shape(model) -> None:
    """The flavor is the shape the other two paths train (a torchtitan release that changed it fails here)."""
    mine = {{"dim": model.dim, "vocab_size": model.vocab_size, "n_layers": len(model.layers),
             "tied": model.enable_weight_tying}}
    want = {{k: SHAPE[k] for k in mine}}
    if mine != want:
        raise SystemExit(f"torchtitan's llama3 {flavor} is {{mine}}, not the side-by-side shape {{want}}")


def side_by_side() -> Trainer.Config:
    spec = model_registry("{flavor}")
    check_shape(spec.model)
    return Trainer.Config(
        hf_assets_path=FOLDER,
        dump_folder=FOLDER + "/outputs",
        model_spec=spec,
        tokenizer=SyntheticTokenizer.Config(),
        dataloader=SyntheticLoader.Config(),
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))),
        optimizer=default_adamw(lr=3e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=1),
        training=TrainingConfig(local_batch_size=MICRO_BATCH, global_batch_size=MICRO_BATCH * ACCUM, seq_len=SEQ,
                                steps=STEPS),
        metrics=MetricsProcessor.Config(log_freq=1, disable_color_printing=True),
        activation_checkpoint=None,
        compile=CompileConfig(enable=True, components=["model", "loss"]),
        checkpoint=CheckpointManager.Config(enable=False),
    )
'''


DATASETS_SHIM = {
    "__init__.py": '''"""Stand-in for `datasets`, written by benchmarks/gpu_side_by_side.py where it is not installed.

torchtitan 0.3.0's trainer imports its Hugging Face text loaders, which import `datasets` (and so pyarrow and pandas,
50 MB of wheels to carry to an offline GPU machine); the side-by-side run trains on synthetic tokens and builds none.
"""


class Dataset:
    """Never built by the synthetic run."""


class IterableDataset(Dataset):
    """Never built by the synthetic run."""


def load_dataset(*args, **kwargs):
    raise RuntimeError("datasets is not installed: the side-by-side run's stand-in cannot load a data set")
''',
    "distributed.py": '''def split_dataset_by_node(*args, **kwargs):
    raise RuntimeError("datasets is not installed: the side-by-side run's stand-in cannot split a data set")
''',
}


def datasets_shim(folder: Path) -> Path | None:
    """The stand-in ``datasets`` package under ``folder`` where the real one does not import here (found, not
    imported); the folder to put first on torchtitan's path, or None."""
    if find_spec("datasets") is not None:
        return None
    for name, text in DATASETS_SHIM.items():
        (folder / "datasets").mkdir(parents=True, exist_ok=True)
        (folder / "datasets" / name).write_text(text)
    return folder


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "side_by_side"),
                        help="folder for torchtitan's config, the logs and side_by_side.json (default $OUT, else "
                             "./side_by_side)")
    parser.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    parser.add_argument("--micro-batch", type=int, default=4, help="micro-batch size (default 4)")
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per step (default 2)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps first, compilation included (default 4)")
    parser.add_argument("--only", default=",".join(PATHS), help=f"comma-separated paths to run (default {PATHS})")
    parser.add_argument("--fsdp-liger", action="store_true", help="the FSDP path with Liger Kernel too")
    parser.add_argument("--timeout", type=int, default=300, help="seconds each path may take (default 300)")
    parser.add_argument("--dry-run", action="store_true", help="write torchtitan's config, print the commands only")
    args = parser.parse_args(argv)
    args.only = [p for p in args.only.split(",") if p]
    unknown = [p for p in args.only if p not in PATHS]
    if unknown:
        parser.error(f"--only: unknown path {unknown[0]} (choose from {', '.join(PATHS)})")
    return args


def shape() -> dict:
    """The shape as torchtitan's flavor names it, from gpu_mfu's ``llama-1b`` (the one definition of it here)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_mfu import SIZES

    s = SIZES[SIZE]
    return {"dim": s["hidden_size"], "n_layers": s["num_layers"], "n_heads": s["num_attention_heads"],
            "n_kv_heads": s["num_query_groups"], "ffn_dim": s["ffn_hidden_size"], "vocab_size": s["vocab_size"],
            "rope_theta": s["rotary_base"], "tied": not s["untie_embeddings"]}


def titan_module(args: argparse.Namespace, folder: Path) -> str:
    """The text of torchtitan's config module for this run."""
    return TITAN_TEMPLATE.format(flavor=TITAN_FLAVOR, shape=shape(), micro_batch=args.micro_batch, accum=args.accum,
                                 seq=args.seq, steps=args.warmup + args.steps, seed=1234,
                                 folder=str(folder.resolve()))


def megatron_layers() -> str:
    """Transformer Engine where it imports, else local layers with SDPA attention (found, not imported)."""
    return "te" if find_spec("transformer_engine") is not None else "sdpa"


def commands(args: argparse.Namespace, out: Path) -> dict[str, list[str]]:
    """Each path's command line (run from the repository root)."""
    py = sys.executable
    common = ["--size", SIZE, "--seq", str(args.seq), "--micro-batch", str(args.micro_batch), "--accum",
              str(args.accum), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmds = {
        "torchtitan": [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m",
                       "torchtitan.train", "--module", TITAN_MODULE, "--config", "side_by_side"],
        "megatron": [py, "benchmarks/gpu_mfu.py", "--backend", "megatron", "--layers", megatron_layers(), *common,
                     "--json", str(out / "megatron.json")],
        "fsdp": [py, "benchmarks/gpu_mfu.py", "--backend", "fsdp", *common, "--json", str(out / "fsdp.json")],
    }
    if args.fsdp_liger:
        cmds["fsdp_liger"] = [*cmds["fsdp"][:-1], str(out / "fsdp_liger.json"), "--liger"]
    return {k: v for k, v in cmds.items() if k.split("_")[0] in args.only}


def titan_figures(log: str, warmup: int) -> dict:
    """torchtitan's per-step log lines: the median tps of the steps after the warm-up, its losses and its own MFU."""
    rows = [(int(m[1]), float(m[2]), float(m[3].replace(",", "")), m[4]) for m in TITAN_STEP.finditer(log)]
    timed = [r for r in rows if r[0] > warmup]
    if not timed:
        raise ValueError(f"torchtitan logged no step after the warm-up's {warmup} ({len(rows)} step lines)")
    own = [float(r[3].rstrip("%")) / 100 for r in timed if r[3] != "N/A"]
    return {"tokens_per_s": statistics.median(r[2] for r in timed), "losses": [r[1] for r in rows],
            "own_mfu": statistics.median(own) if own else None, "steps_logged": len(rows)}


def flops_per_token() -> float:
    """Model FLOPs per token of the shape (Megatron convention, the unpadded 128256 vocabulary every path holds)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_mfu import build_recipe
    from gpu_mfu import parse_args as mfu_args

    from profiling.flops import flops_per_token as per_token

    recipe = build_recipe(mfu_args(["--backend", "fsdp", "--size", SIZE]), "H100-SXM")
    return per_token(recipe.model, convention="megatron", vocab_size=recipe.model.vocab_size)


def table(results: dict[str, dict], per_token: float, peak_tflops: float | None) -> list[str]:
    """One line per path: tok/s, MFU (one convention), ratio to the baseline; then the best of ours against it."""
    base = (results.get(BASELINE) or {}).get("tokens_per_s")
    lines = [f"{'path':<12} {'tok/s':>10} {'MFU':>7} {'vs ' + BASELINE:>14}  what ran"]
    for name, r in results.items():
        tps = r.get("tokens_per_s")
        if tps is None:
            lines.append(f"{name:<12} {'-':>10} {'-':>7} {'-':>14}  {r.get('error', 'not run')}")
            continue
        mfu = f"{tps * per_token / (peak_tflops * 1e12):.1%}" if peak_tflops else "n/a"
        ratio = f"{tps / base:.2f}x" if base else "-"
        lines.append(f"{name:<12} {tps:>10,.0f} {mfu:>7} {ratio:>14}  {r.get('what', '')}")
    ours = [r["tokens_per_s"] for n, r in results.items() if n != BASELINE and r.get("tokens_per_s")]
    if base and ours:
        lines.append(f"best of this project's paths: {max(ours) / base:.2f}x {BASELINE}'s tok/s (baseline "
                     f"{BASELINE} = 1.00x)")
    return lines


def python_path(name: str, out: Path) -> str:
    """PYTHONPATH of one path: torchtitan's config module (and the datasets stand-in, where needed) for torchtitan,
    the repository for every path."""
    shim = datasets_shim(out / "shims") if name == BASELINE else None
    return os.pathsep.join(filter(None, [shim and str(shim), str(out), str(REPO), os.environ.get("PYTHONPATH")]))


def run_path(name: str, cmd: list[str], out: Path, args: argparse.Namespace) -> dict:
    """Run one path (its log under ``out``) and read its figures."""
    env = dict(os.environ, PYTHONPATH=python_path(name, out))
    log = out / f"{name}.log"
    t0 = time.perf_counter()
    try:
        with log.open("w") as f:
            proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = 124
    wall = time.perf_counter() - t0
    text = log.read_text(errors="replace")
    if rc != 0:
        return {"error": f"exit {rc} after {wall:.0f} s (see {log.name})", "tail": text.splitlines()[-12:]}
    if name == BASELINE:
        return {**titan_figures(text, args.warmup), "what": f"torchtitan {TITAN_FLAVOR}, compiled, flex attention"}
    measured = json.loads((out / f"{name}.json").read_text())["measured"]
    return {"tokens_per_s": measured["tokens_per_s"], "step_s": measured["step_s"], "losses": measured["losses"],
            "what": measured["layer_plan"] + f"; attention {measured['attention']}"}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{TITAN_MODULE}.py").write_text(titan_module(args, out))
    cmds = commands(args, out)
    per_token = flops_per_token()
    print(f"gpu_side_by_side: Llama 3.2 1B shape, seq {args.seq}, micro {args.micro_batch} x {args.accum}, bf16, "
          f"one GPU; {per_token:.4e} model FLOPs per token (profiling/flops.py, Megatron convention)")
    for name, cmd in cmds.items():
        print(f"{name}: PYTHONPATH={python_path(name, out)} " + " ".join(cmd))
    if args.dry_run:
        return 0
    import torch

    from profiling.peaks import canonical_gpu, peak_for_recipe

    if not torch.cuda.is_available():
        print("gpu_side_by_side: no CUDA device (use --dry-run for the commands only)", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0)
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_mfu import build_recipe
    from gpu_mfu import parse_args as mfu_args

    peak = peak_for_recipe(build_recipe(mfu_args(["--backend", "fsdp", "--size", SIZE]), canonical_gpu(device)),
                           device_name=device)
    results = {name: run_path(name, cmd, out, args) for name, cmd in cmds.items()}
    lines = table(results, per_token, peak)
    print(f"on {device} (bf16 peak {peak} TFLOP/s)")
    print("\n".join(lines))
    (out / "side_by_side.json").write_text(json.dumps(
        {"device": device, "peak_tflops": peak, "flops_per_token": per_token, "baseline": BASELINE,
         "results": results, "table": lines}, indent=2))
    return 0 if all("tokens_per_s" in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
