"""Rules of the cluster and the launch: the preemption signal, spare nodes and elastic restarts, the Ray launcher,
switches, the profiler's ranks, trackers and Liger kernels."""

from __future__ import annotations

from typing import Iterator

from hpc_tools import backends
from hpc_tools.errors import Violation
from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe import launchers
from hpc_tools.recipe.rules.registry import note, rule
from hpc_tools.recipe.schema import Recipe

# --- cluster, launcher, profiler, trackers ----------------------------------------------------------------------------

@rule
def signal_before_limit(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """The preemption signal comes before the time limit."""
    c = r.cluster
    if c.signal_delay_s >= c.time_limit_min * 60:
        yield Violation("cluster.signal_delay_s", c.signal_delay_s,
                        f"must be shorter than cluster.time_limit={c.time_limit} ({c.time_limit_min * 60:.0f} s)",
                        "lower it or raise the time limit")


@rule
def spares_need_restarts(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """Spare nodes are used by in-job restarts only."""
    c = r.cluster
    if c.spare_nodes and not c.restarts:
        yield Violation("cluster.spare_nodes", c.spare_nodes, "are only used by in-job restarts, and "
                        "cluster.restarts is 0", "set cluster.restarts (e.g. 2) or spare_nodes: 0")


@note
def spares_beyond_nodes(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """More spare nodes than nodes: valid, but the job holds more idle nodes than training ones."""
    c = r.cluster
    if c.restarts and c.spare_nodes > c.nodes:
        yield Violation("cluster.spare_nodes", c.spare_nodes, f"exceeds cluster.nodes={c.nodes}: the job holds "
                        f"{c.nodes + c.spare_nodes} nodes, {c.spare_nodes} of them idle until a node fails",
                        f"fine if failures are that likely; else spare_nodes <= {c.nodes}")


@rule
def min_nodes_within_nodes(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """Elastic training continues on fewer nodes than the layout's, never more."""
    c = r.cluster
    if c.min_nodes is not None and c.min_nodes > c.nodes:
        yield Violation("cluster.min_nodes", c.min_nodes, f"exceeds cluster.nodes={c.nodes}: it is the fewest nodes "
                        "the run may continue on after losing some", f"set min_nodes <= {c.nodes} (null: off)")


@rule
def elastic_needs_restarts(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """Continuing on fewer nodes is a kind of in-job restart."""
    c = r.cluster
    if c.fewest_nodes < c.nodes and not c.restarts:
        yield Violation("cluster.min_nodes", c.min_nodes, f"continues on fewer than cluster.nodes={c.nodes} nodes at "
                        "an in-job restart, and cluster.restarts is 0", "set cluster.restarts (e.g. 2) or "
                        f"min_nodes: {c.nodes}")


@rule
def elastic_backend(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """A backend whose checkpoint cannot be resharded into fewer nodes cannot be elastic."""
    c, row = r.cluster, backends.of(r)
    if c.elastic and not row.elastic:
        yield Violation("cluster.min_nodes", c.min_nodes, f"backend.kind={r.backend.kind} cannot continue on fewer "
                        f"nodes: {row.no_elastic_why}", f"set min_nodes: {c.nodes}, or use backend.kind "
                        f"{' or '.join(backends.with_feature('elastic'))}")


@rule
def launcher_backend(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """A launcher that starts only some backends' rank programs (Ray Train: the PyTorch-native one)."""
    row = launchers.of(r.cluster.launcher)
    if row.backend_feature and not getattr(backends.of(r), row.backend_feature):
        kinds = backends.with_feature(row.backend_feature)
        yield Violation("cluster.launcher", row.name, f"launches backend.kind={' or '.join(kinds)} only "
                        f"({row.backend_feature_words}), not backend.kind={r.backend.kind}",
                        f"use cluster.launcher: {launchers.DEFAULT}, or backend.kind: {kinds[0]}")


@rule
def launcher_container(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """A launcher that starts its processes on the hosts (Ray's nodes and driver) has no container around them."""
    row = launchers.of(r.cluster.launcher)
    if not row.container and r.cluster.setup.container is not None:
        yield Violation("cluster.setup.container.kind", r.cluster.setup.container.kind, row.no_container_why,
                        f"install {row.name} and hpc_tools on the nodes (cluster.setup.venv or conda_env) and drop the "
                        f"container, or use cluster.launcher: {launchers.DEFAULT}")


@note
def launcher_no_time_limit_stop(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """A launcher whose ranks get no stop signal before the time limit (Ray: the signal ends Ray's own processes
    before a checkpoint)."""
    c, row = r.cluster, launchers.of(r.cluster.launcher)
    if not row.time_limit_stop:
        yield Violation("cluster.launcher", row.name, f"gets no stop signal before cluster.time_limit={c.time_limit} "
                        f"({row.no_time_limit_stop_why}): no stop checkpoint and no requeue at the limit, "
                        f"cluster.signal_delay_s is not used; the run resumes from its newest periodic checkpoint "
                        f"(checkpoint.interval_iters={r.checkpoint.interval_iters}) with `hpc_tools resume`",
                        f"use cluster.launcher: {launchers.DEFAULT} for a checkpoint at the time limit, or a time "
                        "limit the run fits in")


@rule
def switch_wait_needs_switches(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """cluster.switch_wait_min is the wait for cluster.switches, which must be set."""
    c = r.cluster
    if c.switch_wait_min is not None and c.switches is None:
        yield Violation("cluster.switch_wait_min", c.switch_wait_min, "is the wait for cluster.switches, which is "
                        "not set", "set cluster.switches (the most leaf switches the job may span) or remove "
                        "switch_wait_min")


@rule
def profiler_ranks_exist(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """torch_profiler.ranks are ranks of this job."""
    bad = [x for x in r.profiling.torch_profiler.ranks if not 0 <= x < lay.world_size]
    if r.profiling.torch_profiler.enabled and bad:
        yield Violation("profiling.torch_profiler.ranks", bad, f"are not ranks of a {lay.world_size}-rank job",
                        f"use ranks in 0..{lay.world_size - 1}")


@rule
def trace_ranks_exist(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """profiling.trace_ranks, when a list, names ranks of this job (at least one)."""
    ranks = r.profiling.trace_ranks
    if isinstance(ranks, list) and r.profiling.trace_sample_interval:
        bad = [x for x in ranks if not 0 <= x < lay.world_size]
        if bad or not ranks:
            yield Violation("profiling.trace_ranks", bad or ranks, f"must be ranks of a {lay.world_size}-rank job "
                            "(at least one)", f"use ranks in 0..{lay.world_size - 1}, or auto, or all")


@rule
def trackers_installed(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """An enabled tracking.wandb or tracking.mlflow needs its package installed."""
    from importlib.util import find_spec  # looked up, never imported: validate stays light

    if r.tracking.wandb is not None and r.tracking.wandb.enabled and find_spec("wandb") is None:
        yield Violation("tracking.wandb.enabled", True, "needs the 'wandb' package, which is not installed",
                        "pip install wandb, or set tracking.wandb.enabled=false")
    if r.tracking.mlflow is not None and r.tracking.mlflow.enabled and find_spec("mlflow") is None:
        yield Violation("tracking.mlflow.enabled", True, "needs the 'mlflow' package, which is not installed",
                        "pip install mlflow, or set tracking.mlflow.enabled=false")



@rule
def liger_needs_llama(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """Liger Kernel is applied to Llama models only (apply_liger_kernel_to_llama)."""
    b = r.backend
    liger = {"fsdp": b.fsdp.liger, "deepspeed": b.deepspeed.liger, "horovod": b.horovod.liger}.get(b.kind, False)
    if liger and r.model.family != "llama":
        yield Violation(f"backend.{b.kind}.liger", True, f"patches Llama models only, not model.family="
                        f"{r.model.family}", f"use family: llama, or backend.{b.kind}.liger=false")


@note
def liger_on_cpu(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """Liger Kernel on CPU ranks: its Triton kernels need CUDA, so the run keeps the plain layers."""
    b = r.backend
    liger = {"fsdp": b.fsdp.liger, "deepspeed": b.deepspeed.liger, "horovod": b.horovod.liger}.get(b.kind, False)
    if liger and not r.cluster.uses_gpus:
        yield Violation(f"backend.{b.kind}.liger", True, "does not apply on CPU ranks (Triton kernels need CUDA): "
                        "this run trains the plain PyTorch layers and loss", "fine for a CPU rehearsal")


HEALTH_COSTLY_MIN = 0.5
"""Below this interval the checks while training may cost more than 1 % of the run: one check takes a few tenths of
a second on a loaded CPU machine (benchmarks/bench_health_overhead.py), 1 % of 30 s is 0.3 s."""


@note
def health_checks_costly(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """Health checks while training more often than every 30 s may cost more than 1 % of the run."""
    every = r.profiling.health_interval_min
    if 0 < every < HEALTH_COSTLY_MIN and r.cluster.preflight != "off":
        yield Violation("profiling.health_interval_min", every, f"checks every {every * 60:g} s: at a few tenths of "
                        "a second per check that may cost more than 1 % of the run", f"fine for a test; "
                        f">= {HEALTH_COSTLY_MIN} keeps it under 1 % (the default, 5, well under)")
