"""Local CPU ranks forked from one process that imported their libraries once, instead of each importing them.

A rank's start costs its imports: torch (~2.4 CPU-s on this project's 2-core test machine), then its backend's
library (megatron-core, DeepSpeed, transformers: ~1-3 s more). Ranks on one machine import the same modules, so the
local executor and the test spawner start one server process (``python -m hpc_tools.runtime.forkserver``) that
imports torch and the backend row's ``preload`` functions once, then forks every rank from it. Each child is set up
as ``subprocess.Popen(..., start_new_session=True, pass_fds=...)`` would start it: a session of its own, the rank's
environment, working directory and output, stdin from /dev/null, no other descriptor than those it is given, then
the same program (``python -m MODULE ARGS`` or ``python SCRIPT ARGS``) run as ``__main__``. Warnings the imports
raised in the server are raised again in each rank once its log is set up (``replay_warnings``), so its log keeps
them. ``benchmarks/bench_local_start.py`` times a local run both ways.

Only for ranks on the CPU with a CPU build of torch (``usable``): a process that has initialised CUDA cannot hand it
to forked children, and a CUDA build's libraries may initialise it at import, so GPU ranks, and any rank of a CUDA
build, start each with its own interpreter. Only the
server imports anything before the fork, on one thread (torch starts no thread at import; its OpenMP pool starts at
the first parallel operator, which no import runs), so the children start clean.

A forked rank's command line (``/proc/PID/cmdline``, ``ps``) is the server's, which carries the rank's:
``python -m hpc_tools.runtime.forkserver -m hpc_tools.runtime.rank --run-dir RUN`` (what ``hpc_tools resume`` reads
to tell a live rank of a run); its ``/proc/PID/environ`` is the server's too (the rank's own is in ``os.environ``).

The protocol: the caller writes one JSON line to the server's stdin (``Spec``: the program, the preload functions,
each rank's environment, output descriptor and extra descriptors) and reads lines from a status pipe it passes:
``R started PID`` once rank R is forked, ``R exited CODE`` when it exits (CODE as ``Popen.returncode``: negative
for a signal). The server exits once every rank has. ``start`` returns one ``ForkedRank`` per rank, with the
``Popen`` methods the local executor and the spawner use (``pid``, ``poll``, ``wait``, ``returncode``, ``stdout``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import IO, Any, NoReturn

from hpc_tools.runtime.process_end import exit_code, exit_process, pid_alive

SERVER = "hpc_tools.runtime.forkserver"
RANK_ONLY_VARS = ("RANK", "LOCAL_RANK")
"""Variables each rank's environment sets for itself: the server starts without them."""
_pending: list[tuple[str, str, str, int, str]] = []  # in a forked rank: the server's import warnings, to raise again


def usable(argv: Sequence[str], uses_gpus: bool) -> bool:
    """Whether ranks running ``argv`` can be forked from the server: CPU ranks of this Python running a module or a
    script, with a CPU build of torch (a CUDA build's imports may initialise CUDA before the fork);
    ``HPC_TOOLS_FORKSERVER=0`` turns it off: each rank imports for itself, as srun's ranks do."""
    if uses_gpus or os.environ.get("HPC_TOOLS_FORKSERVER", "1") == "0" or not cpu_torch():
        return False
    args = [str(a) for a in argv]
    return len(args) >= 2 and args[0] == sys.executable and (args[1] == "-m" and len(args) >= 3
                                                             or args[1].endswith(".py"))


def cpu_torch() -> bool:
    """Whether this Python's torch is a CPU build (its version names ``+cpu``); False without torch."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return "+cpu" in version("torch")
    except PackageNotFoundError:
        return False


class ForkedRank:
    """One forked rank, as the caller sees it: what it uses of ``subprocess.Popen``."""

    def __init__(self, rank: int, stdout: IO[bytes] | None):
        self.rank, self.stdout = rank, stdout
        self.pid: int | None = None
        self.returncode: int | None = None
        self._lost = False  # the server ended without reporting this rank's exit

    def poll(self) -> int | None:
        if self.returncode is None and self._lost and not pid_alive(self.pid):
            self.returncode = 1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank {self.rank}", timeout)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.pid and self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        import signal

        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)


def start(argv: Sequence[str], envs: Sequence[Mapping[str, str]], outs: Sequence[int | None],
          preload: Sequence[str] = (), rank0_fds: Sequence[int] = (), cwd: str | None = None,
          start_timeout_s: float = 600.0) -> list[ForkedRank]:
    """Fork ``len(envs)`` ranks running ``argv`` from one server that ran ``preload`` first (``"module:function"``
    called, ``"module"`` imported).

    ``outs[r]``: the descriptor rank r's stdout and stderr go to (a file's), or None for a new pipe, readable as the
    returned rank's ``stdout``; ``rank0_fds``: descriptors rank 0 keeps (the rendezvous socket). Returns once every
    rank has its pid (the server's imports take a few seconds); the server's own output goes to rank 0's."""
    pipes: list[tuple[int, int] | None] = [os.pipe() if out is None else None for out in outs]
    out_fds = [out if out is not None else pipe[1] for out, pipe in zip(outs, pipes)]  # type: ignore[index]
    status_r, status_w = os.pipe()
    spec = {"argv": [str(a) for a in argv], "preload": list(preload), "status_fd": status_w, "cwd": cwd,
            "ranks": [{"env": dict(env), "out_fd": fd, "fds": list(rank0_fds) if r == 0 else []}
                      for r, (env, fd) in enumerate(zip(envs, out_fds))]}
    server_env = {k: v for k, v in envs[0].items() if k not in RANK_ONLY_VARS}
    ranks = [ForkedRank(r, os.fdopen(pipe[0], "rb") if pipe else None) for r, pipe in enumerate(pipes)]
    try:
        server = subprocess.Popen([sys.executable, "-m", SERVER, *spec["argv"][1:]], stdin=subprocess.PIPE,
                                  stdout=out_fds[0], stderr=subprocess.STDOUT, env=server_env, cwd=cwd,
                                  start_new_session=True, pass_fds=(status_w, *sorted(set(out_fds)), *rank0_fds))
    finally:
        os.close(status_w)
        for pipe in pipes:
            if pipe:
                os.close(pipe[1])
    assert server.stdin is not None
    server.stdin.write(json.dumps(spec).encode() + b"\n")
    server.stdin.close()
    started = threading.Event()
    threading.Thread(target=_follow, args=(os.fdopen(status_r, "rb"), ranks, server, started), daemon=True,
                     name="forkserver-status").start()
    if not started.wait(start_timeout_s):
        server.kill()
        started.wait(5)
    return ranks


def _follow(status: IO[bytes], ranks: list[ForkedRank], server: subprocess.Popen, started: threading.Event) -> None:
    """The status pipe's lines into the ranks; at its end (the server exited) ranks never reported are settled."""
    with status:
        for line in status:
            rank, what, value = line.decode().split()
            if what == "started":
                ranks[int(rank)].pid = int(value)
                if all(r.pid for r in ranks):
                    started.set()
            else:
                ranks[int(rank)].returncode = int(value)
    code = server.wait()
    for r in ranks:
        if r.returncode is None:
            if r.pid is None:  # never forked: the server failed before it (its output is rank 0's)
                r.returncode = code or 1
            r._lost = True
    started.set()


def replay_warnings() -> None:
    """In a forked rank, once its log is set up: raise again the warnings the server's imports raised (no-op in a
    rank that imported for itself)."""
    while _pending:
        message, category, filename, lineno, module = _pending.pop(0)
        cls = _category(category)
        warnings.warn_explicit(message, cls, filename, lineno, module=module)


def _category(name: str) -> type[Warning]:
    module, _, qual = name.rpartition(".")
    try:
        found = getattr(sys.modules[module], qual)
    except (KeyError, AttributeError):
        return UserWarning
    return found if isinstance(found, type) and issubclass(found, Warning) else UserWarning


# ---------------------------------------------------------------------------------------------------------------
# the server


def _preload(refs: Sequence[str]) -> list[tuple[str, str, str, int, str]]:
    """Each ``"module:function"`` imported and called in order (``"module"``: imported), with the warnings they
    raised; after a failing one nothing more is preloaded: the ranks import it again and report it in their own
    log."""
    import importlib

    with warnings.catch_warnings(record=True) as caught:  # the filters a rank has before its imports
        for ref in refs:
            module, _, name = ref.partition(":")
            try:
                imported = importlib.import_module(module)
                if name:
                    getattr(imported, name)()
            except (Exception, SystemExit):  # noqa: BLE001 - the rank imports it again and fails in its own log
                break
    seen, out = set(), []
    for w in caught:
        cat = type(w.message) if isinstance(w.message, Warning) else w.category
        item = (str(w.message), f"{cat.__module__}.{cat.__qualname__}", w.filename, w.lineno,
                _module_of(w.filename))
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out


def _module_of(filename: str) -> str:
    name = os.path.splitext(os.path.basename(filename))[0]
    return name or "<unknown>"


def _child(spec: dict[str, Any], rank: int, pending: list) -> None:
    """In the forked child: become rank ``rank`` as Popen would start it, then run the program as ``__main__``; its
    end (a return, ``SystemExit``) ends this process with its code, without the teardown of the server's imports
    (``process_end.exit_process``, its open files flushed first); an exception takes the usual path, with its
    traceback. The rank program ends itself that way before, with nothing to flush."""
    import runpy

    own = spec["ranks"][rank]
    os.dup2(own["out_fd"], 1)
    os.dup2(own["out_fd"], 2)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    keep = sorted({0, 1, 2, *own["fds"]})
    for low, high in zip(keep, [*keep[1:], os.sysconf("SC_OPEN_MAX")]):
        os.closerange(low + 1, high)
    os.environ.clear()
    os.environ.update(own["env"])
    if spec.get("cwd"):
        os.chdir(spec["cwd"])
    _pending[:] = pending
    argv = spec["argv"]
    try:
        if argv[1] == "-m":
            sys.argv = [argv[2], *argv[3:]]
            sys.modules.pop(argv[2], None)  # preloaded: ``python -m`` runs a fresh copy as __main__
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv[1:]
            sys.path[0] = os.path.dirname(os.path.abspath(argv[1]))
            runpy.run_path(argv[1], run_name="__main__")
    except SystemExit as end:
        exit_process(exit_code(end), flush_files=True)
    exit_process(0, flush_files=True)


def serve() -> NoReturn:
    """The server: read the spec, import, fork every rank, report their pids and exit codes, then end."""
    spec = json.loads(sys.stdin.buffer.readline())
    status = spec["status_fd"]
    pending = _preload(spec["preload"])
    sys.stdout.flush()
    sys.stderr.flush()
    children: dict[int, int] = {}
    for rank in range(len(spec["ranks"])):
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(status)
            os.close(ready_r)
            os.setsid()  # before the pid is reported: the caller signals the rank's process group
            os.close(ready_w)
            _child(spec, rank, pending)  # never returns: the program's exit ends the child
        os.close(ready_w)
        os.read(ready_r, 1)  # EOF once the child has its own session
        os.close(ready_r)
        children[pid] = rank
        os.write(status, f"{rank} started {pid}\n".encode())
    for own in spec["ranks"]:  # the ranks hold their descriptors now: EOF reaches the reader when they exit
        for fd in {own["out_fd"], *own["fds"]}:
            try:
                os.close(fd)
            except OSError:
                pass
    while children:
        pid, wstatus = os.wait()
        rank = children.pop(pid, None)
        if rank is not None:
            os.write(status, f"{rank} exited {os.waitstatus_to_exitcode(wstatus)}\n".encode())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # without the teardown of what it imported (~1 CPU-s): it holds no file, thread or child


if __name__ == "__main__":  # run in the named module: a forked rank's ``replay_warnings`` finds ``_pending`` there
    from hpc_tools.runtime.forkserver import serve as _serve

    _serve()
