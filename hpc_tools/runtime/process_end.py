"""The end of a rank process without the interpreter's teardown (``exit_process``): the rank program's own end, and
every program the fork server (``hpc_tools.runtime.forkserver``) runs as a forked rank; and whether a process has
ended (``pid_alive``)."""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def exit_process(code: int, flush_files: bool = False) -> NoReturn:
    """End this process with ``code`` as ``sys.exit`` would, less the interpreter's teardown (freeing every
    module and object one by one, torch's among them: ~0.9 CPU-s per rank on this project's 2-core test machine, for
    nothing anyone reads). What a normal exit does that matters runs first, in its order: ``threading``'s exit
    callbacks and the wait for non-daemon threads (a background checkpoint write), the ``atexit`` handlers (logging's
    flush and close, multiprocessing's children, torch's), then stdout and stderr flushed. Files are closed by their
    owners (the loop closes its trackers, collector and engine in a ``finally``); ``flush_files`` flushes every open
    file object first too (~0.3 CPU-s: a walk over the interpreter's objects), for a program not written for this
    end, whose files the teardown would have flushed. Only a program that returned (or raised ``SystemExit``) ends
    this way: an exception takes the usual path, with its traceback."""
    import atexit
    import threading

    shutdown = getattr(threading, "_shutdown", None)  # what Py_Finalize calls first (CPython 3.8-3.13)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    if flush_files:
        _flush_open_files()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken console: nothing more to say
            pass
    os._exit(code)


def _flush_open_files() -> None:
    import gc
    import io

    for obj in gc.get_objects():
        if isinstance(obj, io.IOBase):
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except (OSError, ValueError):
                pass


def exit_code(exit: SystemExit) -> int:
    """The status ``sys.exit(x)`` ends a process with: 0 for None, the number, else 1 after printing ``x`` to
    stderr (as the interpreter does)."""
    if exit.code is None:
        return 0
    if isinstance(exit.code, int):
        return exit.code
    print(exit.code, file=sys.stderr)
    return 1


def pid_alive(pid: int | None) -> bool:
    """Whether a process with this id exists (signal 0 tells; one of another user's counts as alive)."""
    if not pid:
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
