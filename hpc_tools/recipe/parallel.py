"""``parallel:`` — the requested degrees. `hpc_tools.layout.ParallelLayout` resolves and owns the arithmetic."""

from __future__ import annotations

from pydantic import Field

from hpc_tools.recipe.base import Section


class ParallelConfig(Section):
    tensor_size: int = Field(default=1, gt=0, le=1 << 20)
    """Tensor-parallel degree (t): splits each layer's matrices across GPUs of one node."""
    pipeline_size: int = Field(default=1, gt=0, le=1 << 20)
    """Pipeline-parallel degree (p): splits the layers into stages."""
    data_size: int = Field(default=-1, ge=-1, le=1 << 24)
    """Data-parallel degree (d); -1 = infer as world size / (tensor_size x pipeline_size)."""
    virtual_pipeline_size: int | None = Field(default=None, gt=0, le=1 << 10)
    """Model chunks per pipeline stage for the interleaved 1F1B schedule (v); null = not interleaved."""
    num_layers_in_first_pipeline_stage: int | None = Field(default=None, gt=0, le=100_000)
    """Transformer layers on the first pipeline stage (Megatron-core's field of the same name); null = an equal share.
    Uneven stages: the first stage also holds the embedding, so a shorter one evens out memory and time. The layers
    the first and last stages leave are split equally over the middle stages (each a multiple of
    virtual_pipeline_size when interleaved, as is this count). Needs pipeline_size > 1 and backend.kind megatron."""
    num_layers_in_last_pipeline_stage: int | None = Field(default=None, gt=0, le=100_000)
    """Transformer layers on the last pipeline stage (Megatron-core's field of the same name); null = an equal share.
    The last stage also holds the final norm, output layer and loss; rules as for the first stage."""
    sequence_parallel: bool = False
    """Shard norms and dropout along the sequence across the tensor-parallel group (needs tensor_size > 1)."""
    context_size: int = Field(default=1, gt=0, le=1 << 20)
    """Context-parallel degree (CP): splits each sequence across GPUs, which exchange keys and values in a ring
    (Transformer Engine attention, load-balanced: 2 x CP chunks). Dense parts: world = PP x TP x CP x DP."""
    expert_size: int = Field(default=1, gt=0, le=1 << 20)
    """Expert-parallel degree (EP): splits the routed experts across GPUs (model.num_experts divisible by it); tokens
    reach them by all-to-all. Expert parts: world = PP x ETP x EP x EDP."""
    expert_tensor_size: int | None = Field(default=None, gt=0, le=1 << 20)
    """Tensor-parallel degree inside each expert (ETP); null = 1 when the model has experts (each expert whole on
    its GPU, Megatron's recommendation), else tensor_size."""
    overlap_moe_expert_parallel_comm: bool = False
    """Hide the expert all-to-all behind compute (Megatron-core's combined 1F1B): the dispatch and combine of one
    microbatch's forward run while another microbatch's backward computes, and the other way round. Needs expert_size
    > 1, the alltoall dispatcher, bf16/fp16, GPUs, no full recomputation, and virtual_pipeline_size when
    pipeline_size > 1 (Megatron-core's own preconditions). Refused for now where those hold: the schedule asks the
    forward step for a schedule plan, which hpc_tools' Megatron engine does not build (no GPU test covers it)."""
    moe_shared_expert_overlap: bool = False
    """Run the shared expert (model.moe_shared_expert_intermediate_size) on its own CUDA stream while the token
    dispatcher's all-to-all runs, hiding the all-to-all up to the shared expert's compute. Needs a shared expert, the
    alltoall dispatcher and GPUs; excludes overlap_moe_expert_parallel_comm (Megatron-core refuses both)."""
