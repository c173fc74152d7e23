"""DeepSpeed ZeRO stages 0-3 with optional CPU offload (Rajbhandari et al. 2019)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Iterator

from hpc_tools import backends
from hpc_tools.planner.arch import (
    Arch,
    pieces,
    stage_parameters,
)
from hpc_tools.planner.collectives import allreduce_s, gather_s
from hpc_tools.planner.sharding.base import Change, Knobs, Scheme, SchemeKnobs, busiest_split, change, dp_bw

if TYPE_CHECKING:
    from hpc_tools.planner.hardware import Hardware
    from hpc_tools.recipe.schema import Recipe


GATHERED = "ZeRO-3 gathered parameters"  # a memory term of its own
CPU_ADAM_PARAMS_PER_S = 1e9  # DeepSpeed CPU-Adam throughput per rank (assumed; ZeRO-Offload reports ~1 s per 1B)
# DeepSpeed's default zero_optimization.reduce_bucket_size (elements); its ZeRO-1/2 gradient bucket.
DS_DEFAULT_BUCKET_ELEMS = 500_000_000


@dataclass(frozen=True, slots=True)
class ZeroKnobs(SchemeKnobs):
    """``backend.deepspeed``'s ZeRO options, and the two keys of DeepSpeed's zero_optimization the planner reads
    (where the recipe's config_overrides set them, else DeepSpeed's defaults); those two are never written back."""
    zero_stage: int
    offload_optimizer: str
    offload_param: str
    overlap_comm: bool = field(metadata={"source": "zero_optimization.overlap_comm"})
    reduce_bucket_size: int = field(metadata={"source": "zero_optimization.reduce_bucket_size"})
    elsewhere: ClassVar[dict[str, str]] = {
        "nvme_path": "where nvme offload writes (the offloaded bytes leave the GPU either way)",
        "pretrained_path": "the starting weights (no memory or time term)",
        "config_overrides": "its zero_optimization overlap_comm and reduce_bucket_size (derived fields)",
        "liger": "not modelled (Liger's fused kernels)"}

    @classmethod
    def derived(cls, recipe: "Recipe") -> dict[str, Any]:
        zero = backends.of(recipe).zero_config(recipe)  # DeepSpeed's default overlap_comm: on for ZeRO-3
        return {"overlap_comm": bool(zero.get("overlap_comm", recipe.backend.deepspeed.zero_stage == 3)),
                "reduce_bucket_size": int(zero.get("reduce_bucket_size", DS_DEFAULT_BUCKET_ELEMS))}


def zero_state_bytes(n_params: float, data: int, stage: int, precision: str = "bf16",
                     offload_optimizer: str = "none", offload_param: str = "none") -> tuple[float, float, float]:
    """(parameters, gradients, optimizer) bytes per GPU under DeepSpeed ZeRO (Rajbhandari et al. 2019).

    Mixed precision: 2 + 2 + K with K = 12; stage 1 shards the optimizer (4Ψ + 12Ψ/N), stage 2 also the gradients
    (2Ψ + 14Ψ/N), stage 3 also the parameters (16Ψ/N). fp32: 4 + 4 + 8. Offloaded states leave the GPU.
    """
    p, g, o = (4, 4, 8) if precision == "fp32" else (2, 2, 12)
    params = p * n_params / (data if stage >= 3 else 1)
    grads = g * n_params / (data if stage >= 2 else 1)
    optim = o * n_params / (data if stage >= 1 else 1)
    if offload_optimizer != "none":
        optim = 0.0
    if offload_param != "none":
        params = 0.0
    return params, grads, optim


def _zero_comm(n: int, k: Knobs, d: int, m: int, bw: float, host_bw: float) -> tuple[float, float]:
    """(collective seconds, offload seconds) per step under ZeRO. Stage 0: all-reduce of 16-bit grads at the step;
    1: reduce-scatter + all-gather at the step (the same 2Ψ as data parallelism, ZeRO paper); 2: a reduce-scatter
    every microbatch + the all-gather; 3: two all-gathers (forward, backward) and a reduce-scatter every microbatch
    (3Ψ per microbatch)."""
    g, z = (4 if k.precision == "fp32" else 2), k.sharding
    grads = g * n
    comm = {0: allreduce_s(grads, d, bw), 1: 2 * gather_s(grads, d, bw),
            2: m * gather_s(grads, d, bw) + gather_s(grads, d, bw), 3: 3 * m * gather_s(grads, d, bw)}[z.zero_stage]
    offload = 0.0
    shard = n / d if z.zero_stage >= 1 else n
    if z.offload_optimizer != "none":  # gradients down, updated parameters up, Adam on the CPU
        offload += 2 * g * shard / host_bw + shard / CPU_ADAM_PARAMS_PER_S
    if z.offload_param != "none":  # every microbatch fetches the parameter partition for forward and backward
        offload += 2 * m * g * shard / host_bw
    return comm, offload


class Zero(Scheme):
    """DeepSpeed ZeRO: stage 1 shards the optimizer states over the data-parallel ranks, 2 also the gradients, 3 also
    the parameters (gathered per module for use); the optimizer states and parameters can be offloaded to the CPU."""

    name = "zero"
    knobs = ZeroKnobs
    dimension = ("ZeRO stage and offload", ("zero_stage", "offload_optimizer", "offload_param", "overlap_comm"))

    def states(self, arch: Arch, k: Knobs, stage: int) -> tuple[int, float, float, float]:
        lay, z = k.layout, k.sharding
        n = stage_parameters(arch, lay.tensor_size, lay.pipeline_size, stage, first=lay.first_stage_layers,
                             last=lay.last_stage_layers)
        return n, *zero_state_bytes(n, lay.data_size, z.zero_stage, k.precision, z.offload_optimizer, z.offload_param)

    def working_terms(self, arch: Arch, k: Knobs) -> dict[str, float]:
        """ZeRO-3 gathers each module's full 16-bit parameters to use them: the current layer plus one prefetched, or
        the whole word embedding, whichever is larger."""
        if k.sharding.zero_stage != 3:
            return {}
        pc = pieces(arch, 1)
        return {GATHERED: (4 if k.precision == "fp32" else 2) * max(2 * pc.layer, pc.word_embedding)}

    def bucket_bytes(self, k: Knobs, n_params: int) -> float:
        """DeepSpeed's reduce bucket (zero_optimization.reduce_bucket_size elements of the gradient dtype)."""
        return (4 if k.precision == "fp32" else 2) * min(k.sharding.reduce_bucket_size, n_params)

    def held(self, k: Knobs, stage_params: int) -> float:
        return stage_params / k.layout.data_size if k.sharding.zero_stage == 3 else stage_params

    def state_notes(self, arch: Arch, k: Knobs) -> tuple[str, str, str]:
        z, n = k.sharding, f" / N (N = d = {k.layout.data_size})"
        p16 = "4" if k.precision == "fp32" else "2"
        params = f"{p16} bytes/param{n if z.zero_stage >= 3 else ''} (ZeRO-{z.zero_stage})"
        grads = (f"{p16} bytes/param{n if z.zero_stage >= 2 else ''} "
                 f"(ZeRO-{z.zero_stage}; 16-bit grads as in the ZeRO paper)")
        optim = (f"{'8' if k.precision == 'fp32' else '12'} bytes/param{n if z.zero_stage >= 1 else ''}: "
                 f"{'' if k.precision == 'fp32' else 'fp32 master, '}Adam m and v (ZeRO paper K)")
        if z.offload_optimizer != "none":
            optim = f"offloaded to {z.offload_optimizer} (0 on the GPU; host holds the shard)"
        if z.offload_param != "none":
            params = f"offloaded to {z.offload_param} (0 on the GPU; see gathered parameters)"
        total = {0: "16Ψ", 1: "4Ψ + 12Ψ/N", 2: "2Ψ + 14Ψ/N", 3: "16Ψ/N"}[z.zero_stage]
        grads += f"; model states {total}" if k.precision != "fp32" else ""
        return params, grads, optim

    def working_notes(self, arch: Arch, k: Knobs) -> dict[str, str]:
        if k.sharding.zero_stage != 3:
            return {}
        return {GATHERED: "16-bit parameters of the current and one prefetched layer (or the whole embedding)"}

    def bucket_note(self, k: Knobs) -> str:
        return f" + DeepSpeed reduce bucket {k.sharding.reduce_bucket_size:.3g} elements"

    def moments_on_gpu(self, k: Knobs) -> bool:
        return k.sharding.offload_optimizer == "none"

    def dp_time(self, arch: Arch, k: Knobs, hw: "Hardware", compute: float) -> tuple[float, float]:
        lay, z = k.layout, k.sharding
        m = max(lay.num_microbatches, 1)
        comm, offload = _zero_comm(sum(busiest_split(arch, k)), k, lay.data_size, m, dp_bw(k, hw), hw.host_bw)
        hidden = (compute if z.zero_stage == 3 else 2 * compute / 3) if z.overlap_comm else 0.0
        return max(comm - hidden, 0.0), offload

    def dp_note(self, k: Knobs) -> str:
        return f"ZeRO-{k.sharding.zero_stage} collectives at "

    def offload_note(self, k: Knobs, hw: "Hardware") -> str:
        if k.sharding.offload_optimizer == "none" and k.sharding.offload_param == "none":
            return "no offload"
        return f"PCIe {hw.host_bw / 1e9:.0f} GB/s, CPU Adam {CPU_ADAM_PARAMS_PER_S:.0e} params/s per rank (assumed)"

    def options(self, base: Knobs, t: int, p: int, d: int, overlap: bool | None) -> Iterator[ZeroKnobs]:
        bucket = base.sharding.reduce_bucket_size
        for stage in (0, 1, 2, 3):
            if p > 1 and stage >= 2:
                continue  # DeepSpeed refuses ZeRO-2/3 with its pipeline
            comm = stage == 3 if overlap is None else bool(overlap)
            yield ZeroKnobs(stage, "none", "none", comm, bucket)
            if stage >= 1:
                yield ZeroKnobs(stage, "cpu", "none", comm, bucket)
            if stage == 3:
                yield ZeroKnobs(3, "cpu", "cpu", True if overlap is None else bool(overlap), bucket)

    def describe(self, k: Knobs) -> list[str]:
        z = k.sharding
        return [f"zero{z.zero_stage}", f"opt->{z.offload_optimizer}", f"param->{z.offload_param}"]

    def changes(self, k: Knobs, options: str) -> Iterator[Change]:
        for stage in range(k.sharding.zero_stage + 1, 4):
            if k.layout.pipeline_size == 1 or stage <= 1:
                yield change(k, options, zero_stage=stage, overlap_comm=stage == 3)
        if k.sharding.zero_stage >= 1 and k.sharding.offload_optimizer == "none":
            yield change(k, options, offload_optimizer="cpu")
