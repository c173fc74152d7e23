"""What the batch shell runs between srun steps, once per job (the life of the allocation): opening the run
(``open_run``), in-job restarts between rank steps (``restarts``), the record of how the ranks ended (``epilogue``)
and set-up failures (``setup_failed``). Standard library and the control plane only: in a pyxis job these run on the
batch host, outside the container (no torch, pydantic or yaml there). What runs on every rank is ``hpc_tools.runtime``.
"""
