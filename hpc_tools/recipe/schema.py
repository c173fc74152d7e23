"""The recipe: one typed model per section. Unknown keys anywhere are errors."""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, PrivateAttr, field_validator

from hpc_tools.recipe.backend import BackendConfig
from hpc_tools.recipe.base import Section, Text
from hpc_tools.recipe.checkpoint import CheckpointConfig
from hpc_tools.recipe.cluster import ClusterConfig
from hpc_tools.recipe.data import DataConfig
from hpc_tools.recipe.model import ModelConfig
from hpc_tools.recipe.parallel import ParallelConfig
from hpc_tools.recipe.profiling import ProfilingConfig
from hpc_tools.recipe.sweep import SweepConfig
from hpc_tools.recipe.tracking import TrackingConfig
from hpc_tools.recipe.training import TrainingConfig

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # always fullmatch: `$` accepts a trailing newline
# Sections a `local:` profile may override (not name/local/sweep).
PROFILE_SECTIONS = ("model", "parallel", "training", "backend", "data", "checkpoint", "cluster", "profiling",
                    "tracking")


class Recipe(Section):
    """A whole recipe: one typed section per concern (`validate --explain SECTION` lists a section's fields)."""

    name: str
    """Job name: letters, digits, `_ . -` (used for the Slurm job name and the run folder)."""
    description: Text = ""
    """Free text (several lines allowed; no other control characters)."""
    model: ModelConfig
    """The network."""
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    """Parallel degrees."""
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    """Optimisation."""
    backend: BackendConfig = Field(default_factory=BackendConfig)
    """Training program."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Training data."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpointing."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """Resources and environment."""
    profiling: ProfilingConfig = Field(default_factory=ProfilingConfig)
    """In-job measurements."""
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    """Experiment tracking: TensorBoard (on by default), W&B, MLflow."""
    local: dict[str, Any] | None = None
    """Profile merged over the recipe when the job runs locally (or with --profile local): a small model and a layout
    that fits a CPU laptop. Same sections as the recipe, partial."""
    sweep: SweepConfig | None = None
    """Grid of overrides for `python -m hpc_tools sweep`."""
    # Which layer wrote what (``hpc_tools.recipe.provenance``): set by ``resolve``, None otherwise.
    _provenance: Any = PrivateAttr(default=None)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not NAME_RE.fullmatch(value):
            raise ValueError("is not a valid job name -- use 1-64 letters, digits, '_', '.', '-', "
                             "starting with a letter or digit")
        return value

    @field_validator("local")
    @classmethod
    def _local_sections(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        for key in value or {}:
            if key not in PROFILE_SECTIONS:
                raise ValueError(f"names the unknown section {key!r} -- valid sections: {', '.join(PROFILE_SECTIONS)}")
        return value
