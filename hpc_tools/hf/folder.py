"""The output folder of an export: written under a hidden temporary name next to it, renamed into place at the end.

So a failed or interrupted export leaves no partial folder under the requested name (only, after a kill, a hidden
``.<name>.export-*`` folder beside it), and ``--overwrite`` replaces an existing folder only once the new one is
complete.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

from hpc_tools.errors import UserError
from profiling.files import staged_folder


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse an ``--out`` that is a file, or a non-empty folder without ``overwrite``."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file (give a folder path)")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"--out {out} is not empty (give a new folder, or add --overwrite to replace it)")


@contextlib.contextmanager
def staged(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``out``; on success it becomes ``out`` (replacing it when
    ``overwrite``), on an error it is removed and ``out`` is untouched."""
    out = Path(out).absolute()
    check_out(out, overwrite)
    with staged_folder(out, prefix=f".{out.name}.export-", replace=True) as tmp:
        yield tmp
        # mkdtemp and the atomic writers make private files; a model folder is meant to be shared (as umask allows)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o777 & ~mask)
        for f in tmp.rglob("*"):
            if f.is_file():
                os.chmod(f, 0o666 & ~mask)
