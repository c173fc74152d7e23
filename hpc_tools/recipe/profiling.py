"""``profiling:`` — what the in-job collectors measure (see the `profiling` package)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hpc_tools.recipe.base import Section


class TorchProfilerConfig(Section):
    enabled: bool = False
    """Capture a torch.profiler trace (TensorBoard / Holistic Trace Analysis readable)."""
    start_step: int = Field(default=5, ge=0)
    """First step of the traced window."""
    num_steps: int = Field(default=3, gt=0)
    """Steps in the traced window."""
    ranks: list[int] = Field(default_factory=lambda: [0])
    """Global ranks that trace."""


class ProfilingConfig(Section):
    enabled: bool = True
    """Write per-rank step records into the run folder."""
    summary_interval: int = Field(default=10, gt=0)
    """Every N steps rank 0 logs the bus bandwidth of the collectives that step timed (a `comm at step N` line in its
    log file; the step figures are the progress line's, every training.log_interval steps)."""
    warmup_steps: int = Field(default=2, ge=0)
    """Steps at the beginning of every start of the job (and of each requeue) excluded from the time and throughput
    figures (compilation, allocator warm-up); the rule is stated in profiling/figures.py."""
    flops_convention: Literal["megatron", "korthikanti"] = "megatron"
    """FLOPs formula for TFLOP/s and MFU: Megatron-LM's current one (causal attention halved) or Korthikanti et al.
    eq. 7 (docs/formulas.md)."""
    memory: bool = True
    """Record peak memory per step (GPU allocated/reserved, or RSS on CPU)."""
    communication: bool = True
    """Time collectives on sampled steps (bytes, time, bus bandwidth per kind)."""
    communication_sample_interval: int = Field(default=10, gt=0)
    """Time collectives on every N-th step only."""
    pipeline_bubble: bool = True
    """Measure time waiting on pipeline p2p per stage."""
    gpu_telemetry: bool = True
    """Sample NVML (SM utilisation, memory, power, clocks, temperature) in a thread; absent without GPUs."""
    telemetry_interval_s: float = Field(default=1.0, gt=0.0)
    """Seconds between telemetry samples."""
    health_interval_min: float = Field(default=5.0, ge=0.0, le=24 * 60)
    """Every N minutes while training, preflight's checks repeated cheaply on every rank between two steps (a short
    GEMM, one all-reduce at a small size; docs/preflight.md, "Health while training"): a node found slow against the
    others in two checks in a row is named in health.json, the manifest and `status`, and left out at once when a
    spare, `min_nodes` or a requeue can replace it (needs cluster.restarts > 0). A float (0.5 = 30 s); 0 = off, and
    cluster.preflight: off (or `auto` on one node) turns it off too. At 5 minutes a check costs well under 1 % of
    the run (benchmarks/bench_health_overhead.py)."""
    torch_profiler: TorchProfilerConfig = Field(default_factory=TorchProfilerConfig)
    """A torch.profiler window on chosen ranks."""
    trace_sample_interval: int = Field(default=200, ge=0)
    """A one-step torch.profiler trace every N steps (after the warm-up) on the ranks of trace_ranks, beside the
    explicit window, for `analyze --breakdown` (docs/breakdown.md); 0 turns it off. The default keeps its cost under
    1 % of the run (benchmarks/bench_collector_overhead.py)."""
    trace_ranks: Literal["all", "auto"] | list[int] = "auto"
    """Ranks that take the sampled traces: `all`, `auto` (every rank up to 32 ranks; above, a small set with a rank
    in every pipeline stage, every TP/CP/EP/DP/PP group and every node: profiling/trace_ranks.py), or a list of
    global ranks (docs/breakdown.md)."""
