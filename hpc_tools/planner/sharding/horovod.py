"""Horovod's DistributedOptimizer: DDP's memory, ring all-reduce of (compressed) gradients."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Iterator

from hpc_tools.planner.arch import Arch, fsdp_parameters
from hpc_tools.planner.collectives import allreduce_s
from hpc_tools.planner.sharding.base import Knobs, Scheme, SchemeKnobs
from hpc_tools.planner.sharding.fsdp import fsdp_state_bytes

if TYPE_CHECKING:
    from hpc_tools.planner.hardware import Hardware


HVD_COPIES = "autocast and compression copies"


@dataclass(frozen=True, slots=True)
class HorovodKnobs(SchemeKnobs):
    """``backend.horovod``'s options that shape memory and the all-reduce."""
    compression: str  # none | fp16
    fusion_threshold_mb: int  # Horovod's fusion buffer (MiB)
    elsewhere: ClassVar[dict[str, str]] = {"liger": "not modelled (Liger's fused kernels)"}


class Horovod(Scheme):
    """Horovod's DistributedOptimizer: every rank a full copy of the model states (DDP's memory), the gradients
    ring-all-reduced once per step (``backward_passes_per_step`` = the microbatches) in fused buffers of
    ``backend.horovod.fusion_threshold_mb``, issued by Horovod's background thread as the last backward produces them
    (Sergeev and Del Balso, "Horovod: fast and easy distributed deep learning in TensorFlow", arXiv:1802.05799);
    ``compression: fp16`` halves the bytes on the wire. No knob for the search: compression changes the numbers and
    the fusion buffer only the buffer term, so both stay as the recipe gives them."""

    name = "horovod"
    knobs = HorovodKnobs
    dimension = ("Horovod (nothing to turn)", ())

    def states(self, arch: Arch, k: Knobs, stage: int) -> tuple[int, float, float, float]:
        n = fsdp_parameters(arch, 1)
        return n, *fsdp_state_bytes(n, 1)

    def working_terms(self, arch: Arch, k: Knobs) -> dict[str, float]:
        n = fsdp_parameters(arch, 1)
        autocast, compressed = k.precision != "fp32", k.sharding.compression == "fp16"
        return {HVD_COPIES: (2 * n if autocast else 0.0) + (2 * n if compressed else 0.0)}

    def bucket_bytes(self, k: Knobs, n_params: int) -> float:
        """The fusion buffer: Horovod allocates HOROVOD_FUSION_THRESHOLD bytes once, at the first fused all-reduce."""
        return k.sharding.fusion_threshold_mb * 2.0 ** 20

    def state_notes(self, arch: Arch, k: Knobs) -> tuple[str, str, str]:
        d = k.layout.data_size
        return (f"4 bytes/param: fp32 parameters (every one of the {d} ranks a full copy, as DDP)",
                "4 bytes/param: fp32 gradients (p.grad, all-reduced in place after the last microbatch)",
                "8 bytes/param: Adam m and v; model states 16 bytes/param, as DDP")

    def working_notes(self, arch: Arch, k: Knobs) -> dict[str, str]:
        parts = ["bf16 copies of the weights autocast caches in the forward (2 bytes/param)"
                 if k.precision != "fp32" else "no autocast copies (fp32)"]
        parts.append("fp16 copies of every gradient until the all-reduce ends (2 bytes/param)"
                     if k.sharding.compression == "fp16" else "no compression copies")
        return {HVD_COPIES: "; ".join(parts)}

    def bucket_note(self, k: Knobs) -> str:
        return f" + Horovod's fusion buffer {k.sharding.fusion_threshold_mb} MiB (backend.horovod.fusion_threshold_mb)"

    def dp_time(self, arch: Arch, k: Knobs, hw: "Hardware", compute: float) -> tuple[float, float]:
        """Ring all-reduce of the gradients (2(d-1)/d of their bytes per rank) once per step, overlapped with the last
        microbatch's backward as DDP's buckets are; exposed: the excess, at least one block's share."""
        n, d, m = fsdp_parameters(arch, 1), k.layout.data_size, max(k.layout.num_microbatches, 1)
        wire = 2 if k.sharding.compression == "fp16" else 4
        reduce = allreduce_s(wire * n, d, hw.link_bw(spans_nodes=d > hw.gpus_per_node))
        return max(reduce - 2 * compute / m / 3, reduce / (arch.layers + 1)), 0.0

    def dp_note(self, k: Knobs) -> str:
        wire = "fp16-compressed" if k.sharding.compression == "fp16" else "fp32"
        return (f"Horovod: ring all-reduce of the {wire} gradients once per step, fused up to "
                f"{k.sharding.fusion_threshold_mb} MiB "
                "and issued as the last backward produces them (exposed: the excess, at least one block's share) at ")

    def options(self, base: Knobs, t: int, p: int, d: int, overlap: bool | None) -> Iterator[HorovodKnobs]:
        yield base.sharding

    def describe(self, k: Knobs) -> list[str]:
        return ["hvd" + ("-fp16" if k.sharding.compression == "fp16" else "")]

    def carries(self, base: Knobs, cand: Knobs) -> bool:
        """A full copy on every rank in a Distributed Checkpoint: any world size resumes it (the search turns no
        knob of Horovod's that the checkpoint would have to keep)."""
        return True
