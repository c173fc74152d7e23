import sys

from hpc_tools.job.restarts.cli import main

sys.exit(main())
