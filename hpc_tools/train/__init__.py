"""The programs that run on every rank, one module (or package) per backend kind, and what they share: the one
training loop (``loop``), checkpoint folders and resume selection (``checkpoint_dirs``), RNG state (``rng``), data
(``data``, ``tokenizer``) and the learning-rate schedule (``schedule``)."""
