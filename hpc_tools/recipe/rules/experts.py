"""Rules of experts, context parallelism, FP8 and multi-latent attention."""

from __future__ import annotations

import re
from typing import Iterator

from hpc_tools import backends
from hpc_tools.errors import Violation
from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe import te_support
from hpc_tools.recipe.rules.registry import _fix, _try, divisors, rule
from hpc_tools.recipe.schema import Recipe

# --- experts, context parallelism, FP8, multi-latent attention --------------------------------------------------------

@rule
def experts_divisible_by_expert_size(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """model.num_experts is divisible by parallel.expert_size (each EP rank holds num_experts / EP experts)."""
    e = r.model.num_experts
    if e is not None and e % lay.expert_size:
        yield Violation("parallel.expert_size", lay.expert_size, f"must divide model.num_experts={e}",
                        _try(divisors(e)))


@rule
def expert_layout_fits(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """expert_size x expert_tensor_size divides tensor x context x data; expert biases need expert_tensor_size 1."""
    if r.model.num_experts is None:
        return
    dense = lay.world_size // lay.pipeline_size if lay.world_size % lay.pipeline_size == 0 else 0
    ep, etp = lay.expert_size, lay.expert_tensor_size
    if dense and dense % (ep * etp):
        fits = [x for x in divisors(dense) if dense % (x * etp) == 0]
        where = f"must divide tensor x context x data = world / pipeline = {dense} (world = PP x ETP x EP x EDP)"
        if fits:
            yield Violation("parallel.expert_size", ep, f"x parallel.expert_tensor_size={etp} {where}",
                            _fix(f"with expert_tensor_size {etp} {_try(fits)} for expert_size", fits))
        else:  # no expert_size fits this expert_tensor_size: the value to change is that one
            yield Violation("parallel.expert_tensor_size", etp, f"x parallel.expert_size={ep} {where}",
                            _fix(f"no expert_size fits it: {_try(divisors(dense))} for expert_tensor_size",
                                 divisors(dense)))
    if r.model.add_bias_linear and r.model.moe_shared_expert_intermediate_size is not None:
        yield Violation("model.moe_shared_expert_intermediate_size", r.model.moe_shared_expert_intermediate_size,
                        "cannot be combined with model.add_bias_linear (Megatron-core's shared experts have no "
                        "biases)", "set add_bias_linear: false or no shared expert")
    if r.model.add_bias_linear and etp > 1:
        yield Violation("parallel.expert_tensor_size", etp, "must be 1 when the experts have biases "
                        "(model.add_bias_linear; Megatron-core has no expert bias under ETP > 1)",
                        _fix("set expert_tensor_size: 1 (or null), or add_bias_linear: false", [1]))


@rule
def expert_parallel_needs_experts(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """expert_size > 1 and expert_tensor_size need model.num_experts; the moe_* options need experts too."""
    m, p = r.model, r.parallel
    if m.num_experts is not None:
        return
    if p.expert_size > 1:
        yield Violation("parallel.expert_size", p.expert_size, "needs a model with experts (model.num_experts is null)",
                        "set model.num_experts (a multiple of it) or expert_size: 1")
    elif p.expert_tensor_size is not None:
        yield Violation("parallel.expert_tensor_size", p.expert_tensor_size,
                        "needs a model with experts (model.num_experts is null)",
                        "set model.num_experts or expert_tensor_size: null")
    elif m.moe_shared_expert_intermediate_size is not None or m.moe_ffn_hidden_size is not None:
        field = ("moe_shared_expert_intermediate_size" if m.moe_shared_expert_intermediate_size is not None
                 else "moe_ffn_hidden_size")
        yield Violation(f"model.{field}", getattr(m, field), "needs model.num_experts (a dense model has no experts)",
                        f"set model.num_experts or {field}: null")


@rule
def moe_routing(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """moe_router_topk <= num_experts, a moe_layer_freq list has num_layers entries, expert bias needs sigmoid."""
    m = r.model
    if m.num_experts is None:
        return
    if m.moe_router_topk > m.num_experts:
        yield Violation("model.moe_router_topk", m.moe_router_topk, f"exceeds model.num_experts={m.num_experts}",
                        f"use 1..{m.num_experts}")
    freq = m.moe_layer_freq
    if isinstance(freq, list) and len(freq) != m.num_layers:
        yield Violation("model.moe_layer_freq", freq,
                        f"has {len(freq)} entries, not one 0/1 per layer (model.num_layers={m.num_layers})",
                        f"give {m.num_layers} entries, or an int N (every N-th layer is MoE)")
    elif isinstance(freq, int) and freq > m.num_layers:
        yield Violation("model.moe_layer_freq", freq, f"exceeds model.num_layers={m.num_layers} (only layer 0 would "
                        "be MoE)", f"use 1..{m.num_layers}")
    if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":
        yield Violation("model.moe_router_enable_expert_bias", True,
                        f"needs model.moe_router_score_function=sigmoid, not {m.moe_router_score_function}",
                        "set moe_router_score_function: sigmoid or the bias false")


@rule
def moe_sequence_parallel(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """A model with experts and tensor_size > 1 needs sequence_parallel (as Megatron-LM requires)."""
    if r.model.num_experts is not None and lay.tensor_size > 1 and not r.parallel.sequence_parallel:
        yield Violation("parallel.sequence_parallel", False,
                        f"must be true for a model with experts and parallel.tensor_size={lay.tensor_size}",
                        "set sequence_parallel: true, or tensor_size: 1")


@rule
def moe_comm_overlap(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """overlap_moe_expert_parallel_comm and moe_shared_expert_overlap keep Megatron-core 0.16's preconditions: experts
    split over EP > 1 (a shared expert), the alltoall dispatcher, bf16/fp16, GPUs (CUDA streams), no full
    recomputation, VPP with PP > 1, not both; overlap_moe_expert_parallel_comm is then refused until the engine
    builds the combined 1F1B schedule plan under a GPU test."""
    m, p, t = r.model, r.parallel, r.training
    if not backends.of(r).moe_comm_overlap:  # backend_features refuses the fields there
        return
    if p.overlap_moe_expert_parallel_comm:
        field, needs = "parallel.overlap_moe_expert_parallel_comm", None
        if m.num_experts is None:
            needs = ("needs a model with experts (model.num_experts is null)", "set it false")
        elif lay.expert_size == 1:
            needs = ("needs parallel.expert_size > 1 (it hides the expert-parallel all-to-all)",
                     "set expert_size > 1 or this false")
        elif m.moe_token_dispatcher_type != "alltoall":
            needs = (f"needs model.moe_token_dispatcher_type=alltoall, not {m.moe_token_dispatcher_type}",
                     "set moe_token_dispatcher_type: alltoall or this false")
        elif t.precision == "fp32":
            needs = ("needs training.precision bf16 or fp16, not fp32", "use precision: bf16 or set this false")
        elif not r.cluster.uses_gpus:
            needs = ("needs GPUs (CUDA streams); CPU ranks (cluster.gpu_type=cpu) have none", "set it false")
        elif t.recompute_granularity == "full":
            needs = ("cannot be combined with training.recompute_granularity=full (Megatron-core refuses it)",
                     "use selective recomputation (recompute_modules) or set this false")
        elif lay.pipeline_size > 1 and not lay.interleaved:
            needs = (f"needs parallel.virtual_pipeline_size > 1 with pipeline_size={lay.pipeline_size} (Megatron-core "
                     "overlaps in the interleaved schedule only)", "set virtual_pipeline_size (e.g. 2) or this false")
        elif p.moe_shared_expert_overlap:
            needs = ("cannot be combined with parallel.moe_shared_expert_overlap (Megatron-core refuses both)",
                     "set moe_shared_expert_overlap: false (this overlap hides the shared expert too)")
        else:  # Megatron-core would accept it; hpc_tools' side is untried (issue 46 item 1)
            needs = ("is not supported yet: Megatron-core's combined 1F1B schedule asks the forward step for a "
                     "schedule plan (return_schedule_plan=True, CUDA streams only), which hpc_tools' Megatron "
                     "engine does not build and no GPU test covers",
                     "set it false (moe_shared_expert_overlap hides the all-to-all behind a shared expert)")
        if needs:
            yield Violation(field, True, *needs)
    if p.moe_shared_expert_overlap and not p.overlap_moe_expert_parallel_comm:
        field, needs = "parallel.moe_shared_expert_overlap", None
        if m.moe_shared_expert_intermediate_size is None:
            needs = ("needs a shared expert (model.moe_shared_expert_intermediate_size is null): Megatron-core "
                     "would ignore it", "set it false")
        elif m.moe_token_dispatcher_type != "alltoall":
            needs = (f"needs model.moe_token_dispatcher_type=alltoall, not {m.moe_token_dispatcher_type}",
                     "set moe_token_dispatcher_type: alltoall or this false")
        elif not r.cluster.uses_gpus:
            needs = ("needs GPUs (a CUDA stream for the shared expert); CPU ranks (cluster.gpu_type=cpu) have none",
                     "set it false")
        if needs:
            yield Violation(field, True, *needs)


@rule
def context_parallel_sequence(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """model.seq_length is divisible by 2 x context_size (x tensor_size with sequence parallelism)."""
    cp = lay.context_size
    if cp == 1:
        return
    step = 2 * cp * (lay.tensor_size if r.parallel.sequence_parallel else 1)
    if r.model.seq_length % step:
        what = "2 x parallel.context_size" + (" x tensor_size (sequence parallel)" if step != 2 * cp else "")
        yield Violation("model.seq_length", r.model.seq_length, f"must be divisible by {what} = {step}",
                        f"use a multiple of {step}, e.g. {-(-r.model.seq_length // step) * step}")


@rule
def context_parallel_needs_te(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """context_size > 1 needs Transformer Engine attention: GPU ranks, transformer_impl not local."""
    if lay.context_size == 1 or not backends.of(r).context_parallel:
        return
    if not r.cluster.uses_gpus:
        yield Violation("parallel.context_size", lay.context_size, "needs Transformer Engine attention (the ring "
                        "exchange of keys and values), which CPU ranks (cluster.gpu_type=cpu) do not have",
                        "set context_size: 1 on CPU ranks")
    elif r.backend.megatron.transformer_impl == "local":
        yield Violation("parallel.context_size", lay.context_size, "needs Transformer Engine attention, not "
                        "backend.megatron.transformer_impl=local", "set transformer_impl: auto or transformer_engine")
    else:  # TE's unfused attention has no context parallelism, and its flash and fused ones take bf16/fp16 only
        if r.training.precision == "fp32":
            yield Violation("parallel.context_size", lay.context_size, "needs Transformer Engine's flash or fused "
                            "attention, which take bf16/fp16 only: with training.precision=fp32 TE has no attention "
                            "backend for context parallelism", "use training.precision: bf16, or context_size: 1")
        if not r.backend.megatron.use_flash_attention:
            yield Violation("parallel.context_size", lay.context_size, "needs Transformer Engine's flash or fused "
                            "attention: backend.megatron.use_flash_attention=false leaves TE's unfused attention, "
                            "which has no context parallelism", "set use_flash_attention: true, or context_size: 1")


@rule
def multi_latent_attention_needs_te(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """multi_latent_attention on GPUs needs Transformer Engine layers (transformer_impl not local): Megatron-core's
    MLA passes k_channels/v_channels to the local DotProductAttention, which takes neither."""
    if not r.model.multi_latent_attention or not backends.of(r).multi_latent_attention or not r.cluster.uses_gpus:
        return
    if r.backend.megatron.transformer_impl == "local":
        yield Violation("model.multi_latent_attention", True, "needs Transformer Engine layers on GPUs (Megatron-"
                        "core's local attention takes no k_channels/v_channels), not "
                        "backend.megatron.transformer_impl=local",
                        "set transformer_impl: auto or transformer_engine, or multi_latent_attention: false")


def megatron_attentions(r: Recipe) -> frozenset[str]:
    """The attention backends (megatron-core's ``AttnBackend`` names) a rank of this Megatron recipe may build:
    ``hpc_tools/train/megatron/layers.py``'s ``layer_plan`` over a node with and one without Transformer Engine."""
    mg = r.backend.megatron
    if not r.cluster.uses_gpus or mg.transformer_impl == "local":
        return frozenset({"local"})
    te = "auto" if mg.use_flash_attention else "unfused"
    return frozenset({te} if mg.transformer_impl == "transformer_engine" else {te, "local"})  # (no TE: local layers)


@rule
def attention_environment(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """cluster.setup.env sets no NVTE_FLASH_ATTN / NVTE_FUSED_ATTN / NVTE_UNFUSED_ATTN other than what Megatron-core
    sets from the recipe's attention (it asserts at model build otherwise; te_support.NVTE_BY_ATTENTION)."""
    if backends.of(r).layers != "megatron":
        return
    clash = te_support.nvte_conflict(megatron_attentions(r), r.cluster.setup.env)
    if clash:
        name, value, expected = clash
        yield Violation(f"cluster.setup.env.{name}", value, "makes Megatron-core's attention check assert at model "
                        f"build: it sets {name}={expected} itself from the recipe's attention "
                        "(backend.megatron.use_flash_attention, transformer_impl)",
                        f"remove {name} from cluster.setup.env and the site file; use_flash_attention: false "
                        "chooses Transformer Engine's unfused attention")


# GPUs without FP8 tensor cores (Ampere and older) and GPUs with MXFP8 (Blackwell), matched on the lower-cased
# gpu_type as profiling/peaks.py matches device names (`A100`, `a100-sxm4-80gb`, `V100-PCIe`); the peaks table lists
# an fp8 peak exactly for the GPUs not refused here (a unit test holds the two together).
_NO_FP8 = re.compile(r"(^|[^a-z0-9])(a100|a10g?|a30|a40|a6000|v100|t4|p100)($|[^0-9a-z])")
_MXFP8 = re.compile(r"(^|[^a-z0-9])g?b[23]00($|[^0-9])")
FP8_MULTIPLE = 16


def gpu_has_fp8(gpu_type: str) -> bool:
    """Whether ``gpu_type`` has FP8 tensor cores (Hopper, Ada, Blackwell, MI300): all but Ampere and older."""
    return not _NO_FP8.search(gpu_type.lower().replace("_", "-").replace(" ", "-"))


def gpu_has_mxfp8(gpu_type: str) -> bool:
    """Whether ``gpu_type`` has MXFP8 (block-scaled FP8) tensor cores: Blackwell."""
    return bool(_MXFP8.search(gpu_type.lower().replace("_", "-").replace(" ", "-")))


@rule
def fp8_supported(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """training.fp8 needs FP8 GPUs (mxfp8: Blackwell; blockwise: CUDA >= 12.9), bf16/fp16, GEMM sizes x 16."""
    # blockwise's compute capability >= 9.0 and torch built for CUDA >= 12.9 (Transformer Engine 2.11) are the node's:
    # the rank refuses them at start and doctor on the node (te_support.blockwise_refusal)
    t, c, m = r.training, r.cluster, r.model
    if t.fp8 is None or not backends.of(r).fp8:
        return
    if not c.uses_gpus:
        yield Violation("training.fp8", t.fp8, "needs GPUs with FP8 tensor cores; CPU ranks have none",
                        "set training.fp8: null for cluster.gpu_type=cpu")
        return
    if not gpu_has_fp8(c.gpu_type):
        yield Violation("training.fp8", t.fp8, f"needs FP8 tensor cores, which cluster.gpu_type={c.gpu_type} lacks "
                        "(Ampere and older)", "use H100/H200/B200-class GPUs or set training.fp8: null")
        return
    if t.fp8_recipe == "mxfp8" and not gpu_has_mxfp8(c.gpu_type):
        yield Violation("training.fp8_recipe", "mxfp8", f"needs Blackwell GPUs, not cluster.gpu_type={c.gpu_type}",
                        "use fp8_recipe: delayed or tensorwise (blockwise: with a torch built for CUDA >= 12.9)")
    if t.precision == "fp32":
        yield Violation("training.precision", "fp32", "cannot be combined with training.fp8 (FP8 GEMMs run inside "
                        "bf16/fp16 training)", "use precision: bf16")
    dims = {"model.hidden_size": m.hidden_size, "model.ffn_hidden_size": m.ffn_hidden_size // lay.tensor_size}
    if m.num_experts is not None:
        dims["model.moe_ffn_hidden_size"] = (m.moe_ffn_hidden_size or m.ffn_hidden_size) // lay.expert_tensor_size
    bad = next(((f, v) for f, v in dims.items() if v % FP8_MULTIPLE), None)
    if bad:
        field, per_gpu = bad
        shard = "" if field == "model.hidden_size" else " per GPU"
        yield Violation(field, getattr(m, field.split(".")[1]), f"gives a GEMM dimension{shard} of {per_gpu}, not a "
                        f"multiple of {FP8_MULTIPLE} as FP8 GEMMs need", f"use a multiple of {FP8_MULTIPLE}"
                        f"{' x the tensor-parallel size' if shard else ''}, or training.fp8: null")


@rule
def multi_latent_attention_shape(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """multi_latent_attention needs RoPE and no grouped-query attention; q_lora_rank only with it."""
    m = r.model
    if not m.multi_latent_attention:
        if m.q_lora_rank is not None:
            yield Violation("model.q_lora_rank", m.q_lora_rank, "is read only with model.multi_latent_attention=true",
                            "set multi_latent_attention: true or q_lora_rank: null")
        return
    if m.position_embedding != "rope":
        yield Violation("model.position_embedding", m.position_embedding, "must be rope with "
                        "model.multi_latent_attention (its qk_pos_emb_head_dim part carries RoPE)",
                        "set position_embedding: rope")
    if m.num_query_groups != m.num_attention_heads:
        yield Violation("model.num_query_groups", m.num_query_groups, "has no meaning with "
                        "model.multi_latent_attention (every head has its own keys and values from the latent)",
                        "set num_query_groups: null")
