"""One lm-evaluation-harness run (its Hugging Face backend, ``lm_eval.simple_evaluate``) on a model folder, offline.

The harness reads datasets through ``datasets``: a site points it at its cache with ``HF_DATASETS_CACHE`` (and
``HF_HOME`` for the hub's files), or defines its tasks over local files with ``--include-path``. HF_HUB_OFFLINE and
HF_DATASETS_OFFLINE are set (to 1) unless the caller set them: a compute node has no internet.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

# what a model in a precision takes on GPUs, over its weights: the CUDA context, activations, lm-eval's batch
OVERHEAD = 1.2
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # training.precision -> transformers' dtype
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
GB = 1e9


def parameter_count(folder: Path) -> int | None:
    """The elements of the tensors in ``folder``'s safetensors files (their headers), None without any."""
    total, files = 0, sorted(Path(folder).glob("*.safetensors"))
    for f in files:
        try:
            with open(f, "rb") as fh:
                header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
            total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
        except (OSError, ValueError, KeyError, TypeError):
            return None
    return total if files else None


def load_args(folder: Path, dtype: str, gpu_bytes: list[int]) -> dict[str, Any]:
    """lm-eval's Hugging Face model arguments: the folder in ``dtype`` ('auto': its config's), spread over the
    visible GPUs (``parallelize``: accelerate's device map) when one GPU of ``gpu_bytes`` cannot hold it; a one-line
    UserError when all of them cannot. Without GPUs (or a parameter count) the folder loads as asked."""
    args: dict[str, Any] = {"pretrained": str(folder), "dtype": dtype}
    count = parameter_count(folder) if gpu_bytes else None
    if count is None:
        return args
    loaded = dtype
    if dtype == "auto":  # transformers loads the config's torch_dtype
        try:
            loaded = json.loads((Path(folder) / "config.json").read_text()).get("torch_dtype") or "float32"
        except (OSError, ValueError):
            loaded = "float32"
    need = OVERHEAD * count * BYTES.get(loaded, 4)
    if need > sum(gpu_bytes):
        from hpc_tools.errors import UserError

        raise UserError(f"{folder}: the model needs about {need / GB:.3g} GB of GPU memory ({count / 1e9:.3g}B "
                        f"parameters in {loaded} x {OVERHEAD}) and the {len(gpu_bytes)} GPU(s) here hold "
                        f"{sum(gpu_bytes) / GB:.3g} GB (evaluate it on a node with more GPU memory, or quantize it "
                        "first)")
    if need > gpu_bytes[0]:
        args["parallelize"] = True
    return args


def evaluate_folder(folder: str | Path, tasks: list[str], include_path: str | None = None, limit: int | None = None,
                    batch_size: int | str | None = None, device: str | None = None,
                    precision: str | None = None) -> dict[str, Any]:
    """lm-eval's results (as its JSON writer makes them serialisable) for the model in ``folder``. On GPUs: loaded in
    ``precision`` (the run's ``training.precision``; None: the folder's own dtype), spread over the node's GPUs when
    one cannot hold it, at lm-eval's ``auto`` batch size unless ``batch_size`` says; on CPU as the folder is, one
    sequence at a time unless ``batch_size`` says."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(name, "1")
    with contextlib.redirect_stdout(sys.stderr):  # lm-eval and transformers print; stdout stays for --json
        import torch
        from lm_eval import simple_evaluate
        from lm_eval.utils import handle_non_serializable

        from hpc_tools.evaluate.tasks import task_manager

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        gpu = device.startswith("cuda")
        gpus = [torch.cuda.mem_get_info(i)[1] for i in range(torch.cuda.device_count())] if gpu else []
        dtype = DTYPES.get(precision or "", "auto") if gpu else "auto"
        model_args = load_args(Path(folder), dtype, gpus)
        batch_size = batch_size or ("auto" if gpu else 1)
        out = simple_evaluate(model="hf", model_args=model_args, tasks=tasks,
                              limit=limit, batch_size=batch_size, device=device, log_samples=False,
                              task_manager=task_manager(tasks, include_path))
    out = dict(out or {})
    out.pop("samples", None)
    return json.loads(json.dumps(out, default=handle_non_serializable))
