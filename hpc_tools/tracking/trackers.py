"""The live trackers of a job: rank 0 hands them the scalars of every log line (``Trackers.log``).

TensorBoard event files go to ``RUN/tensorboard/`` unless ``tracking.tensorboard`` is false; W&B and MLflow run when
their ``tracking`` section is given and enabled. Tracking must never cost a training run: a tracker that fails to
open or to log logs one warning naming itself and the error, and is switched off for the rest of the job; the others
go on.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import urlparse

if TYPE_CHECKING:
    from hpc_tools.recipe.schema import Recipe

log = logging.getLogger("hpc_tools")

TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"
MLRUNS_DIR = "mlruns"

# Scalar name (the step record's field) -> the tag every tracker shows it under; the prefix groups the charts.
TAGS = {
    "loss": "loss/train",
    "val_loss": "loss/val",
    "lr": "optim/lr",
    "grad_norm": "optim/grad_norm",
    "tokens_per_s": "throughput/tokens_per_s",
    "tokens_per_s_per_gpu": "throughput/tokens_per_s_per_gpu",
    "tflops_per_gpu": "throughput/tflops_per_gpu",
    "mfu": "throughput/mfu",
    "step_time_s": "time/step_time_s",
    "pp_wait_share": "time/pp_wait_share",
    "mem_allocated_max_bytes": "memory/allocated_max_bytes",
    "rss_bytes": "memory/rss_bytes",
}


def tag(name: str) -> str:
    """The tag a scalar is shown under (its own name when it has no group)."""
    return TAGS.get(name, name)


def clean_scalars(scalars: dict[str, Any]) -> dict[str, float]:
    """The scalars that are numbers, as floats under their tags (None, strings and the like are left out)."""
    out = {}
    for name, value in scalars.items():
        if value is None or isinstance(value, (str, bytes)):
            continue
        try:
            out[tag(name)] = float(value)
        except (TypeError, ValueError):
            continue
    return out


class Sink:
    """One tracker: ``log`` tagged float scalars of a step, ``close`` at the end."""

    name = "tracker"

    def log(self, step: int, scalars: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TensorBoardSink(Sink):
    name = "TensorBoard"

    def __init__(self, logdir: Path):
        from hpc_tools.tracking.events import event_writer

        self.writer = event_writer(logdir)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.writer.add_scalars(step, scalars)
        self.writer.flush()  # a few bytes per log line: a live TensorBoard sees every one

    def close(self) -> None:
        self.writer.close()


class WandbSink(Sink):
    name = "W&B"

    def __init__(self, run_dir: Path, recipe: "Recipe"):
        import wandb

        cfg = recipe.tracking.wandb
        assert cfg is not None
        folder = Path(run_dir) / WANDB_DIR
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, mode=cfg.mode, tags=cfg.tags or None,
                              name=Path(run_dir).name, id=_safe_id(Path(run_dir).name), resume="allow",
                              dir=str(folder), config=recipe.model_dump(mode="json", exclude={"local", "sweep"}))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowSink(Sink):
    name = "MLflow"

    def __init__(self, run_dir: Path, recipe: "Recipe"):
        import mlflow

        cfg = recipe.tracking.mlflow
        assert cfg is not None
        uri = cfg.tracking_uri or (Path(run_dir) / MLRUNS_DIR).absolute().as_uri()
        if urlparse(uri).scheme in ("", "file"):
            # MLflow 3 keeps its file store "in maintenance mode" and refuses to open one unless this is true; the file
            # store is this tracker's default (no server, no database package), so it opts in unless told otherwise.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(cfg.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(cfg.experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=Path(run_dir).name).info.run_id
        self.client.log_param(self.run_id, "recipe", recipe.name)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        # MLflow refuses NaN/inf in some stores: a non-finite step (the guard skipped it) is left out here only.
        metrics = [Metric(k, v, now, step) for k, v in scalars.items() if math.isfinite(v)]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _safe_id(name: str) -> str:
    """A W&B run id from the run folder name (W&B ids may not contain some characters; the folder name is unique)."""
    return "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in name)[:64]


class Trackers:
    """The job's trackers. ``log`` and ``close`` never raise: a failing tracker warns once and is switched off."""

    def __init__(self, sinks: list[Sink] | None = None):
        self.sinks = list(sinks or [])

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sinks]

    def log(self, step: int, scalars: dict[str, Any]) -> None:
        """Send the numeric scalars of ``step`` (named as in the step records; see ``TAGS``) to every tracker."""
        if not self.sinks:
            return
        clean = clean_scalars(scalars)
        if clean:
            self._each(lambda s: s.log(int(step), clean), "log")

    def close(self) -> None:
        """Close every tracker (flushes the event files)."""
        self._each(lambda s: s.close(), "close")
        self.sinks = []

    def _each(self, call: Callable[[Sink], None], what: str) -> None:
        for sink in list(self.sinks):
            try:
                call(sink)
            except Exception as exc:  # noqa: BLE001 -- no tracker error may stop a training run
                self._drop(sink, f"could not {what}", exc)

    def _drop(self, sink: Sink, what: str, exc: BaseException) -> None:
        log.warning("tracking: %s %s (%s: %s); it is off for the rest of this job", sink.name, what,
                    type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
        if sink in self.sinks:
            self.sinks.remove(sink)
        if what != "could not close":
            try:
                sink.close()
            except Exception:  # noqa: BLE001 -- already reported once
                pass


def open_trackers(run_dir: Path, recipe: "Recipe") -> Trackers:
    """The trackers ``recipe.tracking`` asks for, writing under ``run_dir``; one that cannot open warns once and is
    left out (the job trains on). Called on global rank 0 only."""
    cfg = recipe.tracking
    wanted: list[tuple[str, Callable[[], Sink]]] = []
    if cfg.tensorboard:
        wanted.append(("TensorBoard", lambda: TensorBoardSink(Path(run_dir) / TENSORBOARD_DIR)))
    if cfg.wandb is not None and cfg.wandb.enabled:
        wanted.append(("W&B", lambda: WandbSink(run_dir, recipe)))
    if cfg.mlflow is not None and cfg.mlflow.enabled:
        wanted.append(("MLflow", lambda: MlflowSink(run_dir, recipe)))
    sinks = []
    for name, make in wanted:
        try:
            sinks.append(make())
        except Exception as exc:  # noqa: BLE001 -- a missing package or service must not stop training
            log.warning("tracking: %s could not start (%s: %s); the job goes on without it", name,
                        type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
    return Trackers(sinks)
