"""backend.kind: horovod — the fsdp backend's Hugging Face causal LM (``train/fsdp/model.py``), a full copy on every
rank, trained with Horovod's ``DistributedOptimizer``; checkpoints are the fsdp backend's torch Distributed Checkpoint
folders. Modules: ``rendezvous`` (Horovod's gloo rendezvous without ssh or horovodrun), ``trainer`` (``run(ctx)``)."""
