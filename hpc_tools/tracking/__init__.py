"""Experiment tracking: the training scalars in TensorBoard (every run, by default), W&B and MLflow.

``open_trackers(run_dir, recipe)`` gives the job's trackers (rank 0 calls ``.log(step, scalars)`` at every log line and
``.close()`` at the end; neither ever raises into training); ``write_from_records(run_dir)`` rebuilds a run's
TensorBoard files from its step records afterwards. How to view them: ``docs/tracking.md``.
"""

from __future__ import annotations

from hpc_tools.tracking.rebuild import write_from_records
from hpc_tools.tracking.trackers import TAGS, TENSORBOARD_DIR, Trackers, open_trackers

__all__ = ["TAGS", "TENSORBOARD_DIR", "Trackers", "open_trackers", "write_from_records"]
