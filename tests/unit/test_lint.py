"""The linter configured in pyproject.toml ([tool.ruff]: line length 120, import order, pyflakes) passes on the repo."""

import subprocess
import sys

from tests.helpers import REPO


def test_ruff_passes():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"`python3 -m ruff check .` found problems (fix imports with --fix):\n{proc.stdout}"
