"""Post-save step inflation (profiling.post_save) of hand-made step times, against hand computation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from profiling import post_save
from profiling.records import events_path, jsonl_path


def cols(times: dict[int, float], restart: int = 0) -> dict[str, np.ndarray]:
    steps = sorted(times)
    return {"step": np.array(steps), "restart": np.full(len(steps), restart), "step_time_s":
            np.array([times[s] for s in steps], dtype=float)}


def test_inflated_steps_after_an_async_save_are_counted_until_the_first_normal_one():
    # steps 1-30 at 1.0 s (1.1 s for step 7: noise under the threshold), a save after 10 (async) and after 20 (sync)
    times = {s: 1.0 for s in range(1, 31)}
    times.update({11: 4.0, 12: 2.0, 13: 1.0, 14: 3.0})  # 14 is after a normal step: not the save's
    times[7] = 1.1
    p = post_save.compute(cols(times), [(0, 10, True, "local"), (0, 20, False, "shared")], warmup=2)
    assert p.steady_median_s == 1.0
    a, s = p.saves
    assert (a.step, a.async_, a.tier, a.steps) == (10, True, "local", 2)
    assert a.extra_s == pytest.approx(3.0 + 1.0) and a.first_ratio == 4.0 and a.max_ratio == 4.0
    assert (s.steps, s.extra_s, s.first_ratio, s.max_ratio) == (0, 0.0, 1.0, None)
    d = p.as_dict()
    assert d["saves"] == 2 and d["saves_inflated"] == 1 and d["max_steps"] == 2 and d["mean_steps"] == 1.0
    assert d["async"]["saves_inflated"] == 1 and d["sync"]["saves_inflated"] == 0
    # step time of steps 3..30 (two warm-up steps out): 26 x 1.0 + 0.1 + 3 + 1 + 2
    assert d["extra_share"] == pytest.approx(4.0 / (28 + 0.1 + 3 + 1 + 2))
    line = post_save.text(d)
    assert line.startswith("1 of 2 save(s) slowed the next steps (> 1.25x the steady 1 s/step): 1 step(s) per save")
    assert "at most 2" in line and "up to 4.00x" in line


def test_the_steps_after_a_save_stop_at_the_next_save_and_at_a_new_start():
    times = {s: 1.0 for s in range(1, 21)}
    times.update({6: 3.0, 7: 3.0, 8: 3.0})  # saves after 5 and 7: the first save owns steps 6 and 7 only
    p = post_save.compute(cols(times), [(0, 5, True, "local"), (0, 7, True, "local")], warmup=0)
    assert [x.steps for x in p.saves] == [2, 1]
    # a save after the last step of a start: the next start's steps are not its steps
    both = {k: np.concatenate([cols({s: 1.0 for s in range(1, 11)})[k], cols({s: 5.0 for s in range(9, 13)}, 1)[k]])
            for k in ("step", "restart", "step_time_s")}
    p = post_save.compute(both, [(0, 10, True, "shared")], warmup=0)
    assert p.saves[0].steps == 0 and p.saves[0].first_ratio is None


def test_measure_reads_the_lowest_ranks_records_and_events(tmp_path):
    records = tmp_path / "records"
    records.mkdir()
    for rank, slow in ((0, 2.5), (1, 9.0)):  # rank 1's own times are not read: the lowest rank speaks
        with open(jsonl_path(records, rank), "w") as f:
            for s in range(1, 16):
                f.write(json.dumps({"step": s, "restart": 0, "step_time_s": slow if s == 9 else 0.5}) + "\n")
        with open(events_path(records, rank), "w") as f:
            for e in ({"event": "start", "time": 1.0}, {"event": "checkpoint_save", "step": 8, "restart": 0,
                                                        "async": True, "tier": "shared", "time": 9.0}):
                f.write(json.dumps(e) + "\n")
    d = post_save.measure(records, warmup=1).as_dict()
    assert d["steady_median_s"] == 0.5 and d["per_save"] == [
        {"step": 8, "restart": 0, "async": True, "tier": "shared", "steps": 1, "extra_s": 2.0, "first_ratio": 5.0,
         "max_ratio": 5.0}]
    assert post_save.text(post_save.measure(tmp_path / "none", warmup=1).as_dict()) is None
