"""``python -m hpc_tools.job.setup_failed --run-dir RUN --exit-code N --line LINE [--script SCRIPT]``.

Called by a batch script (both launch paths: the rendered sbatch script and submitit's) when one of its environment
set-up lines (``module load``, ``conda activate``, a venv's ``activate``, the container check; see
``hpc_tools.render.envsetup.checked_setup_lines``) fails: the job stops there, and the run's manifest records FAILED
with the failing line, so ``status`` tells why without anyone reading the batch log.

A plain ``sbatch jobs/<recipe>.sbatch`` has no run folder yet at that point (``hpc_tools.job.open_run`` runs after
the set-up, with the environment the set-up makes): the folder is then created from the recipe the script carries.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from hpc_tools.registry import RunFolder, now_iso

# The rendered script's here-document: `... <<'HPC_TOOLS_RECIPE_<hash>'` up to the delimiter line.
_HEREDOC = re.compile(r"<<'(HPC_TOOLS_RECIPE_[0-9a-f]+)'\n(.*?)\n\1\n", re.S)


def recipe_in_script(script: Path | None) -> str | None:
    """The recipe text a rendered batch script carries, or None (submitit's script carries none)."""
    try:
        match = _HEREDOC.search(script.read_text()) if script else None
    except (OSError, UnicodeDecodeError):
        return None
    return match.group(2) if match else None


def record_setup_failure(run_dir: Path, exit_code: int, line: str, script: Path | None = None) -> RunFolder | None:
    """Record the failed set-up line in the run's manifest (creating the run folder from the script's recipe when a
    plain sbatch job has none yet); returns the run, or None when there is no folder and no recipe to make one.
    ``run_dir`` may be a job array's runs root: the run is then the one holding this job's id."""
    from hpc_tools.job.epilogue import find_own_run

    run = find_own_run(run_dir, dict(os.environ)) if run_dir.is_dir() else None
    if run is None:
        text = recipe_in_script(script)
        if text is None:
            return None
        from hpc_tools.job.open_run import open_run

        run = open_run(run_dir, text, script)
    reason = f"environment set-up failed (exit {exit_code}): {line}"
    run.update(event="setup failed", state="FAILED", exit_code=exit_code, error=reason, reason=reason,
               setup_failed=line, ended=now_iso())
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_tools.job.setup_failed", description=__doc__)
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--exit-code", required=True, type=int, help="the failed line's exit status")
    parser.add_argument("--line", required=True, help="the set-up line that failed")
    parser.add_argument("--script", type=Path, default=None, help="the batch script (carries the recipe)")
    args = parser.parse_args(argv)
    run = record_setup_failure(args.run_dir, args.exit_code, args.line, args.script)
    if run is None:
        print(f"hpc_tools: no run folder at {args.run_dir} to record the set-up failure in", file=sys.stderr)
        return 1
    print(f"hpc_tools: recorded the set-up failure in {run.path / 'manifest.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
