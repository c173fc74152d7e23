"""The backend table: one record per ``backend.kind``, the one place that knows what a backend is and can do.

Every layer asks its row instead of comparing kinds: the recipe's rules (which parallel features it has), the planner
(whether there is a model to plan, how the vocabulary is padded, how its options shape memory), the rank (which
trainer module runs, what it sets before the first CUDA call), ``export`` (the adapter that turns its checkpoint into
a Hugging Face folder), ``doctor`` (the packages a job of this kind imports). Code lives where its floor is: a row
names its trainer-side pieces as ``"module:function"`` strings, imported only when called (``load``), so this module
imports nothing of hpc_tools and the control plane never imports ``hpc_tools.train`` through it.

A new backend is one new row (and its trainer package); ``docs/architecture.md`` lists the row's fields.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable


def _no_zero_config(recipe: Any) -> dict:
    return {}


def _deepspeed_zero_config(recipe: Any) -> dict:
    """The ``zero_optimization`` keys a DeepSpeed recipe overrides (bucket sizes and the like)."""
    return recipe.backend.deepspeed.config_overrides.get("zero_optimization") or {}


def _megatron_attention_path(recipe: Any) -> str:
    """The attention path a Megatron recipe is planned for (``hpc_tools/train/megatron/layers.py`` ``layer_plan``'s
    ``path``, by the planner's names): ``te`` (Transformer Engine layers, its flash or cuDNN fused attention),
    ``te-unfused`` (TE layers, TE's unfused attention: ``use_flash_attention: false``, or fp32), ``sdpa`` (local
    layers, torch's scaled_dot_product_attention) or ``unfused`` (local layers, Megatron's O(s^2) attention). Local
    layers where ``transformer_impl: local`` or on CPU ranks; ``auto`` on GPUs is planned as TE layers (a node without
    TE runs the local ones: plan it with ``transformer_impl: local``)."""
    mg = recipe.backend.megatron
    if mg.transformer_impl == "local" or not recipe.cluster.uses_gpus:
        return "sdpa" if mg.use_flash_attention else "unfused"
    return "te" if mg.use_flash_attention and recipe.training.precision != "fp32" else "te-unfused"


def _hf_attention_path(recipe: Any) -> str:
    """Hugging Face models run torch's scaled_dot_product_attention."""
    return "sdpa"


def _megatron_flash(recipe: Any) -> bool:
    """Megatron's attention keeps no s^2 tensor: on GPU, 16-bit, TE's flash/fused attention or torch's SDPA (TE's
    flash and fused backends take fp16/bf16 only; fp32 runs TE's unfused attention, and SDPA in fp32 is planned with
    the s^2 terms as ``layer_plan``'s ``flash_style`` is)."""
    return (recipe.cluster.uses_gpus and recipe.training.precision != "fp32"
            and _megatron_attention_path(recipe) in ("te", "sdpa"))


def _sdpa_flash(recipe: Any) -> bool:
    """Hugging Face SDPA picks the flash / memory-efficient kernel on GPU."""
    return recipe.cluster.uses_gpus


def _not_compiled(recipe: Any) -> bool:
    return False


def _fsdp_compiled(recipe: Any) -> bool:
    """``backend.fsdp.compile``: each block under torch.compile."""
    return recipe.backend.fsdp.compile


@dataclass(frozen=True, slots=True, kw_only=True)
class Backend:
    kind: str
    """The value of ``backend.kind``."""
    summary: str
    """One line for ``--help`` and the docs."""
    trainer: str
    """The module whose ``run(ctx)`` every rank calls."""
    trains_model: bool
    """It builds and trains a model (there is something to plan, to count FLOPs of and to export)."""
    options: str | None = None
    """Its own options section under ``backend:`` (``backend.<options>``), checked only when it runs."""
    tensor_parallel: bool = False
    """``parallel.tensor_size`` > 1 (inside a node)."""
    sequence_parallel: bool = False
    """``parallel.sequence_parallel`` (with tensor parallelism: norms and dropout on sequence shards)."""
    interleaved_pipeline: bool = False
    """``parallel.virtual_pipeline_size`` > 1."""
    uneven_pipeline: bool = False
    """``parallel.num_layers_in_first_pipeline_stage`` / ``..._last_...``: first and last stages of their own length."""
    pipeline_parallel: bool = True
    """``parallel.pipeline_size`` > 1 (False: every rank holds every layer; data parallelism only)."""
    selective_recompute: bool = False
    """``training.recompute_granularity: selective``."""
    recompute_modules: bool = False
    """``training.recompute_modules`` (which parts of a layer selective recomputation recomputes)."""
    experts: bool = False
    """Mixture-of-experts layers (``model.num_experts`` and the ``moe_*`` fields)."""
    expert_parallel: bool = False
    """``parallel.expert_size`` > 1 and ``parallel.expert_tensor_size`` (experts split across GPUs, all-to-all)."""
    moe_comm_overlap: bool = False
    """``parallel.overlap_moe_expert_parallel_comm`` and ``parallel.moe_shared_expert_overlap`` (the expert
    all-to-all hidden behind another microbatch's or the shared expert's compute)."""
    context_parallel: bool = False
    """``parallel.context_size`` > 1 (sequences split across GPUs, ring exchange of keys and values)."""
    fp8: bool = False
    """``training.fp8`` (FP8 GEMMs through Transformer Engine)."""
    multi_latent_attention: bool = False
    """``model.multi_latent_attention`` (DeepSeek's low-rank query and key/value latents)."""
    pads_vocab: bool = False
    """The embedding is padded to a multiple of 128 x TP (Megatron's ``make_vocab_size_divisible_by``)."""
    hf_model_classes: bool = False
    """It builds Hugging Face model classes, so ``model.family`` fixes normalisation, activation and positions."""
    reads_init_from_hf: bool = False
    """It starts from ``checkpoint.init_from_hf`` (a Hugging Face folder converted on load)."""
    async_save: bool = False
    """``checkpoint.async_save``: it can write a checkpoint in the background while training goes on."""
    no_async_save_why: str = ""
    """Why a row without ``async_save`` has none (the rule's one-line refusal says it)."""
    elastic: bool = False
    """``cluster.min_nodes``: a checkpoint resumes, optimizer state included, into the layout the planner picks for
    fewer nodes (``hpc_tools.planner.elastic``)."""
    no_elastic_why: str = ""
    """Why a row without ``elastic`` cannot continue on fewer nodes (the rule's one-line refusal says it)."""
    checks_load_layout: bool = False
    """``checkpoint.load_path``'s optimizer state is checked against the recipe's layout before a job is queued
    (``hpc_tools.checkpoints.reshard``, the loader's own rule: Megatron's distributed checkpoints); the others
    reshard on load (torch Distributed Checkpoint) or say so on the ranks."""
    hf_export: str | None = None
    """``"module:function"``: (run, recipe, verified checkpoint, out, overwrite) -> summary; None: nothing to export."""
    ray_train: bool = False
    """Its rank program runs as a worker of Ray Train's TorchTrainer (``cluster.launcher: ray``; docs/ray.md): it
    makes its own process group from the environment Ray Train gives it."""
    preload: tuple[str, ...] = ()
    """``"module:function"``s a CPU rank calls before anything else to import its libraries: run once in the local
    fork server, whose children the local ranks are (``hpc_tools.runtime.forkserver``; ``rank_preload``)."""
    rank_setup: str | None = None
    """``"module:function"``: (recipe, layout) -> environment variables to set before the first CUDA call."""
    layers: str = ""
    """Whose layer code the model runs, for the planner's activation model: ``megatron`` (Megatron-core modules) or
    ``huggingface`` (transformers modules); "" without a model. Each is one ``LayerCode`` class in
    ``hpc_tools/planner/memory.py``."""
    sharding: str = ""
    """How model states are sharded across data-parallel ranks, for the planner's memory and communication model:
    ``distributed_optimizer`` (Megatron's: fp32 grads reduce-scattered, optimizer states sharded when on), ``zero``
    (ZeRO stages 0-3 with optional offload), ``fsdp`` (PyTorch FSDP2: parameters, gradients and optimizer states
    sharded over the shard group, replicated across HSDP's replica groups; or plain DDP) or ``horovod`` (every rank a
    full copy, gradients ring-all-reduced in Horovod's fusion buffer); "" without a model. Each
    scheme is one module of ``hpc_tools/planner/sharding/``: a new backend names an existing one here."""
    packages: tuple[str, ...] = ()
    """The distributions a job of this kind imports beyond every job's set (``doctor``)."""
    flash_attention: Callable[[Any], bool] = _sdpa_flash
    """Whether the recipe's attention stores no s^2 activations (the planner's memory model)."""
    zero_config: Callable[[Any], dict] = _no_zero_config
    """The ``zero_optimization`` overrides the planner reads (bucket sizes); {} where there is no ZeRO config."""
    compiled: Callable[[Any], bool] = _not_compiled
    """Whether the recipe's layers run under torch.compile (the planner's default efficiency)."""
    attention_path: Callable[[Any], str] = _hf_attention_path
    """The attention path the recipe is planned for (``te``, ``te-unfused``, ``sdpa``, ``unfused``): the planner's
    default efficiency and activation terms."""


BACKENDS: dict[str, Backend] = {b.kind: b for b in (
    Backend(kind="megatron", summary="Megatron-core GPT/Llama/MoE: tensor, pipeline (1F1B / interleaved), data, "
            "context and expert parallelism, sequence parallelism, distributed optimizer, FP8",
            trainer="hpc_tools.train.megatron.trainer", trains_model=True, options="megatron",
            tensor_parallel=True, sequence_parallel=True, interleaved_pipeline=True, uneven_pipeline=True,
            selective_recompute=True, recompute_modules=True, moe_comm_overlap=True,
            experts=True, expert_parallel=True, context_parallel=True, fp8=True, multi_latent_attention=True,
            pads_vocab=True, async_save=True, elastic=True, checks_load_layout=True,
            reads_init_from_hf=True, hf_export="hpc_tools.train.megatron.hf_export:export_checkpoint",
            rank_setup="hpc_tools.train.megatron.config:rank_environment", layers="megatron",
            preload=("hpc_tools.train.megatron.trainer:import_on_cpu",),
            sharding="distributed_optimizer", packages=("megatron-core",),
            flash_attention=_megatron_flash, attention_path=_megatron_attention_path),
    Backend(kind="deepspeed", summary="a Hugging Face causal LM under DeepSpeed ZeRO (stages 0-3, offload, "
            "pipeline with stage 0/1)",
            trainer="hpc_tools.train.deepspeed.trainer", trains_model=True, options="deepspeed",
            hf_model_classes=True, hf_export="hpc_tools.train.deepspeed.export:export_checkpoint", layers="huggingface",
            no_async_save_why="DeepSpeed 0.19's only background writer (its decoupled checkpoint engine) waits for "
            "the write before the next optimizer step, so at most one forward/backward overlaps it",
            no_elastic_why="its ZeRO checkpoints hold each data-parallel rank's optimizer partition, and loading "
            "them at another data-parallel size needs DeepSpeed's universal checkpoint conversion (ds_to_universal), "
            "which a restart does not run",
            sharding="zero", preload=("hpc_tools.train.deepspeed.trainer:import_on_cpu",),
            packages=("deepspeed", "transformers"), zero_config=_deepspeed_zero_config),
    Backend(kind="fsdp", summary="a Hugging Face causal LM under PyTorch FSDP2 (full_shard, hybrid_shard; with "
            "tensor parallelism: FSDP x TP) or DDP, checkpoints through torch Distributed Checkpoint",
            trainer="hpc_tools.train.fsdp.trainer", trains_model=True, options="fsdp", pipeline_parallel=False,
            tensor_parallel=True,
            hf_model_classes=True, reads_init_from_hf=True, async_save=True, elastic=True,
            hf_export="hpc_tools.train.hf_causal_lm.export:export_checkpoint", ray_train=True,
            layers="huggingface", sharding="fsdp", packages=("transformers", "accelerate"), compiled=_fsdp_compiled,
            preload=("hpc_tools.train.imports:import_transformers",)),
    Backend(kind="horovod", summary="a Hugging Face causal LM (the fsdp backend's), a full copy on every rank, its "
            "gradients ring-all-reduced by Horovod's DistributedOptimizer (gloo on CPU, NCCL on GPU), checkpoints "
            "through torch Distributed Checkpoint",
            trainer="hpc_tools.train.horovod.trainer", trains_model=True, options="horovod", pipeline_parallel=False,
            hf_model_classes=True, reads_init_from_hf=True, elastic=True,
            no_async_save_why="the Horovod backend writes its checkpoints synchronously",
            hf_export="hpc_tools.train.hf_causal_lm.export:export_checkpoint",
            layers="huggingface", sharding="horovod", packages=("transformers", "accelerate", "horovod"),
            preload=("hpc_tools.train.imports:import_transformers",)),
    Backend(kind="comm_check", summary="no model: every rank joins the process group and times all-reduces "
            "(a cluster smoke test)",
            trainer="hpc_tools.train.comm_check", trains_model=False,
            no_elastic_why="it trains no model and keeps no checkpoint to continue from"),
)}
KINDS = tuple(BACKENDS)


def backend(kind: str) -> Backend:
    """The row of ``kind`` (a recipe's ``backend.kind``, already checked by the schema)."""
    return BACKENDS[kind]


def of(recipe: Any) -> Backend:
    """The row of a recipe's ``backend.kind``."""
    return BACKENDS[recipe.backend.kind]


def with_feature(feature: str) -> list[str]:
    """The kinds whose row has ``feature`` true, for the fix an error names."""
    return [b.kind for b in BACKENDS.values() if getattr(b, feature)]


RANK_PRELOAD = ("hpc_tools.train.dynamo_lazy:install", "hpc_tools.runtime.rank")
"""What every rank imports first, before its row's ``preload``: torch with TorchDynamo deferred, the rank program."""


def rank_preload(kind: str) -> tuple[str, ...]:
    """What the local fork server imports for ranks of backend ``kind``, in order."""
    return (*RANK_PRELOAD, *BACKENDS[kind].preload)


def load(ref: str) -> Callable[..., Any]:
    """The function a row names as ``"module:function"`` (``"module"`` alone: its ``run``), imported now."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name or "run")
