"""backend.kind: fsdp — a Hugging Face causal LM (``hpc_tools.train.hf_causal_lm``) under PyTorch FSDP2
(``fully_shard``: full_shard, hybrid_shard; with tensor parallelism: FSDP x TP) or DistributedDataParallel, with torch
Distributed Checkpoint checkpoints. Modules: ``parallel`` (the mesh, sharding and the step's gradient hooks),
``trainer`` (``FSDPJob``; ``run(ctx)`` is the entry point)."""
