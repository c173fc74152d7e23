"""The names users already know: Megatron-LM's arguments, Megatron-core's config fields, torchtitan's job config and
DeepSpeed's ds_config keys, each mapped to the recipe field that holds the same setting here (or marked as derived
here, with the reason). The one table of them: the unknown-key error (``recipe/pydantic_errors.py``) and
``validate --explain`` (``recipe/explain.py``) read it. Plain data, no imports of the schema; a unit test checks that
every target is a field (or section) of the recipe.

A name is the key as a recipe would hold it: underscores, as an argparse ``dest`` (Megatron-LM's
``--tensor-model-parallel-size`` is ``tensor_model_parallel_size``; dashes and leading ``--`` are read the same way,
``lookup_name``). Generic words that only mean something inside their own table (torchtitan's ``checkpoint.interval``,
``training.steps``) are dotted: they match only under a key of that name.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Alias:
    name: str
    """The foreign key (underscored; dotted = a key inside a table of that name)."""
    target: str | None
    """The recipe field (or section) that holds the same setting here; None: derived here, not set."""
    known_as: tuple[str, ...]
    """Where the name comes from, one spelling per library (``Megatron-LM's --tensor-model-parallel-size``)."""
    note: str = ""
    """How the value maps when it is not the same value; for a derived name, how it is derived here."""


def _lm(flag: str) -> str:
    return f"Megatron-LM's --{flag}"


def _mc(field: str) -> str:
    return f"Megatron-core's {field}"


def _tt(key: str) -> str:
    return f"torchtitan's {key}"


def _ds(key: str) -> str:
    return f"DeepSpeed's {key}"


def _same(name: str, target: str, config: str = "TransformerConfig") -> Alias:
    """A name Megatron-LM (as --flag) and Megatron-core (as a config field) both use for the recipe's ``target``."""
    return Alias(name, target, (_lm(name.replace("_", "-")), _mc(f"{config}.{name}")))


TABLE: tuple[Alias, ...] = (
    # --- parallel degrees -------------------------------------------------------------------------------------------
    _same("tensor_model_parallel_size", "parallel.tensor_size"),
    _same("pipeline_model_parallel_size", "parallel.pipeline_size"),
    Alias("virtual_pipeline_model_parallel_size", "parallel.virtual_pipeline_size",
          (_mc("TransformerConfig.virtual_pipeline_model_parallel_size"),),
          "model chunks per pipeline stage, the same value"),
    Alias("num_virtual_stages_per_pipeline_rank", "parallel.virtual_pipeline_size",
          (_lm("num-virtual-stages-per-pipeline-rank"),), "model chunks per pipeline stage, the same value"),
    Alias("num_layers_per_virtual_pipeline_stage", "parallel.virtual_pipeline_size",
          (_lm("num-layers-per-virtual-pipeline-stage"),),
          "that is layers per model chunk (n); here it is chunks per stage: virtual_pipeline_size = "
          "num_layers / (pipeline_size x n)"),
    Alias("decoder_first_pipeline_num_layers", "parallel.num_layers_in_first_pipeline_stage",
          (_lm("decoder-first-pipeline-num-layers"),)),
    Alias("decoder_last_pipeline_num_layers", "parallel.num_layers_in_last_pipeline_stage",
          (_lm("decoder-last-pipeline-num-layers"),)),
    _same("context_parallel_size", "parallel.context_size"),
    _same("overlap_moe_expert_parallel_comm", "parallel.overlap_moe_expert_parallel_comm"),
    _same("moe_shared_expert_overlap", "parallel.moe_shared_expert_overlap"),
    _same("expert_model_parallel_size", "parallel.expert_size"),
    _same("expert_tensor_parallel_size", "parallel.expert_tensor_size"),
    _same("sequence_parallel", "parallel.sequence_parallel"),
    Alias("data_parallel_size", "parallel.data_size", ("Megatron-LM's args.data_parallel_size",),
          "derived from the world size there, as data_size: -1 does here"),
    Alias("tensor_parallel_degree", "parallel.tensor_size", (_tt("parallelism.tensor_parallel_degree"),)),
    Alias("pipeline_parallel_degree", "parallel.pipeline_size", (_tt("parallelism.pipeline_parallel_degree"),)),
    Alias("context_parallel_degree", "parallel.context_size", (_tt("parallelism.context_parallel_degree"),)),
    Alias("expert_parallel_degree", "parallel.expert_size", (_tt("parallelism.expert_parallel_degree"),)),
    Alias("expert_tensor_parallel_degree", "parallel.expert_tensor_size",
          (_tt("parallelism.expert_tensor_parallel_degree"),)),
    Alias("data_parallel_shard_degree", "parallel.data_size", (_tt("parallelism.data_parallel_shard_degree"),),
          "with backend.kind fsdp and no replication it is data_size (-1 = the rest of the world, as there); with "
          "data_parallel_replicate_degree > 1 it is backend.fsdp.shard_size (strategy hybrid_shard)"),
    Alias("data_parallel_replicate_degree", "backend.fsdp.strategy",
          (_tt("parallelism.data_parallel_replicate_degree"),),
          "R > 1 with sharding is strategy: hybrid_shard (data_size = R x backend.fsdp.shard_size); replicas "
          "without sharding are strategy: ddp"),
    Alias("fsdp_reshard_after_forward", "backend.fsdp.reshard_after_forward",
          (_tt("parallelism.fsdp_reshard_after_forward"),), "always = true, never = false"),
    Alias("pipeline_parallel_microbatch_size", "training.micro_batch_size",
          (_tt("parallelism.pipeline_parallel_microbatch_size"),)),
    Alias("parallelism", "parallel", (_tt("[parallelism]"),), "its *_degree keys are the *_size fields there"),
    Alias("sharding_strategy", "backend.fsdp.strategy", ("PyTorch FSDP's sharding_strategy",),
          "FULL_SHARD = full_shard, HYBRID_SHARD = hybrid_shard, NO_SHARD = ddp"),
    # --- Horovod ----------------------------------------------------------------------------------------------------
    Alias("horovod_fusion_threshold", "backend.horovod.fusion_threshold_mb", ("Horovod's HOROVOD_FUSION_THRESHOLD",),
          "bytes there, MiB here (134217728 bytes = 128)"),
    Alias("fusion_threshold_mb", "backend.horovod.fusion_threshold_mb", ("horovodrun's --fusion-threshold-mb",)),
    Alias("backward_passes_per_step", None, ("Horovod's DistributedOptimizer(backward_passes_per_step)",),
          "the microbatches of a step, global_batch_size / (micro_batch_size x data-parallel size); set "
          "training.global_batch_size"),
    # --- Ray Train (cluster.launcher: ray) --------------------------------------------------------------------------
    Alias("max_failures", "cluster.restarts", ("Ray Train's FailureConfig(max_failures)",),
          "the same count: worker-group restarts over the run"),
    Alias("failure_config.max_failures", "cluster.restarts", ("Ray Train's RunConfig(failure_config=...)",),
          "the same count: worker-group restarts over the run"),
    Alias("scaling_config.num_workers", None, ("Ray Train's ScalingConfig(num_workers)",),
          "the ranks, cluster.nodes x cluster.gpus_per_node; a (min, max) pair is cluster.min_nodes..cluster.nodes "
          "nodes; set those"),
    Alias("scaling_config.use_gpu", "cluster.gpu_type", ("Ray Train's ScalingConfig(use_gpu)",),
          "false = gpu_type: cpu"),
    # --- optimizer sharding -----------------------------------------------------------------------------------------
    Alias("use_distributed_optimizer", "backend.megatron.distributed_optimizer",
          (_lm("use-distributed-optimizer"), _mc("DistributedDataParallelConfig.use_distributed_optimizer"))),
    _same("overlap_grad_reduce", "backend.megatron.overlap_grad_reduce", "DistributedDataParallelConfig"),
    _same("overlap_param_gather", "backend.megatron.overlap_param_gather", "DistributedDataParallelConfig"),
    Alias("zero_optimization", "backend.deepspeed", (_ds("zero_optimization"),),
          "its keys other than stage and offload_* go in backend.deepspeed.config_overrides"),
    Alias("zero_optimization.stage", "backend.deepspeed.zero_stage", (_ds("zero_optimization.stage"),)),
    Alias("zero_optimization.offload_optimizer", "backend.deepspeed.offload_optimizer",
          (_ds("zero_optimization.offload_optimizer.device"),), "its device (none, cpu or nvme) is the value here"),
    Alias("zero_optimization.offload_param", "backend.deepspeed.offload_param",
          (_ds("zero_optimization.offload_param.device"),), "its device (none, cpu or nvme) is the value here"),
    # --- batch and schedule -----------------------------------------------------------------------------------------
    Alias("micro_batch_size", "training.micro_batch_size", (_lm("micro-batch-size"),)),
    Alias("global_batch_size", "training.global_batch_size", (_lm("global-batch-size"),)),
    Alias("train_micro_batch_size_per_gpu", "training.micro_batch_size", (_ds("train_micro_batch_size_per_gpu"),)),
    Alias("train_batch_size", "training.global_batch_size", (_ds("train_batch_size"),)),
    Alias("local_batch_size", "training.micro_batch_size", (_tt("training.local_batch_size"),)),
    Alias("training.batch_size", "training.micro_batch_size", (_tt("training.batch_size"),)),
    Alias("gradient_accumulation_steps", None, (_ds("gradient_accumulation_steps"),),
          "global_batch_size / (micro_batch_size x data-parallel size); set training.global_batch_size"),
    Alias("num_microbatches", None, (_mc("get_num_microbatches()"),),
          "global_batch_size / (micro_batch_size x data-parallel size); set training.global_batch_size"),
    Alias("train_iters", "training.train_iters", (_lm("train-iters"),)),
    Alias("training.steps", "training.train_iters", (_tt("training.steps"),)),
    Alias("lr", "training.lr", (_lm("lr"), _mc("OptimizerConfig.lr"))),
    Alias("min_lr", "training.min_lr", (_lm("min-lr"), _mc("OptimizerConfig.min_lr"))),
    Alias("optimizer.lr", "training.lr", (_tt("optimizer.lr"),)),
    Alias("optimizer", "training", (_tt("[optimizer]"), _ds("optimizer")),
          "the optimizer is AdamW: training.lr, adam_beta1, adam_beta2, adam_eps, weight_decay"),
    Alias("optimizer.eps", "training.adam_eps", (_tt("optimizer.eps"),)),
    Alias("optimizer.weight_decay", "training.weight_decay", (_tt("optimizer.weight_decay"),)),
    Alias("lr_warmup_iters", "training.lr_warmup_iters", (_lm("lr-warmup-iters"),)),
    Alias("warmup_steps", "training.lr_warmup_iters", (_tt("lr_scheduler.warmup_steps"),)),
    Alias("lr_decay_iters", "training.lr_decay_iters", (_lm("lr-decay-iters"),)),
    Alias("lr_decay_style", "training.lr_decay_style", (_lm("lr-decay-style"),)),
    Alias("decay_type", "training.lr_decay_style", (_tt("lr_scheduler.decay_type"),)),
    Alias("lr_scheduler", "training", (_tt("[lr_scheduler]"),),
          "training.lr_warmup_iters, lr_decay_iters, lr_decay_style, min_lr"),
    Alias("weight_decay", "training.weight_decay", (_lm("weight-decay"), _mc("OptimizerConfig.weight_decay"))),
    Alias("adam_beta1", "training.adam_beta1", (_lm("adam-beta1"), _mc("OptimizerConfig.adam_beta1"))),
    Alias("adam_beta2", "training.adam_beta2", (_lm("adam-beta2"), _mc("OptimizerConfig.adam_beta2"))),
    Alias("adam_eps", "training.adam_eps", (_lm("adam-eps"), _mc("OptimizerConfig.adam_eps"))),
    Alias("clip_grad", "training.clip_grad", (_lm("clip-grad"), _mc("OptimizerConfig.clip_grad"))),
    Alias("gradient_clipping", "training.clip_grad", (_ds("gradient_clipping"),)),
    Alias("max_norm", "training.clip_grad", (_tt("training.max_norm"),)),
    Alias("seed", "training.seed", (_lm("seed"),)),
    Alias("log_interval", "training.log_interval", (_lm("log-interval"),)),
    Alias("steps_per_print", "training.log_interval", (_ds("steps_per_print"),)),
    Alias("log_freq", "training.log_interval", (_tt("metrics.log_freq"),)),
    Alias("eval_interval", "training.eval_interval", (_lm("eval-interval"),)),
    Alias("eval_iters", "training.eval_iters", (_lm("eval-iters"),)),
    Alias("validation.freq", "training.eval_interval", (_tt("validation.freq"),)),
    Alias("validation.steps", "training.eval_iters", (_tt("validation.steps"),)),
    # --- precision --------------------------------------------------------------------------------------------------
    Alias("bf16", "training.precision", (_lm("bf16"), _mc("TransformerConfig.bf16"), _ds("bf16.enabled")),
          "precision: bf16"),
    Alias("fp16", "training.precision", (_lm("fp16"), _mc("TransformerConfig.fp16"), _ds("fp16.enabled")),
          "precision: fp16"),
    Alias("params_dtype", "training.precision", (_mc("TransformerConfig.params_dtype"),),
          "torch.bfloat16 = bf16, torch.float16 = fp16, torch.float32 = fp32"),
    Alias("mixed_precision_param", "training.precision", (_tt("training.mixed_precision_param"),),
          "bfloat16 = bf16, float32 = fp32"),
    Alias("fp8_format", "training.fp8", (_lm("fp8-format"),), "e4m3 or hybrid"),
    Alias("fp8", "training.fp8", (_mc("TransformerConfig.fp8"),), "e4m3 or hybrid"),
    _same("fp8_recipe", "training.fp8_recipe"),
    Alias("float8", "training.fp8", (_tt("[float8]"),),
          "training.fp8: e4m3 with training.fp8_recipe: tensorwise is torchtitan's tensorwise scaling"),
    # --- recomputation ----------------------------------------------------------------------------------------------
    _same("recompute_granularity", "training.recompute_granularity"),
    _same("recompute_method", "training.recompute_method"),
    _same("recompute_num_layers", "training.recompute_num_layers"),
    _same("recompute_modules", "training.recompute_modules"),
    Alias("recompute_activations", "training.recompute_granularity", (_lm("recompute-activations"),),
          "recompute_granularity: selective"),
    Alias("activation_checkpoint.mode", "training.recompute_granularity", (_tt("activation_checkpoint.mode"),),
          "none, selective or full; torchtitan's selective_ac_option has no counterpart"),
    Alias("activation_checkpointing", "training.recompute_granularity", (_ds("activation_checkpointing"),),
          "recompute_granularity: full"),
    # --- model ------------------------------------------------------------------------------------------------------
    _same("num_layers", "model.num_layers"),
    _same("hidden_size", "model.hidden_size"),
    _same("ffn_hidden_size", "model.ffn_hidden_size"),
    _same("num_attention_heads", "model.num_attention_heads"),
    _same("num_query_groups", "model.num_query_groups"),
    Alias("group_query_attention", "model.num_query_groups", (_lm("group-query-attention"),),
          "on when num_query_groups is below num_attention_heads"),
    Alias("kv_channels", None, (_lm("kv-channels"), _mc("TransformerConfig.kv_channels")),
          "hidden_size / num_attention_heads (multi-latent attention: model.qk_head_dim, v_head_dim)"),
    Alias("seq_length", "model.seq_length", (_lm("seq-length"),)),
    Alias("seq_len", "model.seq_length", (_tt("training.seq_len"),)),
    Alias("max_sequence_length", "model.seq_length", (_mc("GPTModel(max_sequence_length)"),)),
    Alias("max_position_embeddings", "model.seq_length", (_lm("max-position-embeddings"),),
          "learned positions are sized to seq_length here"),
    Alias("vocab_size", "model.vocab_size", (_lm("vocab-size"), _mc("GPTModel(vocab_size)"))),
    Alias("make_vocab_size_divisible_by", None, (_lm("make-vocab-size-divisible-by"),),
          "the vocabulary is padded to a multiple of 128 x tensor_size (Megatron-LM's default)"),
    _same("normalization", "model.normalization"),
    Alias("swiglu", "model.activation", (_lm("swiglu"),), "activation: swiglu"),
    Alias("gated_linear_unit", "model.activation", (_mc("TransformerConfig.gated_linear_unit"),),
          "true with SiLU is activation: swiglu"),
    Alias("position_embedding_type", "model.position_embedding",
          (_lm("position-embedding-type"), _mc("GPTModel(position_embedding_type)"))),
    Alias("rotary_base", "model.rotary_base", (_lm("rotary-base"), _mc("GPTModel(rotary_base)"))),
    Alias("untie_embeddings_and_output_weights", "model.untie_embeddings",
          (_lm("untie-embeddings-and-output-weights"),)),
    Alias("share_embeddings_and_output_weights", "model.untie_embeddings",
          (_mc("GPTModel(share_embeddings_and_output_weights)"),), "the opposite value"),
    Alias("disable_bias_linear", "model.add_bias_linear", (_lm("disable-bias-linear"),), "the opposite value"),
    Alias("add_bias_linear", "model.add_bias_linear", (_mc("TransformerConfig.add_bias_linear"),)),
    _same("hidden_dropout", "model.hidden_dropout"),
    _same("attention_dropout", "model.attention_dropout"),
    _same("init_method_std", "model.init_method_std"),
    Alias("norm_epsilon", "model.norm_epsilon", (_lm("norm-epsilon"),)),
    Alias("layernorm_epsilon", "model.norm_epsilon", (_mc("TransformerConfig.layernorm_epsilon"),)),
    Alias("num_experts", "model.num_experts", (_lm("num-experts"),)),
    Alias("num_moe_experts", "model.num_experts", (_mc("TransformerConfig.num_moe_experts"),)),
    _same("moe_router_topk", "model.moe_router_topk"),
    _same("moe_ffn_hidden_size", "model.moe_ffn_hidden_size"),
    _same("moe_shared_expert_intermediate_size", "model.moe_shared_expert_intermediate_size"),
    _same("moe_layer_freq", "model.moe_layer_freq"),
    _same("moe_router_load_balancing_type", "model.moe_router_load_balancing_type"),
    _same("moe_aux_loss_coeff", "model.moe_aux_loss_coeff"),
    _same("moe_router_score_function", "model.moe_router_score_function"),
    _same("moe_router_enable_expert_bias", "model.moe_router_enable_expert_bias"),
    _same("moe_token_dispatcher_type", "model.moe_token_dispatcher_type"),
    _same("moe_expert_capacity_factor", "model.moe_expert_capacity_factor"),
    _same("moe_grouped_gemm", "model.moe_grouped_gemm"),
    _same("multi_latent_attention", "model.multi_latent_attention"),
    Alias("q_lora_rank", "model.q_lora_rank", (_lm("q-lora-rank"), _mc("MLATransformerConfig.q_lora_rank"))),
    Alias("kv_lora_rank", "model.kv_lora_rank", (_lm("kv-lora-rank"), _mc("MLATransformerConfig.kv_lora_rank"))),
    Alias("qk_head_dim", "model.qk_head_dim", (_lm("qk-head-dim"), _mc("MLATransformerConfig.qk_head_dim"))),
    Alias("qk_pos_emb_head_dim", "model.qk_pos_emb_head_dim",
          (_lm("qk-pos-emb-head-dim"), _mc("MLATransformerConfig.qk_pos_emb_head_dim"))),
    Alias("v_head_dim", "model.v_head_dim", (_lm("v-head-dim"), _mc("MLATransformerConfig.v_head_dim"))),
    # --- layers -----------------------------------------------------------------------------------------------------
    Alias("transformer_impl", "backend.megatron.transformer_impl", (_lm("transformer-impl"),),
          "local or transformer_engine (auto: Transformer Engine where it can run)"),
    Alias("use_flash_attn", "backend.megatron.use_flash_attention", (_lm("use-flash-attn"),)),
    # --- data -------------------------------------------------------------------------------------------------------
    Alias("data_path", "data.blend", (_lm("data-path"),), "its weight-prefix pairs are {path, weight} entries"),
    Alias("split", "data.split", (_lm("split"),)),
    Alias("data_cache_path", "data.cache_dir", (_lm("data-cache-path"),)),
    Alias("tokenizer_model", "data.tokenizer", (_lm("tokenizer-model"),), "a local tokenizer folder"),
    Alias("mock_data", "data.source", (_lm("mock-data"),), "source: synthetic"),
    # --- checkpoints ------------------------------------------------------------------------------------------------
    Alias("save", "checkpoint.dir", (_lm("save"),)),
    Alias("load", "checkpoint.load_path", (_lm("load"),),
          "a run resumes from its own checkpoint.dir first; load_path is read when that has none"),
    Alias("save_interval", "checkpoint.interval_iters", (_lm("save-interval"),)),
    Alias("async_save", "checkpoint.async_save", (_lm("async-save"),)),
    Alias("async_mode", "checkpoint.async_save", (_tt("checkpoint.async_mode"),),
          "disabled = false; async and async_with_pinned_mem = true"),
    Alias("checkpoint.interval", "checkpoint.interval_iters", (_tt("checkpoint.interval"),)),
    Alias("checkpoint.folder", "checkpoint.dir", (_tt("checkpoint.folder"),)),
    Alias("keep_latest_k", "checkpoint.keep_last", (_tt("checkpoint.keep_latest_k"),)),
    Alias("gloo_socket_ifname", "checkpoint.local_replicate_interface", ("torch.distributed's GLOO_SOCKET_IFNAME",),
          "the same names, for the node-local tier's copies only (the run's own groups keep the environment's)"),
    # --- tracking ---------------------------------------------------------------------------------------------------
    Alias("wandb_project", "tracking.wandb.project", (_lm("wandb-project"),)),
)

ALIASES: dict[str, Alias] = {a.name: a for a in TABLE}
"""Foreign name -> its alias (``TABLE`` by name; names are unique, a unit test checks)."""


def lookup_name(key: str) -> str:
    """A key as the table spells it: ``--Expert-Model-Parallel-Size`` -> ``expert_model_parallel_size``."""
    return key.strip().lstrip("-").replace("-", "_").lower()


def find(parts: list[str]) -> Alias | None:
    """The alias of the key at ``parts`` (a recipe path as the user wrote it, the unknown key last): the longest
    dotted tail of the path that the table names (``checkpoint.interval``, then ``interval``)."""
    names = [lookup_name(p) for p in parts]
    for i in range(len(names)):
        found = ALIASES.get(".".join(names[i:]))
        if found is not None:
            return found
    return None


def known_names(target: str) -> list[Alias]:
    """The aliases whose target is ``target`` (``validate --explain FIELD`` lists them)."""
    return [a for a in TABLE if a.target == target]
