"""What the batch shell runs between srun steps, once per job (the life of the allocation): opening the run
(``open_run``, with the batch log's path from ``batch_log``), the rank order by topology before a rank step
(``placement``), in-job restarts between rank steps (``restarts``, a package of the evidence, the nodes, the
decision and its action; each failure's class from ``failure_class``), the record of how the ranks ended
(``epilogue``), set-up failures (``setup_failed``), the time-limit stop's requeue (``requeue``, the job's last step)
and a Ray cluster over the allocation (``ray_launch``). No torch anywhere here; the steps that call Slurm's client
(``restarts``, ``batch_log``, ``placement``, ``requeue``) and ``epilogue`` import the standard library and hpc_tools
only (no pydantic or yaml), because a pyxis job runs those four on the batch host, outside a container that has no
Slurm client (``tests/unit/test_restarts_pyxis.py``). What runs on every rank is ``hpc_tools.runtime``.
"""
