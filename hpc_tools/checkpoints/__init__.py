"""Checkpoint folders on disk, torch-free: naming and pointers (``dirs``), what their files must be (``verify``) and
which saved shard layouts a new layout can load (``reshard``).

Saving and resuming live on the ranks, in ``hpc_tools.train.checkpointing`` (the saver: when, which tier, background
writes, the commit; the resume: verify, load, fall back); the backends write their files
(``hpc_tools.train.engine.Checkpointable``). ``export``, ``resume``, ``status`` and the ranks read the folders
through these modules.
"""
