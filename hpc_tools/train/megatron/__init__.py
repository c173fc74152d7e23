"""backend.kind: megatron — a Megatron-core GPT trained with tensor, pipeline (1F1B / interleaved) and data parallelism.

Modules: ``layers`` (which layers and attention backend a rank runs), ``config`` (recipe -> Megatron configs),
``model`` (layer spec, GPTModel chunks, Float16Module, DDP), ``sdpa_attention`` (the local layers' attention core on
torch's scaled_dot_product_attention), ``schedule`` (learning rate), ``engine`` (parallel state, optimizer, one
training step), ``checkpoint`` (dist_checkpointing save/load through ``hpc_tools.checkpoints.dirs``), ``trainer``
(``run(ctx)`` on every rank), ``cpu_compat`` (the CPU routes Megatron-core needs without CUDA), ``router_load`` (the
tokens each expert received), ``hf_export`` and ``hf_import`` (its Hugging Face adapter: a checkpoint -> an HF
folder, and step-0 weights from one). Imports run one way: ``layers`` <- ``config`` <- ``model``.
"""
