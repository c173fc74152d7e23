"""The rank-side measurements of preflight (imports torch): a GEMM at the recipe's precision, a memory copy, and a
timed collective over a process group. Every figure is the best of a few timed repetitions within a time slice: a
healthy node reaches its speed in at least one of them, a slow one in none.

Faults for tests, from the environment: ``HPC_TOOLS_PREFLIGHT_SLOW_RANK=R`` makes rank R's GEMM sleep four times as
long as each multiplication took (a fifth of its speed), ``R:1`` in its first look only (a host busy for a moment:
the second look, ``run.SECOND_LOOKS``, finds it healthy); ``HPC_TOOLS_PREFLIGHT_SLOW_LINK=R`` makes rank R sleep
``SLOW_LINK_S`` inside every timed collective it joins (its group waits for it, as for a throttled link);
``HPC_TOOLS_PREFLIGHT_IFNAME_RANK=R:NAME`` gives rank R ``GLOO_SOCKET_IFNAME=NAME`` (one node set differently).
"""

from __future__ import annotations

import os
import time

SLOW_RANK_ENV = "HPC_TOOLS_PREFLIGHT_SLOW_RANK"
SLOW_LINK_ENV = "HPC_TOOLS_PREFLIGHT_SLOW_LINK"
SLOW_LINK_S = 0.1
IFNAME_RANK_ENV = "HPC_TOOLS_PREFLIGHT_IFNAME_RANK"
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _injected(name: str, rank: int, look: int = 0) -> bool:
    """Whether ``name`` (``R`` or ``R:LOOKS``) injects its fault into ``rank`` at look ``look`` (0: the first)."""
    spec = os.environ.get(name, "").strip()
    who, _, looks = spec.partition(":")
    return who == str(rank) and (not looks or look < int(looks))


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gemm_tflops(device, precision: str, n: int, slice_s: float, rank: int, max_iters: int = 200,
                look: int = 0) -> float:
    """TFLOP/s of an ``n`` x ``n`` x ``n`` matrix product at ``precision`` (2 n^3 FLOPs each), the best of the
    repetitions that fit in ``slice_s`` seconds (at least 3); ``look``: which look of preflight this is."""
    import torch

    dtype = getattr(torch, DTYPES.get(precision, "float32"))
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.matmul(a, b)  # warm-up: kernels chosen, memory allocated
    _sync(device)
    slow = _injected(SLOW_RANK_ENV, rank, look)
    best, end, i = float("inf"), time.perf_counter() + slice_s, 0
    while i < 3 or (time.perf_counter() < end and i < max_iters):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        _sync(device)
        dt = time.perf_counter() - t0
        if slow:
            time.sleep(4 * dt)
            dt = time.perf_counter() - t0
        best, i = min(best, dt), i + 1
    return 2 * n**3 / best / 1e12


def mem_gbps(device, nbytes: int, slice_s: float, max_iters: int = 100) -> float:
    """GB/s of a device-to-device (GPU) or host (CPU) memory copy of ``nbytes``: each copy reads and writes them
    (2 x nbytes moved, as STREAM's copy kernel counts), the best of the repetitions that fit in ``slice_s``."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    best, end, i = float("inf"), time.perf_counter() + slice_s, 0
    while i < 3 or (time.perf_counter() < end and i < max_iters):
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best, i = min(best, time.perf_counter() - t0), i + 1
    return 2 * nbytes / best / 1e9


def collective_seconds(op: str, nbytes: int, group, n: int, device, rank: int, iters: int = 8,
                       warmup: bool = True, per_sync: int = 1) -> float:
    """The time of one ``op`` ('all_reduce', 'all_gather', 'all_to_all') moving a buffer of ``nbytes`` (the whole
    buffer, as nccl-tests sizes it) over ``group`` of ``n`` ranks (None: the default group): the best of ``iters``
    timings, each of ``per_sync`` back-to-back runs and one synchronize (divided by ``per_sync``), after one warm-up
    run."""
    import torch
    import torch.distributed as dist

    numel = max(nbytes // 4 // n * n, n)
    buf = torch.ones(numel, dtype=torch.float32, device=device)
    if op == "all_reduce":
        def once():
            dist.all_reduce(buf, group=group)
    elif op == "all_gather":
        shard = buf[: numel // n].clone()
        parts = list(buf.chunk(n))

        def once():
            dist.all_gather(parts, shard, group=group)
    elif op == "all_to_all":
        out = torch.empty_like(buf)

        def once():
            dist.all_to_all_single(out, buf, group=group)
    else:
        raise ValueError(f"unknown collective {op!r}")
    slow = _injected(SLOW_LINK_ENV, rank)
    if warmup:
        once()
        _sync(device)
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(per_sync):
            if slow:
                time.sleep(SLOW_LINK_S)
            once()
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / per_sync)
    return best


def interface_of(address: str) -> str | None:
    """The network interface holding IPv4 ``address`` (Linux: SIOCGIFADDR on each interface), else None."""
    import fcntl
    import socket
    import struct

    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == address:
            return name
    return None


def address_of(interface: str) -> str | None:
    """The IPv4 address of ``interface``, else None (no such interface, or none on it)."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", interface.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def gloo_endpoint(master_addr: str, master_port: int) -> tuple[str | None, str | None, str | None]:
    """(interface, address, error) gloo uses on this rank: ``GLOO_SOCKET_IFNAME``'s first interface when set (an
    interface this node lacks is the error), else the one the route to the rendezvous host leaves by."""
    import socket

    wanted = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    rank, _, name = os.environ.get(IFNAME_RANK_ENV, "").partition(":")
    if rank.strip() == os.environ.get("RANK") and name:  # a test's node-specific setting
        wanted = name.strip()
    if wanted:
        addr = address_of(wanted)
        if addr is None:
            return wanted, None, f"GLOO_SOCKET_IFNAME={wanted} names no interface with an IPv4 address on this node"
        return wanted, addr, None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(master_addr), master_port or 9))
            addr = s.getsockname()[0]
    except OSError as exc:
        return None, None, f"no route to the rendezvous host {master_addr}: {exc.strerror or exc}"
    return interface_of(addr), addr, None


# NVML's clock event ("throttle") reason bits that mean the hardware holds the clocks down (nvml.h:
# nvmlClocksEventReasonHwSlowdown 0x8, SwThermalSlowdown 0x20, HwThermalSlowdown 0x40, HwPowerBrakeSlowdown 0x80);
# idle, application-clock and software power-cap reasons are not faults.
CLOCK_FAULTS = {0x8: "hardware slowdown", 0x20: "software thermal slowdown", 0x40: "hardware thermal slowdown",
                0x80: "hardware power brake"}


def nvml_findings(device, nvml=None) -> list[tuple[str, str]]:
    """What NVML says is wrong with this rank's GPU, as (kind, reason): "failed" for uncorrected ECC errors since
    the driver loaded (volatile count), row remapping pending or failed (A100 and later) and retired pages pending
    (earlier GPUs); "slow" for clocks held down by the hardware (``CLOCK_FAULTS``). A query the GPU does not support
    is skipped. ``nvml``: the pynvml module (nvidia-ml-py; a stand-in in tests). The GPU is found by its UUID, so
    CUDA_VISIBLE_DEVICES renumbering does not matter. Empty when NVML is absent or the device is not a GPU."""
    if getattr(device, "type", None) != "cuda":
        return []
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return []
    try:
        nvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver library: nothing to read, the GEMM still judges the GPU
        return []
    try:
        handle = _nvml_handle(device, nvml)
        out: list[tuple[str, str]] = []
        ecc = _ask(lambda: nvml.nvmlDeviceGetTotalEccErrors(handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                             nvml.NVML_VOLATILE_ECC))
        if ecc:
            out.append(("failed", f"{ecc} uncorrected ECC error(s) since the driver loaded (NVML volatile count)"))
        rows = _ask(lambda: nvml.nvmlDeviceGetRemappedRows(handle))
        if rows and (rows[2] or rows[3]):
            out.append(("failed", "memory row remapping " + ("failed" if rows[3] else "pending a GPU reset")
                        + f" ({rows[1]} row(s) remapped for uncorrectable errors)"))
        pending = _ask(lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle))
        if pending:
            out.append(("failed", "retired memory pages pending a GPU reset (NVML)"))
        reasons = _ask(lambda: nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))
        held = [why for bit, why in CLOCK_FAULTS.items() if reasons and reasons & bit]
        if held:
            out.append(("slow", "clocks held down: " + ", ".join(held) + " (NVML clock event reasons)"))
        return out
    finally:
        _ask(nvml.nvmlShutdown)


def _nvml_handle(device, nvml):
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is not None:
        text = str(uuid)
        return nvml.nvmlDeviceGetHandleByUUID(text if text.startswith("GPU-") else f"GPU-{text}")
    return nvml.nvmlDeviceGetHandleByIndex(index)


def _ask(query):
    """One NVML query; None where the GPU or driver does not support it (NVMLError_NotSupported and the like)."""
    try:
        return query()
    except Exception:  # noqa: BLE001 - pynvml raises one class per NVML return code
        return None
