"""The parallel layout: the one owner of world size, the five parallel degrees, microbatches and every number derived
from them.

Two decompositions of the same ranks (Megatron-core's, ``parallel_state.initialize_model_parallel``):

* dense parts (attention, dense MLPs, embeddings, norms): world = PP x TP x CP x DP, so
  ``data_size`` = world / (PP x TP x CP);
* expert parts (the routed experts of MoE layers): world = PP x ETP x EP x EDP, so
  ``expert_data_size`` = world / (PP x ETP x EP).

The context-parallel ranks of a replica hold the same weights (they split the sequence), so dense gradients are
reduced over DP x CP ranks; expert gradients over the EDP ranks. sbatch (--nodes, --ntasks-per-node), the local
launcher, Megatron's parallel sizes, the planner and DeepSpeed's batch triple all read this class; nothing else
multiplies parallel degrees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelLayout:
    nodes: int
    ranks_per_node: int
    tensor_size: int
    pipeline_size: int
    data_size: int
    virtual_pipeline_size: int | None
    sequence_parallel: bool
    micro_batch_size: int
    global_batch_size: int
    context_size: int = 1
    """CP: ranks one sequence is split across."""
    expert_size: int = 1
    """EP: ranks the routed experts are split across."""
    expert_tensor_size: int | None = None
    """ETP: tensor-parallel degree inside an expert; None (when built by hand) = tensor_size, Megatron's default.
    ``from_recipe`` resolves the recipe's null to 1 when the model has experts."""
    first_stage_layers: int | None = None
    """Layers on the first pipeline stage (``parallel.num_layers_in_first_pipeline_stage``); None = an equal share."""
    last_stage_layers: int | None = None
    """Layers on the last pipeline stage (``parallel.num_layers_in_last_pipeline_stage``); None = an equal share."""

    def __post_init__(self) -> None:
        if self.expert_tensor_size is None:
            object.__setattr__(self, "expert_tensor_size", self.tensor_size)

    @classmethod
    def from_recipe(cls, recipe: Any) -> "ParallelLayout":
        """Resolve -1/null degrees against the cluster; the result may still break rules (see recipe.rules).

        ``recipe`` is a ``hpc_tools.recipe.schema.Recipe`` (its parallel, training and cluster sections); it is not
        imported here, since the recipe's rules build on this class (the layout sits below the recipe)."""
        p, t, c = recipe.parallel, recipe.training, recipe.cluster
        world = c.nodes * c.gpus_per_node
        data = (p.data_size if p.data_size != -1
                else max(world // (p.tensor_size * p.pipeline_size * p.context_size), 1))
        global_batch = t.global_batch_size if t.global_batch_size is not None else t.micro_batch_size * data
        etp = p.expert_tensor_size
        if etp is None:
            etp = 1 if recipe.model.num_experts is not None else p.tensor_size
        return cls(nodes=c.nodes, ranks_per_node=c.gpus_per_node, tensor_size=p.tensor_size,
                   pipeline_size=p.pipeline_size, data_size=data, virtual_pipeline_size=p.virtual_pipeline_size,
                   sequence_parallel=p.sequence_parallel, micro_batch_size=t.micro_batch_size,
                   global_batch_size=global_batch, context_size=p.context_size, expert_size=p.expert_size,
                   expert_tensor_size=etp, first_stage_layers=p.num_layers_in_first_pipeline_stage,
                   last_stage_layers=p.num_layers_in_last_pipeline_stage)

    @property
    def world_size(self) -> int:
        """Ranks in the job: nodes x ranks per node (one rank per GPU)."""
        return self.nodes * self.ranks_per_node

    @property
    def model_parallel_size(self) -> int:
        """Megatron's model-parallel group: TP x PP."""
        return self.tensor_size * self.pipeline_size

    @property
    def replica_size(self) -> int:
        """Ranks one data-parallel replica of the dense parts spans: PP x TP x CP."""
        return self.tensor_size * self.pipeline_size * self.context_size

    @property
    def layout_size(self) -> int:
        """Ranks the dense decomposition accounts for: PP x TP x CP x DP (must equal world_size)."""
        return self.replica_size * self.data_size

    @property
    def expert_replica_size(self) -> int:
        """Ranks one copy of the experts spans: PP x ETP x EP."""
        return self.pipeline_size * self.expert_tensor_size * self.expert_size

    @property
    def expert_data_size(self) -> int:
        """EDP = world / (PP x ETP x EP): the ranks that hold the same experts and reduce their gradients (0 when
        PP x ETP x EP does not divide the world: a rule reports it)."""
        world, rep = self.world_size, self.expert_replica_size
        return world // rep if world % rep == 0 else 0

    @property
    def dense_grad_size(self) -> int:
        """Ranks that reduce a dense parameter's gradient (and shard its distributed-optimizer state): DP x CP."""
        return self.data_size * self.context_size

    @property
    def seq_shard(self) -> int:
        """Ranks one sequence is split across by CP (its tokens per rank: seq_length / CP)."""
        return self.context_size

    @property
    def num_microbatches(self) -> int:
        """m = B / (b x d): microbatches per step on each pipeline (gradient accumulation steps)."""
        return self.global_batch_size // (self.micro_batch_size * self.data_size)

    @property
    def interleaved(self) -> bool:
        return self.virtual_pipeline_size is not None and self.virtual_pipeline_size > 1

    @property
    def bubble_fraction(self) -> float:
        """Pipeline bubble over ideal compute time: (p-1)/m, interleaved (p-1)/(v m) (Narayanan et al. 2021)."""
        if self.pipeline_size == 1:
            return 0.0
        v = self.virtual_pipeline_size if self.interleaved else 1
        return (self.pipeline_size - 1) / (v * self.num_microbatches)

    @property
    def uneven(self) -> bool:
        """The first or the last pipeline stage has a layer count of its own (Megatron-core's uneven stages)."""
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    def stage_chunks(self, num_layers: int) -> tuple[tuple[range, ...], ...] | None:
        """The layers of each model chunk of each pipeline stage (``pipeline_chunks``); None when this layout cannot
        split ``num_layers`` (a rule reports it)."""
        return pipeline_chunks(num_layers, self.pipeline_size, self.virtual_pipeline_size if self.interleaved else 1,
                               self.first_stage_layers, self.last_stage_layers)

    def deepspeed_batch(self) -> dict[str, int]:
        """DeepSpeed's batch triple; train_batch_size = micro x accumulation x data-parallel size."""
        return {
            "train_batch_size": self.global_batch_size,
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": self.num_microbatches,
        }

    def megatron_sizes(self) -> dict[str, int | None]:
        """Arguments for megatron.core.parallel_state.initialize_model_parallel, under its own names."""
        return {
            "tensor_model_parallel_size": self.tensor_size,
            "pipeline_model_parallel_size": self.pipeline_size,
            "virtual_pipeline_model_parallel_size": self.virtual_pipeline_size if self.interleaved else None,
            "context_parallel_size": self.context_size,
            "expert_model_parallel_size": self.expert_size,
            "expert_tensor_parallel_size": self.expert_tensor_size,
        }

    def describe(self) -> str:
        vpp = f"xVPP{self.virtual_pipeline_size}" if self.interleaved else ""
        if self.uneven:
            vpp += f"({uneven_label(self.first_stage_layers, self.last_stage_layers)})"
        sp = "+SP" if self.sequence_parallel else ""
        cp = f"xCP{self.context_size}" if self.context_size > 1 else ""
        ep = (f", EP{self.expert_size}xETP{self.expert_tensor_size}xEDP{self.expert_data_size}"
              if self.expert_size > 1 or self.expert_tensor_size != self.tensor_size else "")
        return (f"TP{self.tensor_size}xPP{self.pipeline_size}{vpp}{cp}xDP{self.data_size}{sp}{ep} on {self.nodes}x"
                f"{self.ranks_per_node} ranks, micro {self.micro_batch_size}, global {self.global_batch_size}, "
                f"{self.num_microbatches} microbatches")


def uneven_label(first: int | None, last: int | None) -> str:
    """``first 3, last 2``: the stages an uneven split sets (for layout labels)."""
    return ", ".join(f"{name} {n}" for name, n in (("first", first), ("last", last)) if n is not None)


def middle_stage_layers(num_layers: int, pipeline: int, first: int | None, last: int | None) -> tuple[int, int]:
    """(layers left for the middle stages, middle stages): what the first and last stages' own counts leave, in
    Megatron-core's sense (a stage without a count of its own is a middle stage)."""
    return (num_layers - (first or 0) - (last or 0),
            pipeline - (first is not None) - (last is not None))


def pipeline_chunks(num_layers: int, pipeline: int, virtual: int = 1, first: int | None = None,
                    last: int | None = None) -> tuple[tuple[range, ...], ...] | None:
    """Which layers each pipeline stage builds: ``[stage][chunk]`` is the range of (global, 0-based) layer indices of
    model chunk ``chunk`` of ``stage``, as Megatron-core assigns them (``get_num_layers_to_build`` and
    ``get_transformer_layer_offset``, 0.16). Even stages: chunk j of stage s holds the equal chunk ``s + p j``.
    Uneven stages: the first (last) stage holds ``first`` (``last``) layers, split into ``virtual`` equal chunks, and
    the middle stages an equal share of the rest; chunk j of every stage comes from round j of ``num_layers /
    virtual`` layers. None when the split is not one Megatron-core builds: a count not divisible by ``virtual``, or
    not divisible over the middle stages, or a stage left with no layers (Megatron-core 0.16 itself accepts a
    negative middle count and a count on PP1; the recipe's rules refuse both), or interleaving with both ends set
    and no middle stage (PP2: Megatron-core 0.16's layer offset then divides by zero)."""
    v = virtual
    if pipeline < 1 or v < 1 or num_layers < 1:
        return None
    if first is None and last is None:
        if num_layers % (pipeline * v):
            return None
        per = (num_layers // (pipeline * v),) * pipeline
    else:
        if pipeline < 2 or any(n is not None and (n < 1 or n % v) for n in (first, last)):
            return None
        middle, stages = middle_stage_layers(num_layers, pipeline, first, last)
        if middle < 0 or (stages == 0) != (middle == 0) or (stages and (middle % stages or middle // stages % v)):
            return None
        if stages == 0 and v > 1:  # Megatron-core 0.16's interleaved layer offset divides by the middle stages
            return None
        share = middle // stages if stages else 0
        counts = [share] * pipeline
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        per = tuple(n // v for n in counts)
    round_size = sum(per)
    starts = [sum(per[:s]) for s in range(pipeline)]
    return tuple(tuple(range(j * round_size + starts[s], j * round_size + starts[s] + per[s]) for j in range(v))
                 for s in range(pipeline))


def uneven_splits(num_layers: int, pipeline: int, virtual: int = 1) -> list[tuple[int | None, int | None]]:
    """The uneven splits worth trying when ``pipeline`` x ``virtual`` does not divide ``num_layers``: (first, last)
    stage counts with the middle stages' share the smallest that fits (a multiple of ``virtual``) and the first and
    last stages no longer than it: the rest split over both ends (both orders), or left on one end. Empty when no such
    split exists (PP1, or too few layers)."""
    v = virtual
    if pipeline < 2 or num_layers < pipeline:
        return []
    share = -(-num_layers // pipeline)
    share += -share % v
    out: list[tuple[int | None, int | None]] = []
    rest = num_layers - (pipeline - 2) * share  # left for the two end stages
    if pipeline == 2:
        rest = num_layers
    half = rest // 2 - rest // 2 % v
    for first in (half, rest - half):
        last = rest - first
        if v <= first <= share and v <= last <= share and first % v == 0 and last % v == 0:
            out.append((first, last))
    one = num_layers - (pipeline - 1) * share  # left for one end stage
    if pipeline > 2 and v <= one < share and one % v == 0:
        out += [(one, None), (None, one)]
    return [s for s in dict.fromkeys(out) if pipeline_chunks(num_layers, pipeline, v, *s) is not None]
