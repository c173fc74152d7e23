"""What the planner asks a sharding scheme (``Scheme``), what a scheme reads of a configuration (``Knobs``), and
the helpers every scheme shares."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Protocol

from hpc_tools.planner.arch import (
    Arch,
    busiest_moe_stage,
    stage_split,
)

if TYPE_CHECKING:
    from hpc_tools.layout import ParallelLayout
    from hpc_tools.planner.hardware import Hardware


class Knobs(Protocol):
    """What a scheme reads of a configuration: ``hpc_tools.planner.knobs.Knobs`` (not imported: that module looks its
    scheme up here), the layout and precision every scheme reads, then each scheme's own knobs."""
    layout: "ParallelLayout"
    precision: str
    moe: bool
    distributed_optimizer: bool  # distributed_optimizer
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    zero_stage: int  # zero
    offload_optimizer: str
    offload_param: str
    ds_overlap_comm: bool
    ds_bucket_elems: int
    fsdp_strategy: str  # fsdp
    fsdp_shard_size: int | None
    fsdp_reshard: bool
    hvd_compression: str  # horovod
    hvd_fusion_mb: int

    @property
    def virtual(self) -> int: ...

    @property
    def shard_group(self) -> int: ...


Change = tuple[list[str], Knobs]  # ``--set`` strings and the configuration they make (``fit``)


class Scheme:
    """What the planner asks a sharding scheme. ``k`` is the configuration (``Knobs``) being planned."""

    name: ClassVar[str]
    """The backend table's ``sharding`` value."""
    dimension: ClassVar[tuple[str, tuple[str, ...]]]
    """What the search turns for it: the label users read and the ``Knobs`` attributes (``planner/dimensions.py``)."""

    # --- memory -----------------------------------------------------------------------------------------------------
    def states(self, arch: Arch, k: Knobs, stage: int) -> tuple[int, float, float, float]:
        """(parameters of the stage one GPU computes with, parameter, gradient, optimizer bytes on one GPU)."""
        raise NotImplementedError

    def working_terms(self, arch: Arch, k: Knobs) -> dict[str, float]:
        """Memory terms of its own (gathered or unsharded copies), after the activations."""
        return {}

    def bucket_bytes(self, k: Knobs, n_params: int) -> float:
        """Communication buffers beyond NCCL's own."""
        return 0.0

    def held(self, k: Knobs, stage_params: int) -> float:
        """The parameters one GPU keeps of the ``stage_params`` it computes with (sharded schemes: a 1/S share)."""
        return stage_params

    def state_notes(self, arch: Arch, k: Knobs) -> tuple[str, str, str]:
        """What the parameter, gradient and optimizer terms assume."""
        raise NotImplementedError

    def working_notes(self, arch: Arch, k: Knobs) -> dict[str, str]:
        """What ``working_terms`` assume, by term."""
        return {}

    def bucket_note(self, k: Knobs) -> str:
        """Appended to the communication-buffer line."""
        return ""

    def moments_on_gpu(self, k: Knobs) -> bool:
        """The fp32 optimizer moments live in GPU memory (so storing them in BF16 would save some)."""
        return True

    # --- step time --------------------------------------------------------------------------------------------------
    def dp_time(self, arch: Arch, k: Knobs, hw: "Hardware", compute: float) -> tuple[float, float]:
        """(exposed data-parallel communication, offload) seconds per step; ``compute``: the step's compute."""
        raise NotImplementedError

    def dp_note(self, k: Knobs) -> str:
        """The data-parallel line up to its bandwidth (``... at ``)."""
        raise NotImplementedError

    def offload_note(self, k: Knobs, hw: "Hardware") -> str:
        return "no offload"

    # --- knobs ------------------------------------------------------------------------------------------------------
    def options(self, base: Knobs, t: int, p: int, d: int, overlap: bool | None) -> Iterator[dict[str, Any]]:
        """The knob settings the search tries on a TP ``t`` x PP ``p`` x DP ``d`` layout (``overlap``: the recipe's
        DeepSpeed overlap_comm, None where it sets none)."""
        raise NotImplementedError

    def describe(self, k: Knobs) -> list[str]:
        """Its part of ``Knobs.describe``."""
        raise NotImplementedError

    def option_updates(self, k: Knobs) -> dict[str, Any]:
        """Its knobs as fields of the backend's own options section."""
        raise NotImplementedError

    def cheap_changes(self, k: Knobs, options: str) -> Iterator[Change]:
        """Single changes that cost (almost) no step time, tried before any relayout (``options``: the backend's
        options section, ``backend.<name>``)."""
        return iter(())

    def changes(self, k: Knobs, options: str) -> Iterator[Change]:
        """Single changes of its knobs, tried after the relayouts and before a deeper pipeline."""
        return iter(())

    # --- elastic layouts (``hpc_tools.planner.elastic``) -------------------------------------------------------------
    def carries(self, base: Knobs, cand: Knobs) -> bool:
        """Whether a checkpoint saved under ``base`` resumes, optimizer state included, into ``cand`` (a scheme
        whose checkpoints hold each data-parallel rank's partition: never at another layout)."""
        return False

    def carry_fix(self, k: Knobs) -> str:
        """A change of its knobs that would let more layouts carry the checkpoint (``, or <field>: <value> (why)``),
        for the refusal of a ``cluster.min_nodes`` with none; "" where there is none."""
        return ""


def dp_bw(k: Knobs, hw: "Hardware") -> float:
    lay = k.layout
    return hw.link_bw(spans_nodes=lay.tensor_size * lay.context_size * lay.data_size > hw.gpus_per_node)


def busiest_split(arch: Arch, k: Knobs) -> tuple[int, int]:
    """(dense, expert) parameters of the pipeline stage that holds the most (first, last or the busiest MoE stage)."""
    lay, v = k.layout, k.virtual
    t, p = lay.tensor_size, lay.pipeline_size
    shards = lay.expert_size * lay.expert_tensor_size
    first, last = lay.first_stage_layers, lay.last_stage_layers
    busiest = busiest_moe_stage(arch, p, v, first, last)
    stages = {0, p - 1} | ({busiest} if busiest is not None else set())
    return max((stage_split(arch, t, p, s, shards, v, first, last) for s in stages), key=sum)
