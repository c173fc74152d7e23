"""backend.kind: megatron — a Megatron-core GPT trained with tensor, pipeline (1F1B / interleaved) and data parallelism.

Modules: ``layers`` (which layers and attention backend a rank runs), ``config`` (recipe -> Megatron configs),
``model`` (layer spec, GPTModel chunks, Float16Module, DDP), ``schedule`` (learning rate), ``engine`` (parallel
state, optimizer, one training step), ``checkpoint`` (dist_checkpointing save/load through
``hpc_tools.checkpoints.dirs``), ``trainer`` (``run(ctx)`` on every rank) and ``cpu_compat`` (the CPU routes
Megatron-core needs without CUDA). Imports run one way: ``layers`` <- ``config`` <- ``model``.
"""
