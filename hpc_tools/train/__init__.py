"""The programs that run on every rank, one package per backend kind (``megatron``, ``deepspeed``, ``fsdp``,
``horovod``; ``comm_check`` has no model), and what they share: the one training loop (``loop``) and what it needs
of an engine (``engine``), checkpoints on the ranks (``checkpointing``), RNG state (``rng``), data (``data``, built
ahead on GPUs by ``prefetch``), the learning-rate schedule (``schedule``), the process groups a job creates
(``groups``), the Hugging Face causal LM the HF backends share (``hf_causal_lm``) and importing training libraries
without their unused optional imports (``imports``), TorchDynamo imported only when something compiles
(``dynamo_lazy``)."""
