"""``checkpoint:`` — saving and resuming."""

from __future__ import annotations

from pydantic import Field

from hpc_tools.recipe.base import Section


class CheckpointConfig(Section):
    dir: str | None = None
    """Checkpoint folder; null = `checkpoints/` inside the run folder."""
    interval_iters: int = Field(default=0, ge=0)
    """Save every N steps; 0 = only at the end and on preemption."""
    keep_last: int = Field(default=2, gt=0)
    """Complete checkpoints kept; older ones are deleted after a newer one is complete."""
    resume: bool = True
    """Resume from the newest complete checkpoint in `dir` when one exists (requeued jobs rely on this)."""
    load_path: str | None = None
    """A checkpoint to start from when `dir` has none (e.g. saved under another layout)."""
