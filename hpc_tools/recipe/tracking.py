"""``tracking:`` — where rank 0 sends the training scalars as the job runs (``hpc_tools.tracking``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hpc_tools.recipe.base import Section


class WandbConfig(Section):
    enabled: bool = True
    """Send the scalars to Weights & Biases (needs the `wandb` package; `false` turns it off, e.g. in a profile)."""
    project: str = "hpc_tools"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user); null = the account's default."""
    mode: Literal["online", "offline"] = "offline"
    """`offline` writes the run under the run folder's `wandb/` (upload later with `wandb sync`); `online` needs
    network access from rank 0 and a login (`WANDB_API_KEY`)."""
    tags: list[str] = Field(default_factory=list)
    """W&B run tags."""


class MlflowConfig(Section):
    enabled: bool = True
    """Send the scalars to MLflow (needs the `mlflow` package; `false` turns it off, e.g. in a profile)."""
    tracking_uri: str | None = None
    """MLflow tracking URI (`file:/path`, `http://host:5000`, ...); null = `file:` the run folder's `mlruns/`."""
    experiment: str = "hpc_tools"
    """MLflow experiment name (created when missing)."""


class TrackingConfig(Section):
    tensorboard: bool = True
    """Write TensorBoard event files into the run folder's `tensorboard/` as the job runs (`python -m hpc_tools
    tensorboard RUN` rebuilds them from the records and prints the command to view them)."""
    wandb: WandbConfig | None = None
    """Weights & Biases; null = off, a mapping (even `{}`) = on."""
    mlflow: MlflowConfig | None = None
    """MLflow; null = off, a mapping (even `{}`) = on."""

