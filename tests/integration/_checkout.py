"""The drivers' path set-up, imported by each ``*_driver.py`` before anything of hpc_tools: run as a script
(``python tests/integration/NAME_driver.py``, as the tests and the ranks they spawn start it), a driver finds this
module beside it (a script's folder is sys.path[0]), and it puts this checkout on sys.path, so ``hpc_tools`` and
``profiling`` import from this tree whether or not the package is installed."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
