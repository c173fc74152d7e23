"""What runs inside the job, on every rank: environment, signals, hang watchdog, heartbeats, backend dispatch.

What the batch shell runs between the rank steps, once per job (opening the run, in-job restarts, the epilogue),
is ``hpc_tools.job``."""
