"""Importing a training library without the optional packages it imports at module level and this project never
uses through it (``hpc_tools.train.megatron.cpu_compat.import_megatron``: wandb behind megatron-core's inference
context and torch.utils.tensorboard behind its timers; ``hpc_tools.train.deepspeed.trainer.import_deepspeed``:
mlflow behind DeepSpeed's autotuner). Each is a few
CPU seconds per rank process; a recipe's ``tracking`` section imports them afterwards as usual."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def absent(*names: str) -> Iterator[None]:
    """Inside the block, ``import NAME`` raises ImportError for each name not imported yet (a library's
    ``try: import NAME except ImportError`` reads it as not installed); afterwards nothing is left behind in
    ``sys.modules``, so a later ``import NAME`` imports it. A name already imported stays as it is."""
    hidden = [n for n in names if n not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]
