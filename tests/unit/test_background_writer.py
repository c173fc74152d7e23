"""Megatron's background checkpoint writer on a GPU (``train/megatron/checkpoint.py`` ``BackgroundWriter``), checked
without one: the persistent writer process starts when the writer is built (not at the first save, nor cold again
at the save after an abort), and on the rank's own device (its local index) instead of megatron-core's
``global rank % device_count``. The process itself is replaced by a recorder: what is checked is what it is given."""

from __future__ import annotations

import gc
import multiprocessing

import pytest


class Recorded:
    """Stands in for the spawned process: records its target and arguments, starts nothing."""

    started: list = []
    active = False

    def __init__(self, target, args):
        self.target, self.args = target, args

    def start(self) -> None:
        Recorded.started.append(self)

    def kill(self) -> None:
        pass


@pytest.fixture
def writer_on(monkeypatch):
    from megatron.core.dist_checkpointing.strategies import async_utils

    from hpc_tools.train.megatron import checkpoint

    Recorded.started = []
    real = multiprocessing.get_context

    class Spawn:  # the spawn context (its queues), but its Process records
        Process = Recorded

        def __getattr__(self, name):
            return getattr(real("spawn"), name)

    monkeypatch.setattr(multiprocessing, "get_context", lambda method=None: Spawn() if method == "spawn" and
                        Recorded.active else real(method))
    monkeypatch.setattr(checkpoint, "_start_results_queue", lambda: None)  # no Manager process in a unit test
    monkeypatch.setattr(async_utils.torch.distributed, "get_rank", lambda: 5)  # global rank 5, local device 1
    writers = []

    def build(device_index):
        Recorded.active = True
        try:
            writers.append(checkpoint.BackgroundWriter(device_index))
        finally:
            Recorded.active = False
        return writers[-1]

    yield build, async_utils
    Recorded.active = False
    for writer in writers:
        writer.close()  # kills the recorded process (nothing), so no writer waits for it at exit
    writers.clear()
    gc.collect()  # the callers' __del__ (it asks torch.distributed for the rank) while get_rank is still stood in


def test_the_persistent_writer_starts_when_built_on_the_ranks_own_device(writer_on):
    build, async_utils = writer_on
    writer = build(1)
    [proc] = Recorded.started
    assert proc.target is async_utils.PersistentAsyncCaller.async_loop
    assert proc.args[0] == 1, "the local device index, not the global rank (5): async_loop sets rank % device_count"
    caller = writer.queue.persistent_caller
    assert caller.process is proc and proc.args[1:4] == (caller.queue, caller.preload_q, caller.comp_q)


def test_after_an_abort_the_writer_restarts_on_the_same_device_before_the_next_save(writer_on, monkeypatch):
    build, _ = writer_on
    writer = build(1)
    writer.queue.persistent_caller.process = None  # what close(abort=True) leaves
    scheduled = []
    monkeypatch.setattr(writer.queue, "schedule_async_request", scheduled.append)
    monkeypatch.setattr("hpc_tools.train.megatron.checkpoint.MegatronWrite", lambda queue: "write")

    class Request:
        preload_fn = None

    Recorded.active = True
    assert writer.schedule(Request()) == "write" and len(scheduled) == 1
    assert [p.args[0] for p in Recorded.started] == [1, 1], "started again by us, on device 1, not by the library"


def test_on_cpu_no_persistent_writer_is_started(writer_on):
    build, _ = writer_on
    writer = build(None)
    assert Recorded.started == [] and not writer.queue.persistent
