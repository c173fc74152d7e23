"""backend.kind: megatron — what every rank runs: ``run(ctx)`` (called by hpc_tools.runtime.rank).

``MegatronJob`` is the engine (``hpc_tools.train.engine.RankJob``) of ``hpc_tools.train.loop`` (which owns records,
the stop agreement and evaluations; resume and saves are ``hpc_tools.train.checkpointing``'s) around
``hpc_tools.train.megatron.engine.MegatronCore`` (model chunks, optimizer, one step). The data of a step is a pure
function of the step, so no data position is saved.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hpc_tools.checkpoints.dirs import CheckpointDirs
from hpc_tools.runtime.context import RankContext
from hpc_tools.train import loop
from hpc_tools.train.engine import StepResult
from hpc_tools.train.prefetch import BatchPrefetcher

log = logging.getLogger("hpc_tools.megatron")


def run(ctx: RankContext) -> None:
    """Train the recipe on this rank."""
    _quiet_megatron(ctx.device_type)
    loop.run(ctx, MegatronJob)


class MegatronJob:
    """``engine.RankJob`` for Megatron-core: the engine of this rank's layout, its data and its checkpoints."""

    checkpoints = True

    def __init__(self, ctx: RankContext):
        from hpc_tools.train.data import build_samples
        from hpc_tools.train.megatron.engine import MegatronCore

        self.ctx = ctx
        self.samples = build_samples(ctx.recipe)  # first: a bad data path fails before a model is built
        self.engine = MegatronCore(ctx.recipe, ctx.layout, ctx.device, timeout=ctx.collective_timeout)
        self.prefetch = BatchPrefetcher(self._build_batch, ctx.recipe.training.train_iters,
                                        background=ctx.device.type == "cuda", pin=ctx.device.type == "cuda")
        self.dirs = CheckpointDirs(ctx.checkpoint_dir, keep_last=ctx.recipe.checkpoint.keep_last)
        self._attention_told = False
        self._background = None  # checkpoint.BackgroundWriter, made when the saver starts it (checkpoint.async_save)
        for note in self.engine.notes:
            ctx.info("note: %s", note)
        if ctx.recipe.checkpoint.init_from_hf:  # step-0 weights from a Hugging Face folder unless resuming
            from hpc_tools.train.megatron.hf_import import init_unless_resuming

            init_unless_resuming(self.engine, ctx.recipe, self.dirs)

    def describe(self) -> str:
        r = self.ctx.recipe
        return (f"megatron: {self.ctx.layout.describe()}, {r.model.family}, {r.training.precision} on {self.ctx.device}"
                f", {self.engine.plan.describe()}")

    def coords(self) -> dict[str, int]:
        c = self.engine.coords
        return {"tp_rank": c.tp_rank, "pp_rank": c.pp_rank, "dp_rank": c.dp_rank}

    def resume(self, source: Path) -> int:
        from hpc_tools.train.megatron import checkpoint

        return checkpoint.load(self.engine, source)

    def batch(self, step: int) -> list[dict[str, Any]]:
        """This rank's microbatches of ``step``; on a GPU built (and pinned) in the background during the step
        before (``hpc_tools.train.prefetch``)."""
        return self.prefetch.get(step)

    def _build_batch(self, step: int) -> list[dict[str, Any]]:
        from hpc_tools.train.data import microbatches_for_step

        return microbatches_for_step(self.samples, step, self.engine.coords.dp_rank, self.ctx.layout)

    def step(self, step: int, batch: list[dict[str, Any]]) -> StepResult:
        result = self.engine.train_step(step, batch)
        if not self._attention_told:  # TE chooses at the first forward (attention=auto): say what it chose, once
            self._attention_told = True
            if self.engine.plan.attention == "auto":
                from hpc_tools.train.megatron.layers import te_attention_choice

                self.ctx.info("attention: Transformer Engine chose %s", te_attention_choice() or "(no record)")
        return result

    def evaluate(self, batches: list[list[dict[str, Any]]]) -> float:
        """Validation loss over ``batches`` (``RankJob.evaluate``: forward only, the same on every rank)."""
        return self.engine.evaluate(batches)

    def write_checkpoint(self, folder: Path, step: int, background: bool):
        """The saver's write (``engine.Checkpointable``): this rank's shards into ``folder``; in the background
        through dist_checkpointing's async path (``start_background_writer``), returning its ``Write``."""
        from hpc_tools.train.megatron import checkpoint

        if background:
            self.start_background_writer()
        return checkpoint.write(self.engine, folder, step, background=self._background if background else None)

    def start_background_writer(self) -> None:
        """dist_checkpointing's async writer (``checkpoint.BackgroundWriter``), once: on a GPU its persistent writer
        process starts now, on this rank's device."""
        from hpc_tools.train.megatron import checkpoint

        if self._background is None:
            device = self.ctx.device
            self._background = checkpoint.BackgroundWriter(device.index if device.type == "cuda" else None)

    def checkpoint_meta(self, step: int) -> dict[str, Any]:
        from hpc_tools.train.megatron import checkpoint

        return checkpoint.meta(self.engine, step)

    def close(self) -> None:
        if getattr(self, "_background", None) is not None:
            self._background.close()
            self._background = None
        self.prefetch.close()
        self.engine.close()


def import_on_cpu() -> None:
    """What a CPU rank imports before training (the row's ``preload``, run once by the local fork server for all its
    ranks): megatron-core without its GPU-only imports, its import warnings quietened as ``run`` does."""
    from hpc_tools.train.megatron.cpu_compat import import_megatron

    _quiet_megatron("cpu")
    import_megatron()


def _quiet_megatron(device_type: str = "cpu") -> None:
    # Megatron logs every bucket's parameter list and its whole config at INFO, and warns at import that apex and
    # Transformer Engine are missing: expected on CPU (hidden there), a slow path on a GPU (kept there).
    import warnings

    if device_type != "cuda":
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    for name in ("megatron.core", "megatron.core.distributed", "megatron.core.optimizer"):
        logging.getLogger(name).setLevel(logging.WARNING)
