"""``sweep:`` — a grid of overrides; each cell is a resolved recipe, run as one job (arrays group equal resources)."""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import Field, field_validator

from hpc_tools.recipe.base import Section

# One dotted key (`cluster.nodes`) or several joined by commas (`parallel.tensor_size,parallel.pipeline_size`).
KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")  # fullmatch: `$` takes a trailing newline


MAX_CELLS = 10_000  # each cell becomes a run folder (and a Slurm array task)


def axis_keys(axis: str) -> list[str]:
    """The dotted recipe keys of one grid axis (a comma-joined axis moves several keys together)."""
    return [k.strip() for k in axis.split(",")]


class SweepConfig(Section):
    grid: dict[str, list[Any]] = Field(default_factory=dict)
    """Dotted recipe keys mapped to the values to try, e.g. `cluster.nodes: [1, 2, 4]`; the cells are the product of
    the axes. Keys joined by commas move together (a zipped axis), e.g.
    `parallel.tensor_size,parallel.pipeline_size: [[1, 1], [2, 1], [2, 2]]` tries three layouts, not nine."""
    repeats: int = Field(default=1, gt=0, le=1000)
    """Runs per cell (for run-to-run spread)."""
    max_parallel: int | None = Field(default=None, gt=0, le=MAX_CELLS)
    """The most cells of the sweep that run at once on Slurm (each job array's `--array=...%K`, shared between the
    sweep's arrays). Unset: as many as Slurm starts (no throttle of the tool's own; submitit's silent %256 is not
    applied). Cells beyond Slurm's `MaxArraySize` or the user's `MaxSubmitJobs` wait in the sweep's record and are
    submitted by `sweep status` as earlier cells end. Locally cells run one at a time anyway."""
    scaling: Literal["auto", "strong", "weak", "none"] = "auto"
    """How `analyze` reads the sweep: `strong` (fixed global batch), `weak` (fixed work per GPU), `none`, or `auto`
    (strong when every cell has the same global batch, weak when global batch / GPUs is constant)."""

    @field_validator("grid")
    @classmethod
    def _grid(cls, value: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for axis, values in value.items():
            keys = axis_keys(axis)
            bad = [k for k in keys if not KEY_RE.fullmatch(k)]
            if bad:
                raise ValueError(f"has the axis {axis!r} whose key {bad[0]!r} is not a dotted recipe key "
                                 "-- use section.key, e.g. cluster.nodes or training.micro_batch_size")
            if not values:
                raise ValueError(f"has the axis {axis!r} with no values -- list at least one value")
            if len(keys) > 1:
                for item in values:
                    if not isinstance(item, (list, tuple)) or len(item) != len(keys):
                        raise ValueError(f"axis {axis!r} has the value {item!r}, not a list of {len(keys)} values "
                                         f"-- give one [{', '.join(keys)}] list per cell")
        cells = math.prod(len(values) for values in value.values())
        if cells > MAX_CELLS:  # checked before anything expands the product
            raise ValueError(f"has {cells} cells -- a sweep holds at most {MAX_CELLS}; split it into several sweeps")
        return value
