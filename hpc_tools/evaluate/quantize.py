"""``quantize``: a Hugging Face folder (a run's newest verified checkpoint, exported first) -> a smaller folder with
torchao's weight-only schemes, written through transformers' ``TorchAoConfig`` (config.json carries the
``quantization_config``; ``from_pretrained`` and vLLM's torchao support load it).

Schemes (``SCHEMES``): ``int8`` (torchao ``Int8WeightOnlyConfig``: int8 weights, one scale per output row) and
``fp8`` (``Float8WeightOnlyConfig``: float8 e4m3 weights, one scale per row). Both quantize every ``nn.Linear``
but the embedding and output layers' tied weights. Both save memory, not time: torchao 0.18 runs each layer as the
weights cast or dequantized to the activations' precision and a GEMM at that precision (``Int8Tensor``'s and
``Float8Tensor``'s linear), on CPU and on any GPU (no float8 units, compute capability 8.9, needed), and neither is
faster than the unquantized model without ``torch.compile`` fusing the cast into the GEMM (not measured here: no
GPU). GPT-2 folders (what Megatron ``model.family: gpt`` runs
export) keep their weights in ``Conv1D`` layers, which these schemes leave untouched: they are first written as the
same network in ``nn.Linear`` layers (transformers' GPTBigCode, ``quantize_gpt2``), and that folder is quantized.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from hpc_tools.errors import UserError
from hpc_tools.evaluate.quantize_gpt2 import is_gpt2, linear_config, to_linear_folder
from hpc_tools.evaluate.results import EVAL_DIR, QUANTIZE_META, quantize_name
from hpc_tools.evaluate.target import EXPORT_META, Target, ensure_exported, models
from hpc_tools.registry import atomic_write

SCHEMES = {"int8": "Int8WeightOnlyConfig", "fp8": "Float8WeightOnlyConfig"}
MODEL_FILES = ("config.json", "generation_config.json", EXPORT_META, QUANTIZE_META)


def check(target: Target, scheme: str) -> None:
    """Refusals before anything is exported or written."""
    if scheme not in SCHEMES:
        raise UserError(f"--scheme {scheme!r} is not one of {', '.join(SCHEMES)} (int8: weight-only int8, any "
                        "machine; fp8: weight-only float8, any machine; both save memory, not time)")
    if target.folder is not None:
        if target.meta.get("kind") == QUANTIZE_META:
            raise UserError(f"{target.ref} is already quantized ({target.meta.get('scheme')}) (quantize the "
                            "unquantized export or its run)")
        config = _config(target.folder)
        if is_gpt2(config):
            linear_config(config)  # a GPT-2 variant GPTBigCode cannot express: refused before anything is written


def quantize(target: Target, scheme: str, out: str | Path, overwrite: bool = False) -> dict[str, Any]:
    """Write the quantized folder ``out``; returns what quantize measured (also beside the model, and in the run's
    eval/ folder)."""
    from hpc_tools.hf.folder import check_out, staged

    out = Path(out).absolute()
    check_out(out, overwrite)
    check(target, scheme)
    (model,) = models(target, None)
    src = ensure_exported(model, target.run) if target.run is not None and target.folder is None else model.folder
    with staged(out, overwrite) as tmp:
        for f in src.iterdir():  # the tokenizer files (the model files are written by save_pretrained)
            if f.is_file() and not f.name.startswith("model") and f.name not in MODEL_FILES:
                shutil.copy2(f, tmp / f.name)
        converted = _quantized_save(src, tmp, scheme)
        sizes = linear_bytes(src, tmp)
        if not sizes["linear_modules"]:
            raise UserError(f"{target.ref}: {scheme} quantized no linear layer of this model (quantize a "
                            "GPT-2 or llama-family model, as `python -m hpc_tools export` writes them)")
        import torchao

        summary = {"scheme": scheme, "library": f"torchao {torchao.__version__}", "torchao_config": SCHEMES[scheme],
                   "folder": str(out), "source_folder": str(src),
                   "run_dir": str(target.run.path) if target.run is not None else None,
                   "iteration": model.iteration, "tokens": model.tokens, "converted": converted, **sizes,
                   "folder_bytes_before": folder_bytes(src), "folder_bytes_after": folder_bytes(tmp)}
        atomic_write(tmp / QUANTIZE_META, json.dumps(summary, indent=2, sort_keys=True))
    if target.run is not None:
        record = target.run.path / EVAL_DIR / quantize_name(scheme, model.iteration)
        record.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(record, json.dumps(summary, indent=2, sort_keys=True))
    return summary


def _quantized_save(src: Path, out: Path, scheme: str) -> str | None:
    """Load ``src`` in bf16 with transformers' TorchAoConfig and save it quantized into ``out``; a GPT-2 folder is
    written in nn.Linear layers first (beside ``out``, removed after). Returns what was converted, or None."""
    import tempfile

    import torch
    import torchao.quantization as tq
    from transformers import AutoModelForCausalLM, TorchAoConfig

    converted = None
    with tempfile.TemporaryDirectory(prefix=".linear-", dir=out.parent) as linear:
        if is_gpt2(_config(src)):
            to_linear_folder(src, Path(linear))
            src, converted = Path(linear), "GPT2LMHeadModel (Conv1D) -> GPTBigCodeForCausalLM (nn.Linear)"
        qmodel = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16, device_map="cpu",
                                                      quantization_config=TorchAoConfig(getattr(tq, SCHEMES[scheme])()))
        qmodel.save_pretrained(str(out))
    return converted


def linear_bytes(before: Path, after: Path) -> dict[str, Any]:
    """Bytes of the quantized linear layers' weights: as exported, as bf16 (2 bytes a weight), and quantized (data,
    scales and zero points), from the safetensors headers."""
    old, new = _tensors(before), _tensors(after)
    modules = sorted({name.rsplit("._weight_", 1)[0] for name in new if "._weight_" in name})
    stored = sum(old[f"{m}.weight"][0] for m in modules)
    bf16 = sum(2 * old[f"{m}.weight"][1] for m in modules)
    quant = sum(size for name, (size, _) in new.items() if name.rsplit("._weight_", 1)[0] in modules)
    return {"linear_modules": len(modules), "linear_bytes_before": stored, "linear_bytes_bf16": bf16,
            "linear_bytes_after": quant, "ratio_vs_bf16": quant / bf16 if bf16 else None,
            "ratio_vs_before": quant / stored if stored else None}


def _tensors(folder: Path) -> dict[str, tuple[int, int]]:
    """name -> (bytes, elements) of every tensor in the folder's safetensors files (headers only)."""
    import math
    import struct

    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, info in header.items():
            if name != "__metadata__":
                start, end = info["data_offsets"]
                found[name] = (end - start, math.prod(info["shape"]))
    return found


def folder_bytes(folder: Path) -> int:
    """Bytes of the model folder's files (its own eval/ left out)."""
    return sum(f.stat().st_size for f in Path(folder).rglob("*")
               if f.is_file() and EVAL_DIR not in f.relative_to(folder).parts)


def _config(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        raise UserError(f"{folder}/config.json is not readable JSON (give a folder written by `python -m "
                        "hpc_tools export`)") from None
