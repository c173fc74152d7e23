"""One lm-evaluation-harness run (its Hugging Face backend, ``lm_eval.simple_evaluate``) on a model folder, offline.

The harness reads datasets through ``datasets``: a site points it at its cache with ``HF_DATASETS_CACHE`` (and
``HF_HOME`` for the hub's files), or defines its tasks over local files with ``--include-path``. HF_HUB_OFFLINE and
HF_DATASETS_OFFLINE are set (to 1) unless the caller set them: a compute node has no internet.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any


def evaluate_folder(folder: str | Path, tasks: list[str], include_path: str | None = None, limit: int | None = None,
                    batch_size: int = 1, device: str | None = None) -> dict[str, Any]:
    """lm-eval's results (as its JSON writer makes them serialisable) for the model in ``folder``."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(name, "1")
    with contextlib.redirect_stdout(sys.stderr):  # lm-eval and transformers print; stdout stays for --json
        import torch
        from lm_eval import simple_evaluate
        from lm_eval.utils import handle_non_serializable

        from hpc_tools.evaluate.tasks import task_manager

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        out = simple_evaluate(model="hf", model_args={"pretrained": str(folder), "dtype": "auto"}, tasks=tasks,
                              limit=limit, batch_size=batch_size, device=device, log_samples=False,
                              task_manager=task_manager(tasks, include_path))
    out = dict(out or {})
    out.pop("samples", None)
    return json.loads(json.dumps(out, default=handle_non_serializable))
