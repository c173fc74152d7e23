"""Megatron-core <-> Hugging Face: the name and layout mapping (``mapping``), the recipe's model as a transformers
config (``config``), exporting a run's verified checkpoint as a ``from_pretrained`` folder (``export``, written into
place by ``folder``, with the run's tokenizer by ``tokenizer``), initialising a run from such a folder (``load``).

Nothing here imports torch or transformers at module level (the CLI's ``--help`` stays fast).
"""
