"""The one owner of Slurm resource flags. Both the rendered sbatch script and the submitit executor read them here,
derived from the parallel layout (nodes, one task per GPU) and the recipe's cluster section. Which flags that makes
hpc_tools' own (and so refused in ``cluster.sbatch_extra``) is stated beside the fields that set them:
``hpc_tools.recipe.cluster.OWNED_FLAGS``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.schema import Recipe
from hpc_tools.render import launchers
from hpc_tools.render.launchers import STOP_SIGNAL


@dataclass(frozen=True, slots=True)
class SlurmSpec:
    job_name: str
    nodes: int
    ntasks_per_node: int
    gpus_per_node: int | None
    cpus_per_task: int
    mem_gb: int | None
    time_limit: str
    time_min: int
    partition: str | None
    account: str | None
    qos: str | None
    constraint: str | None
    reservation: str | None
    exclusive: bool
    signal_delay_s: int
    requeue: bool
    extra: tuple[str, ...] = ()
    spare_nodes: int = 0
    switches: int | None = None
    switch_wait_min: int | None = None
    elastic: bool = False  # cluster.min_nodes below nodes: the job goes on after a node failure, on fewer nodes
    stop_signal: bool = True  # --signal before the time limit: the launcher's time_limit_stop (not Ray's)

    @property
    def no_kill(self) -> bool:
        """A node failure leaves the job running on the others: an in-job restart takes a spare, or goes on with
        fewer nodes (elastic)."""
        return bool(self.spare_nodes) or self.elastic

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> "SlurmSpec":
        lay, c = ParallelLayout.from_recipe(recipe), recipe.cluster
        return cls(job_name=recipe.name, nodes=lay.nodes + c.spare_nodes, spare_nodes=c.spare_nodes,
                   ntasks_per_node=lay.ranks_per_node,
                   gpus_per_node=lay.ranks_per_node if c.uses_gpus else None, cpus_per_task=c.cpus_per_task,
                   mem_gb=c.mem_gb, time_limit=c.time_limit, time_min=max(1, math.ceil(c.time_limit_min)),
                   partition=c.partition, account=c.account, qos=c.qos, constraint=c.constraint,
                   reservation=c.reservation, exclusive=c.exclusive, signal_delay_s=c.signal_delay_s,
                   requeue=c.requeue, extra=tuple(c.sbatch_extra), switches=c.switches,
                   switch_wait_min=c.switch_wait_min, elastic=c.elastic,
                   stop_signal=launchers.of(c.launcher).time_limit_stop)

    @property
    def step_nodes(self) -> int:
        """Nodes of a rank step (the layout's): the allocation's without its spares."""
        return self.nodes - self.spare_nodes

    @property
    def switches_value(self) -> str:
        """--switches' value: COUNT, or COUNT@MINUTES with a wait of its own."""
        return f"{self.switches}@{self.switch_wait_min}" if self.switch_wait_min else str(self.switches)

    def sbatch_options(self) -> list[tuple[str, str | None]]:
        """(flag, value) pairs in a fixed order; value None means a bare flag."""
        opts: list[tuple[str, str | None]] = [
            ("job-name", self.job_name), ("nodes", str(self.nodes)), ("ntasks-per-node", str(self.ntasks_per_node))]
        if self.gpus_per_node:
            opts.append(("gpus-per-node", str(self.gpus_per_node)))
        opts.append(("cpus-per-task", str(self.cpus_per_task)))
        if self.mem_gb:
            opts.append(("mem", f"{self.mem_gb}G"))
        opts.append(("time", self.time_limit))
        for key in ("partition", "account", "qos", "constraint", "reservation"):
            if getattr(self, key):
                opts.append((key, getattr(self, key)))
        if self.exclusive:
            opts.append(("exclusive", None))
        if self.switches:  # topology/tree: the most leaf switches the allocation may span
            opts.append(("switches", self.switches_value))
        if self.stop_signal:
            opts.append(("signal", f"{STOP_SIGNAL}@{self.signal_delay_s}"))
        opts.append(("requeue", None) if self.requeue else ("no-requeue", None))
        if self.no_kill:
            opts.append(("no-kill", None))
        opts.append(("open-mode", "append"))  # a requeued job appends to its log
        return opts

    def sbatch_lines(self, output: str = "%x-%j.out") -> list[str]:
        lines = [f"#SBATCH --{k}" if v is None else f"#SBATCH --{k}={v}" for k, v in self.sbatch_options()]
        return lines + [f"#SBATCH --output={output}"] + [f"#SBATCH {x}" for x in self.extra]

    def submitit_parameters(self) -> dict:
        """Keyword arguments for submitit.SlurmExecutor.update_parameters (submitit adds --signal=USR2@delay)."""
        extra: dict = {"requeue": True} if self.requeue else {"no-requeue": True}
        if self.no_kill:
            extra["no-kill"] = True
        if self.reservation:
            extra["reservation"] = self.reservation
        if self.switches:
            extra["switches"] = self.switches_value
        for item in self.extra:  # cluster.sbatch_extra: submitit writes `#SBATCH --key=value`, or `--key` for True
            key, sep, value = item[2:].partition("=")
            extra[key] = value if sep else True
        params = {"job_name": self.job_name, "nodes": self.nodes, "ntasks_per_node": self.ntasks_per_node,
                  "cpus_per_task": self.cpus_per_task, "time": self.time_min, "signal_delay_s": self.signal_delay_s,
                  "additional_parameters": extra}
        if self.gpus_per_node:
            params["gpus_per_node"] = self.gpus_per_node
        if self.mem_gb:
            params["mem"] = f"{self.mem_gb}GB"
        for key in ("partition", "account", "qos", "constraint"):
            if getattr(self, key):
                params[key] = getattr(self, key)
        if self.exclusive:
            params["exclusive"] = True
        return params
