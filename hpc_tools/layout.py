"""The parallel layout: the one owner of world size, TP x PP x DP, microbatches and every number derived from them.

sbatch (--nodes, --ntasks-per-node), the local launcher, Megatron's parallel sizes and DeepSpeed's batch triple all
read this class; nothing else multiplies parallel degrees.
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

    @classmethod
    def from_recipe(cls, recipe: Any) -> "ParallelLayout":
        """Resolve -1/null degrees against the cluster; the result may still break rules (see recipe.rules).

        ``recipe`` is a ``hpc_tools.recipe.schema.Recipe`` (its parallel, training and cluster sections); it is not
        imported here, since the recipe's rules build on this class (the layout sits below the recipe)."""
        p, t, c = recipe.parallel, recipe.training, recipe.cluster
        world = c.nodes * c.gpus_per_node
        data = p.data_size if p.data_size != -1 else max(world // (p.tensor_size * p.pipeline_size), 1)
        global_batch = t.global_batch_size if t.global_batch_size is not None else t.micro_batch_size * data
        return cls(nodes=c.nodes, ranks_per_node=c.gpus_per_node, tensor_size=p.tensor_size,
                   pipeline_size=p.pipeline_size, data_size=data, virtual_pipeline_size=p.virtual_pipeline_size,
                   sequence_parallel=p.sequence_parallel, micro_batch_size=t.micro_batch_size,
                   global_batch_size=global_batch)

    @property
    def world_size(self) -> int:
        """Ranks in the job: nodes x ranks per node (one rank per GPU)."""
        return self.nodes * self.ranks_per_node

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_size * self.pipeline_size

    @property
    def layout_size(self) -> int:
        """Ranks the degrees account for: t x p x d (must equal world_size)."""
        return self.tensor_size * self.pipeline_size * self.data_size

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

    def deepspeed_batch(self) -> dict[str, int]:
        """DeepSpeed's batch triple; train_batch_size = micro x accumulation x data-parallel size."""
        return {
            "train_batch_size": self.global_batch_size,
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": self.num_microbatches,
        }

    def megatron_sizes(self) -> dict[str, int | None]:
        """Arguments for megatron.core.parallel_state.initialize_model_parallel."""
        return {
            "tensor_model_parallel_size": self.tensor_size,
            "pipeline_model_parallel_size": self.pipeline_size,
            "virtual_pipeline_model_parallel_size": self.virtual_pipeline_size if self.interleaved else None,
        }

    def describe(self) -> str:
        vpp = f"xVPP{self.virtual_pipeline_size}" if self.interleaved else ""
        sp = "+SP" if self.sequence_parallel else ""
        return (f"TP{self.tensor_size}xPP{self.pipeline_size}{vpp}xDP{self.data_size}{sp} on {self.nodes}x"
                f"{self.ranks_per_node} ranks, micro {self.micro_batch_size}, global {self.global_batch_size}, "
                f"{self.num_microbatches} microbatches")
