"""Where a job runs: Slurm through submitit, or local processes on this machine. What runs is the same."""
