"""backend.kind: horovod — a Hugging Face causal LM (``hpc_tools.train.hf_causal_lm``), a full copy on every rank,
trained with Horovod's ``DistributedOptimizer``; checkpoints are torch Distributed Checkpoint folders. Modules:
``rendezvous`` (Horovod's gloo rendezvous without ssh or horovodrun), ``trainer`` (``HorovodJob``, ``run(ctx)``)."""
