"""What the training loop (``hpc_tools.train.loop``) and the saver (``hpc_tools.train.checkpointing.saver``) need
from the pieces they drive: a backend's ``RankJob`` (with the ``Write`` its background saves return), the
``StepResult`` of one step, and the ``Collector`` of the step records.

Every backend's job (``megatron.trainer.MegatronJob``, ``deepspeed.trainer.DeepSpeedJob``, ``fsdp.trainer.FSDPJob``,
``horovod.trainer.HorovodJob``, ``comm_check.CommCheck``) implements the whole ``RankJob``;
``profiling.collector.StepCollector`` is the ``Collector`` of a run, and ``NullCollector`` the one a harness gives
when it keeps no records (subclass it to watch a few calls).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager, Protocol


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one step reports to the records (``profiling.collector.StepCollector.end_step``) and the log."""

    loss: float | None = None
    """Mean loss over the whole global batch (every microbatch, every data-parallel rank): the same on every rank.
    None for a step without a model (comm_check)."""
    grad_norm: float | None = None
    """Global gradient norm before clipping, when the backend computes one."""
    lr: float | None = None
    """Learning rate the optimizer step used."""
    skipped: bool | None = None
    """True when the optimizer skipped the update (fp16 loss-scale overflow, or a non-finite step); None when the
    backend cannot tell."""
    nonfinite: bool = False
    """The loss or the gradient norm of this step was not finite on some rank: the same on every rank (the engine
    all-reduces it) and the update was skipped where the backend can (see the engines)."""
    note: str | None = None
    """A progress detail of this step, logged by rank 0 every ``training.log_interval`` steps and at the last one."""
    figures: dict[str, Any] | None = None
    """Further record fields the backend measured in this step (``profiling.schema`` names), e.g. the MoE router's
    load (``moe_*``); None when it has none."""


class Write(Protocol):
    """One rank's background write of a checkpoint (what ``RankJob.write_checkpoint(..., background=True)`` returns)."""

    ended: float | None
    """``time.perf_counter()`` when this rank's write ended, when known (else the poll that found it done)."""

    def done(self) -> bool:
        """This rank's write has ended (well or not); local and cheap."""

    def finish(self) -> None:
        """Collective, once every rank's write is done: the library's end of the save; raises when it failed."""

    def abort(self) -> None:
        """Stop the write without committing it (after an error; its folder stays partial)."""

    def kill(self) -> None:
        """Kill the writer now (``saver.INJECT_KILL_WRITER_ENV``, tests only)."""


class Checkpointable(Protocol):
    """What the saver asks of an engine: its files of a step, and what the checkpoint's meta file records."""

    def start_background_writer(self) -> None:
        """Collective, once, when the saver is built for background saves (checkpoint.async_save): make and start the
        background writer now, so that the first background save does not wait for it; a no-op for a backend that
        writes synchronously."""

    def write_checkpoint(self, folder: Path, step: int, background: bool) -> Write | None:
        """Collective: this rank's files of step ``step`` into ``folder`` (which exists): None once they are on
        disk; with ``background`` (asked only when checkpoint.async_save is on) the ``Write`` still under way, or
        None where the backend writes synchronously. A writer not started yet is made at the first such call."""

    def checkpoint_meta(self, step: int) -> dict[str, Any]:
        """What the meta file of the checkpoint of ``step`` records besides its files (format, layout...)."""


class RankJob(Checkpointable, Protocol):
    """One rank's share of a job as the loop drives it. Every method except ``describe`` and ``coords`` may be a
    collective: all ranks call it at the same point."""

    checkpoints: bool
    """False for a backend without state to save (comm_check): the loop then neither resumes nor saves."""

    def describe(self) -> str:
        """One line for rank 0's log: backend, layout, precision..."""

    def coords(self) -> dict[str, int]:
        """This rank's place for its records: keyword arguments of ``StepCollector.for_rank`` (tp/pp/dp_rank)."""

    def resume(self, source: Path) -> int:
        """Load the checkpoint at ``source``; returns the step it holds (the last completed one)."""

    def batch(self, step: int) -> Any:
        """This rank's input of ``step`` (the loop times it as data time)."""

    def step(self, step: int, batch: Any) -> StepResult:
        """Forward, backward and optimizer step of ``step`` on ``batch``."""

    def evaluate(self, batches: list) -> float | None:
        """The validation loss over ``batches`` (``training.eval_iters`` lists of this rank's microbatches; forward
        only), the same on every rank; None for a backend without a model (comm_check)."""

    def close(self) -> None:
        """Release what the engine holds (called once, also after an error)."""


class Collector(Protocol):
    """The step records of one rank (``profiling.collector.StepCollector``: its docstrings say what each keeps)."""

    def start_step(self, step: int) -> None: ...

    def data_timer(self) -> ContextManager[Any]:
        """Times the body as the step's data time."""

    def end_step(self, step: int, **fields: Any) -> dict[str, Any] | None:
        """The step's record (None when none is kept): loss, lr, grad_norm, skipped, nonfinite, figures."""

    def add_evaluation(self, step: int, val_loss: float | None, seconds: float) -> None:
        """The evaluation after step ``step`` joins its record."""

    def flush(self) -> None:
        """The records so far on disk (before a checkpoint: its steps are recorded before it exists)."""

    def event(self, kind: str, seconds: float | None = None, step: int | None = None, **fields: Any) -> None:
        """A run event (``checkpoint_save``, ``checkpoint_load``) for goodput and ``status``."""

    def close(self) -> None: ...


class NullCollector:
    """A ``Collector`` that keeps nothing: for harnesses that drive the loop or the saver without records."""

    def start_step(self, step: int) -> None:
        pass

    def data_timer(self) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def end_step(self, step: int, **fields: Any) -> dict[str, Any] | None:
        return None

    def add_evaluation(self, step: int, val_loss: float | None, seconds: float) -> None:
        pass

    def flush(self) -> None:
        pass

    def event(self, kind: str, seconds: float | None = None, step: int | None = None, **fields: Any) -> None:
        pass

    def close(self) -> None:
        pass
