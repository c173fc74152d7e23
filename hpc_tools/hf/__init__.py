"""Megatron-core <-> Hugging Face: the name and layout mapping (``mapping``), exporting a run's verified checkpoint
as a ``from_pretrained`` folder (``export``), initialising a Megatron run from such a folder (``load``).

Nothing here imports torch or transformers at module level (the CLI's ``--help`` stays fast).
"""
