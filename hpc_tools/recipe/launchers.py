"""What each ``cluster.launcher`` is: the one owner of its facts, for the recipe's rules and every other caller.

One frozen row per value the schema's ``Literal`` allows (``tests/unit/test_launchers.py`` checks both ways). Callers
ask the row instead of comparing the name: the rules which backends it launches (``backend_feature``, a feature of
the backend table's rows), whether it starts its ranks inside ``cluster.setup.container`` and whether Slurm signals
its ranks before the time limit; the Slurm and local executors and ``status`` whether one process drives every rank
(``driver``); ``doctor`` the packages it needs. What a launcher writes into the batch script is
``hpc_tools.render.launchers``', whose rows read these facts. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class LauncherFacts:
    name: str
    """The value of ``cluster.launcher``."""
    time_limit_stop: bool
    """Slurm signals the ranks ``cluster.signal_delay_s`` before the time limit (they checkpoint, the job requeues)."""
    no_time_limit_stop_why: str = ""
    """Why a launcher without the stop gets none (the recipe's note says it)."""
    driver: str | None = None
    """The module whose ``drive`` runs every rank from one process; None: one task per rank."""
    packages: tuple[tuple[str, str], ...] = ()
    """(distribution, pip requirement) it needs beyond every job's."""
    backend_feature: str | None = None
    """The feature of the backend table's row (``hpc_tools.backends.Backend``) a backend needs to be launched by
    it; None: every backend."""
    backend_feature_words: str = ""
    """That feature in words, for the rule's line."""
    container: bool = True
    """It starts its ranks inside ``cluster.setup.container``."""
    no_container_why: str = ""
    """Why a launcher without containers cannot start one around its processes (the rule's line)."""


DEFAULT = "srun"
"""``cluster.launcher``'s default: one task per GPU, every backend, the time-limit stop."""

LAUNCHERS: dict[str, LauncherFacts] = {row.name: row for row in (
    LauncherFacts(name="srun", time_limit_stop=True),
    LauncherFacts(name="ray", time_limit_stop=False, driver="hpc_tools.job.ray_launch",
                  no_time_limit_stop_why="Slurm's signal would end Ray's processes before any worker checkpoints",
                  packages=(("ray", "ray[default,train]"),), backend_feature="ray_train",
                  backend_feature_words="PyTorch-native: FSDP2, HSDP, DDP", container=False,
                  no_container_why="is not started around the Ray nodes and driver (cluster.launcher=ray runs them "
                  "on the hosts)"),
)}


def of(name: str) -> LauncherFacts:
    """The row of ``cluster.launcher`` ``name`` (the schema allows no other; a KeyError names a missing row)."""
    return LAUNCHERS[name]
