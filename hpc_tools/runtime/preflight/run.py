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
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from hpc_tools.runtime.preflight import leave_out, measure
from hpc_tools.runtime.preflight.bisect import find_slow
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
STEP_LATENCY_S = 10e-6
"""Latency of one step of a ring all-reduce between nodes (2(n-1) steps), assumed (InfiniBand's few microseconds plus
NCCL's own per step; not measured here): the expected busbw at a message size (``expected_at``)."""
# GPU collectives are timed over this many back-to-back runs per host synchronize: one synchronize per run would add
# its own microseconds to every run of a small message.
PER_SYNC = {"cpu": 1, "cuda": 5}
GEMM_N = {"cpu": 256, "cuda": 8192}
MEM_BYTES = {"cpu": 32 << 20, "cuda": 1 << 30}
BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# Ranks sharing a host (local ranks standing for nodes) measure in turn, this many times round (a third of it for
# GEMM and memory), the best kept: another process of the host may take the cores during any one turn.
SHARED_REPEATS = 9
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


def expected_at(bw_gbps: float | None, nbytes: int, n: int) -> float | None:
    """The all-reduce busbw a link the planner gives ``bw_gbps`` for (its large-message figure) is expected to reach
    with a message of ``nbytes`` over ``n`` ranks: a ring's 2(n-1) steps each pay ``STEP_LATENCY_S``, and each rank
    moves 2(n-1)/n x ``nbytes`` at ``bw_gbps`` (nccl-tests' busbw of that time). None without a figure."""
    if not bw_gbps or n < 2:
        return bw_gbps
    moved = nbytes * 2 * (n - 1) / n
    return moved / (2 * (n - 1) * STEP_LATENCY_S + moved / (bw_gbps * 1e9)) / 1e9


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
        if ctx.is_rank0:
            leave_out.write(ctx.run_dir, ctx.dist.restart_count, nodes, mode, line, how,
                            leave_out.details(report.rows, nodes))
        if dist.is_initialized():
            dist.barrier()  # the marker is written before any rank ends the step
        raise leave_out.LeaveOut(f"{line}; leaving {', '.join(nodes)} out of the run: {how}")
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


def _check(ctx: "RankContext", mode: str) -> Report:
    import torch
    import torch.distributed as dist

    t0 = time.perf_counter()
    recipe, budget = ctx.recipe, float(recipe_budget(ctx.recipe))
    deadline = t0 + budget
    device = ctx.device
    dev = device.type
    gpu = dev == "cuda"
    if gpu:
        torch.cuda.set_device(device)
    node, host = node_label(ctx), socket.gethostname()
    mine = RankResult(rank=ctx.rank, node=node, host=host)
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
    world = ctx.dist.world_size
    places: list[Any] = [None] * world
    dist.all_gather_object(places, (ctx.rank, node, host, machine_id()))
    nodes: dict[str, list[int]] = {}
    for r, n, _, _ in places:
        nodes.setdefault(n, []).append(r)
    hosts = {n: h for _, n, h, _ in places}
    host_of = {r: m for r, _, _, m in places}  # the machine: who shares cores (and takes turns with whom)

    # 2. GEMM and memory: ranks of one machine take turns on CPU (several times round, the best kept: a turn that
    # another process of the machine disturbed is not the node's speed)
    turn_of = {r: [p[0] for p in places if p[3] == places[r][3]].index(r) for r in range(world)}
    turns = max(turn_of.values()) + 1 if not gpu else 1
    passes = SHARED_REPEATS // 3 if turns > 1 else 1
    local_s = max(budget * 0.25 / turns / passes, 0.05)

    def look(number: int) -> None:
        for t in list(range(turns)) * passes:
            if gpu or turn_of[ctx.rank] == t:
                try:
                    g = measure.gemm_tflops(device, recipe.training.precision, GEMM_N[dev], min(0.4, local_s * 0.6),
                                            ctx.rank, look=number)
                    m = measure.mem_gbps(device, MEM_BYTES[dev], min(0.2, local_s * 0.4))
                    mine.gemm_tflops, mine.mem_gbps = max(g, mine.gemm_tflops or 0.0), max(m, mine.mem_gbps or 0.0)
                except Exception as exc:  # noqa: BLE001 - a broken device is a finding, named in the table
                    mine.error = f"{type(exc).__name__}: {exc}"
            if turns > 1:
                dist.barrier()

    looks = look_until_settled(look, mine, world, deadline)

    if gpu:  # what the driver knows: uncorrected ECC errors, rows to remap, clocks held down
        mine.health = measure.nvml_findings(device)

    # 4. collectives over all ranks, at the layout's size, within what is left of the budget
    nbytes = message_bytes(recipe, dev)
    timeout = timedelta(seconds=max(deadline - time.perf_counter(), 5.0))
    made: list = []

    def group(ranks: list[int]):
        if len(set(ranks)) == world:  # every rank: the default group (a second world communicator costs memory)
            return None
        g = dist.new_group(ranks=sorted(ranks), timeout=timeout)
        made.append(g)
        return g

    ops = ["all_reduce", "all_gather"] + (["all_to_all"] if ctx.layout.expert_size > 1 else [])
    collectives: dict[str, Any] = {"bytes": nbytes, "ranks": world}
    whole = group(list(range(world)))
    if world > 1:
        for op in ops:
            secs = _agreed_seconds(measure.collective_seconds(op, nbytes, whole, world, device, ctx.rank,
                                                              per_sync=PER_SYNC[dev]), world)
            collectives[op] = {"seconds": round(max(secs), 6),
                               "busbw_gbps": busbw_gbps(op, _bytes_moved(nbytes, world), max(secs), world)}
    if gpu:
        mine.transport = _nccl_transport_seen(ctx) if len(nodes) > 1 else "intra-node (one node)"
    intra: dict[str, float | None] = {}
    multi = {n: rs for n, rs in nodes.items() if len(rs) > 1}
    if multi and len(nodes) > 1:
        groups = {n: group(rs) for n, rs in multi.items()}
        mine_group = next((n for n, rs in multi.items() if ctx.rank in rs), None)
        agreed = _timed_groups(ctx, list(multi), multi, groups, mine_group, nbytes, device, host_of)
        for n, rs in multi.items():
            intra[n] = busbw_gbps("all_reduce", _bytes_moved(nbytes, len(rs)), max(agreed[r] for r in rs), len(rs))

    # 5. the slow-link search over the nodes whose own figures are sound: a node already named by its GEMM, memory,
    # device or error is slow in every collective it joins, and would make the search name the halves it sits in
    inter_exp, intra_exp, exp_source = expected_busbw(ctx)
    node_names = list(nodes)
    figures: dict[frozenset, float | None] = {}
    link = link_bytes(nbytes, dev)
    if "all_reduce" in collectives and link == nbytes:
        figures[frozenset(node_names)] = collectives["all_reduce"]["busbw_gbps"]
    own, late = gather_with_clocks(mine, world, deadline)
    named_alone = {r.node for r in named(judge(own, peak_tflops=_peak(recipe)))}
    linked = [n for n in node_names if n not in named_alone]
    search = None
    # nodes that share a machine (namespace nodes of a test cluster) time their links through its shared cores:
    # healthy pairs there differ by 1.5x, so only a far larger gap names a link
    shared = len({host_of[nodes[n][0]] for n in linked}) < len(linked)
    factor = SHARED_LINK_FACTOR if shared else SLOW_FACTOR
    if len(linked) > 1 and not late:
        search = find_slow(linked, _RoundRunner(ctx, nodes, link, device, group, figures, inter_exp, host_of,
                                                factor))
    if "all_reduce" in collectives:  # the table's figure where no search measured the whole at the link's size
        figures.setdefault(frozenset(node_names), collectives["all_reduce"]["busbw_gbps"])
    busbw = {n: _smallest_figure(n, figures) for n in node_names}
    link_reasons: dict[str, str] = {}
    if search is not None and search.culprits:
        for n in search.culprits:
            link_reasons[n] = (f"all-reduce busbw {busbw.get(n) or 0:.3g} GB/s over a group holding it, below "
                               f"{factor}x the other half's (search over halves, {search.rounds} rounds: "
                               f"{search.note})")

    # 6. verdicts, on every rank alike
    results: list[Any] = [None] * world
    dist.all_gather_object(results, mine)
    peak = _peak(recipe)
    expected_t, t_source = expected_transport(gpu, recipe.cluster.setup.env, len(nodes) > 1)
    transports = {n: next((r.transport for r in results if r.node == n and r.transport), None) for n in node_names}
    rows = judge(results, busbw=busbw, intra=intra, peak_tflops=peak, link_reasons=link_reasons,
                 transport_why=transport_reasons(transports, expected_t, gpu, hosts))
    problems = []
    ar = collectives.get("all_reduce", {}).get("busbw_gbps")
    exp = expected_at(inter_exp if len(nodes) > 1 else intra_exp, nbytes, world)  # at the message's size
    if ar is not None and exp and ar < EXPECTED_FLOOR * exp:
        problems.append(f"all-reduce busbw over all {world} ranks {ar:.3g} GB/s is {ar / exp:.2f}x the expected "
                        f"{exp:.3g} GB/s at {nbytes / 2**20:g} MiB ({exp_source}; below {EXPECTED_FLOOR}x)")
    if search is not None and search.between:
        problems.append(f"all-reduce over all nodes is slow but over neither half: {search.note}")
    for g in made:
        if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(g)
    report = Report(mode=mode, budget_s=budget, seconds=time.perf_counter() - t0, rows=rows, problems=problems,
                    collectives={**collectives, "expected_busbw_gbps": exp, "expected_source": exp_source},
                    search={"rounds": search.rounds, "note": search.note, "culprits": list(search.culprits),
                            "tested": [[list(g) for g in rnd] for rnd in search.tested]} if search else {},
                    notes=[f"transport expected: {expected_t or 'the same on every node'} ({t_source})",
                           *([f"GEMM and memory looked at {len(looks)} times (best of all kept); named slow per look: "
                              + "; ".join(", ".join(n) or "none" for n in looks)] if len(looks) > 1 else []),
                           f"GEMM {GEMM_N[dev]}^3 at {recipe.training.precision}; peak: "
                           + (f"{peak:.4g} TFLOP/s (profiling.peaks)" if peak else "none (not judged)")])
    if report.seconds > budget:
        report.problems.append(f"preflight took {report.seconds:.1f} s, over its budget of {budget:g} s "
                               "(cluster.preflight_budget_s)")
    if ctx.is_rank0:
        report.write(ctx.run_dir)
        for line in table_lines(rows):
            log.info("preflight: %s", line)
        log.info("preflight: %s in %.1f s (budget %g s); the table is in %s", "healthy" if report.healthy else
                 f"NOT healthy ({len(named(rows))} node(s) named, {len(report.problems)} problem(s))",
                 report.seconds, budget, ctx.run_dir / "preflight.json")
        preflight_event(ctx, report.seconds)
    return report


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


def _bytes_moved(nbytes: int, n: int) -> int:
    return max(nbytes // 4 // n * n, n) * 4


def machine_id() -> str:
    """Which machine (kernel) this rank runs on: its boot id, the same in every container and namespace of one
    kernel, so ranks that share cores are known to share them even where each has a host name of its own (the test
    cluster's nodes are network and UTS namespaces of one machine); else the host name."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or socket.gethostname()
    except OSError:
        return socket.gethostname()


def _agreed_seconds(secs: float, world: int) -> list[float]:
    """Every rank's time, on every rank (one all-gather over the default group)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(secs)], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    out = [torch.zeros_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    return [float(x.item()) for x in out]


def _smallest_figure(node: str, figures: dict[frozenset, float | None]) -> float | None:
    """The busbw of the smallest group holding ``node`` (of those, the last measured)."""
    holding = [(len(g), -i, v) for i, (g, v) in enumerate(figures.items()) if node in g and v is not None]
    return min(holding)[2] if holding else None


def _timed_groups(ctx, measured, ranks, pgs, mine, nbytes, device, hosts_of) -> list[float]:
    """Every rank's all-reduce time over its group of this round, on every rank. Groups on separate machines run
    at once; groups that share a machine (``machine_id``: local ranks standing for nodes, namespace nodes) run one
    after another, so that they do not share its cores while they are timed."""
    import torch.distributed as dist

    world = ctx.dist.world_size
    hosts = [{hosts_of[r] for r in ranks[g]} for g in measured]
    shared = any(a & b for i, a in enumerate(hosts) for b in hosts[i + 1:])
    if not shared:
        secs = measure.collective_seconds("all_reduce", nbytes, pgs[mine], len(ranks[mine]), device,
                                          ctx.rank, per_sync=PER_SYNC[device.type]) if mine else 0.0
        return _agreed_seconds(secs, world)
    secs = float("inf")  # one timed run per group in turn, SHARED_REPEATS times round: both see the host's load alike
    for i in range(SHARED_REPEATS):
        for g in measured:
            if g == mine:
                secs = min(secs, measure.collective_seconds("all_reduce", nbytes, pgs[mine], len(ranks[mine]),
                                                            device, ctx.rank, iters=1, warmup=i == 0))
            dist.barrier()
    return _agreed_seconds(secs if mine else 0.0, world)


class _RoundRunner:
    """The search's cost function on the ranks: one round's groups measured at once (an all-reduce each), slow =
    below ``SLOW_FACTOR`` x the other group's busbw or the expected figure.

    A group of one node has no link of its own to test. The search pairs it with a node already found healthy when
    there is one; where there is none (a round of a pair and a lone node: three candidates, the first split), the
    runner measures every pair of the three, one after another, and judges the nodes from the pairs alone (pairs
    of the same size: a figure over three ranks is not comparable with one over two): a node is slow when every
    pair holding it is slow and a pair without it is not; a single slow pair names both of its ends (a slow link
    cannot be pinned on one of them). Later rounds over those nodes answer from the same pairs."""

    def __init__(self, ctx, nodes, nbytes, device, group, figures, expected, hosts_of, factor=SLOW_FACTOR):
        self.ctx, self.nodes, self.nbytes, self.device, self.group = ctx, nodes, nbytes, device, group
        self.figures, self.expected, self.hosts_of, self.factor = figures, expected, hosts_of, factor
        self.by_pairs: dict[str, bool] = {}

    def expected_for(self, group: tuple[str, ...]) -> float | None:
        """The busbw expected of ``group``'s all-reduce at the search's message size (``expected_at``)."""
        if not self.expected:
            return None
        return expected_at(self.expected, self.nbytes, sum(len(self.nodes[n]) for n in group))

    def timed(self, measured, ranks, pgs, mine) -> list[float]:
        return _timed_groups(self.ctx, measured, ranks, pgs, mine, self.nbytes, self.device, self.hosts_of)

    def measure(self, measured: list[tuple[str, ...]]) -> dict[tuple[str, ...], float | None]:
        """One collective round over ``measured`` (disjoint groups of nodes); the figures, also kept for the table."""
        ranks = {g: [r for n in g for r in self.nodes[n]] for g in measured}
        pgs = {g: self.group(ranks[g]) for g in measured}
        mine = next((g for g in measured if self.ctx.rank in ranks[g]), None)
        agreed = self.timed(measured, ranks, pgs, mine)
        figs: dict[tuple[str, ...], float | None] = {}
        for g in measured:
            figs[g] = busbw_gbps("all_reduce", _bytes_moved(self.nbytes, len(ranks[g])),
                                 max(agreed[r] for r in ranks[g]), len(ranks[g]))
            self.figures[frozenset(g)] = figs[g]
        return figs

    def __call__(self, groups: list[tuple[str, ...]]) -> list[bool | None]:
        if len(groups) == 1:  # the whole group (measured already, or now: the nodes a node named alone left)
            if frozenset(groups[0]) not in self.figures:
                self.measure([groups[0]])
            fig = self.figures[frozenset(groups[0])]
            if self.expected and fig is not None:
                return [fig < self.factor * self.expected_for(groups[0])]
            return [None]
        if self.by_pairs and all(n in self.by_pairs for g in groups for n in g):  # judged from the pairs already
            return [any(self.by_pairs[n] for n in g) for g in groups]
        if all(len(g) == 1 for g in groups):
            return [None] * len(groups)
        measured = [g for g in groups if len(g) > 1]
        figs = self.measure(measured)
        ref = max([v for v in figs.values() if v is not None] + [self.expected_for(g) or 0.0 for g in measured])
        out: list[bool | None] = [figs[g] < self.factor * ref if figs.get(g) is not None else None for g in groups]
        if len(groups) == 2 and [len(g) for g in groups if len(g) == 1] == [1] and len(measured[0]) == 2:
            lone = next(i for i, g in enumerate(groups) if len(g) == 1)
            self.by_pairs = self.judge_triangle(measured[0], groups[lone][0], figs[measured[0]])
            out[lone] = self.by_pairs.get(groups[lone][0])
            out[1 - lone] = any(self.by_pairs.get(n) for n in measured[0]) if self.by_pairs else out[1 - lone]
        return out

    def judge_triangle(self, pair: tuple[str, ...], lone: str, pair_fig: float | None) -> dict[str, bool]:
        """Every pair of the three nodes measured twice (one at a time: they share nodes), the better figure of each
        kept; each node's verdict."""
        a, b = pair
        figs = {frozenset(pair): pair_fig}
        for other in ((a, lone), (b, lone)):
            figs[frozenset(other)] = self.measure([other])[other]
        for again in (pair, (a, lone), (b, lone)):  # each pair twice, the better kept: one disturbed measurement of
            fig = self.measure([again])[again]      # a healthy pair on a shared host is not a slow link
            old = figs[frozenset(again)]
            figs[frozenset(again)] = self.figures[frozenset(again)] = None if fig is None or old is None else max(
                fig, old)
        if any(v is None for v in figs.values()):
            return {}
        ref = max(max(figs.values()), self.expected_for(pair) or 0.0)
        slow = {p for p, v in figs.items() if v < self.factor * ref}
        verdict = {n: all(p in slow for p in figs if n in p) and any(p not in slow for p in figs if n not in p)
                   for n in (a, b, lone)}
        if len(slow) == 1:  # one slow link: both of its ends
            verdict.update({n: True for n in next(iter(slow))})
        return verdict


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
