"""backend.kind: fsdp — a Hugging Face causal LM under PyTorch FSDP2 (``fully_shard``: full_shard, hybrid_shard) or
DistributedDataParallel, with torch Distributed Checkpoint checkpoints. ``trainer.run(ctx)`` is the entry point."""
