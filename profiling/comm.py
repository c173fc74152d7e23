"""Time and bytes of every collective and p2p transfer, without the trainers' cooperation.

How: the collective functions on the ``torch.distributed`` module are replaced by thin wrappers, and so are the
bindings that Megatron-core and DeepSpeed took at import time (``from torch.distributed import _coalescing_manager``,
``dist_reduce_scatter_func = torch.distributed.reduce_scatter_tensor``, DeepSpeed's ``cdb.all_gather_function``).
Replacing functions (not a TorchFunctionMode) also sees the calls made from autograd backward hooks (Megatron DDP's
grad reduce). ``torch.distributed.distributed_c10d``'s own globals are left alone: c10d compares them by identity
(``op.op is isend`` in batch_isend_irecv, ``op0 is all_reduce`` in the coalescing manager).

What is measured per operation: the call (issue) interval and, for async ops, every ``wait()`` on the returned Work
(the returned Work is a proxy only on traced steps). ``time_s`` = call + waits = time this rank was stalled by the
operation; ``span_s`` = issue to the end of the last wait, an upper bound of the operation's duration used for
bandwidth (for synchronous ops the two are equal). Ops inside ``_coalescing_manager`` run at the block's exit and are
counted as one operation of their kind. On GPU the marks are CUDA events on the current stream (see clock.py).

Every step, on host clocks (CPU ranks), the wrappers also add up the time this rank is held in collectives other than
pipeline p2p (the call plus the ``wait()`` of an async one: ``CommTracer.host_wait_s``, the record's
``collective_wait_s``): two ``perf_counter`` reads per collective. A rank that arrives late at a collective waits
least in it, so this is what tells which rank the others wait for on every step, not only on the sampled ones
(``profiling.stragglers``). GPU collectives return before they ran, so GPU ranks leave it out.

The wrappers cost one attribute check when not tracing; tracing happens on sampled steps only, plus p2p on every
step when the pipeline bubble is measured (pipeline_size > 1).

Pipeline p2p: Megatron's ``P2PCommunicator._communicate`` issues ``torch.distributed.batch_isend_irecv`` /
``isend`` / ``irecv`` and waits either inside ``_communicate`` or, with ``overlap_p2p_comm``, in ``schedules.py``
(``recv_prev_wait_handle.wait()``). Hooking here sees both; hooking ``p2p_communication``'s methods would miss the
second. DeepSpeed's pipeline engine goes through ``torch.distributed.send``/``recv`` and is seen the same way.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from profiling import trace
from profiling.clock import Clock

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "p2p")
# wrapped function -> (kind, the argument whose bytes are the nccl-tests "size" of the operation)
FUNCTIONS: dict[str, tuple[str, str]] = {
    "all_reduce": ("all_reduce", "tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "_all_gather_base": ("all_gather", "output_tensor"),
    "all_gather_single": ("all_gather", "output_tensor"),  # torch >= 2.13 names for the *_tensor functions
    "all_gather": ("all_gather", "tensor_list"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "_reduce_scatter_base": ("reduce_scatter", "input"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "broadcast": ("broadcast", "tensor"),
    "reduce": ("reduce", "tensor"),
    "all_to_all_single": ("all_to_all", "input"),
    "send": ("p2p", "tensor"),
    "recv": ("p2p", "tensor"),
    "isend": ("p2p", "tensor"),
    "irecv": ("p2p", "tensor"),
    "batch_isend_irecv": ("p2p", "p2p_op_list"),
}
_PATCH_PREFIXES = ("megatron", "deepspeed")


def busbw_factor(kind: str, n: int) -> float:
    """nccl-tests: all-reduce 2(n-1)/n; all-gather, reduce-scatter, all-to-all (n-1)/n; broadcast, reduce, p2p 1."""
    if n <= 1 and kind != "p2p":
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def nbytes(obj: Any) -> int:
    """Bytes of a tensor, a list of tensors, or a list of P2POps."""
    if obj is None:
        return 0
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(getattr(x, "tensor", x)) for x in obj)
    try:
        return obj.numel() * obj.element_size()
    except AttributeError:
        return 0


@dataclass(slots=True)
class Op:
    kind: str
    nbytes: int
    group_size: int
    issue: tuple
    waits: list = field(default_factory=list)


class _TimedWork:
    """Proxy of a Work handle whose wait() is timed; everything else goes to the real Work."""

    __slots__ = ("_work", "_op", "_clock")

    def __init__(self, work, op: Op, clock: Clock):
        self._work, self._op, self._clock = work, op, clock

    def wait(self, *args, **kwargs):
        m0 = self._clock.mark()
        out = self._work.wait(*args, **kwargs)
        self._op.waits.append((m0, self._clock.mark()))
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


class _HostTimedWork:
    """Proxy of a Work handle whose wait() adds to the tracer's every-step collective wait (host clock)."""

    __slots__ = ("_work", "_tracer")

    def __init__(self, work, tracer: "CommTracer"):
        self._work, self._tracer = work, tracer

    def wait(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._tracer.host_wait_s += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self._work, name)


class CommTracer:
    """Per-process tracing state; ``begin_step`` / ``end_step`` bracket the traced operations of one step.
    ``host_wait``: also add up, every step, the host time held in collectives other than p2p (``host_wait_s``)."""

    def __init__(self, clock: Clock, p2p_every_step: bool = False, host_wait: bool = False):
        self.clock = clock
        self.p2p_every_step = p2p_every_step
        self.host_wait = host_wait and not clock.cuda
        self.host_wait_s = 0.0
        self.sampling = False
        self.ops: list[Op] = []
        self._local = threading.local()

    def begin_step(self, sample: bool) -> None:
        self.ops = []
        self.sampling = sample
        self.host_wait_s = 0.0

    def end_step(self) -> list[Op]:
        ops, self.ops, self.sampling = self.ops, [], False
        return ops

    def collective_wait_s(self, ops: list[Op]) -> float | None:
        """This step's host time held in collectives other than p2p (None when not measured): the timed ops' on a
        sampled step, the every-step sum otherwise."""
        if not self.host_wait:
            return None
        traced = sum(stalled_s(op, self.clock) for op in ops if op.kind != "p2p")
        return self.host_wait_s + traced

    def host_call(self, orig, args, kwargs):
        """An untraced collective timed on the host clock (``host_wait``): its call and its Work's waits."""
        if getattr(self._local, "inside", False) or getattr(self._local, "coalesce", None) is not None:
            return orig(*args, **kwargs)
        self._local.inside = True
        t0 = time.perf_counter()
        try:
            out = orig(*args, **kwargs)
        finally:
            self.host_wait_s += time.perf_counter() - t0
            self._local.inside = False
        if out is None or isinstance(out, (int, list)) or not hasattr(out, "wait"):
            return out
        return _HostTimedWork(out, self)

    def wants(self, kind: str) -> bool:
        return (self.sampling or (self.p2p_every_step and kind == "p2p")) and not getattr(self._local, "inside", False)

    def call(self, orig, kind: str, size: int, group, args, kwargs):
        coalesce = getattr(self._local, "coalesce", None)
        if coalesce is not None:  # inside _coalescing_manager: the op runs at the block's exit
            coalesce.append((kind, size, _group_size(group, kind)))
            return orig(*args, **kwargs)
        self._local.inside = True  # an op implemented with other ops (e.g. all_gather via broadcast) counts once
        try:
            m0 = self.clock.mark()
            out = orig(*args, **kwargs)
            m1 = self.clock.mark()
        finally:
            self._local.inside = False
        op = Op(kind, size, _group_size(group, kind), (m0, m1))
        self.ops.append(op)
        if out is None or isinstance(out, int):
            return out
        if isinstance(out, list):
            return [_TimedWork(w, op, self.clock) if hasattr(w, "wait") else w for w in out]
        return _TimedWork(out, op, self.clock) if hasattr(out, "wait") else out

    @contextlib.contextmanager
    def host_coalescing(self, orig_cm, args, kwargs):
        """``_coalescing_manager`` on an untraced step (``host_wait``): its ops run at the block's exit, which is
        timed, and so is the ``wait()`` of the returned handle (async)."""
        self._local.coalesce = []  # the ops inside are queued, not run: not timed one by one
        try:
            with orig_cm(*args, **kwargs) as cm:
                yield cm
                self._local.coalesce = None
                t0 = time.perf_counter()
            self.host_wait_s += time.perf_counter() - t0
        finally:
            self._local.coalesce = None
        real_wait = getattr(cm, "wait", None)
        if real_wait is not None:
            def wait():
                w0 = time.perf_counter()
                try:
                    real_wait()
                finally:
                    self.host_wait_s += time.perf_counter() - w0

            cm.wait = wait

    @contextlib.contextmanager
    def coalescing(self, orig_cm, args, kwargs):
        async_ops = kwargs.get("async_ops", args[2] if len(args) > 2 else False)
        items: list[tuple[str, int, int]] = []
        self._local.coalesce = items
        try:
            with orig_cm(*args, **kwargs) as cm:
                yield cm
                self._local.coalesce = None
                m0 = self.clock.mark()
            m1 = self.clock.mark()
        finally:
            self._local.coalesce = None
        if not items:
            return
        op = Op(items[0][0], sum(i[1] for i in items), items[0][2], (m0, m1))
        self.ops.append(op)
        if async_ops:
            real_wait = cm.wait

            def wait():
                w0 = self.clock.mark()
                real_wait()
                op.waits.append((w0, self.clock.mark()))

            cm.wait = wait


def _group_size(group, kind: str) -> int:
    if kind == "p2p":
        return 2
    import torch.distributed as dist

    return dist.get_world_size(group)


def stalled_s(op: Op, clock: Clock) -> float:
    """Time this rank was held by the op: its call plus its waits."""
    for mark in (op.issue[1], *(w[1] for w in op.waits)):
        clock.wait(mark)
    return clock.seconds(*op.issue) + sum(clock.seconds(a, b) for a, b in op.waits)


def span_s(op: Op, clock: Clock) -> float:
    """Issue to completion as this rank saw it (upper bound of the op's duration)."""
    end = op.waits[-1][1] if op.waits else op.issue[1]
    clock.wait(end)
    return clock.seconds(op.issue[0], end)


def per_kind(ops: list[Op], clock: Clock) -> list[dict[str, Any]]:
    """One row per (kind, group size): calls, bytes, time_s (stalled), span_s, algbw and busbw in GB/s."""
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for op in ops:
        row = rows.setdefault((op.kind, op.group_size), {"kind": op.kind, "group_size": op.group_size, "calls": 0,
                                                         "bytes": 0, "time_s": 0.0, "span_s": 0.0})
        row["calls"] += 1
        row["bytes"] += op.nbytes
        row["time_s"] += stalled_s(op, clock)
        row["span_s"] += span_s(op, clock)
    for row in rows.values():
        algbw = row["bytes"] / row["span_s"] / 1e9 if row["span_s"] > 0 else None
        row["algbw_gbps"] = algbw
        row["busbw_gbps"] = None if algbw is None else algbw * busbw_factor(row["kind"], row["group_size"])
    return list(rows.values())


# --- installing the wrappers ------------------------------------------------------------------------------------------

_TRACER: CommTracer | None = None
_PATCHES: list[tuple[Any, str, Any]] = []


def _bind(orig, arg_name: str):
    """A fast (args, kwargs) -> (size argument, group) reader for one function's signature."""
    params = list(inspect.signature(orig).parameters)
    i_size, i_group = params.index(arg_name), params.index("group") if "group" in params else None

    def read(args, kwargs):
        size = args[i_size] if len(args) > i_size else kwargs.get(arg_name)
        group = args[i_group] if i_group is not None and len(args) > i_group else kwargs.get("group")
        return size, group

    return read


def _wrap(name: str, orig):
    kind, arg_name = FUNCTIONS[name]
    read = _bind(orig, arg_name)

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        if trace._recording:  # a torch.profiler window records: mark the call with its process group
            size, group = read(args, kwargs)
            if name == "batch_isend_irecv" and size:
                group = getattr(size[0], "group", None)
            with trace.comm_span(kind, group):
                return call(*args, **kwargs)
        return call(*args, **kwargs)

    def call(*args, **kwargs):
        tracer = _TRACER
        if tracer is None or not tracer.wants(kind):
            if tracer is not None and tracer.host_wait and kind != "p2p":
                return tracer.host_call(orig, args, kwargs)
            return orig(*args, **kwargs)
        size, group = read(args, kwargs)
        return tracer.call(orig, kind, nbytes(size), group, args, kwargs)

    wrapper.__hpc_orig__ = orig
    return wrapper


def _wrap_coalescing(orig_cm):
    @functools.wraps(orig_cm)
    def coalescing_manager(*args, **kwargs):
        tracer = _TRACER
        if tracer is None or getattr(tracer._local, "coalesce", None) is not None:
            return orig_cm(*args, **kwargs)
        if not tracer.sampling:
            return tracer.host_coalescing(orig_cm, args, kwargs) if tracer.host_wait else orig_cm(*args, **kwargs)
        return tracer.coalescing(orig_cm, args, kwargs)

    coalescing_manager.__hpc_orig__ = orig_cm
    return coalescing_manager


def _p2p_op_class(orig_cls):
    """P2POp that unwraps our isend/irecv wrappers: c10d checks ``op in [isend, irecv]`` and ``op.op is isend``."""

    class P2POp(orig_cls):
        def __new__(cls, op, *args, **kwargs):
            return super().__new__(cls, getattr(op, "__hpc_orig__", op), *args, **kwargs)

        def __init__(self, op, *args, **kwargs):
            super().__init__(getattr(op, "__hpc_orig__", op), *args, **kwargs)

    P2POp.__hpc_orig__ = orig_cls
    return P2POp


def _set(obj, name: str, value) -> None:
    _PATCHES.append((obj, name, getattr(obj, name)))
    setattr(obj, name, value)


def install(tracer: CommTracer) -> None:
    """Make ``tracer`` the active one; the first call replaces the functions (see the module docstring)."""
    global _TRACER
    _TRACER = tracer
    if _PATCHES:
        return
    import torch.distributed as dist

    replacement: dict[str, tuple[Any, Any]] = {}  # name on torch.distributed -> (original, wrapper)
    for name in FUNCTIONS:
        if hasattr(dist, name):
            replacement[name] = (getattr(dist, name), _wrap(name, getattr(dist, name)))
    if hasattr(dist, "_coalescing_manager"):
        replacement["_coalescing_manager"] = (dist._coalescing_manager, _wrap_coalescing(dist._coalescing_manager))
    replacement["P2POp"] = (dist.P2POp, _p2p_op_class(dist.P2POp))
    by_id = {id(orig): (orig, new) for orig, new in replacement.values()}
    for name, (_, new) in replacement.items():
        _set(dist, name, new)
    # Bindings taken at import time by the training libraries (module globals, DeepSpeed's backend object).
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith(_PATCH_PREFIXES):
            continue
        for attr, value in list(vars(mod).items()):
            hit = by_id.get(id(value))
            if hit is not None and hit[0] is value:
                _set(mod, attr, hit[1])
    cdb = getattr(sys.modules.get("deepspeed.comm.comm"), "cdb", None)
    for attr in ("all_gather_function", "reduce_scatter_function"):
        hit = by_id.get(id(getattr(cdb, attr, None)))
        if cdb is not None and hit is not None:
            _set(cdb, attr, hit[1])


def uninstall(tracer: CommTracer | None = None) -> None:
    """Deactivate ``tracer`` (or any) and restore every replaced function."""
    global _TRACER
    if tracer is not None and _TRACER is not tracer:
        return
    _TRACER = None
    while _PATCHES:
        obj, name, orig = _PATCHES.pop()
        setattr(obj, name, orig)
