"""``training:`` — batch sizes, steps, optimiser, precision, recomputation."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hpc_tools.recipe.base import Section

# training.recompute_modules: Megatron-core 0.16's TransformerConfig.recompute_modules choices, in its order
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
RecomputeModule = Literal["core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"]
DEFAULT_RECOMPUTE_MODULES = ("core_attn",)  # Megatron-core's default when recompute_modules is None


def recompute_modules(granularity: str, modules: "list[str] | tuple[str, ...] | None") -> tuple[str, ...]:
    """The modules selective recomputation recomputes (``training.recompute_modules``, null = Megatron-core's
    default [core_attn]); () unless the granularity is selective."""
    if granularity != "selective":
        return ()
    return tuple(DEFAULT_RECOMPUTE_MODULES if modules is None else modules)


class TrainingConfig(Section):
    micro_batch_size: int = Field(default=1, gt=0, le=1 << 24)
    """Sequences per GPU per microbatch (b)."""
    global_batch_size: int | None = Field(default=None, gt=0, le=1 << 40)
    """Sequences per optimiser step (B = b x d x microbatches); null = micro_batch_size x data-parallel size."""
    train_iters: int = Field(default=100, gt=0)
    """Optimiser steps to train."""
    lr: float = Field(default=3e-4, gt=0.0)
    """Peak learning rate."""
    min_lr: float = Field(default=0.0, ge=0.0)
    """Learning rate at the end of the decay."""
    lr_warmup_iters: int = Field(default=0, ge=0)
    """Linear warm-up steps from 0 to lr."""
    lr_decay_iters: int | None = Field(default=None, gt=0)
    """Steps over which lr decays to min_lr; null = train_iters."""
    lr_decay_style: Literal["cosine", "linear", "constant"] = "cosine"
    """Shape of the decay after warm-up."""
    weight_decay: float = Field(default=0.1, ge=0.0)
    """AdamW weight decay."""
    adam_beta1: float = Field(default=0.9, gt=0.0, lt=1.0)
    """AdamW beta1."""
    adam_beta2: float = Field(default=0.95, gt=0.0, lt=1.0)
    """AdamW beta2."""
    adam_eps: float = Field(default=1e-8, gt=0.0)
    """AdamW epsilon."""
    clip_grad: float = Field(default=1.0, ge=0.0)
    """Clip the global gradient norm to this value; 0 = no clipping."""
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    """Parameter/compute precision; bf16/fp16 keep fp32 master weights (except DeepSpeed ZeRO-0 with bf16, which
    updates the bf16 weights directly)."""
    fp8: Literal["e4m3", "hybrid"] | None = None
    """FP8 GEMMs through Transformer Engine on GPUs that have them (Hopper, Ada, Blackwell): `e4m3` everywhere or
    `hybrid` (e4m3 forward, e5m2 gradients); weights, master copies and the other layers stay in `precision`
    (bf16/fp16). null = no FP8."""
    fp8_recipe: Literal["delayed", "tensorwise", "mxfp8", "blockwise"] = "delayed"
    """FP8 scaling (with fp8 set): `delayed` (per-tensor scale from an amax history), `tensorwise` (current per-tensor
    scaling), `mxfp8` (32-element blocks with E8M0 scales; Blackwell only) or `blockwise` (1x128 / 128x128 blocks,
    DeepSeek-V3's)."""
    seed: int = 1234
    """Seed for initialisation, data order and dropout."""
    recompute_granularity: Literal["none", "selective", "full"] = "none"
    """Activation recomputation: none, selective (the parts in recompute_modules; by default the attention core) or
    full (whole layers)."""
    recompute_modules: list[RecomputeModule] | None = Field(default=None, max_length=len(RECOMPUTE_MODULES))
    """With selective recomputation: the parts of each layer recomputed in the backward instead of stored
    (Megatron-core's names): `core_attn` (attention core), `moe_act` (routed experts' activation; grouped GEMM),
    `layernorm` (the norms' outputs), `mla_up_proj` (multi-latent attention's up-projections and RoPE), `mlp` (dense
    MLPs), `moe` (whole MoE layers, all-to-all included), `shared_experts`; null = [core_attn]."""
    recompute_method: Literal["uniform", "block"] = "uniform"
    """With full recomputation: `uniform` recomputes groups of recompute_num_layers, `block` the first
    recompute_num_layers per stage."""
    recompute_num_layers: int = Field(default=1, gt=0, le=100_000)
    """With full recomputation: layers per group (uniform) or layers recomputed per stage (block)."""
    max_nonfinite_steps: int = Field(default=3, ge=0, le=1_000_000)
    """Steps in a row whose loss or gradient norm is not finite (inf/nan) that are skipped (no update, counted in the
    step record's `nonfinite`); one more stops the job with an error naming the step. 0 = stop at the first. No
    checkpoint is saved while the newest step was non-finite."""
    log_interval: int = Field(default=1, gt=0)
    """Print a progress line on rank 0 every N steps (step N/total, loss, validation loss, tok/s, TFLOP/s, MFU,
    memory, elapsed, ETA)."""
    eval_interval: int | None = Field(default=None, gt=0, le=1 << 40)
    """Compute the validation loss every N steps and at the last step (forward only, over eval_iters validation
    batches; recorded as `val_loss` and `eval_time_s`, not counted as step time); null = no evaluation."""
    eval_iters: int = Field(default=10, ge=1, le=1_000_000)
    """Global batches of validation data per evaluation (each as large as a training step's global batch)."""
