"""Prepared training data: local corpora -> Megatron indexed datasets (``prepare``), and reading them (``indexed``).

``inputs``: what a ``data prepare`` INPUT is and its documents, batch by batch. ``prepare``: tokenize in worker
processes (``pool``, an ordered process pool that always ends), write ``PREFIX.bin``/``PREFIX.idx`` atomically.
``indexed``: check a recipe's blend and build the train/valid/test datasets with megatron.core (index caches built
once, then memory-mapped). ``samples``: a source's training windows and the seeded order a run visits them in.
``tokenizer``: the byte tokenizer or a local Hugging Face one. The format and the cache behaviour are described in
docs/data.md."""
