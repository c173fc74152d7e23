"""Calibrated hang detection (issue 48 item 1): each phase's bound from the run's observed maxima x a factor, with
floors, capped, carried across starts in the run folder; ``cluster.hang_timeout_min`` as an explicit override.

The bounds are checked as properties over drawn phases and observations (hypothesis), with the real defaults; the
watchdog's thread is then run for real with small floors (``Bounds(floors=...)``, a constructor argument, not a
recipe knob) so that a step, a slow save and an evaluation take tenths of a second."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_tools.recipe.load import load_recipe
from hpc_tools.registry import RunFolder
from hpc_tools.runtime import hang_bounds as hb
from hpc_tools.runtime import watchdog as wd
from hpc_tools.runtime.context import WATCHDOG_MARGIN_S, RankContext
from hpc_tools.runtime.hang_bounds import EVAL, FIRST, PHASES, SAVE, STEP, Bounds, Observed
from hpc_tools.runtime.rank import record_hang

CAP = hb.DEFAULT_CAP_MIN * 60
observations = st.lists(st.tuples(st.sampled_from(PHASES), st.floats(0.0, 5000.0, allow_nan=False)), max_size=40)


def calibrated(obs) -> Bounds:
    b = Bounds()
    for phase, seconds in obs:
        b.add(phase, seconds)
    return b


@settings(max_examples=300, derandomize=True, deadline=None)
@given(obs=observations, phase=st.sampled_from(PHASES))
def test_a_calibrated_bound_is_the_slowest_observed_x_the_factor_between_its_floor_and_the_cap(obs, phase):
    b = calibrated(obs)
    cap = CAP + (hb.STARTUP_S if phase == FIRST else 0)
    seen = [s for p, s in obs if p == phase]
    limit = b.bound(phase)
    assert limit <= cap
    if not seen or (phase == STEP and len(seen) < hb.WARMUP_STEPS):
        assert limit == cap, (phase, seen)  # nothing known yet (or the step's warm-up): the cap
    else:
        assert limit == min(cap, max(hb.FLOORS[phase], hb.FACTOR * max(seen)))
        assert limit >= hb.FLOORS[phase] and (limit == cap or limit >= hb.FACTOR * max(seen))
    if phase == STEP and len(seen) >= hb.WARMUP_STEPS and hb.FACTOR * max(seen) <= CAP:
        assert limit == max(60.0, 5 * max(seen))  # the words: max(60 s, 5 x the slowest observed step)
    assert str(round(limit)) in b.why(phase)


@settings(max_examples=150, derandomize=True, deadline=None)
@given(obs=observations, more=observations, phase=st.sampled_from(PHASES))
def test_more_observations_never_lower_a_bound_once_calibrated(obs, more, phase):
    b = calibrated(obs)
    warm = b.observed.steps >= hb.WARMUP_STEPS or phase != STEP
    before = b.bound(phase) if phase in b.observed.max_s and warm else None
    for p, s in more:
        b.add(p, s)
    if before is not None:
        assert b.bound(phase) >= before


@settings(max_examples=100, derandomize=True, deadline=None)
@given(obs=observations, minutes=st.floats(0.01, 120.0), phase=st.sampled_from(PHASES))
def test_an_explicit_hang_timeout_is_every_phases_fixed_bound(obs, minutes, phase):
    b = Bounds.of_cluster(minutes)
    for p, s in obs:
        b.add(p, s)
    assert not b.calibrated and not b.off
    assert b.bound(phase) == pytest.approx(minutes * 60 + (hb.STARTUP_S if phase == FIRST else 0))
    assert Bounds.of_cluster(0).off


def test_the_maxima_are_kept_in_the_run_folder_and_carried_to_the_next_start(tmp_path):
    b = Bounds.of_cluster(None, tmp_path, world_size=4)
    assert b.calibrated and b.bound(STEP) == CAP and b.bound(FIRST) == CAP + hb.STARTUP_S
    b.add(FIRST, 200.0)
    for s in (1.0, 3.0, 2.0, 20.0, 2.0):
        b.add(STEP, s)
    b.add(SAVE, 100.0)
    b.save(tmp_path)
    again = Bounds.of_cluster(None, tmp_path, world_size=4)  # the next start: calibrated before its first step
    assert again.bound(FIRST) == 1000.0 and again.bound(STEP) == 100.0 and again.bound(SAVE) == 500.0
    assert again.bound(EVAL) == CAP  # never observed
    assert Bounds.of_cluster(None, tmp_path, world_size=2).bound(STEP) == CAP  # another world size: not used
    assert Bounds.of_cluster(2.0, tmp_path, world_size=4).bound(STEP) == 120.0  # the override wins
    (tmp_path / hb.FILE).write_text("{not json")
    assert Observed.load(tmp_path, 4).max_s == {}


def test_a_recipe_without_a_hang_setting_is_calibrated_and_its_process_group_outlasts_the_cap():
    recipe = load_recipe("recipes/gpt_3d.yaml", profile="local")
    assert recipe.cluster.hang_timeout_min is None and Bounds.of_cluster(recipe.cluster.hang_timeout_min).calibrated
    ctx = RankContext(recipe=recipe, layout=None, dist=None, run=None)
    assert ctx.collective_timeout == timedelta(seconds=CAP + WATCHDOG_MARGIN_S)
    fixed = load_recipe("recipes/gpt_3d.yaml", ["cluster.hang_timeout_min=0.5"], profile="local")
    assert Bounds.of_cluster(fixed.cluster.hang_timeout_min).bound(STEP) == 30.0


# -- the watchdog's thread, for real, with small floors --------------------------------------------------------------
SMALL = {FIRST: 2.0, STEP: 0.4, SAVE: 0.4, EVAL: 0.4}


@pytest.fixture
def dog(tmp_path, monkeypatch):
    monkeypatch.setattr(wd, "CHECK_S", 0.02)
    hangs: list[tuple[float, str | None, dict]] = []
    d = wd.Watchdog(0, tmp_path, 0, bounds=Bounds(cap_s=30.0, floors=dict(SMALL)))
    monkeypatch.setattr(d, "_hang", lambda idle, section=None: hangs.append((idle, section, d._detection(section)))
                        or d._stop.set())
    d.start()
    yield d, hangs
    d.stop()


def steps(d, n: int, seconds: float = 0.02) -> None:
    for _ in range(n):
        time.sleep(seconds)
        d.beat(d.beat_record.step + 1)


def test_a_slow_save_and_an_evaluation_are_no_hang_but_a_stopped_step_is_within_its_bound(dog, tmp_path):
    d, hangs = dog
    steps(d, hb.WARMUP_STEPS + 2)  # the first step, then the warm-up
    assert d.bounds.bound(STEP) == 0.4  # max(floor 0.4 s, 5 x ~0.02 s)
    with d.outside_step(SAVE):  # a save of 1.2 s: several times the step bound; its first: the cap bounds it
        for _ in range(6):
            time.sleep(0.2)
            d.progress()
    with d.outside_step(EVAL):  # an evaluation of 0.8 s, also several step bounds
        time.sleep(0.8)
    steps(d, 3)
    assert hangs == []
    assert d.bounds.observed.max_s[SAVE] >= 0.2 and d.bounds.observed.max_s[EVAL] >= 0.8
    assert d.bounds.bound(EVAL) >= 4.0  # 5 x its own slowest, not the step's
    with d.outside_step(SAVE):  # a save that saved nothing (no progress): not an observation of a save
        pass
    assert d.bounds.observed.max_s[SAVE] >= 0.2
    stopped = time.monotonic()
    time.sleep(1.0)  # the rank stops after its step: named within the step bound (+ the thread's check)
    assert hangs and hangs[0][1] is None
    idle, _, detection = hangs[0]
    assert 0.4 < idle < 0.4 + 0.2
    assert detection["phase"] == STEP and detection["timeout_s"] == 0.4 and detection["step"] == d.beat_record.step
    assert detection["detected_after_s"] <= time.monotonic() - stopped + 0.05
    time.sleep(0.1)  # rank 0's thread kept the maxima in the run folder
    kept = json.loads((tmp_path / hb.FILE).read_text())
    assert kept["steps"] >= hb.WARMUP_STEPS and set(kept["max_s"]) == {FIRST, STEP, SAVE, EVAL}


def test_a_save_that_stalls_past_its_calibrated_bound_is_a_hang(dog):
    d, hangs = dog
    steps(d, 2)
    with d.outside_step(SAVE):
        time.sleep(0.05)
        d.progress()
    assert d.bounds.bound(SAVE) == 0.4  # calibrated from that save: its floor
    with d.outside_step(SAVE):
        d.progress()
        time.sleep(0.8)
    assert hangs and hangs[0][1] == SAVE and hangs[0][2]["phase"] == SAVE and hangs[0][0] > 0.4


def test_the_verdict_and_its_detection_time_are_in_the_manifest(tmp_path):
    run = RunFolder.create(tmp_path, "r", "name: r\n", "", {"state": "RUNNING"})
    detection = {"phase": STEP, "timeout_s": 60.0, "bound": "60 s", "detected_after_s": 62.5, "step": 25,
                 "restart": 0}
    verdict = wd.HangVerdict(culprits=[1], nodes=["n1"], waiting=[0, 2, 3], line="rank 1 (n1) stopped",
                             detection=detection)
    record_hang(run, verdict)
    record_hang(run, verdict)
    m = run.manifest()
    assert m["state"] == "HANG" and len(m["hangs"]) == 2
    assert m["hangs"][0]["detected_after_s"] == 62.5 and m["hangs"][0]["ranks"] == [1] and m["hangs"][0]["at"]


def test_an_evaluation_runs_outside_the_step_clock(tmp_path, monkeypatch):
    from hpc_tools.train.loop import Evaluation

    monkeypatch.setattr(wd, "CHECK_S", 0.02)
    d = wd.Watchdog(0, tmp_path, 1, bounds=Bounds(cap_s=30.0, floors=dict(SMALL)))
    engine = SimpleNamespace(evaluate=lambda batches: time.sleep(0.3) or 1.5)
    ev = Evaluation(SimpleNamespace(watchdog=d), engine)
    ev._batches = [["a batch"]]
    before = d._last
    loss, seconds = ev()
    assert loss == 1.5 and seconds >= 0.3
    assert d.bounds.observed.max_s[EVAL] >= 0.3 and d._last >= before + 0.3  # the step clock stood still


def test_the_goodput_report_and_status_show_each_hangs_detection_time(tmp_path):
    import pandas as pd

    from hpc_tools.analysis.analyze import Analysis
    from hpc_tools.analysis.report import _hang_lines
    from hpc_tools.cli.status import _health_lines
    from profiling import goodput

    (tmp_path / "records").mkdir()
    hangs = [{"phase": STEP, "timeout_s": 60.0, "detected_after_s": 62.5, "step": 25, "restart": 0},
             {"phase": SAVE, "timeout_s": 300.0, "detected_after_s": 303.1, "step": 40, "restart": 1}]
    summary = goodput.measure(tmp_path / "records", {"state": "COMPLETED", "hangs": hangs}, 4, False).summary()
    assert summary["hangs"] == 2 and summary["hang_detection_s"] == [62.5, 303.1]
    none = goodput.measure(tmp_path / "records", {"state": "COMPLETED"}, 4, False).summary()
    assert none["hangs"] == 0 and none["hang_detection_s"] == []
    frame = pd.DataFrame([{"run_id": "a", **summary}, {"run_id": "b", **none}])
    empty = pd.DataFrame()
    lines = _hang_lines(Analysis(runs=empty, ranks=empty, steps=empty, scaling=[], goodput=frame))
    assert len(lines) == 3 and "a: 2 hang(s), each named 62 s, 303 s after its last progress" in lines[1]
    assert _hang_lines(Analysis(runs=empty, ranks=empty, steps=empty, scaling=[], goodput=frame.iloc[1:])) == []
    text = _health_lines({"straggler_verdict": "none", "goodput": summary})
    assert any(line.startswith("hangs    2, named 62 s, 303 s after the last progress") for line in text), text
