"""DeepSpeed ZeRO stages 0-3 with optional CPU offload (Rajbhandari et al. 2019)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterator

from hpc_tools.planner.arch import (
    Arch,
    pieces,
    stage_parameters,
)
from hpc_tools.planner.collectives import allreduce_s, gather_s
from hpc_tools.planner.sharding.base import Change, Knobs, Scheme, busiest_split, dp_bw

if TYPE_CHECKING:
    from hpc_tools.planner.hardware import Hardware


GATHERED = "ZeRO-3 gathered parameters"  # a memory term of its own
CPU_ADAM_PARAMS_PER_S = 1e9  # DeepSpeed CPU-Adam throughput per rank (assumed; ZeRO-Offload reports ~1 s per 1B)


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
    g = 4 if k.precision == "fp32" else 2
    grads = g * n
    comm = {0: allreduce_s(grads, d, bw), 1: 2 * gather_s(grads, d, bw),
            2: m * gather_s(grads, d, bw) + gather_s(grads, d, bw), 3: 3 * m * gather_s(grads, d, bw)}[k.zero_stage]
    offload = 0.0
    shard = n / d if k.zero_stage >= 1 else n
    if k.offload_optimizer != "none":  # gradients down, updated parameters up, Adam on the CPU
        offload += 2 * g * shard / host_bw + shard / CPU_ADAM_PARAMS_PER_S
    if k.offload_param != "none":  # every microbatch fetches the parameter partition for forward and backward
        offload += 2 * m * g * shard / host_bw
    return comm, offload


class Zero(Scheme):
    """DeepSpeed ZeRO: stage 1 shards the optimizer states over the data-parallel ranks, 2 also the gradients, 3 also
    the parameters (gathered per module for use); the optimizer states and parameters can be offloaded to the CPU."""

    name = "zero"
    dimension = ("ZeRO stage and offload", ("zero_stage", "offload_optimizer", "offload_param", "ds_overlap_comm"))

    def states(self, arch: Arch, k: Knobs, stage: int) -> tuple[int, float, float, float]:
        lay = k.layout
        n = stage_parameters(arch, lay.tensor_size, lay.pipeline_size, stage, first=lay.first_stage_layers,
                             last=lay.last_stage_layers)
        return n, *zero_state_bytes(n, lay.data_size, k.zero_stage, k.precision, k.offload_optimizer,
                                    k.offload_param)

    def working_terms(self, arch: Arch, k: Knobs) -> dict[str, float]:
        """ZeRO-3 gathers each module's full 16-bit parameters to use them: the current layer plus one prefetched, or
        the whole word embedding, whichever is larger."""
        if k.zero_stage != 3:
            return {}
        pc = pieces(arch, 1)
        return {GATHERED: (4 if k.precision == "fp32" else 2) * max(2 * pc.layer, pc.word_embedding)}

    def bucket_bytes(self, k: Knobs, n_params: int) -> float:
        """DeepSpeed's reduce bucket (zero_optimization.reduce_bucket_size elements of the gradient dtype)."""
        return (4 if k.precision == "fp32" else 2) * min(k.ds_bucket_elems, n_params)

    def held(self, k: Knobs, stage_params: int) -> float:
        return stage_params / k.layout.data_size if k.zero_stage == 3 else stage_params

    def state_notes(self, arch: Arch, k: Knobs) -> tuple[str, str, str]:
        n = f" / N (N = d = {k.layout.data_size})"
        p16 = "4" if k.precision == "fp32" else "2"
        params = f"{p16} bytes/param{n if k.zero_stage >= 3 else ''} (ZeRO-{k.zero_stage})"
        grads = (f"{p16} bytes/param{n if k.zero_stage >= 2 else ''} "
                 f"(ZeRO-{k.zero_stage}; 16-bit grads as in the ZeRO paper)")
        optim = (f"{'8' if k.precision == 'fp32' else '12'} bytes/param{n if k.zero_stage >= 1 else ''}: "
                 f"{'' if k.precision == 'fp32' else 'fp32 master, '}Adam m and v (ZeRO paper K)")
        if k.offload_optimizer != "none":
            optim = f"offloaded to {k.offload_optimizer} (0 on the GPU; host holds the shard)"
        if k.offload_param != "none":
            params = f"offloaded to {k.offload_param} (0 on the GPU; see gathered parameters)"
        total = {0: "16Ψ", 1: "4Ψ + 12Ψ/N", 2: "2Ψ + 14Ψ/N", 3: "16Ψ/N"}[k.zero_stage]
        grads += f"; model states {total}" if k.precision != "fp32" else ""
        return params, grads, optim

    def working_notes(self, arch: Arch, k: Knobs) -> dict[str, str]:
        if k.zero_stage != 3:
            return {}
        return {GATHERED: "16-bit parameters of the current and one prefetched layer (or the whole embedding)"}

    def bucket_note(self, k: Knobs) -> str:
        return f" + DeepSpeed reduce bucket {k.ds_bucket_elems:.3g} elements"

    def moments_on_gpu(self, k: Knobs) -> bool:
        return k.offload_optimizer == "none"

    def dp_time(self, arch: Arch, k: Knobs, hw: "Hardware", compute: float) -> tuple[float, float]:
        lay = k.layout
        m = max(lay.num_microbatches, 1)
        comm, offload = _zero_comm(sum(busiest_split(arch, k)), k, lay.data_size, m, dp_bw(k, hw), hw.host_bw)
        hidden = (compute if k.zero_stage == 3 else 2 * compute / 3) if k.ds_overlap_comm else 0.0
        return max(comm - hidden, 0.0), offload

    def dp_note(self, k: Knobs) -> str:
        return f"ZeRO-{k.zero_stage} collectives at "

    def offload_note(self, k: Knobs, hw: "Hardware") -> str:
        if k.offload_optimizer == "none" and k.offload_param == "none":
            return "no offload"
        return f"PCIe {hw.host_bw / 1e9:.0f} GB/s, CPU Adam {CPU_ADAM_PARAMS_PER_S:.0e} params/s per rank (assumed)"

    def options(self, base: Knobs, t: int, p: int, d: int, overlap: bool | None) -> Iterator[dict[str, Any]]:
        for stage in (0, 1, 2, 3):
            if p > 1 and stage >= 2:
                continue  # DeepSpeed refuses ZeRO-2/3 with its pipeline
            yield {"zero_stage": stage, "offload_optimizer": "none", "offload_param": "none",
                   "ds_overlap_comm": stage == 3 if overlap is None else bool(overlap)}
            if stage >= 1:
                yield {"zero_stage": stage, "offload_optimizer": "cpu", "offload_param": "none",
                       "ds_overlap_comm": stage == 3 if overlap is None else bool(overlap)}
            if stage == 3:
                yield {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu",
                       "ds_overlap_comm": True if overlap is None else bool(overlap)}

    def describe(self, k: Knobs) -> list[str]:
        return [f"zero{k.zero_stage}", f"opt->{k.offload_optimizer}", f"param->{k.offload_param}"]

    def option_updates(self, k: Knobs) -> dict[str, Any]:
        return {"zero_stage": k.zero_stage, "offload_optimizer": k.offload_optimizer, "offload_param": k.offload_param}

    def changes(self, k: Knobs, options: str) -> Iterator[Change]:
        for stage in range(k.zero_stage + 1, 4):
            if k.layout.pipeline_size == 1 or stage <= 1:
                yield [f"{options}.zero_stage={stage}"], replace(k, zero_stage=stage, ds_overlap_comm=stage == 3)
        if k.zero_stage >= 1 and k.offload_optimizer == "none":
            yield [f"{options}.offload_optimizer=cpu"], replace(k, offload_optimizer="cpu")
