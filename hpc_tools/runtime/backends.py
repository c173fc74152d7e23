"""Backend kind -> the trainer module that runs on every rank (imported lazily: each pulls in heavy packages)."""

from __future__ import annotations

import importlib
from typing import Callable

from hpc_tools.runtime.context import RankContext

TRAINERS = {
    "megatron": "hpc_tools.train.megatron.trainer",
    "deepspeed": "hpc_tools.train.deepspeed.trainer",
    "comm_check": "hpc_tools.train.comm_check",
}


def trainer_for(kind: str) -> Callable[[RankContext], None]:
    """The ``run(ctx)`` function of the backend's trainer module."""
    return importlib.import_module(TRAINERS[kind]).run
