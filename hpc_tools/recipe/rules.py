"""Cross-field rules a recipe must satisfy before anything is written or queued.

Each rule is a small function registered with ``@rule``; ``check_recipe`` runs them all and returns every violation,
so ``validate`` reports all problems at once. The layout arithmetic itself lives in ``hpc_tools.layout``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

from hpc_tools import backends
from hpc_tools.errors import Violation
from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.reads import fields_read
from hpc_tools.recipe.schema import Recipe

RuleFn = Callable[[Recipe, ParallelLayout], Iterator[Violation]]


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    doc: str
    fn: RuleFn

    @property
    def reads(self) -> frozenset[str]:
        """The recipe fields this rule reads, found in its source (``hpc_tools.recipe.reads``)."""
        return fields_read(self.fn)


RULES: list[Rule] = []


def rule(fn: RuleFn) -> RuleFn:
    RULES.append(Rule(fn.__name__, (fn.__doc__ or "").strip(), fn))
    return fn


def check_recipe(recipe: Recipe) -> list[Violation]:
    layout = ParallelLayout.from_recipe(recipe)
    return [v for r in RULES for v in r.fn(recipe, layout)]


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in ascending order, in O(sqrt n) (n can be any bounded recipe value)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _try(values: list[int], limit: int = 8) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return f"try {shown}{', ...' if len(values) > limit else ''}"


# --- layout -----------------------------------------------------------------------------------------------------------

@rule
def layout_fills_world(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """tensor_size x pipeline_size x data_size equals nodes x gpus_per_node."""
    world, mp = lay.world_size, lay.model_parallel_size
    if r.parallel.data_size == -1:
        if world % mp:
            yield Violation("parallel.tensor_size", r.parallel.tensor_size,
                            f"x parallel.pipeline_size={r.parallel.pipeline_size} must divide the world size "
                            f"cluster.nodes x cluster.gpus_per_node = {world}",
                            f"make tensor_size x pipeline_size one of {', '.join(map(str, divisors(world)))}")
    elif lay.layout_size != world:
        yield Violation("parallel.data_size", r.parallel.data_size,
                        f"gives tensor x pipeline x data = {lay.layout_size}, not the world size "
                        f"cluster.nodes x cluster.gpus_per_node = {world}",
                        f"set data_size: -1 to infer it, or {world // mp if world % mp == 0 else 'change the cluster'}")


@rule
def heads_divisible_by_tensor(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """model.num_attention_heads and model.num_query_groups are divisible by tensor_size."""
    m = r.model
    for field, value in (("num_attention_heads", m.num_attention_heads), ("num_query_groups", m.num_query_groups)):
        if value % lay.tensor_size:
            yield Violation("parallel.tensor_size", lay.tensor_size, f"must divide model.{field}={value}",
                            _try(divisors(value)))
            return


@rule
def heads_shape(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """hidden_size is divisible by num_attention_heads, which is divisible by num_query_groups."""
    m = r.model
    if m.hidden_size % m.num_attention_heads:
        yield Violation("model.num_attention_heads", m.num_attention_heads,
                        f"must divide model.hidden_size={m.hidden_size}", _try(divisors(m.hidden_size)))
    if m.num_attention_heads % m.num_query_groups:
        yield Violation("model.num_query_groups", m.num_query_groups,
                        f"must divide model.num_attention_heads={m.num_attention_heads}",
                        _try(divisors(m.num_attention_heads)))
    if m.position_embedding == "rope" and m.hidden_size % m.num_attention_heads == 0 and m.head_dim % 2:
        yield Violation("model.num_attention_heads", m.num_attention_heads,
                        f"gives an odd head dimension {m.head_dim}, which RoPE cannot rotate",
                        "choose heads so that hidden_size / heads is even")


@rule
def layers_divisible_by_stages(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """model.num_layers is divisible by pipeline_size x virtual_pipeline_size."""
    chunks = lay.pipeline_size * (r.parallel.virtual_pipeline_size or 1)
    if r.model.num_layers % chunks:
        what = "pipeline_size" if not r.parallel.virtual_pipeline_size else "pipeline_size x virtual_pipeline_size"
        yield Violation("model.num_layers", r.model.num_layers, f"must be divisible by parallel.{what}={chunks}",
                        f"use a multiple of {chunks} layers, or {_try(divisors(r.model.num_layers))} for that product")


@rule
def interleaving_needs_pipeline(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """virtual_pipeline_size needs pipeline_size > 1, and microbatches divisible by pipeline_size."""
    v = r.parallel.virtual_pipeline_size
    if v is None or v == 1:
        return
    if lay.pipeline_size == 1:
        yield Violation("parallel.virtual_pipeline_size", v, "needs parallel.pipeline_size > 1",
                        "set pipeline_size >= 2 or virtual_pipeline_size: null")
    elif lay.data_size > 0 and lay.num_microbatches % lay.pipeline_size:
        yield Violation("parallel.virtual_pipeline_size", v,
                        f"needs the microbatch count ({lay.num_microbatches}) divisible by "
                        f"pipeline_size={lay.pipeline_size} for the interleaved schedule",
                        "raise training.global_batch_size to a multiple of "
                        f"{lay.micro_batch_size * lay.data_size * lay.pipeline_size}")


@rule
def global_batch_divisible(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """global_batch_size is divisible by micro_batch_size x data_size."""
    step = lay.micro_batch_size * lay.data_size
    if step > 0 and lay.global_batch_size % step:
        lower = lay.global_batch_size // step * step
        options = [x for x in (lower, lower + step) if x > 0]
        yield Violation("training.global_batch_size", lay.global_batch_size,
                        f"must be divisible by micro_batch_size x data_size = {lay.micro_batch_size} x "
                        f"{lay.data_size} = {step}", f"try {' or '.join(map(str, options))}")


@rule
def sequence_parallel_needs_tensor(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """sequence_parallel needs tensor_size > 1 and seq_length divisible by tensor_size."""
    if not r.parallel.sequence_parallel:
        return
    if lay.tensor_size == 1:
        yield Violation("parallel.sequence_parallel", True, "needs parallel.tensor_size > 1",
                        "set tensor_size >= 2 or sequence_parallel: false")
    elif r.model.seq_length % lay.tensor_size:
        yield Violation("model.seq_length", r.model.seq_length,
                        f"must be divisible by parallel.tensor_size={lay.tensor_size} under sequence parallelism",
                        f"use a multiple of {lay.tensor_size}")


@rule
def recompute_layers_fit(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """With full recomputation, recompute_num_layers is at most the layers of one pipeline chunk."""
    t = r.training
    chunks = lay.pipeline_size * (r.parallel.virtual_pipeline_size or 1)
    per_chunk = r.model.num_layers // chunks if r.model.num_layers % chunks == 0 else None
    if t.recompute_granularity == "full" and per_chunk and t.recompute_num_layers > per_chunk:
        yield Violation("training.recompute_num_layers", t.recompute_num_layers,
                        f"exceeds the {per_chunk} layers of one pipeline chunk", f"use 1..{per_chunk}")


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
    if not row.interleaved_pipeline and r.parallel.virtual_pipeline_size not in (None, 1):
        yield Violation("parallel.virtual_pipeline_size", r.parallel.virtual_pipeline_size,
                        f"is not supported by backend.kind={kind}'s pipeline",
                        f"set it null, or use backend.kind: {_others('interleaved_pipeline')}")
    if not row.selective_recompute and r.training.recompute_granularity == "selective":
        yield Violation("training.recompute_granularity", "selective", f"is not available with backend.kind={kind}",
                        f"use full or none, or backend.kind: {_others('selective_recompute')}")
    if r.checkpoint.async_save and not row.async_save:
        yield Violation("checkpoint.async_save", True, f"is not available with backend.kind={kind}",
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


# --- training, data, cluster ------------------------------------------------------------------------------------------

@rule
def lr_schedule(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """min_lr <= lr and warm-up no longer than the decay."""
    t = r.training
    if t.min_lr > t.lr:
        yield Violation("training.min_lr", t.min_lr, f"exceeds training.lr={t.lr}", f"use a value <= {t.lr}")
    decay = t.lr_decay_iters or t.train_iters
    if t.lr_warmup_iters > decay:
        yield Violation("training.lr_warmup_iters", t.lr_warmup_iters, f"exceeds the decay length {decay}",
                        f"use at most {decay}")


@rule
def data_sources(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """source: files needs paths, source: indexed a blend; the byte tokenizer needs vocab_size >= 257."""
    if r.data.source == "files" and not r.data.paths:
        yield Violation("data.paths", [], "is empty but data.source=files",
                        "list local files or folders, or use source: synthetic")
    if r.data.source == "indexed" and not r.data.blend:
        yield Violation("data.blend", [], "is empty but data.source=indexed",
                        "list prepared datasets as {path: PREFIX, weight: W} (python -m hpc_tools data prepare)")
    if r.data.tokenizer == "byte" and r.model.vocab_size < 257:
        yield Violation("model.vocab_size", r.model.vocab_size, "is below the byte tokenizer's 257 tokens",
                        "use vocab_size >= 257")


@rule
def signal_before_limit(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """The preemption signal comes before the time limit."""
    c = r.cluster
    if c.signal_delay_s >= c.time_limit_min * 60:
        yield Violation("cluster.signal_delay_s", c.signal_delay_s,
                        f"must be shorter than cluster.time_limit={c.time_limit} ({c.time_limit_min * 60:.0f} s)",
                        "lower it or raise the time limit")


@rule
def profiler_ranks_exist(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """torch_profiler.ranks are ranks of this job."""
    bad = [x for x in r.profiling.torch_profiler.ranks if not 0 <= x < lay.world_size]
    if r.profiling.torch_profiler.enabled and bad:
        yield Violation("profiling.torch_profiler.ranks", bad, f"are not ranks of a {lay.world_size}-rank job",
                        f"use ranks in 0..{lay.world_size - 1}")


@rule
def trackers_installed(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """An enabled tracking.wandb or tracking.mlflow needs its package installed."""
    from importlib.util import find_spec  # looked up, never imported: validate stays light

    if r.tracking.wandb is not None and r.tracking.wandb.enabled and find_spec("wandb") is None:
        yield Violation("tracking.wandb.enabled", True, "needs the 'wandb' package, which is not installed",
                        "pip install wandb, or set tracking.wandb.enabled=false")
    if r.tracking.mlflow is not None and r.tracking.mlflow.enabled and find_spec("mlflow") is None:
        yield Violation("tracking.mlflow.enabled", True, "needs the 'mlflow' package, which is not installed",
                        "pip install mlflow, or set tracking.mlflow.enabled=false")
