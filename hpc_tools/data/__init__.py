"""Prepared training data: local corpora -> Megatron indexed datasets (``prepare``), and reading them (``indexed``).

``inputs``: what a ``data prepare`` INPUT is and its documents, batch by batch. ``prepare``: tokenize in worker
processes, write ``PREFIX.bin``/``PREFIX.idx`` atomically. ``indexed``: check a recipe's blend and build the
train/valid/test datasets with megatron.core (index caches built once, then memory-mapped). The format and the cache
behaviour are described in docs/data.md.
"""
