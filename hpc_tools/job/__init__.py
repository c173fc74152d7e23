"""What the batch shell runs between srun steps, once per job (the life of the allocation): opening the run
(``open_run``, with the batch log's path from ``batch_log``), in-job restarts between rank steps (``restarts``), the
record of how the ranks ended (``epilogue``) and set-up failures (``setup_failed``). No torch anywhere here; the
steps that call Slurm's client (``restarts``, ``batch_log``) and ``epilogue`` import the standard library and hpc_tools
only (no pydantic or yaml), because a pyxis job runs the first two on the batch host, outside a container that has no
Slurm client (``tests/unit/test_restarts_pyxis.py``). What runs on every rank is ``hpc_tools.runtime``.
"""
