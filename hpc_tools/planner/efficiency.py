"""The stored efficiency factors: one per cluster (GPU type and partition) in a JSON file
($HPC_TOOLS_CALIBRATION, else ~/.config/hpc_tools/calibration.json) that ``calibrate.calibrate`` writes and every
plan and search reads (``resolve_efficiency``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_tools.errors import UserError

if TYPE_CHECKING:
    from hpc_tools.recipe.cluster import ClusterConfig
    from hpc_tools.recipe.schema import Recipe


CALIBRATION_VERSION = 1


def default_path() -> Path:
    """$HPC_TOOLS_CALIBRATION, else ~/.config/hpc_tools/calibration.json."""
    env = os.environ.get("HPC_TOOLS_CALIBRATION")
    return Path(env) if env else Path.home() / ".config" / "hpc_tools" / "calibration.json"


def cluster_key(cluster: "ClusterConfig") -> str:
    """``H100-SXM`` or ``H100-SXM@partition``: what one efficiency factor is valid for."""
    return cluster.gpu_type + (f"@{cluster.partition}" if cluster.partition else "")


def load_store(path: Path | None = None) -> dict[str, Any]:
    path = path or default_path()
    if not path.is_file():
        return {"version": CALIBRATION_VERSION, "clusters": {}}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"calibration file {path} is not valid JSON ({exc.msg}; delete it or fix it)") from None
    data.setdefault("clusters", {})
    return data


def efficiency_for(cluster: "ClusterConfig", path: Path | None = None) -> tuple[float, str] | None:
    """(efficiency, source) stored for this cluster (exact key, else the GPU type alone), or None."""
    clusters = load_store(path)["clusters"]
    for key in (cluster_key(cluster), cluster.gpu_type):
        if key in clusters:
            return float(clusters[key]["efficiency"]), f"calibrated {key}, {len(clusters[key].get('runs', []))} run(s)"
    return None


def resolve_efficiency(recipe: "Recipe", efficiency: float | None = None,
                       calibration: Path | None = None, use_calibration: bool = True) -> tuple[float | None, str]:
    """(efficiency, where it came from): an explicit value, else the stored calibration for the recipe's cluster,
    else (None, "default") for the planner's default."""
    if efficiency is not None:
        return efficiency, "--efficiency"
    if use_calibration:
        found = efficiency_for(recipe.cluster, calibration)
        if found:
            return found
    return None, "default"
