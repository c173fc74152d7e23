"""The data prepare's worker pool: results in order, a worker's error raised as itself, and the pool always ends, in
bounded time, with every worker reaped: after an error, with workers that ignore SIGTERM, with a worker that died,
with a worker blocked mid-reply, and over many failing runs in a row (the old ``multiprocessing.Pool`` once waited
minutes in ``terminate`` after an input error on a loaded machine)."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time

import pytest

from hpc_tools.data.pool import JOIN_TIMEOUT_S, OrderedPool, WorkerDied
from hpc_tools.errors import UserError


def _slow_square(x: int) -> int:
    time.sleep(random.Random(x).random() * 0.02)  # replies come back out of order unless the pool orders them
    return x * x


def _fail_at_5(x: int) -> int:
    if x == 5:
        raise UserError(f"item {x} is bad")
    time.sleep(0.01)
    return x


def _stubborn(x: int) -> int:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if x == 1:
        time.sleep(3600)
    return x


def _sleep_on_1(x: int) -> int:
    if x == 1:
        time.sleep(3600)
    return x


def _die(x: int) -> int:
    if x == 3:
        os._exit(7)
    return x


def _big(x: int) -> bytes:
    return bytes(16 << 20)  # far more than a pipe holds: the worker blocks in its send until the parent reads


def _sigterm_handler(_: int):
    return signal.getsignal(signal.SIGTERM)


def _broken(x: int):
    raise ValueError("not a user error")


def _all_reaped(pids: list[int]) -> bool:
    alive = {p.pid for p in multiprocessing.active_children()}
    return not alive & set(pids)


def test_results_come_back_in_input_order_from_every_worker():
    with OrderedPool(_slow_square, 3) as pool:
        pids = pool.pids
        assert list(pool.imap(range(40))) == [x * x for x in range(40)]
        assert list(pool.imap([])) == []
        assert list(pool.imap(range(2))) == [0, 1]  # fewer items than workers
    assert len(set(pids)) == 3 and _all_reaped(pids)


def test_a_workers_user_error_is_raised_as_itself_and_the_pool_ends_every_time():
    for _ in range(25):  # the failing path again and again: each end is bounded and reaps both workers
        pool = OrderedPool(_fail_at_5, 2)
        pids = pool.pids
        t0 = time.monotonic()
        with pytest.raises(UserError, match=r"^item 5 is bad$"):
            with pool:
                list(pool.imap(range(50)))
        assert time.monotonic() - t0 < JOIN_TIMEOUT_S
        assert _all_reaped(pids)


def test_other_exceptions_carry_the_workers_traceback():
    with pytest.raises(ValueError, match="not a user error") as err:
        with OrderedPool(_broken, 2) as pool:
            list(pool.imap(range(3)))
    notes = getattr(err.value, "__notes__", [])
    assert any("in the worker process" in n and "_broken" in n for n in notes), notes


def test_workers_that_ignore_sigterm_and_never_return_are_still_ended():
    pool = OrderedPool(_stubborn, 2)
    pids = pool.pids
    results = pool.imap(range(4))
    assert next(results) == 0  # worker 1 is now asleep for an hour with SIGTERM ignored
    t0 = time.monotonic()
    pool.kill()
    assert time.monotonic() - t0 < JOIN_TIMEOUT_S
    assert _all_reaped(pids)


def test_a_worker_that_dies_is_one_line_naming_its_exit_code_not_a_hang():
    pool = OrderedPool(_die, 2)
    t0 = time.monotonic()
    with pytest.raises(WorkerDied, match=r"^worker process \d+ exited with code 7$"):
        with pool:
            list(pool.imap(range(10)))
    assert time.monotonic() - t0 < 2 * JOIN_TIMEOUT_S


def test_a_worker_killed_from_outside_is_named_with_its_signal():
    pool = OrderedPool(_sleep_on_1, 2)
    results = pool.imap(range(4))
    assert next(results) == 0
    os.kill(pool.pids[1], signal.SIGTERM)  # what scancel sends: a worker has the default handler, so it dies
    with pytest.raises(WorkerDied, match=r"^worker process \d+ was killed by signal 15$"):
        next(results)
    pool.kill()


def test_a_worker_blocked_mid_reply_is_ended():
    pool = OrderedPool(_big, 2)
    pids = pool.pids
    results = pool.imap(range(4))
    assert len(next(results)) == 16 << 20  # worker 0 now has item 2 and worker 1 item 1: both block in their send
    time.sleep(0.5)
    t0 = time.monotonic()
    pool.kill()
    assert time.monotonic() - t0 < JOIN_TIMEOUT_S
    assert _all_reaped(pids)


def test_a_worker_runs_the_default_sigterm_whatever_the_parent_installed():
    """A submitit job's process handles SIGTERM by logging it and carrying on: a worker must not inherit that."""
    previous = signal.signal(signal.SIGTERM, lambda *a: None)
    try:
        pool = OrderedPool(_sigterm_handler, 2)
    finally:
        signal.signal(signal.SIGTERM, previous)
    with pool:
        assert list(pool.imap(range(2))) == [signal.SIG_DFL, signal.SIG_DFL]
