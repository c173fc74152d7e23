"""The repository explains itself: no text file cites notes or paths that live outside it.

Facts the code relies on are stated in docs/ (megatron-on-cpu.md, slurm-dev-cluster.md, formulas.md) or inline; a
pointer to a machine path or to someone's private notes is useless to the next reader.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.helpers import REPO

# Assembled from pieces so that this file does not match itself.
FORBIDDEN = {
    "a machine path": re.compile("/" + "work/"),
    "a sibling folder outside the repository": re.compile(r"\.\./" + "shared"),
    "private notes": re.compile("shared/FA" + "CTS|REFER" + r"ENCE\.md"),
    "a citation of private notes": re.compile(r"\b" + "FA" + r"CTS\b"),
}


def text_files() -> list[str]:
    """Tracked files plus new ones not ignored (what the next commit will hold)."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                             capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return sorted({p for p in out.stdout.splitlines() if (REPO / p).is_file()})


def offences(path: str) -> list[str]:
    data = (REPO / path).read_bytes()
    if b"\0" in data:
        return []  # binary
    text = data.decode("utf-8", errors="replace")
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for what, pattern in FORBIDDEN.items():
            if pattern.search(line):
                found.append(f"{path}:{lineno}: {what}: {line.strip()[:100]}")
    return found


def test_no_text_file_cites_anything_outside_the_repository():
    found = [o for path in text_files() for o in offences(path)]
    assert not found, "state the fact in docs/ or inline instead:\n" + "\n".join(found)


def test_the_check_sees_a_citation():
    assert FORBIDDEN["a citation of private notes"].search("# " + "FA" + "CTS: slurmd needs cgroups")
    assert FORBIDDEN["a machine path"].search("see /" + "work/shared/notes.md")
    assert not any(p.search("the facts in docs/formulas.md") for p in FORBIDDEN.values())


def test_examples_use_variables_slurm_itself_sets():
    """``$SLURM_TMPDIR`` is a site convention (set by some sites' prolog, not by Slurm): examples name what Slurm
    sets in every job (``$SLURM_JOB_ID``, ``$SLURMD_NODENAME``) or a plain path; a line may name it only as the site
    convention it is."""
    name = "SLURM_" + "TMPDIR"  # assembled, so that this file does not match itself
    found = [f"{path}:{n}: {line.strip()[:100]}" for path in text_files()
             if not (REPO / path).read_bytes().count(b"\0")
             for n, line in enumerate((REPO / path).read_text(errors="replace").splitlines(), 1)
             if name in line and "site convention" not in line]
    assert not found, "\n".join(found)
