"""``python -m hpc_tools.job.batch_log``: where Slurm writes this batch job's output (``StdOut`` of
``scontrol show job``), printed on one line (nothing when it is unknown).

Asked on the batch host: in a pyxis job the rendered script runs this with the host's ``python3`` before its
``open_run`` step, which runs inside the container, where an image has no Slurm client, and passes the answer as
``--batch-log``. Standard library only.
"""

from __future__ import annotations

import os
import sys

from hpc_tools import slurm_client


def batch_log_path(job_id: str | None) -> str | None:
    """Where Slurm writes this batch job's output (StdOut of `scontrol show job`)."""
    return slurm_client.show_job(job_id, timeout=10).get("StdOut") if job_id else None


def main() -> int:
    print(batch_log_path(os.environ.get("SLURM_JOB_ID")) or "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
