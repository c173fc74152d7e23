"""TensorBoard event files rebuilt from a run's step records, after the fact (``python -m hpc_tools tensorboard``).

One value per step and scalar: the training and validation loss are the mean over the ranks that report them
(``profiling.figures.RunReducer.step_losses``: the loss is null off the last pipeline stage); every other scalar is
the lowest rank's record (global rank 0 normally), which is what the live tracker logged. A requeued or resumed run's
re-run steps count once, the newest start's record winning (``profiling.figures.prepare_rank``). The records are
found and read by ``profiling.records`` only.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from hpc_tools.tracking.trackers import TENSORBOARD_DIR, clean_scalars

# The record fields drawn, under the tags of hpc_tools.tracking.trackers.TAGS.
SERIES = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu",
          "step_time_s", "mem_allocated_max_bytes", "rss_bytes")


def step_series(records_dir: Path) -> tuple[list[int], list[float], dict[str, list[float | None]]]:
    """(steps, wall times, scalar name -> value per step, None where not recorded) of a run's records."""
    import numpy as np

    from profiling.figures import COLUMNS, RunReducer
    from profiling.records import iter_rank_columns
    from profiling.schema import FIELD_NAMES

    # val_loss exists from record schema version 2 on; older files simply lack the column.
    wanted = [c for c in SERIES + ("time",) if c in FIELD_NAMES]
    reducer = RunReducer(warmup=0)
    first: dict[str, np.ndarray] | None = None
    for rank, cols in iter_rank_columns(Path(records_dir), tuple(dict.fromkeys(COLUMNS + tuple(wanted)))):
        prepared = reducer.add_rank(rank, cols)
        if prepared is not None and first is None:
            first = prepared[0]  # ranks come in order: the lowest rank with step records
    if first is None:
        return [], [], {}
    steps = first["step"].astype(np.int64)
    series: dict[str, np.ndarray] = {name: first[name] for name in SERIES if name in first}
    series["loss"] = reducer.step_losses(steps)
    if "val_loss" in FIELD_NAMES:
        series["val_loss"] = reducer.step_losses(steps, validation=True)
    out = {name: [None if np.isnan(v) else float(v) for v in values] for name, values in series.items()
           if not np.all(np.isnan(values))}
    wall = first["time"] if "time" in first else np.zeros(steps.size)
    return steps.tolist(), wall.tolist(), out


def rebuild(run_dir: Path, plain: bool = False) -> tuple[Path, int]:
    """Write ``RUN/tensorboard/`` anew from the records: (the folder, steps written). The new event file is written
    beside the folder and moved in once complete, replacing the old event files; ``plain`` uses the self-contained
    writer even when TensorBoard is installed."""
    from hpc_tools.registry import RunFolder
    from hpc_tools.tracking.events import event_files, event_writer

    run = RunFolder(run_dir)
    steps, wall, series = step_series(run.records_dir)
    target = Path(run_dir) / TENSORBOARD_DIR
    staging = Path(run_dir) / f".{TENSORBOARD_DIR}-rebuild-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        writer = event_writer(staging, plain=plain)
        try:
            for i, step in enumerate(steps):
                scalars = clean_scalars({name: values[i] for name, values in series.items()})
                if scalars:
                    writer.add_scalars(step, scalars, wall_time=wall[i])
        finally:
            writer.close()
        target.mkdir(parents=True, exist_ok=True)
        for old in event_files(target):
            old.unlink()
        for new in event_files(staging):
            os.replace(new, target / new.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target, len(steps)


def write_from_records(run_dir: Path) -> Path:
    """(Re)build the run's TensorBoard event files from its records; returns the folder to point TensorBoard at."""
    return rebuild(run_dir)[0]
