"""An ordered process pool that always ends: ``workers`` forked processes, each with a pipe of its own.

Why not ``multiprocessing.Pool``: its workers share two queues guarded by process-shared locks, and three helper
threads move work between them. A worker that dies holding a lock or mid-message (killed by Slurm, by the OOM killer,
by ``Pool.terminate`` itself) leaves those threads waiting forever, and ``terminate``/``join`` with them (the data
prepare job hung there: once RUNNING forever in a submitit job whose SIGTERM handler the workers had inherited, once for
minutes after an input error in a loaded test run). Here nothing is shared: the parent sends one item to a worker,
reads its one reply from the same pipe, and ends the pool with SIGKILL, which no inherited handler can bypass, and a
bounded join. A worker that dies is seen as the end of its pipe and reported in one line with its exit code.

Items go out round-robin with one item in flight per worker (a worker is idle whenever the parent writes to it, so
neither side can block on a full pipe while the other does too), and results come back in input order.
"""

from __future__ import annotations

import collections
import multiprocessing
import signal
import traceback
from typing import Callable, Iterable, Iterator

from hpc_tools.errors import UserError

JOIN_TIMEOUT_S = 10.0
"""How long a worker gets to exit after its last item (or after SIGKILL) before it is killed (or given up on)."""


class WorkerDied(UserError):
    """A worker process ended without answering (killed, out of memory, or crashed in native code): one line, and
    exit code 1 (not bad input, but nothing a traceback would explain better)."""

    exit_code = 1


class OrderedPool:
    """``fn`` over items in ``workers`` forked processes, results in input order (``imap``); end with ``close`` (all
    done: each worker exits on its own) or ``kill`` (on an error: SIGKILL). ``fn`` and whatever it reads are inherited
    by the fork, so they are not pickled; items and results are."""

    def __init__(self, fn: Callable, workers: int):
        if workers < 1:
            raise ValueError(f"workers={workers} must be at least 1")
        ctx = multiprocessing.get_context("fork")
        self._procs: list = []
        self._conns: list = []
        # SIGTERM stays blocked from the fork until the worker's own default handler is in place (_serve): a worker
        # must never run the parent's handler (submitit's logs "Bypassing signal SIGTERM" and carries on)
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            for _ in range(workers):
                parent_end, child_end = ctx.Pipe()
                inherited = [*self._conns, parent_end]  # the worker closes its copies: EOF must reach it
                proc = ctx.Process(target=_serve, args=(fn, child_end, inherited), daemon=True,
                                   name=f"hpc-tools-worker-{len(self._procs)}")
                proc.start()
                child_end.close()
                self._procs.append(proc)
                self._conns.append(parent_end)
        except BaseException:
            self.kill()
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def imap(self, items: Iterable) -> Iterator:
        """``fn(item)`` for every item, in order; a worker's exception is raised here as it was raised there."""
        source = iter(items)
        busy: collections.deque[int] = collections.deque()  # workers with an item in flight, oldest first
        for worker in range(len(self._conns)):
            if not self._give(worker, source):
                break
            busy.append(worker)
        while busy:
            worker = busy.popleft()
            result = self._take(worker)
            if self._give(worker, source):  # the next item goes out before this result is used: no idle worker
                busy.append(worker)
            yield result

    def close(self) -> None:
        """Every item is done: each worker is told to exit, and is killed if it has not within the timeout."""
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass  # already gone: the join below reaps it
        self._end(graceful=True)

    def kill(self) -> None:
        """End the workers now, whatever they are doing (SIGKILL), and reap them."""
        self._end(graceful=False)

    def __enter__(self) -> "OrderedPool":
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.close()
        else:
            self.kill()

    def _give(self, worker: int, source: Iterator) -> bool:
        for item in source:
            try:
                self._conns[worker].send(item)
            except OSError:
                raise self._died(worker) from None
            return True
        return False

    def _take(self, worker: int):
        try:
            ok, value = self._conns[worker].recv()
        except (EOFError, OSError):
            raise self._died(worker) from None
        if not ok:
            raise value
        return value

    def _died(self, worker: int) -> WorkerDied:
        proc = self._procs[worker]
        proc.join(JOIN_TIMEOUT_S)
        code = proc.exitcode
        how = (f"was killed by signal {-code}" if code is not None and code < 0 else
               f"exited with code {code}" if code is not None else "stopped answering")
        hint = " (out of memory? try fewer --workers)" if code == -signal.SIGKILL else ""
        return WorkerDied(f"worker process {proc.pid} {how}{hint}")

    def _end(self, graceful: bool) -> None:
        for proc in self._procs:
            if not graceful and proc.exitcode is None:
                proc.kill()
        for proc in self._procs:
            proc.join(JOIN_TIMEOUT_S)
            if proc.exitcode is None:
                proc.kill()
                proc.join(JOIN_TIMEOUT_S)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []


def _serve(fn: Callable, conn, inherited: list) -> None:
    """A worker: the default SIGTERM (it dies), Ctrl-C left to the parent; then ``fn`` on each item until told to
    stop (None) or the parent's end of the pipe closes."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    for other in inherited:
        other.close()
    while True:
        try:
            item = conn.recv()
        except (EOFError, OSError):
            return
        if item is None:
            return
        try:
            reply = (True, fn(item))
        except UserError as err:
            reply = (False, err)
        except BaseException as err:  # noqa: BLE001 - sent to the parent, which raises it
            reply = (False, _portable(err))
        try:
            conn.send(reply)
        except (OSError, ValueError):
            return
        except Exception as err:  # noqa: BLE001 - the result or the exception would not pickle
            conn.send((False, RuntimeError(f"a worker's reply could not be sent back: {err!r}")))


def _portable(err: BaseException) -> BaseException:
    """The worker's exception with its traceback as a note (the parent's traceback ends at ``imap``)."""
    text = "".join(traceback.format_exception(err)).rstrip()
    if hasattr(err, "add_note"):
        err.add_note(f"in the worker process:\n{text}")
    return err
