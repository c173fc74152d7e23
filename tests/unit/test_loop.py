"""The one training loop (hpc_tools.train.loop) with a fake engine, context and collector: the order of steps,
records, stop agreement, saves and close, which the real backends' integration tests (test_megatron_run,
test_deepspeed_zero, the comm_check runs) exercise end to end."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from hpc_tools.checkpoints.dirs import CheckpointDirs
from hpc_tools.errors import UserError
from hpc_tools.train import loop
from hpc_tools.train.checkpointing.saver import Saver
from hpc_tools.train.engine import NullCollector


class FakeContext:
    """The parts of RankContext the loop uses; ``stop_at`` raises the (agreed) stop flag after that step."""

    def __init__(self, tmp_path: Path, events: list, *, iters: int = 6, interval: int | None = None,
                 stop_at: int | None = None, resume: bool = True, load_path: str | None = None):
        self.events, self.stop_at = events, stop_at
        self.checkpoint_dir = tmp_path / "checkpoints"
        self.recipe = SimpleNamespace(
            training=SimpleNamespace(train_iters=iters, log_interval=2, max_nonfinite_steps=3),
            checkpoint=SimpleNamespace(interval_iters=interval, keep_last=2, resume=resume, load_path=load_path,
                                       verify="checksum", local_dir=None, local_interval_iters=None,
                                       async_save=False, local_replicate=True))
        self.is_rank0 = True
        self.logged: list[str] = []

    def heartbeat(self, step: int) -> None:
        self.events.append(("heartbeat", step))

    def agree_stop(self, final: bool = False) -> bool:
        self.events.append(("agree_stop",))
        return self.stop_at is not None and self.events[-2] == ("heartbeat", self.stop_at)

    def note_layout(self, from_iteration: int) -> None:  # the manifest's layouts (RankContext): no run folder here
        pass

    def finish_preempted(self, step: int) -> None:
        self.events.append(("finish_preempted", step))

    def info(self, msg: str, *args) -> None:
        self.logged.append(msg % args)


class FakeCollector(NullCollector):
    def __init__(self, events: list, coords: dict):
        self.events, self.coords = events, coords

    def start_step(self, step: int) -> None:
        self.events.append(("start_step", step))

    def end_step(self, step: int, **fields) -> None:
        self.events.append(("end_step", step, fields["loss"]))

    def close(self) -> None:
        self.events.append(("collector.close",))


class FakeEngine:
    """Records every call; ``raise_at`` makes that step fail; ``resumed`` is the step a resume returns."""

    def __init__(self, events: list, *, checkpoints: bool = True, raise_at: int | None = None, resumed: int = 0):
        self.events, self.checkpoints, self.raise_at, self.resumed = events, checkpoints, raise_at, resumed

    def describe(self) -> str:
        return "fake"

    def coords(self) -> dict[str, int]:
        return {"pp_rank": 1, "dp_rank": 0}

    def resume(self, source: Path) -> int:
        self.events.append(("resume", source.name))
        return self.resumed

    def batch(self, step: int):
        return [step]

    def step(self, step: int, batch) -> loop.StepResult:
        if step == self.raise_at:
            raise RuntimeError(f"boom at {step}")
        self.events.append(("step", step, batch))
        return loop.StepResult(loss=1.0 / step, note=f"note {step}")

    def write_checkpoint(self, folder: Path, step: int, background: bool) -> None:
        self.events.append(("save", step))

    def checkpoint_meta(self, step: int) -> dict:
        return {"format": "fake"}

    def close(self) -> None:
        self.events.append(("engine.close",))


def run(ctx: FakeContext, engine: FakeEngine) -> list:
    collectors = []

    def collector_for(c, **coords):
        collectors.append(FakeCollector(ctx.events, coords))
        return collectors[-1]

    loop.train(ctx, engine, collector_for=collector_for)
    assert collectors[0].coords == {"pp_rank": 1, "dp_rank": 0}
    return ctx.events


def only(events: list, *names: str) -> list:
    return [e for e in events if e[0] in names]


def test_one_step_in_order_and_a_final_save(tmp_path):
    events: list = []
    ctx = FakeContext(tmp_path, events, iters=2)
    run(ctx, FakeEngine(events))
    assert events[:7] == [("start_step", 1), ("step", 1, [1]), ("end_step", 1, 1.0), ("heartbeat", 1),
                          ("agree_stop",), ("start_step", 2), ("step", 2, [2])]
    assert events[7:] == [("end_step", 2, 0.5), ("heartbeat", 2), ("agree_stop",), ("save", 2),
                          ("collector.close",), ("engine.close",)], "the collector closes first, then the engine"
    assert "fake; steps 1..2" in ctx.logged and "note 2" in ctx.logged and "note 1" not in ctx.logged


def test_interval_saves_and_the_last_step_saves_once(tmp_path):
    events: list = []
    run(FakeContext(tmp_path, events, iters=7, interval=3), FakeEngine(events))
    assert only(events, "save") == [("save", 3), ("save", 6), ("save", 7)]


def test_stop_saves_that_step_then_finishes_preempted_and_returns(tmp_path):
    events: list = []
    run(FakeContext(tmp_path, events, iters=10, interval=4, stop_at=4), FakeEngine(events))
    tail = only(events, "step", "agree_stop", "save", "finish_preempted", "collector.close", "engine.close")
    assert tail[-6:] == [("step", 4, [4]), ("agree_stop",), ("save", 4), ("finish_preempted", 4),
                         ("collector.close",), ("engine.close",)], "one save of step 4, before finish_preempted"
    assert max(e[1] for e in only(events, "step")) == 4


def test_stop_without_checkpoints_still_finishes_preempted(tmp_path):
    events: list = []
    run(FakeContext(tmp_path, events, iters=5, stop_at=2), FakeEngine(events, checkpoints=False))
    assert only(events, "save", "resume") == []
    assert only(events, "finish_preempted") == [("finish_preempted", 2)]


def test_collector_and_engine_closed_when_the_engine_raises(tmp_path):
    events: list = []
    with pytest.raises(RuntimeError, match="boom at 3"):
        run(FakeContext(tmp_path, events, iters=5, interval=1), FakeEngine(events, raise_at=3))
    assert events[-2:] == [("collector.close",), ("engine.close",)]
    assert only(events, "save") == [("save", 1), ("save", 2)]


def test_resume_continues_after_the_newest_complete_checkpoint(tmp_path):
    events: list = []
    ctx = FakeContext(tmp_path, events, iters=5)
    dirs = CheckpointDirs(ctx.checkpoint_dir)
    for step in (2, 3):
        dirs.begin(step)
        dirs.commit(step)
    dirs.begin(4)  # a save killed half way: never resumed from
    run(ctx, FakeEngine(events, resumed=3))
    assert events[0] == ("resume", "iter_0000003")
    assert [e[1] for e in only(events, "step")] == [4, 5]
    assert any(line.startswith("resumed from") and line.endswith("at step 3") for line in ctx.logged)


def test_nothing_to_do_when_the_checkpoint_is_at_the_end(tmp_path):
    events: list = []
    ctx = FakeContext(tmp_path, events, iters=3)
    CheckpointDirs(ctx.checkpoint_dir).begin(3)
    CheckpointDirs(ctx.checkpoint_dir).commit(3)
    run(ctx, FakeEngine(events, resumed=3))
    assert only(events, "step", "save") == []
    assert any(line.startswith("nothing to do") for line in ctx.logged)
    assert events[-2:] == [("collector.close",), ("engine.close",)]


def test_bad_load_path_is_a_user_error_and_the_engine_is_closed(tmp_path):
    events: list = []
    ctx = FakeContext(tmp_path, events, resume=False, load_path=str(tmp_path / "nothing"))
    with pytest.raises(UserError, match="checkpoint.load_path=.*holds no complete checkpoint"):
        loop.train(ctx, FakeEngine(events), collector_for=lambda c, **k: pytest.fail("no collector before resume"))
    assert events == [("engine.close",)]


def test_the_saver_decides_which_steps_save(tmp_path):
    every4 = Saver(FakeContext(tmp_path, [], interval=4), FakeEngine([]))
    assert [s for s in range(1, 11) if every4.tier_due(s, 10, stop=False)] == [4, 8, 10]
    never = Saver(FakeContext(tmp_path, []), FakeEngine([]))
    assert never.tier_due(3, 10, stop=True) == "shared" and never.tier_due(3, 10, stop=False) is None


def test_a_non_finite_step_is_never_saved(tmp_path):
    events: list = []
    saver = Saver(FakeContext(tmp_path, events, interval=2), FakeEngine(events))
    assert saver.save(2, 10, nonfinite=True) == [] and only(events, "save") == []
    [rec] = saver.save(4, 10)
    assert rec.iteration == 4 and rec.verified and only(events, "save") == [("save", 4)]
