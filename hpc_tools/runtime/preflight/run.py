"""Preflight on the ranks (``cluster.preflight``): every rank measures, rank 0 writes the table, every rank reaches
the same verdict. Called by the rank program (``hpc_tools.runtime.rank``) before the trainer, in the same srun step
and process group as the training (no second rendezvous), and by ``--preflight-only`` for ``hpc_tools preflight``.

The steps, within ``cluster.preflight_budget_s`` (each time slice is a share of it):

1. the process group (gloo on CPU, NCCL on GPU), left up for the trainer; every rank's node and host;
2. per rank a GEMM at the recipe's precision and a memory copy (ranks of one machine on CPU take turns: they share
   its cores; GPU ranks measure at once, each on its own GPU); a node these figures name slow is looked at again
   (``SECOND_LOOKS``: every rank measures once more, the best of all looks kept) before it is named;
3. the transport: gloo's interface and address on CPU; on GPU NCCL's own INFO lines (``NCCL_DEBUG=INFO`` into
   ``preflight/nccl-<host>-<pid>.log`` of the run folder while preflight runs, unless the user set ``NCCL_DEBUG``);
4. collectives over all ranks at the layout's message size (all-reduce, all-gather, all-to-all with expert
   parallelism), as bus bandwidth; one all-reduce inside each node with several ranks, all nodes at once;
5. the search for a slow link (``bisect.find_slow``): all-reduces over halves of the nodes, both halves at once,
   over the nodes not named already by their own figures (a node slow to compute is slow in every collective);
6. the verdicts (``verdict.judge``), ``preflight.json`` and the table on rank 0, a ``preflight`` event for the
   goodput report; named nodes that a spare or a requeue can replace end the step for the restart controller
   (``leave_out``), else ``strict`` raises ``PreflightFailed`` on every rank with one line and ``auto`` logs it
   and goes on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from hpc_tools.runtime.preflight import leave_out, measure
from hpc_tools.runtime.preflight.bisect import find_slow
from hpc_tools.runtime.preflight.links import (
    PER_SYNC,
    SHARED_REPEATS,
    RoundRunner,
    agreed_seconds,
    bytes_moved,
    expected_at,
    smallest_figure,
    timed_groups,
)
from hpc_tools.runtime.preflight.verdict import (
    EXPECTED_FLOOR,
    SLOW,
    SLOW_FACTOR,
    PreflightFailed,
    RankResult,
    Report,
    busbw_gbps,
    expected_transport,
    failure_line,
    gloo_transport,
    judge,
    named,
    nccl_transport,
    table_lines,
    transport_reasons,
)

if TYPE_CHECKING:
    from hpc_tools.runtime.context import RankContext

log = logging.getLogger("hpc_tools")
RANKS_PER_NODE_ENV = "HPC_TOOLS_PREFLIGHT_RANKS_PER_NODE"  # local executor: ranks that stand for one node
NCCL_DIR = "preflight"
_CREATED = False  # this process's default group was made by preflight (``close`` ends it)
# Message sizes: one micro-batch's activations (b x s x h at the precision's bytes), what a TP all-reduce or an SP
# all-gather moves, held between these bounds so the checks stay within the budget.
SIZE_BOUNDS = {"cpu": (256 << 10, 4 << 20), "cuda": (1 << 20, 256 << 20)}
# The slow-link search's all-reduce message, at least: on GPUs a link's figure near its large-message speed (a 1 MiB
# all-reduce across nodes is latency-bound, a fraction of it); on CPU the layout's own (the test cluster's timing).
LINK_BYTES = {"cpu": 0, "cuda": 64 << 20}
GEMM_N = {"cpu": 256, "cuda": 8192}
MEM_BYTES = {"cpu": 32 << 20, "cuda": 1 << 30}
BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
SECOND_LOOKS = 2
"""Times the GEMM and memory figures are measured again while they name a node slow (each look as long as the first):
a node's turns can all fall in a moment other work took the host (on the loaded 2-core test machine a node's memory
copy measured 0.24x its peer's, both nodes being namespaces of that one host), while a slow node is slow in every
look. Healthy figures cost no second look."""
SHARED_LINK_FACTOR = 0.25
"""The link search's factor where the nodes share one machine (``machine_id``: the test cluster's namespace nodes):
their collectives are timed on the same cores, and healthy pairs measured up to 1.5x apart there (so 0.7 named
healthy nodes in 3 of 6 runs on 3 healthy namespace nodes), while a throttled link measured 100x slower."""


def enabled(recipe) -> bool:
    """``cluster.preflight``: strict always, auto for a multi-node job, off never."""
    mode = recipe.cluster.preflight
    return mode == "strict" or (mode == "auto" and recipe.cluster.nodes > 1)


def node_label(ctx: "RankContext") -> str:
    """This rank's node: the Slurm node name (else the host name); on the local executor ``local<k>``, k = rank //
    ranks per node (the recipe's, or ``HPC_TOOLS_PREFLIGHT_RANKS_PER_NODE``): local ranks stand in for nodes."""
    from hpc_tools.runtime.heartbeat import node_name

    if ctx.dist.executor != "local":
        return node_name()
    per = int(os.environ.get(RANKS_PER_NODE_ENV) or ctx.layout.ranks_per_node or 1)
    return f"local{ctx.rank // max(per, 1)}"


def message_bytes(recipe, device_type: str) -> int:
    lo, hi = SIZE_BOUNDS[device_type]
    act = recipe.training.micro_batch_size * recipe.model.seq_length * recipe.model.hidden_size
    return int(min(max(act * BYTES.get(recipe.training.precision, 4), lo), hi))


def link_bytes(nbytes: int, device_type: str) -> int:
    """The slow-link search's message: the layout's ``nbytes``, at least ``LINK_BYTES``."""
    return max(nbytes, LINK_BYTES[device_type])


def expected_busbw(ctx: "RankContext") -> tuple[float | None, float | None, str]:
    """(inter-node, intra-node) busbw GB/s the planner expects, and where from: the run's manifest (``submit`` and
    ``hpc_tools preflight`` record the planner's figures there: ``submission.preflight_expectation``), else the
    recipe's overrides (a plain ``sbatch`` of a rendered script); CPU ranks: none."""
    c = ctx.recipe.cluster
    if not c.uses_gpus:
        return None, None, "CPU ranks: no table figure"
    try:
        recorded = ctx.run.manifest().get("preflight_expected_busbw_gbps")
    except (OSError, ValueError):
        recorded = None
    if isinstance(recorded, dict) and recorded.get("inter"):
        return recorded.get("inter"), recorded.get("intra"), str(recorded.get("source") or "the planner")
    if c.inter_node_bw_gbps or c.intra_node_bw_gbps:
        return c.inter_node_bw_gbps, c.intra_node_bw_gbps, "cluster.inter_node_bw_gbps / intra_node_bw_gbps"
    return None, None, "none recorded (submit through `hpc_tools submit` for the planner's figures)"


def run_in_job(ctx: "RankContext") -> Report | None:
    """The training job's preflight (module docstring), when ``cluster.preflight`` has it on; None when off."""
    if not enabled(ctx.recipe):
        return None
    mode = ctx.recipe.cluster.preflight
    if mode == "strict":
        report = check(ctx, mode)
    else:
        try:
            report = check(ctx, mode)
        except PreflightFailed as exc:  # this rank cannot join (its gloo interface): told; the rendezvous fails next
            log.warning("%s; training goes on (cluster.preflight=auto)", exc)
            return None
        except Exception as exc:  # noqa: BLE001 - auto never stops a job: a check that broke is told and skipped
            log.warning("preflight could not finish on rank %d (%s: %s); training goes on (cluster.preflight=auto)",
                        ctx.rank, type(exc).__name__, exc)
            return None
    if not report.healthy:
        decide(ctx, report, mode)
    return report


def decide(ctx: "RankContext", report: Report, mode: str) -> None:
    """What a report that names nodes or problems does to this step, the same on every rank: named nodes that a spare
    or a requeue can replace (``leave_out.replacement``, from what the restart controller exported) end the step
    (``LeaveOut``; rank 0 writes the marker first); else ``strict`` raises ``PreflightFailed`` and ``auto`` trains on,
    each with one line."""
    import torch.distributed as dist

    line = failure_line(report.rows, report.problems, mode)
    nodes = [r.node for r in named(report.rows)]
    # the local executor's ranks stand in for nodes: nothing replaces them (the hints come from a Slurm job's loop)
    how = leave_out.replacement(nodes, os.environ) if nodes and os.environ.get("HPC_TOOLS_EXECUTOR") != "local" \
        else None
    if how:
        words = f"{line}; leaving {', '.join(nodes)} out of the run: {how}"
        if ctx.is_rank0:  # the marker and the event before the barrier: once a peer ends the step, srun may stop rank 0
            leave_out.write(ctx.run_dir, ctx.dist.restart_count, nodes, mode, line, how,
                            leave_out.details(report.rows, nodes))
            ctx.run.update(event=leave_out.LeaveOut.event, reason=words, soft=True)
        if dist.is_initialized():
            dist.barrier()  # the marker is written before any rank ends the step
        raise leave_out.LeaveOut(words)
    again = [n for n in nodes if n in leave_out.accepted(os.environ)]
    why = ("named before, and nothing could replace " + ("them" if len(again) > 1 else "it")) if again else \
        "nothing can replace " + ("them" if len(nodes) > 1 else "it") + \
        " (no spare node outside the step, no room to go on with fewer nodes, no in-job restart or requeue left)"
    if mode == "strict":
        raise PreflightFailed(f"{line}; {why}" if nodes else line)
    ctx.info("%s; training goes on (cluster.preflight=auto%s)", line, f": {why}" if nodes else "")


def look_until_settled(look: Callable[[int], None], mine: RankResult, world: int, deadline: float
                       ) -> list[list[str]]:
    """Run ``look(number)`` (this rank's GEMM and memory measurement into ``mine``) until the gathered figures name
    no node slow, ``SECOND_LOOKS`` more looks are spent, or a rank is past its ``deadline``; per look, the nodes it
    named slow. Every rank decides from the same gathered data, its peers' clocks included: a rank that decided alone
    (its own deadline passed, a peer's not) would wait for them at the next collective until the group's timeout."""
    looks: list[list[str]] = []
    while True:
        look(len(looks))
        seen, late = gather_with_clocks(mine, world, deadline)
        looks.append([r.node for r in judge(seen) if r.verdict == SLOW])
        if not looks[-1] or len(looks) > SECOND_LOOKS or late:
            return looks


def gather_with_clocks(mine: RankResult, world: int, deadline: float) -> tuple[list[RankResult], bool]:
    """Every rank's results, and whether any rank is past its own ``deadline``: the one answer every rank acts on
    before a step that takes collectives (the ranks' deadlines differ by their start times)."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (mine, time.perf_counter() > deadline))
    return [result for result, _ in gathered], any(past for _, past in gathered)


def check(ctx: "RankContext", mode: str) -> Report:
    """Every rank measures; every rank returns the same report (rank 0 also writes it and prints the table). On GPU
    NCCL's INFO lines go to the run's preflight folder while it runs, and only then (``nccl_info_to_file``)."""
    with nccl_info_to_file(ctx.run_dir / NCCL_DIR if ctx.device.type == "cuda" else None):
        return _check(ctx, mode)


@dataclass
class _Checking:
    """What the steps of one check share: the rank's context, the mode, the budget and its clock, this rank's result,
    where every rank runs (``places``: rank, node, host, machine) and the process groups made for the check (ended
    with it)."""

    ctx: "RankContext"
    mode: str
    t0: float
    budget: float
    mine: RankResult
    places: list = field(default_factory=list)
    made: list = field(default_factory=list)
    timeout: timedelta | None = None

    @property
    def deadline(self) -> float:
        return self.t0 + self.budget

    @property
    def gpu(self) -> bool:
        return self.ctx.device.type == "cuda"

    @property
    def world(self) -> int:
        return self.ctx.dist.world_size

    @property
    def nodes(self) -> dict[str, list[int]]:
        """node -> its ranks, in rank order."""
        out: dict[str, list[int]] = {}
        for r, n, _, _ in self.places:
            out.setdefault(n, []).append(r)
        return out

    @property
    def hosts(self) -> dict[str, str]:
        return {n: h for _, n, h, _ in self.places}

    @property
    def host_of(self) -> dict[int, str]:
        """rank -> machine: who shares cores (and takes turns with whom)."""
        return {r: m for r, _, _, m in self.places}

    def group(self, ranks: list[int]):
        """A process group of ``ranks`` for this check (None: every rank, the default group; a second world
        communicator costs memory)."""
        import torch.distributed as dist

        if len(set(ranks)) == self.world:
            return None
        g = dist.new_group(ranks=sorted(ranks), timeout=self.timeout)
        self.made.append(g)
        return g


def _check(ctx: "RankContext", mode: str) -> Report:
    """The six steps of the module docstring, in order (3, the transport, is read within 1 and 4)."""
    t0 = time.perf_counter()
    s = _join(ctx, mode, t0, float(recipe_budget(ctx.recipe)))  # 1
    looks = _compute(s)  # 2
    nbytes = message_bytes(ctx.recipe, ctx.device.type)
    s.timeout = timedelta(seconds=max(s.deadline - time.perf_counter(), 5.0))
    collectives, intra = _collectives(s, nbytes)  # 4 (and 3 on GPU)
    expected = expected_busbw(ctx)
    search, busbw, link_reasons = _link_search(s, nbytes, collectives, expected[0])  # 5
    return _verdicts(s, looks, nbytes, collectives, intra, search, busbw, link_reasons, expected)  # 6


def _join(ctx: "RankContext", mode: str, t0: float, budget: float) -> _Checking:
    """Step 1: the process group (made here when none is up, after the ranks' gloo endpoints agree), this rank's
    node and host (and on CPU gloo's transport), and where every rank runs."""
    import torch
    import torch.distributed as dist

    gpu = ctx.device.type == "cuda"
    if gpu:
        torch.cuda.set_device(ctx.device)
    s = _Checking(ctx, mode, t0, budget, RankResult(rank=ctx.rank, node=node_label(ctx), host=socket.gethostname()))
    mine = s.mine
    if not gpu:
        iface, addr, err = measure.gloo_endpoint(ctx.dist.master_addr, ctx.dist.master_port)
        mine.transport, mine.error = gloo_transport(iface, addr), err
    if not dist.is_initialized():
        global _CREATED
        store = _store(ctx)
        line = None if gpu else _endpoints_agree(ctx, store, mine, mode, budget)
        if line and mode == "strict":
            raise PreflightFailed(line)
        if line:  # auto: told on every rank (the rendezvous may fail next, and then says why in its own words)
            log.warning("%s; training goes on (cluster.preflight=auto)", line)
        dist.init_process_group(ctx.dist_backend, store=store, rank=ctx.rank, world_size=ctx.dist.world_size,
                                timeout=ctx.collective_timeout)
        _CREATED = True
    s.places = [None] * s.world
    dist.all_gather_object(s.places, (ctx.rank, mine.node, mine.host, machine_id()))
    return s


def _compute(s: _Checking) -> list[list[str]]:
    """Step 2: GEMM and memory until they settle (``look_until_settled``; per look, the nodes named slow); ranks of
    one machine take turns on CPU (several times round, the best kept: a turn that another process of the machine
    disturbed is not the node's speed). On GPU also what the driver knows (ECC errors, rows to remap, clocks)."""
    import torch.distributed as dist

    ctx, mine, places, device, dev = s.ctx, s.mine, s.places, s.ctx.device, s.ctx.device.type
    turn_of = {r: [p[0] for p in places if p[3] == places[r][3]].index(r) for r in range(s.world)}
    turns = max(turn_of.values()) + 1 if not s.gpu else 1
    passes = SHARED_REPEATS // 3 if turns > 1 else 1
    local_s = max(s.budget * 0.25 / turns / passes, 0.05)

    def look(number: int) -> None:
        for t in list(range(turns)) * passes:
            if s.gpu or turn_of[ctx.rank] == t:
                try:
                    g = measure.gemm_tflops(device, ctx.recipe.training.precision, GEMM_N[dev],
                                            min(0.4, local_s * 0.6), ctx.rank, look=number)
                    m = measure.mem_gbps(device, MEM_BYTES[dev], min(0.2, local_s * 0.4))
                    mine.gemm_tflops, mine.mem_gbps = max(g, mine.gemm_tflops or 0.0), max(m, mine.mem_gbps or 0.0)
                except Exception as exc:  # noqa: BLE001 - a broken device is a finding, named in the table
                    mine.error = f"{type(exc).__name__}: {exc}"
            if turns > 1:
                dist.barrier()

    looks = look_until_settled(look, mine, s.world, s.deadline)
    if s.gpu:  # what the driver knows: uncorrected ECC errors, rows to remap, clocks held down
        mine.health = measure.nvml_findings(device)
    return looks


def _collectives(s: _Checking, nbytes: int) -> tuple[dict[str, Any], dict[str, float | None]]:
    """Step 4: collectives over all ranks at the layout's size (busbw per op), within what is left of the budget;
    on GPU the transport NCCL reported (step 3); one all-reduce inside each node with several ranks, all at once."""
    ctx, world, device, nodes = s.ctx, s.world, s.ctx.device, s.nodes
    ops = ["all_reduce", "all_gather"] + (["all_to_all"] if ctx.layout.expert_size > 1 else [])
    collectives: dict[str, Any] = {"bytes": nbytes, "ranks": world}
    whole = s.group(list(range(world)))
    if world > 1:
        for op in ops:
            secs = agreed_seconds(measure.collective_seconds(op, nbytes, whole, world, device, ctx.rank,
                                                             per_sync=PER_SYNC[device.type]), world)
            collectives[op] = {"seconds": round(max(secs), 6),
                               "busbw_gbps": busbw_gbps(op, bytes_moved(nbytes, world), max(secs), world)}
    if s.gpu:
        s.mine.transport = _nccl_transport_seen(ctx) if len(nodes) > 1 else "intra-node (one node)"
    intra: dict[str, float | None] = {}
    multi = {n: rs for n, rs in nodes.items() if len(rs) > 1}
    if multi and len(nodes) > 1:
        groups = {n: s.group(rs) for n, rs in multi.items()}
        mine_group = next((n for n, rs in multi.items() if ctx.rank in rs), None)
        agreed = timed_groups(ctx, list(multi), multi, groups, mine_group, nbytes, device, s.host_of)
        for n, rs in multi.items():
            intra[n] = busbw_gbps("all_reduce", bytes_moved(nbytes, len(rs)), max(agreed[r] for r in rs), len(rs))
    return collectives, intra


def _link_search(s: _Checking, nbytes: int, collectives: dict[str, Any], inter_exp: float | None):
    """Step 5: the slow-link search over the nodes whose own figures are sound (a node already named by its GEMM,
    memory, device or error is slow in every collective it joins, and would make the search name the halves it sits
    in): (the search's result or None, each node's busbw, the reasons of the nodes it named)."""
    nodes, host_of = s.nodes, s.host_of
    node_names = list(nodes)
    figures: dict[frozenset, float | None] = {}
    link = link_bytes(nbytes, s.ctx.device.type)
    if "all_reduce" in collectives and link == nbytes:
        figures[frozenset(node_names)] = collectives["all_reduce"]["busbw_gbps"]
    own, late = gather_with_clocks(s.mine, s.world, s.deadline)
    named_alone = {r.node for r in named(judge(own, peak_tflops=_peak(s.ctx.recipe)))}
    linked = [n for n in node_names if n not in named_alone]
    search = None
    # nodes that share a machine (namespace nodes of a test cluster) time their links through its shared cores:
    # healthy pairs there differ by 1.5x, so only a far larger gap names a link
    shared = len({host_of[nodes[n][0]] for n in linked}) < len(linked)
    factor = SHARED_LINK_FACTOR if shared else SLOW_FACTOR
    if len(linked) > 1 and not late:
        search = find_slow(linked, RoundRunner(s.ctx, nodes, link, s.ctx.device, s.group, figures, inter_exp,
                                               host_of, factor))
    if "all_reduce" in collectives:  # the table's figure where no search measured the whole at the link's size
        figures.setdefault(frozenset(node_names), collectives["all_reduce"]["busbw_gbps"])
    busbw = {n: smallest_figure(n, figures) for n in node_names}
    link_reasons: dict[str, str] = {}
    if search is not None and search.culprits:
        for n in search.culprits:
            link_reasons[n] = (f"all-reduce busbw {busbw.get(n) or 0:.3g} GB/s over a group holding it, below "
                               f"{factor}x the other half's (search over halves, {search.rounds} rounds: "
                               f"{search.note})")
    return search, busbw, link_reasons


def _verdicts(s: _Checking, looks, nbytes, collectives, intra, search, busbw, link_reasons, expected) -> Report:
    """Step 6: the verdicts, on every rank alike; the groups made for the check ended; rank 0 writes and tells."""
    import torch.distributed as dist

    ctx, world, recipe, nodes, gpu = s.ctx, s.world, s.ctx.recipe, s.nodes, s.gpu
    inter_exp, intra_exp, exp_source = expected
    results: list[Any] = [None] * world
    dist.all_gather_object(results, s.mine)
    peak = _peak(recipe)
    expected_t, t_source = expected_transport(gpu, recipe.cluster.setup.env, len(nodes) > 1)
    transports = {n: next((r.transport for r in results if r.node == n and r.transport), None) for n in nodes}
    rows = judge(results, busbw=busbw, intra=intra, peak_tflops=peak, link_reasons=link_reasons,
                 transport_why=transport_reasons(transports, expected_t, gpu, s.hosts))
    problems = []
    ar = collectives.get("all_reduce", {}).get("busbw_gbps")
    exp = expected_at(inter_exp if len(nodes) > 1 else intra_exp, nbytes, world)  # at the message's size
    if ar is not None and exp and ar < EXPECTED_FLOOR * exp:
        problems.append(f"all-reduce busbw over all {world} ranks {ar:.3g} GB/s is {ar / exp:.2f}x the expected "
                        f"{exp:.3g} GB/s at {nbytes / 2**20:g} MiB ({exp_source}; below {EXPECTED_FLOOR}x)")
    if search is not None and search.between:
        problems.append(f"all-reduce over all nodes is slow but over neither half: {search.note}")
    for g in s.made:
        if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(g)
    dev = ctx.device.type
    report = Report(mode=s.mode, budget_s=s.budget, seconds=time.perf_counter() - s.t0, rows=rows, problems=problems,
                    collectives={**collectives, "expected_busbw_gbps": exp, "expected_source": exp_source},
                    search={"rounds": search.rounds, "note": search.note, "culprits": list(search.culprits),
                            "tested": [[list(g) for g in rnd] for rnd in search.tested]} if search else {},
                    notes=[f"transport expected: {expected_t or 'the same on every node'} ({t_source})",
                           *([f"GEMM and memory looked at {len(looks)} times (best of all kept); named slow per look: "
                              + "; ".join(", ".join(n) or "none" for n in looks)] if len(looks) > 1 else []),
                           f"GEMM {GEMM_N[dev]}^3 at {recipe.training.precision}; peak: "
                           + (f"{peak:.4g} TFLOP/s (profiling.peaks)" if peak else "none (not judged)")])
    if report.seconds > s.budget:
        report.problems.append(f"preflight took {report.seconds:.1f} s, over its budget of {s.budget:g} s "
                               "(cluster.preflight_budget_s)")
    if ctx.is_rank0:
        _tell(ctx, report, rows, s.budget)
    return report


def _tell(ctx: "RankContext", report: Report, rows, budget: float) -> None:
    """Rank 0: ``preflight.json``, the table in the log and the goodput's ``preflight`` event."""
    report.write(ctx.run_dir)
    for line in table_lines(rows):
        log.info("preflight: %s", line)
    log.info("preflight: %s in %.1f s (budget %g s); the table is in %s", "healthy" if report.healthy else
             f"NOT healthy ({len(named(rows))} node(s) named, {len(report.problems)} problem(s))",
             report.seconds, budget, ctx.run_dir / "preflight.json")
    preflight_event(ctx, report.seconds)


def _store(ctx: "RankContext"):
    """The rendezvous store the process group would make from MASTER_ADDR/PORT (env://), made here first so that
    the ranks can compare their gloo endpoints before the group connects them."""
    from hpc_tools.runtime.distenv import rendezvous_store

    return rendezvous_store(ctx.dist, ctx.collective_timeout or timedelta(minutes=30))


def _endpoints_agree(ctx: "RankContext", store, mine: RankResult, mode: str, budget: float) -> str | None:
    """Before the rendezvous (gloo connects every pair as the group starts, and a rank on a wrong or missing interface
    makes it fail or wait without naming the node): every rank's node, host, interface and error through the store;
    a node whose interface is missing or differs from the others' (``transport_reasons``) is named on every rank,
    in the one line returned (None: they agree), which ``strict`` stops on and ``auto`` tells."""
    import json

    store.set(f"preflight/endpoint/{ctx.rank}", json.dumps([mine.node, mine.host, mine.transport, mine.error]))
    keys = [f"preflight/endpoint/{r}" for r in range(ctx.dist.world_size)]
    wait_s = max(budget, 1.0)
    try:
        store.wait(keys, timedelta(seconds=wait_s))
    except (RuntimeError, TimeoutError) as exc:  # torch's DistStoreError is a RuntimeError
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        if not missing:
            raise
        return (f"preflight (cluster.preflight={mode}): rank(s) {', '.join(map(str, missing))} did not reach the "
                f"rendezvous within {wait_s:g} s ({type(exc).__name__}; their nodes did not start them, or cannot "
                f"reach {ctx.dist.master_addr}:{ctx.dist.master_port})")
    seen = [json.loads(store.get(k)) for k in keys]
    failed = {n: f"rank {r}: {e}" for r, (n, _, _, e) in enumerate(seen) if e}
    transports = {n: t for n, _, t, _ in seen}
    expected, _ = expected_transport(False, ctx.recipe.cluster.setup.env, len(transports) > 1)
    wrong = transport_reasons(transports, expected, False, {n: h for n, h, _, _ in seen})
    named_nodes = {**wrong, **failed}
    if not named_nodes:
        return None
    return (f"preflight (cluster.preflight={mode}): " + " | ".join(f"node {n} transport: {why}" for n, why in
                                                                    named_nodes.items()) +
            " (set GLOO_SOCKET_IFNAME to an interface every node has)")


def close() -> None:
    """End the process group preflight made (after the trainer used it; ``loop.process_group`` leaves a group it
    found up): the ranks leave together."""
    global _CREATED
    import torch.distributed as dist

    if _CREATED and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    _CREATED = False


def recipe_budget(recipe) -> float:
    return float(recipe.cluster.preflight_budget_s)


def machine_id() -> str:
    """Which machine (kernel) this rank runs on: its boot id, the same in every container and namespace of one
    kernel, so ranks that share cores are known to share them even where each has a host name of its own (the test
    cluster's nodes are network and UTS namespaces of one machine); else the host name."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or socket.gethostname()
    except OSError:
        return socket.gethostname()


def _peak(recipe) -> float | None:
    if not recipe.cluster.uses_gpus:
        return None
    from profiling.peaks import peak_for_recipe

    return peak_for_recipe(recipe)


@contextlib.contextmanager
def nccl_info_to_file(folder: Path | None) -> Iterator[None]:
    """While preflight runs: NCCL's INFO lines of this process into ``folder`` (``nccl-<host>-<pid>.log``), to read the
    transport back. Only the ``NCCL_DEBUG*`` variables that are unset are set (``NCCL_DEBUG`` set by the user wins:
    nothing changes, the transport is read from the user's ``NCCL_DEBUG_FILE`` if any), and they are removed after,
    so the trainer's NCCL warnings go to the rank's log, not the preflight folder. NCCL reads them once per process:
    ``ncclResetDebugInit`` (NCCL >= 2.24.3) makes it read them again. ``folder`` None (CPU ranks): nothing."""
    if folder is None or "NCCL_DEBUG" in os.environ:
        yield
        return
    wanted = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET",
              "NCCL_DEBUG_FILE": str(folder / f"nccl-{socket.gethostname()}-{os.getpid()}.log")}
    added = [k for k in wanted if k not in os.environ]
    folder.mkdir(parents=True, exist_ok=True)
    os.environ.update({k: wanted[k] for k in added})
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)
        if not _reset_nccl_debug():
            log.info("NCCL's INFO lines of this process stay in %s (NCCL not loaded, or older than 2.24.3: no "
                     "ncclResetDebugInit)", folder)


def _reset_nccl_debug() -> bool:
    """``ncclResetDebugInit()`` of the NCCL this process loaded (never loading one); False without it."""
    import ctypes

    try:
        ctypes.CDLL("libnccl.so.2", mode=os.RTLD_NOLOAD).ncclResetDebugInit()
    except (OSError, AttributeError):
        return False
    return True


def _nccl_transport_seen(ctx: "RankContext") -> str | None:
    path = os.environ.get("NCCL_DEBUG_FILE", "")
    if not path:
        return None
    path = path.replace("%h", socket.gethostname()).replace("%p", str(os.getpid()))
    try:
        with open(path, errors="replace") as f:
            return nccl_transport(f.read())
    except OSError:
        return None


def preflight_event(ctx: "RankContext", seconds: float) -> None:
    """The goodput's ``preflight`` bucket (``profiling.goodput``): an event in rank 0's events file, tagged with this
    start, before the collector's own start event of the same start."""
    import contextlib
    import json

    from profiling.records import events_path

    row = {"event": "preflight", "time": time.time(), "seconds": round(seconds, 3), "rank": 0,
           "restart": ctx.dist.restart_count}
    with contextlib.suppress(OSError):
        ctx.run.records_dir.mkdir(parents=True, exist_ok=True)
        with open(events_path(ctx.run.records_dir, 0), "a") as f:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
