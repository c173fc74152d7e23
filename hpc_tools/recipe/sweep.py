"""``sweep:`` — a grid of overrides run as one job array."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from hpc_tools.recipe.base import Section


class SweepConfig(Section):
    grid: dict[str, list[Any]] = Field(default_factory=dict)
    """Dotted recipe keys mapped to the values to try, e.g. `cluster.nodes: [1, 2, 4]`; the cells are the product."""
    repeats: int = Field(default=1, gt=0)
    """Runs per cell (for run-to-run spread)."""
