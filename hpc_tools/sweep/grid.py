"""Grid expansion: a recipe's ``sweep:`` section -> cells (overrides), each resolved and checked like a single run.

A cell that breaks a rule is not an error of the sweep: it is dropped and listed with the violation text, so that a
grid over nodes x layouts can be written without pre-filtering the combinations that do not fit.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Iterable

import yaml
from pydantic import ValidationError

from hpc_tools.errors import RecipeError, UserError
from hpc_tools.recipe.load import resolve
from hpc_tools.recipe.pydantic_errors import violations_from_pydantic
from hpc_tools.recipe.schema import Recipe
from hpc_tools.recipe.sweep import SweepConfig, axis_keys


@dataclass
class Cell:
    """One point of the grid: its parameters, the --set overrides that produce it, and the resolved recipe."""

    index: int
    params: dict[str, Any]
    overrides: list[str]
    recipe: Recipe | None = None
    reasons: list[str] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return self.recipe is not None

    def label(self) -> str:
        """Short human label, e.g. ``nodes=2 tensor_size=2``."""
        return " ".join(f"{k.rsplit('.', 1)[-1]}={_show(v)}" for k, v in self.params.items())


@dataclass
class SweepPlan:
    name: str
    config: SweepConfig
    cells: list[Cell]
    base_overrides: list[str]
    profile: str | None

    @property
    def valid(self) -> list[Cell]:
        return [c for c in self.cells if c.valid]

    @property
    def invalid(self) -> list[Cell]:
        return [c for c in self.cells if not c.valid]


def _show(value: Any) -> str:
    """A value as a YAML flow scalar, so that ``--set key=<it>`` parses back to the same value."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def cell_params(config: SweepConfig) -> list[dict[str, Any]]:
    """The grid's product, in a stable order (axes in recipe order, values in list order)."""
    axes = list(config.grid.items())
    combos = itertools.product(*(values for _, values in axes)) if axes else [()]
    out = []
    for combo in combos:
        params: dict[str, Any] = {}
        for (axis, _), value in zip(axes, combo):
            keys = axis_keys(axis)
            params.update(zip(keys, value) if len(keys) > 1 else [(keys[0], value)])
        out.append(params)
    return out


def sweep_config(raw: dict[str, Any], source: str = "recipe") -> SweepConfig:
    """The ``sweep:`` section typed; a missing or malformed one is a one-line error naming the field."""
    block = raw.get("sweep")
    if not block:
        raise UserError(f"{source} has no sweep: section (add e.g. `sweep: {{grid: {{cluster.nodes: [1, 2]}}}}`)")
    if not isinstance(block, dict):
        raise UserError(f"{source}: sweep must be a mapping with grid and repeats (got {type(block).__name__})")
    try:
        return SweepConfig.model_validate(block)
    except ValidationError as exc:
        # Same wording as every other recipe field: prefix the location with the section name.
        errors = [{**err, "loc": ("sweep", *err["loc"])} for err in exc.errors()]
        raise RecipeError(violations_from_pydantic(errors, raw), source) from None


def expand(raw: dict[str, Any], overrides: Iterable[str] = (), profile: str | None = None,
           source: str = "recipe") -> SweepPlan:
    """Every cell of the recipe's grid, resolved with the cell's values first and ``--set`` overrides after them.

    --set beats the recipe (its sweep grid included), as everywhere else; a --set that pins a grid axis makes some
    cells identical, and the repeats are dropped with the reason rather than run twice.
    """
    from hpc_tools.recipe.load import dump_resolved
    from hpc_tools.submission import fit_violations

    config = sweep_config(raw, source)
    base = list(overrides)
    cells, seen = [], {}
    for index, params in enumerate(cell_params(config)):
        cell_overrides = [f"{k}={_show(v)}" for k, v in params.items()]
        cell = Cell(index=index, params=params, overrides=cell_overrides)
        try:
            cell.recipe = resolve(raw, cell_overrides + base, profile, source)
        except RecipeError as exc:
            cell.reasons = [str(v) for v in exc.violations]
        except UserError as exc:  # e.g. an axis that names a value as if it were a section
            cell.reasons = [str(exc)]
        if cell.recipe is not None:
            fit = fit_violations(cell.recipe)  # the planner's memory verdict, as `submit` applies it
            if fit:
                cell.recipe, cell.reasons = None, [str(v) for v in fit]
        if cell.recipe is not None:
            text = dump_resolved(cell.recipe)
            if text in seen:
                cell.recipe, cell.reasons = None, [f"is the same recipe as cell {seen[text]} after the --set overrides"]
            else:
                seen[text] = index
        cells.append(cell)
    return SweepPlan(name=str(raw.get("name", "sweep")), config=config, cells=cells, base_overrides=base,
                     profile=profile)


def check_world(plan: SweepPlan, slurm: bool) -> None:
    """Drop the cells that do not fit this machine's files or (with ``slurm``) the live cluster, as `submit` refuses
    such a recipe (``recipe.world.world_violations``; the cluster is asked once for every cell)."""
    from hpc_tools.world import slurm_view, world_violations

    view = slurm_view() if slurm and plan.valid else None
    for cell in plan.valid:
        found = world_violations(cell.recipe, slurm=slurm, view=view)
        if found:
            cell.recipe, cell.reasons = None, [str(v) for v in found]
