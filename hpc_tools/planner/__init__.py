"""The planner: memory and step-time model, the memory-fit check before queueing, and the configuration search.

Pure Python (no torch). Entry points:

* ``fit_violations(recipe)`` -> list of Violation (``validate`` and ``submit`` call it);
* ``plan_recipe(recipe)`` -> Plan (memory breakdown, step time, tokens/s, MFU, the assumption behind each term);
* ``search(recipe, top=5)`` and ``auto_configure(recipe)`` (for ``submit --auto``);
* ``calibrate.calibrate(run_dirs)`` fits a per-cluster efficiency factor from measured runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from hpc_tools.planner.efficiency import resolve_efficiency
from hpc_tools.planner.estimate import Plan, make_plan
from hpc_tools.planner.fit import fit_violations
from hpc_tools.planner.search import SearchResult, auto_configure, search

if TYPE_CHECKING:
    from hpc_tools.recipe.schema import Recipe

__all__ = ["Plan", "SearchResult", "auto_configure", "fit_violations", "plan_recipe", "resolve_efficiency", "search"]


def plan_recipe(recipe: "Recipe", efficiency: float | None = None, calibration: Path | None = None,
                use_calibration: bool = True) -> Plan:
    """The recipe's plan, with the calibrated efficiency for its cluster when one is stored."""
    eff, source = resolve_efficiency(recipe, efficiency, calibration, use_calibration)
    return make_plan(recipe, efficiency=eff, efficiency_source=source)
