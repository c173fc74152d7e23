"""Rules of the backend kinds: the features each has (the backend table), DeepSpeed, FSDP, Horovod and Megatron
options, and precision on the device."""

from __future__ import annotations

from typing import Iterator

from hpc_tools import backends
from hpc_tools.errors import Violation
from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.rules.registry import _try, divisors, rule
from hpc_tools.recipe.schema import Recipe

# --- backends ---------------------------------------------------------------------------------------------------------

def _others(feature: str) -> str:
    return " or ".join(backends.with_feature(feature))


@rule
def backend_features(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """The parallel features a recipe asks for are ones its backend has (the backend table)."""
    row, kind = backends.of(r), r.backend.kind
    if not row.tensor_parallel and lay.tensor_size != 1:
        yield Violation("parallel.tensor_size", lay.tensor_size, f"must be 1 with backend.kind={kind}",
                        f"use backend.kind: {_others('tensor_parallel')} for tensor parallelism")
    if not row.sequence_parallel and r.parallel.sequence_parallel:
        yield Violation("parallel.sequence_parallel", True, f"is not available with backend.kind={kind}",
                        f"set it false, or use backend.kind: {_others('sequence_parallel')}")
    if not row.pipeline_parallel and lay.pipeline_size != 1:
        yield Violation("parallel.pipeline_size", lay.pipeline_size, f"must be 1 with backend.kind={kind} (every rank "
                        "holds every layer)", f"use backend.kind: {_others('pipeline_parallel')} for pipelines")
    for end, n in (("first", r.parallel.num_layers_in_first_pipeline_stage),
                   ("last", r.parallel.num_layers_in_last_pipeline_stage)):
        if n is not None and not row.uneven_pipeline:
            yield Violation(f"parallel.num_layers_in_{end}_pipeline_stage", n,
                            f"is not available with backend.kind={kind} (it has no uneven pipeline stages)",
                            f"set it null, or use backend.kind: {_others('uneven_pipeline')} for uneven stages")
            break
    if not row.interleaved_pipeline and r.parallel.virtual_pipeline_size not in (None, 1):
        yield Violation("parallel.virtual_pipeline_size", r.parallel.virtual_pipeline_size,
                        f"is not supported by backend.kind={kind}'s pipeline",
                        f"set it null, or use backend.kind: {_others('interleaved_pipeline')}")
    if not row.selective_recompute and r.training.recompute_granularity == "selective":
        yield Violation("training.recompute_granularity", "selective", f"is not available with backend.kind={kind}",
                        f"use full or none, or backend.kind: {_others('selective_recompute')}")
    if not row.recompute_modules and r.training.recompute_modules is not None:
        yield Violation("training.recompute_modules", r.training.recompute_modules,
                        f"is not available with backend.kind={kind}",
                        f"set it null, or use backend.kind: {_others('recompute_modules')}")
    overlaps = {"parallel.overlap_moe_expert_parallel_comm": r.parallel.overlap_moe_expert_parallel_comm,
                "parallel.moe_shared_expert_overlap": r.parallel.moe_shared_expert_overlap}
    for path in (p for p, on in overlaps.items() if on and not row.moe_comm_overlap):
        yield Violation(path, True, f"is not available with backend.kind={kind}",
                        f"set it false, or use backend.kind: {_others('moe_comm_overlap')}")
    if not row.experts and r.model.num_experts is not None:
        yield Violation("model.num_experts", r.model.num_experts, f"is not available with backend.kind={kind} (it "
                        "would train a dense model)", f"use backend.kind: {_others('experts')} for experts")
    if not row.expert_parallel and lay.expert_size != 1:
        yield Violation("parallel.expert_size", lay.expert_size, f"must be 1 with backend.kind={kind}",
                        f"use backend.kind: {_others('expert_parallel')} for expert parallelism")
    if not row.context_parallel and lay.context_size != 1:
        yield Violation("parallel.context_size", lay.context_size, f"must be 1 with backend.kind={kind}",
                        f"use backend.kind: {_others('context_parallel')} for context parallelism")
    if not row.fp8 and r.training.fp8 is not None:
        yield Violation("training.fp8", r.training.fp8, f"is not available with backend.kind={kind}",
                        f"set it null, or use backend.kind: {_others('fp8')} (FP8 through Transformer Engine)")
    if not row.multi_latent_attention and r.model.multi_latent_attention:
        yield Violation("model.multi_latent_attention", True, f"is not available with backend.kind={kind}",
                        f"set it false, or use backend.kind: {_others('multi_latent_attention')}")
    if r.checkpoint.async_save and not row.async_save:
        why = f" ({row.no_async_save_why})" if row.no_async_save_why else ""
        yield Violation("checkpoint.async_save", True, f"is not available with backend.kind={kind}{why}",
                        f"set it false, or use backend.kind: {_others('async_save')}")
    if r.checkpoint.init_from_hf and not row.reads_init_from_hf:
        yield Violation("checkpoint.init_from_hf", r.checkpoint.init_from_hf,
                        f"is read by backend.kind={_others('reads_init_from_hf')} only, not {kind}",
                        "for deepspeed set backend.deepspeed.pretrained_path to the folder instead")


@rule
def deepspeed_layout(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """DeepSpeed's pipeline only with ZeRO stage 0 or 1, and not from a pretrained folder."""
    if backends.of(r).options != "deepspeed":
        return
    ds = r.backend.deepspeed
    if lay.pipeline_size > 1 and ds.zero_stage >= 2:
        yield Violation("backend.deepspeed.zero_stage", ds.zero_stage,
                        f"cannot be combined with DeepSpeed's pipeline (parallel.pipeline_size={lay.pipeline_size}); "
                        "DeepSpeed refuses ZeRO-2/3 with pipeline parallelism",
                        "use zero_stage 0 or 1, or pipeline_size: 1")
    if lay.pipeline_size > 1 and ds.pretrained_path:
        yield Violation("backend.deepspeed.pretrained_path", ds.pretrained_path,
                        "cannot be split into DeepSpeed pipeline stages", "use pipeline_size: 1")


@rule
def deepspeed_offload(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """Optimizer offload needs ZeRO >= 1, parameter offload ZeRO-3, NVMe offload an nvme_path."""
    if backends.of(r).options != "deepspeed":
        return
    ds = r.backend.deepspeed
    if ds.offload_optimizer != "none" and ds.zero_stage == 0:
        yield Violation("backend.deepspeed.offload_optimizer", ds.offload_optimizer, "needs zero_stage >= 1",
                        "set backend.deepspeed.zero_stage to 1, 2 or 3")
    if ds.offload_param != "none" and ds.zero_stage != 3:
        yield Violation("backend.deepspeed.offload_param", ds.offload_param, "needs zero_stage 3",
                        "set backend.deepspeed.zero_stage: 3 or offload_param: none")
    if "nvme" in (ds.offload_optimizer, ds.offload_param) and not ds.nvme_path:
        yield Violation("backend.deepspeed.nvme_path", None, "is required for nvme offload",
                        "give a local NVMe folder, e.g. /local_nvme")


# The Hugging Face class behind each family fixes these shapes (backends whose row has hf_model_classes).
HF_FAMILY_SHAPE = {
    "gpt": {"normalization": "LayerNorm", "activation": "gelu", "position_embedding": "learned_absolute"},
    "llama": {"normalization": "RMSNorm", "activation": "swiglu", "position_embedding": "rope"},
}


@rule
def deepspeed_model_expressible(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """Backends that build Hugging Face GPT-2 / LLaMA classes: the model section must be one they can express."""
    if not backends.of(r).hf_model_classes:
        return
    if backends.of(r).options == "deepspeed" and r.backend.deepspeed.pretrained_path:  # the folder's architecture
        return
    m, kind = r.model, r.backend.kind
    for key, needed in HF_FAMILY_SHAPE[m.family].items():
        if getattr(m, key) != needed:
            yield Violation(f"model.{key}", getattr(m, key),
                            f"is not available for model.family={m.family} with backend.kind={kind}",
                            f"its Hugging Face class uses {needed}; use that, the other family, or "
                            "backend.kind: megatron")
    if m.family == "gpt" and m.num_query_groups != m.num_attention_heads:
        yield Violation("model.num_query_groups", m.num_query_groups,
                        f"needs model.family=llama with backend.kind={kind}",
                        "GPT-2 has plain multi-head attention; set it null")
    if m.family == "gpt" and not m.add_bias_linear:
        yield Violation("model.add_bias_linear", False,
                        f"is not available for model.family=gpt with backend.kind={kind}",
                        "GPT-2 always has biases; use family: llama")
    if m.family == "llama" and m.hidden_dropout > 0:
        yield Violation("model.hidden_dropout", m.hidden_dropout,
                        f"is not available for model.family=llama with backend.kind={kind}",
                        "LlamaForCausalLM has no hidden dropout; set it 0")


@rule
def fsdp_mesh(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """FSDP: hybrid_shard's shard groups divide the world into 2 or more replicas; 16-bit training in bf16."""
    if backends.of(r).options != "fsdp":
        return
    fs, world = r.backend.fsdp, lay.world_size
    if lay.tensor_size > 1:
        node = r.cluster.gpus_per_node
        if node % lay.tensor_size:
            yield Violation("parallel.tensor_size", lay.tensor_size, f"must divide cluster.gpus_per_node={node} "
                            "(tensor parallelism stays inside a node)", _try(divisors(node)))
        if fs.strategy != "full_shard":
            yield Violation("backend.fsdp.strategy", fs.strategy, "cannot be combined with tensor parallelism "
                            f"(parallel.tensor_size={lay.tensor_size})", "use strategy: full_shard, or tensor_size: 1")
        if r.model.family != "llama":
            yield Violation("model.family", r.model.family, "has no tensor-parallel plan with backend.kind=fsdp "
                            "(GPT-2's fused attention projection)", "use family: llama, or tensor_size: 1")
    if fs.strategy == "hybrid_shard":
        shard = fs.shard_size or r.cluster.gpus_per_node
        field = "backend.fsdp.shard_size" if fs.shard_size else "cluster.gpus_per_node (the default shard_size)"
        if world % shard or world // shard < 2:
            fits = [d for d in divisors(world) if d < world]
            yield Violation(field, shard, f"must divide the {world} ranks into 2 or more replica groups for "
                            "backend.fsdp.strategy=hybrid_shard", f"set backend.fsdp.shard_size to one of "
                            f"{', '.join(map(str, fits[-4:])) or 'none (1 rank)'}, use cluster.nodes > 1, or "
                            "strategy: full_shard")
    elif fs.shard_size is not None:
        yield Violation("backend.fsdp.shard_size", fs.shard_size, f"is read by strategy hybrid_shard only, not "
                        f"{fs.strategy}", "set it null, or strategy: hybrid_shard")
    if r.training.precision == "fp16":
        yield Violation("training.precision", "fp16", "is not available with backend.kind=fsdp (no loss scaler)",
                        "use bf16 (FSDP2's MixedPrecisionPolicy) or fp32")


@rule
def horovod_precision(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """Horovod: fp32, or bf16 autocast (no loss scaler for fp16)."""
    if backends.of(r).options == "horovod" and r.training.precision == "fp16":
        yield Violation("training.precision", "fp16", "is not available with backend.kind=horovod (no loss scaler)",
                        "use bf16 (autocast, as DDP) or fp32")


@rule
def megatron_overlap(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """overlap_param_gather needs the distributed optimizer and overlap_grad_reduce."""
    mg = r.backend.megatron
    needs_both = not (mg.distributed_optimizer and mg.overlap_grad_reduce)
    if backends.of(r).options == "megatron" and mg.overlap_param_gather and needs_both:
        yield Violation("backend.megatron.overlap_param_gather", True,
                        "needs distributed_optimizer: true and overlap_grad_reduce: true",
                        "enable both or set it false")


@rule
def precision_on_device(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """fp16 needs GPUs (CPUs here have no fp16 kernels for training)."""
    if r.training.precision == "fp16" and not r.cluster.uses_gpus:
        yield Violation("training.precision", "fp16", "is not supported on CPU ranks (cluster.gpu_type=cpu)",
                        "use bf16 or fp32")
