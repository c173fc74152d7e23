"""Importing a training library without the optional packages it imports at module level and this project never
uses through it (``hpc_tools.train.megatron.cpu_compat.import_megatron``: wandb behind megatron-core's inference
context and torch.utils.tensorboard behind its timers; ``hpc_tools.train.deepspeed.trainer.import_deepspeed``:
mlflow behind DeepSpeed's autotuner; ``import_transformers``: torchao and scipy behind transformers' model code). Each
is a fraction of a CPU second to a few per rank process; a recipe's ``tracking`` section imports them afterwards as
usual."""

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


TRANSFORMERS_UNUSED = ("torchao", "scipy")
"""What transformers imports with its model code (``transformers.modeling_utils``, which every model class imports)
when installed, and no training rank uses: torchao behind its torchao quantizer (``quantizers.auto``), scipy behind
its object-detection losses (``loss.loss_for_object_detection``). ~600 modules; ``hpc-tools quantize`` imports
torchao in its own process."""


def import_transformers() -> None:
    """Import transformers and its model code (and accelerate, where installed) with ``TRANSFORMERS_UNUSED`` read as
    absent. transformers decides what is installed when it is first imported, so for the rest of this process it
    takes both for not installed (its torchao quantization and object-detection losses are then unavailable here).
    A no-op once transformers is imported."""
    if "transformers" in sys.modules:
        return
    from importlib.util import find_spec

    with absent(*TRANSFORMERS_UNUSED):
        import transformers.modeling_utils  # noqa: F401
        if find_spec("accelerate") is not None:
            import accelerate  # noqa: F401  # the FSDP/Horovod empty build's; it imports transformers' model code
