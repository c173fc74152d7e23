"""The recipe's `model:`, `parallel:`, `training:` and `backend.megatron:` sections as Megatron-core configs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpc_tools.train.megatron.layers import layer_plan, module_available, te_version, version_at_least

if TYPE_CHECKING:
    from hpc_tools.layout import ParallelLayout
    from hpc_tools.recipe.schema import Recipe

PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def params_dtype(recipe: "Recipe"):
    import torch

    return getattr(torch, PRECISION_DTYPES[recipe.training.precision])


def fusions(recipe: "Recipe", device_type: str, plan) -> dict[str, bool]:
    """The fused kernels to ask megatron-core for: only those this device and these libraries have, so that the
    config neither asserts nor falls back silently (megatron-core 0.16.1's checks, read from its source):

    - gradient_accumulation_fusion: needs apex's ``fused_weight_gradient_mlp_cuda`` even with TE layers (the output
      layer is always mcore's ColumnParallelLinear, which raises without it);
    - bias_activation_fusion: torch-jit kernels; TransformerConfig refuses it for gelu without a bias;
    - masked_softmax_fusion: Megatron's ``scaled_upper_triang_masked_softmax_cuda`` (local attention only; TE's
      attention ignores it);
    - bias_dropout_fusion: torch-jit, any CUDA device;
    - apply_rope_fusion: TE's fused RoPE (TransformerConfig raises without TE; for multi-latent attention it fuses
      only YaRN RoPE, and raises for plain RoPE);
    - persist_layer_norm: only apex's FusedLayerNorm reads it, and no spec here uses that (mcore's torch norm asserts
      it off): always off.
    All off on CPU.
    """
    off = dict(gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
               bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False)
    if device_type != "cuda":
        return off
    m = recipe.model
    return {**off,
            "gradient_accumulation_fusion": module_available(APEX_WGRAD),
            "bias_activation_fusion": m.activation == "swiglu" or bool(m.add_bias_linear),
            "masked_softmax_fusion": not plan.transformer_engine and not plan.sdpa
            and module_available("scaled_upper_triang_masked_softmax_cuda"),
            "bias_dropout_fusion": True,
            "apply_rope_fusion": plan.transformer_engine and m.position_embedding == "rope"
            and not m.multi_latent_attention}


APEX_WGRAD = "fused_weight_gradient_mlp_cuda"
NO_APEX_NOTE = ("gradient_accumulation_fusion off: apex's fused_weight_gradient_mlp_cuda is not installed, and "
                "Transformer Engine's weight-gradient fusion is tied to the same switch, so each micro-batch "
                "writes its 16-bit weight gradients and adds them to the fp32 main gradients in a separate pass "
                "(install apex with its CUDA extensions to fuse them)")


def fusion_notes(recipe: "Recipe", device_type: str) -> list[str]:
    """What a CUDA run pays for a fusion it cannot have, for the start line (``doctor`` says the same)."""
    if device_type != "cuda" or module_available(APEX_WGRAD):
        return []
    return [NO_APEX_NOTE]


def p2p_options(layout: "ParallelLayout", device_type: str) -> dict[str, bool]:
    """Pipeline p2p: batched isend/irecv, or overlapped with compute (they exclude each other in megatron-core).

    On CUDA with the interleaved schedule, ``overlap_p2p_comm`` (Megatron-LM's default for VPP) hides the p2p behind
    compute; otherwise batched. On gloo, interleaved 1F1B with PP=2 and batched p2p gives silently wrong losses;
    plain p2p is exact (docs/megatron-on-cpu.md; test_megatron_layouts' PP2xVPP2 case checks it).
    """
    interleaved = layout.interleaved
    if device_type == "cuda":
        return {"batch_p2p_comm": not interleaved, "overlap_p2p_comm": interleaved}
    return {"batch_p2p_comm": not (interleaved and layout.pipeline_size == 2), "overlap_p2p_comm": False}


def recompute_modules(recipe: "Recipe", plan) -> list[str]:
    """The modules selective recomputation recomputes (``training.recompute_modules``, null = [core_attn]), less
    ``core_attn`` where TE's flash/fused attention runs (``plan.flash_style``): it stores no s^2 tensor, so its
    recomputation would only repeat the kernel (Megatron-core warns the same). [] unless selective."""
    from hpc_tools.errors import UserError
    from hpc_tools.recipe.training import recompute_modules as chosen

    t = recipe.training
    mods = [x for x in chosen(t.recompute_granularity, t.recompute_modules)
            if not (x == "core_attn" and plan.flash_style)]
    te_only = [x for x in mods if x in ("layernorm", "moe_act")]
    if te_only and not plan.transformer_engine:  # their checkpoint reads Transformer Engine's FP8 state
        raise UserError(f"training.recompute_modules={mods} names {te_only[0]}, which Megatron-core 0.16 recomputes "
                        f"through Transformer Engine, but this rank builds {plan.layers} layers (remove it)")
    return mods


def recompute_granularity(recipe: "Recipe", plan) -> str | None:
    """``training.recompute_granularity``, except that selective recompute is dropped when nothing is left to
    recompute (``recompute_modules``: by default the attention core, which flash/fused attention does not need).
    Kept under TE's unfused attention (fp32, or ``use_flash_attention: false``)."""
    g = recipe.training.recompute_granularity
    if g == "none" or (g == "selective" and not recompute_modules(recipe, plan)):
        return None
    return g


def transformer_config(recipe: "Recipe", layout: "ParallelLayout", device_type: str, plan=None):
    """TransformerConfig for this recipe and layout on ``device_type`` (``plan``: ``layers.layer_plan``).

    The parallel sizes go into the config as well as into parallel_state: without them sequence parallelism refuses
    to start and, with PP=2, the distributed and plain optimizers diverge (docs/megatron-on-cpu.md). Building it
    creates no CUDA tensor, so the CUDA config can be checked on CPU.
    """
    import torch.nn.functional as F
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    plan = plan or layer_plan(recipe, device_type)
    m, t = recipe.model, recipe.training
    dtype = params_dtype(recipe)
    recompute = recompute_granularity(recipe, plan)
    interleaved = layout.interleaved
    extra = {**moe_options(recipe, layout, plan), **context_options(layout, plan), **fp8_options(recipe, plan)}
    config_cls = TransformerConfig
    if m.multi_latent_attention:
        mla_layers_check(plan, device_type)
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        config_cls, extra = MLATransformerConfig, {**extra, **mla_options(recipe)}
    return config_cls(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups, ffn_hidden_size=m.ffn_hidden_size, kv_channels=m.head_dim,
        hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout, init_method_std=m.init_method_std,
        layernorm_epsilon=m.norm_epsilon, normalization=m.normalization, add_bias_linear=m.add_bias_linear,
        gated_linear_unit=m.activation == "swiglu", activation_func=F.silu if m.activation == "swiglu" else F.gelu,
        tensor_model_parallel_size=layout.tensor_size, pipeline_model_parallel_size=layout.pipeline_size,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline_size if interleaved else None,
        num_layers_in_first_pipeline_stage=layout.first_stage_layers,
        num_layers_in_last_pipeline_stage=layout.last_stage_layers,
        sequence_parallel=layout.sequence_parallel,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=t.precision == "bf16", fp16=t.precision == "fp16",
        attention_softmax_in_fp32=True, attention_backend=AttnBackend[plan.attention],
        recompute_granularity=recompute,
        recompute_method=t.recompute_method if recompute == "full" else None,
        recompute_num_layers=t.recompute_num_layers if recompute == "full" else None,
        recompute_modules=recompute_modules(recipe, plan) if recompute == "selective" else None,
        overlap_moe_expert_parallel_comm=recipe.parallel.overlap_moe_expert_parallel_comm,
        moe_shared_expert_overlap=recipe.parallel.moe_shared_expert_overlap,
        use_cpu_initialization=device_type != "cuda",
        **fusions(recipe, device_type, plan), **p2p_options(layout, device_type),
        deallocate_pipeline_outputs=True, **extra,
    )


def grouped_gemm(recipe: "Recipe", plan) -> bool:
    """Whether the experts run as one grouped GEMM (``TEGroupedMLP``) rather than one MLP each (``SequentialMLP``).

    ``model.moe_grouped_gemm: null`` = on with Transformer Engine layers (a GPU with TE), off otherwise. With the
    local layers megatron-core 0.16.1 offers only the legacy ``GroupedMLP``, which needs the CUDA ``grouped_gemm``
    package: asking for it there is refused in one line."""
    from hpc_tools.errors import UserError

    m = recipe.model
    if not m.num_experts:
        return False
    if m.moe_grouped_gemm is None:
        return plan.transformer_engine
    if m.moe_grouped_gemm and not plan.transformer_engine:
        raise UserError("model.moe_grouped_gemm=true needs Transformer Engine layers (TEGroupedMLP) but this rank "
                        f"builds {plan.layers} layers (set model.moe_grouped_gemm: null or false)")
    return bool(m.moe_grouped_gemm)


def moe_options(recipe: "Recipe", layout: "ParallelLayout", plan) -> dict:
    """The TransformerConfig fields of the mixture of experts (megatron-core's names; none without experts).

    Dropless (``moe_expert_capacity_factor: null``) unless a capacity factor is set; with one, tokens over capacity
    are dropped (no padding to capacity). The router runs in fp32 (``moe_router_dtype``) whatever the precision, as
    Megatron-LM recommends for stable routing; TE's fused permutation and routing with TE layers (``moe_fusions``). The
    expert sizes go into the config as well as into parallel_state."""
    m = recipe.model
    if not m.num_experts:
        return {}
    freq = m.moe_layer_freq
    return dict(
        num_moe_experts=m.num_experts, moe_router_topk=m.moe_router_topk,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size or m.ffn_hidden_size,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_layer_freq=list(freq) if isinstance(freq, (list, tuple)) else freq,
        moe_router_load_balancing_type=m.moe_router_load_balancing_type, moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        moe_router_score_function=m.moe_router_score_function,
        moe_router_enable_expert_bias=m.moe_router_enable_expert_bias,
        moe_token_dispatcher_type=m.moe_token_dispatcher_type,
        moe_expert_capacity_factor=m.moe_expert_capacity_factor, moe_grouped_gemm=grouped_gemm(recipe, plan),
        moe_router_dtype="fp32", **moe_fusions(plan),
        expert_model_parallel_size=layout.expert_size, expert_tensor_parallel_size=layout.expert_tensor_size,
    )


MOE_FUSION_TE = {"moe_permute_fusion": (2, 1), "moe_router_fusion": (2, 7)}
"""The least Transformer Engine of each MoE fusion, as megatron-core 0.16.1 binds its kernels
(``extensions/transformer_engine.py``: TE's ``permutation`` module, TE >= 2.1; ``router``'s fused top-k and aux-loss
scores, bound from TE 2.7.0.dev). Asked for without them, the config raises at build (permutation) or the router at the
first forward (``fused_topk_with_score_function is not available``)."""


def moe_fusions(plan, version: str | None = None) -> dict[str, bool]:
    """TE's fused token permutation (``moe_permute_fusion``: the dispatcher's permute/unpermute and chunk sort in one
    kernel each) and fused routing (``moe_router_fusion``: top-k with the score function, and the aux-loss scores),
    on with Transformer Engine layers where the installed TE has them (``version``: TE's, read from its package
    metadata when not given); off with the local layers (the kernels are TE's)."""
    if not plan.transformer_engine:
        return dict.fromkeys(MOE_FUSION_TE, False)
    version = te_version() if version is None else version
    return {name: version_at_least(version, least) for name, least in MOE_FUSION_TE.items()}


def mla_layers_check(plan, device_type: str) -> None:
    """Multi-latent attention on a GPU needs Transformer Engine layers: megatron-core 0.16.1's MLA passes
    ``k_channels``/``v_channels`` to the local ``DotProductAttention``, which takes neither (``TypeError`` at build),
    and without TE its ``HAVE_TE`` is still true (the TE extension module imports a MagicMock). On CPU the local
    layers run it through ``cpu_compat``'s shims. Refused in one line, as context parallelism and FP8 are."""
    if device_type == "cuda" and not plan.transformer_engine:
        from hpc_tools.errors import UserError

        raise UserError(f"model.multi_latent_attention=true needs Transformer Engine layers on a GPU, but this rank "
                        f"builds {plan.layers} layers (megatron-core's local attention takes no k_channels/"
                        "v_channels): install transformer_engine on the GPU nodes, or set multi_latent_attention: "
                        "false")


def mla_options(recipe: "Recipe") -> dict:
    """MLATransformerConfig's fields for multi-latent attention (DeepSeek-V2/V3). RoPE goes on the decoupled
    ``qk_pos_emb_head_dim`` part only; the rope type is plain ``rope`` (YaRN scaling is for context extension)."""
    m = recipe.model
    return dict(multi_latent_attention=True, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                qk_head_dim=m.qk_head_dim, qk_pos_emb_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim,
                rope_type="rope", rotary_base=m.rotary_base)


CP_COMM_TYPE = "p2p"
"""Context parallelism's K/V exchange in Transformer Engine's attention: ``p2p`` = the ring (each CP rank passes its
K/V chunk to the next while it attends to the one it holds; the load-balanced 2 x CP chunk split keeps causal work
even). Megatron-LM's default."""


def context_options(layout: "ParallelLayout", plan) -> dict:
    """TransformerConfig's context-parallel fields: the size, and with CP > 1 the K/V exchange of TE's attention
    (megatron-core's ``TEDotProductAttention`` passes ``cp_group``, ``cp_global_ranks`` and ``cp_comm_type`` to TE;
    its local ``DotProductAttention`` asserts ``context_parallel_size == 1`` and torch's SDPA has no K/V ring either,
    so local layers, ``sdpa`` or ``unfused``, are refused in one line)."""
    if layout.context_size == 1:
        return {"context_parallel_size": 1}
    if not plan.transformer_engine:
        from hpc_tools.errors import UserError

        raise UserError(f"parallel.context_size={layout.context_size} needs Transformer Engine's attention, but this "
                        f"rank builds {plan.layers} layers with {plan.path} attention, which has no context "
                        "parallelism (run on GPUs with transformer_engine, or set parallel.context_size: 1)")
    return {"context_parallel_size": layout.context_size, "cp_comm_type": CP_COMM_TYPE}


FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")


def fp8_options(recipe: "Recipe", plan) -> dict:
    """TransformerConfig's FP8 fields (Transformer Engine layers only): ``fp8`` is the format (``e4m3``: E4M3
    everywhere; ``hybrid``: E4M3 forward, E5M2 gradients) and ``fp8_recipe`` the scaling (``delayed``: amax history;
    ``tensorwise``: current per-tensor scaling; ``mxfp8``: 32-element blocks, Blackwell; ``blockwise``: 128-element
    blocks). megatron-core wraps each layer's forward in TE's ``fp8_autocast`` with the matching TE recipe
    (``megatron/core/fp8_utils.py`` ``get_fp8_context``)."""
    t = recipe.training
    if not t.fp8:
        return {}
    if not plan.transformer_engine:
        from hpc_tools.errors import UserError

        raise UserError(f"training.fp8={t.fp8} needs Transformer Engine layers, but this rank builds {plan.layers} "
                        "layers (run on Hopper/Blackwell GPUs with transformer_engine, or set training.fp8: null)")
    import torch

    if torch.cuda.is_available():  # the device and the CUDA build this rank runs on (CPU: the config is only built)
        fp8_device_check(recipe, torch.cuda.get_device_capability(), torch.version.cuda)
    return {"fp8": t.fp8, "fp8_recipe": t.fp8_recipe}


def fp8_device_check(recipe: "Recipe", capability: tuple[int, int] | None, cuda: str | None) -> None:
    """The rank-start refusal of an FP8 recipe this GPU (compute ``capability``) and torch build (``cuda``:
    ``torch.version.cuda``) cannot run, in one line: ``blockwise`` needs compute capability >= 9.0 and CUDA >= 12.9
    (Transformer Engine 2.11; ``hpc_tools/recipe/te_support.py``), which TE would otherwise assert at the first
    forward. A pure function of its arguments: ``fp8_options`` passes torch's values."""
    from hpc_tools.recipe.te_support import BLOCKWISE_FIX, blockwise_refusal

    t = recipe.training
    if t.fp8 and t.fp8_recipe == "blockwise":
        why = blockwise_refusal(capability, cuda)
        if why:
            from hpc_tools.errors import UserError

            raise UserError(f"training.fp8_recipe=blockwise {why} ({BLOCKWISE_FIX})")


def cuda_device_max_connections(recipe: "Recipe", layout: "ParallelLayout") -> str | None:
    """``CUDA_DEVICE_MAX_CONNECTIONS`` a CUDA rank needs, or None.

    megatron-core overlaps the tensor-parallel (sequence-parallel) communication and the data-parallel gradient
    reduce with compute by issuing them in order on one hardware queue, and relies on ``CUDA_DEVICE_MAX_CONNECTIONS=1``
    for that order (tensor_parallel/layers.py, distributed_data_parallel.py). Set before the first CUDA call.
    """
    mg = recipe.backend.megatron
    needs = layout.tensor_size > 1 or layout.sequence_parallel or mg.overlap_grad_reduce or mg.overlap_param_gather
    return "1" if needs else None



def rank_environment(recipe: "Recipe", layout: "ParallelLayout") -> dict[str, str]:
    """What a CUDA rank of this recipe sets before its first CUDA call (the backend table's ``rank_setup``)."""
    value = cuda_device_max_connections(recipe, layout)
    return {} if value is None else {"CUDA_DEVICE_MAX_CONNECTIONS": value}

def ddp_config(recipe: "Recipe"):
    from megatron.core.distributed import DistributedDataParallelConfig

    mg = recipe.backend.megatron
    # check_for_nan_in_grad raises on the rank that sees a NaN; the non-finite guard wants every rank to skip the
    # update together and count it (training.max_nonfinite_steps), so the engine checks the reduced grad buffers
    # itself (engine.MegatronCore._nonfinite_flag) and fp16 keeps Megatron's own found_inf skip.
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=recipe.training.precision != "fp32", overlap_grad_reduce=mg.overlap_grad_reduce,
        overlap_param_gather=mg.overlap_param_gather, align_param_gather=mg.overlap_param_gather,
        use_distributed_optimizer=mg.distributed_optimizer, check_for_nan_in_grad=False, bucket_size=None)


def optimizer_config(recipe: "Recipe"):
    from megatron.core.optimizer import OptimizerConfig

    t, mg = recipe.training, recipe.backend.megatron
    return OptimizerConfig(
        optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, clip_grad=t.clip_grad, bf16=t.precision == "bf16",
        fp16=t.precision == "fp16", params_dtype=params_dtype(recipe),
        use_distributed_optimizer=mg.distributed_optimizer,
        overlap_param_gather=mg.overlap_param_gather, initial_loss_scale=2.0 ** 16, loss_scale_window=1000,
        hysteresis=2, min_loss_scale=1.0)
