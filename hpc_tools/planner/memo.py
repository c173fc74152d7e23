"""What the candidates of one layout search share, computed once (``planner.search.search``).

The search scores every combination of its knobs, and most of a candidate's memory is shared with many others: a
stage's activations do not depend on the sharding options (distributed optimizer, ZeRO stage, offload, FSDP
strategy), the expert-parallel size or the data-parallel size beyond the microbatch count, so the candidates that
differ only in those reuse them; which middle stage is the busiest depends on the pipeline split alone. The memo
returns exactly what ``memory.stage_activation_bytes`` / ``edge_activation_bytes`` and ``arch.busiest_moe_stage``
return (the same calls, keyed by every input they read), so a search with it ranks bit for bit what one without it
would (``tests/unit/test_search_memo.py`` compares the two on every shipped recipe and on drawn ones).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpc_tools.planner.arch import Arch, busiest_moe_stage
from hpc_tools.planner.memory import edge_activation_bytes, layer_bytes, stage_activation_bytes

if TYPE_CHECKING:
    from hpc_tools.planner.knobs import Knobs


class SearchMemo:
    """Per-search memo (``memory.estimate_memory(..., memo=)``); holds one entry per distinct input."""

    __slots__ = ("_activations", "_layers", "_middle")

    def __init__(self) -> None:
        self._activations: dict[tuple, tuple[float, float, float]] = {}
        self._layers: dict[tuple, float] = {}
        self._middle: dict[tuple, int | None] = {}

    def activations(self, arch: Arch, k: "Knobs", stage: int) -> tuple[float, float, float]:
        """(activations, recompute working set, embedding/logits activations) of one GPU of ``stage``."""
        key = activation_key(arch, k, stage)
        hit = self._activations.get(key)
        if hit is None:
            hit = self._activations[key] = (*stage_activation_bytes(arch, k, stage, self.layer_bytes),
                                            edge_activation_bytes(arch, k, stage))
        return hit

    def layer_bytes(self, arch: Arch, k: "Knobs", recompute: str, moe: bool = False) -> float:
        """``memory.layer_bytes``, once per layer configuration (the pipeline split and the stage aside)."""
        lay = k.layout
        key = (arch, recompute, moe, k.backend, k.precision, k.recompute, k.recompute_modules, k.flash, k.attention,
               k.on_gpu, lay.tensor_size, lay.sequence_parallel, lay.micro_batch_size, lay.context_size,
               lay.expert_tensor_size)
        hit = self._layers.get(key)
        if hit is None:
            hit = self._layers[key] = layer_bytes(arch, k, recompute, moe)
        return hit

    def busiest_moe_stage(self, arch: Arch, pipeline: int, virtual: int, first: int | None,
                          last: int | None) -> int | None:
        """``arch.busiest_moe_stage``, once per pipeline split."""
        key = (arch, pipeline, virtual, first, last)
        if key not in self._middle:
            self._middle[key] = busiest_moe_stage(arch, pipeline, virtual, first, last)
        return self._middle[key]


def activation_key(arch: Arch, k: "Knobs", stage: int) -> tuple:
    """Every input of a stage's activations (``stage_activation_bytes``, ``edge_activation_bytes`` and the layer
    code they call, ``memory.LayerCode``): the model, the stage, the backend (its layer code, selective recompute),
    precision, recomputation, attention path, GPU or CPU kernels, TP, SP, micro batch, CP, ETP (the routed tokens
    per expert shard), the pipeline split and the microbatch count (``SearchMemo.layer_bytes``' key: those of a
    layer). Not in it, since no activation term reads them: DP (but through the microbatch count), EP, the sharding
    options, FP8, the dispatcher and the overlap flags. A term that comes to read another knob must add it here (the
    memo test compares against the plain model)."""
    lay = k.layout
    return (arch, stage, k.backend, k.precision, k.recompute, k.recompute_method, k.recompute_num_layers,
            k.recompute_modules, k.flash, k.attention, k.on_gpu, lay.tensor_size, lay.sequence_parallel,
            lay.micro_batch_size, lay.context_size, lay.expert_tensor_size, lay.pipeline_size,
            lay.virtual_pipeline_size, lay.num_microbatches, lay.first_stage_layers, lay.last_stage_layers)


def states_floor(arch: Arch, k: "Knobs") -> float:
    """A floor of ``memory.estimate_memory(arch, k).total``, never above it, rounding included: the first stage's
    parameter, gradient and optimizer bytes summed as ``memory.stage_memory`` begins its sum, whose other terms are
    all at least 0 (float addition of a non-negative term never lowers a sum), and the peak is the largest stage."""
    _, params, grads, optim = k.scheme.states(arch, k, 0)
    return sum((params, grads, optim))
