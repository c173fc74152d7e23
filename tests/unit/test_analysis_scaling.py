"""Scaling fits: reported only where they mean something.

Known serial fractions (0, 0.1, 0.5) are recovered within their 95 % interval; noisy, two-point, super-linear and
slowing-down series get "no fit" with the reason; no series, however wild, yields a serial fraction outside [0, 1] or
a negative speedup.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from hpc_tools.analysis.analyze import analyse
from hpc_tools.analysis.plots import efficiency, throughput
from hpc_tools.analysis.report import render_markdown
from hpc_tools.analysis.scaling import MIN_R2, fit_amdahl, fit_gustafson, t95
from hpc_tools.testing.synthetic import amdahl_times, synthetic_run

GPUS = (1, 2, 4, 8, 16)


def run_medians(serial: float, gpus=GPUS, repeats: int = 3, run_noise: float = 0.02, seed: int = 0):
    """(GPU count, median step time) per run: the slowest rank per step (amdahl_times, 3 % step noise), then a
    run-to-run factor (the spread between repeats of one layout)."""
    rng = np.random.default_rng(seed)
    n, t = [], []
    for g in gpus:
        for _ in range(repeats):
            steps = amdahl_times(g, serial, 2.0, 60, 0.03, rng, ranks=2).max(axis=0)
            n.append(g)
            t.append(float(np.median(steps)) * (1 + run_noise * rng.standard_normal()))
    return np.array(n), np.array(t)


def assert_physical(fit) -> None:
    """Whatever the verdict: no serial fraction or interval outside [0, 1]; "no fit" always carries its reason."""
    if fit.ok:
        lo, hi = fit.interval
        assert 0.0 <= lo <= fit.serial_fraction <= hi <= 1.0, fit
        assert fit.r2 >= MIN_R2
        assert "95 % interval" in fit.verdict() and "R^2" in fit.verdict()
    else:
        assert fit.serial_fraction is None and fit.interval is None and fit.r2 is None
        assert ": no fit (" in fit.reason and fit.reason.endswith(")")


@pytest.mark.parametrize("serial", [0.0, 0.1, 0.5])
@pytest.mark.parametrize("seed", range(3))
def test_known_serial_fraction_is_recovered_within_its_interval(serial, seed):
    fit = fit_amdahl(*run_medians(serial, seed=seed))
    assert fit.ok, fit.reason
    assert_physical(fit)
    lo, hi = fit.interval
    assert lo <= serial <= hi, fit
    assert hi - lo < 0.1  # 15 runs at 2 % spread pin f down
    assert fit.t1_interval[0] <= 2.0 <= fit.t1_interval[1], fit


@pytest.mark.parametrize("serial", [0.1, 0.5])
def test_intervals_cover_the_truth_about_95_percent_of_the_time(serial):
    """Not just one lucky seed: over 100 synthetic sweeps the 95 % interval holds the true f in 85+ of them."""
    covered = 0
    for seed in range(100):
        fit = fit_amdahl(*run_medians(serial, gpus=(1, 2, 4, 8), repeats=2, run_noise=0.03, seed=seed))
        assert_physical(fit)
        covered += fit.ok and fit.interval[0] <= serial <= fit.interval[1]
    assert covered >= 85, covered


def test_noisy_three_point_series_gets_no_fit_with_its_reason():
    n = np.array([1, 1, 2, 2, 4, 4])
    ideal = 2.0 * (0.1 + 0.9 / n)
    t = ideal * np.array([1.18, 0.85, 0.84, 1.17, 1.16, 0.84])  # run-to-run spread 33 %
    fit = fit_amdahl(n, t)
    assert not fit.ok
    assert fit.reason.startswith("3 GPU counts, spread 33%: no fit (")
    assert "95 % interval of f" in fit.reason or "R^2" in fit.reason
    assert_physical(fit)


def test_two_point_series_gets_no_fit():
    fit = fit_amdahl([2, 2, 4, 4], [1.0, 1.1, 0.6, 0.65])
    assert not fit.ok and fit.reason == ("2 GPU counts, spread 10%: no fit (Amdahl's law has 2 parameters, T1 and f: "
                                         "fitting them needs 3 or more GPU counts)")
    g = fit_gustafson([1, 1, 2, 2], [1.0, 1.0, 1.9, 1.8])
    assert not g.ok and "needs 3 or more GPU counts" in g.reason


def test_super_linear_series_gets_no_fit():
    n, _ = run_medians(0.0)
    fit = fit_amdahl(n, 2.0 / n**1.3)  # efficiency 2.3 at 16 GPUs (e.g. the model starts fitting in cache)
    assert not fit.ok and "super-linear: efficiency 2.30 at 16 GPUs" in fit.reason
    m = np.array([1, 2, 4, 8], dtype=float)
    g = fit_gustafson(m, m * 1.2 ** np.log2(m))
    assert not g.ok and "super-linear" in g.reason


def test_step_time_growing_with_gpus_gets_no_fit_not_f_above_one():
    """The sweep that once reported f = 1.99 and a 0.5x "speedup limit": step time grows with the GPU count."""
    fit = fit_amdahl([1, 2, 4, 1, 2, 4], [1.0, 1.3, 1.9, 1.05, 1.2, 2.0])
    assert not fit.ok and "does not fall as GPUs are added" in fit.reason
    assert "1.99" not in fit.verdict() and "0.5x" not in fit.verdict()


@pytest.mark.parametrize("seed", range(200))
def test_no_series_gives_a_serial_fraction_outside_0_1(seed):
    """Random sweeps (any shape: flat, rising, falling, erratic) never give an unphysical number."""
    rng = np.random.default_rng(seed)
    k = int(rng.integers(2, 7))
    n = np.repeat(2 ** np.arange(k), int(rng.integers(1, 4)))
    t = np.exp(rng.normal(0, 1, n.size)) * (1 / n) ** rng.uniform(-0.5, 1.5)
    fit = fit_amdahl(n, t)
    assert_physical(fit)
    if fit.ok:
        assert np.all(fit.speedup(np.array([1, 64, 1024]), 1) > 0)
    s = n / n[0] * t[0] / t
    assert_physical(fit_gustafson(n, s))


def test_gustafson_recovers_known_s_within_its_interval():
    rng = np.random.default_rng(3)
    m = np.repeat([1, 2, 4, 8], 2).astype(float)
    for s in (0.0, 0.2):
        fit = fit_gustafson(m, (m - s * (m - 1)) * (1 + 0.01 * rng.standard_normal(m.size)))
        assert fit.ok, fit.reason
        assert fit.interval[0] <= s <= fit.interval[1]
        assert_physical(fit)


def test_t_quantiles():
    assert t95(1) == pytest.approx(12.706) and t95(11) == t95(10) and t95(1000) == 1.96 and t95(0) == np.inf


def test_end_to_end_from_records(tmp_path):
    """Per-step noise (3 %) in real record files; the fit goes through medians of the slowest rank per step; the
    projection carries the interval's range and stays positive."""
    rng = np.random.default_rng(7)
    serial = 0.05
    for gpus in GPUS:
        for _ in range(2):
            st = amdahl_times(gpus, serial, 1.5, 200, 0.03, rng)
            synthetic_run(tmp_path, [f"cluster.gpus_per_node={gpus}", "training.global_batch_size=16"], st)
    result = analyse([str(tmp_path)], warmup=0)
    (series,) = result.scaling
    assert series.kind == "strong" and series.amdahl.ok, series.amdahl
    assert series.amdahl.interval[0] <= serial <= series.amdahl.interval[1]
    table = series.table
    assert list(table["world_size"]) == list(GPUS) and list(table["repeats"]) == [2] * 5
    assert (table["efficiency_lo"] <= table["efficiency"]).all()
    assert (table["efficiency"] <= table["efficiency_hi"]).all()
    expected = 1 / (serial + (1 - serial) / table["world_size"])
    np.testing.assert_allclose(table["speedup"], expected, rtol=0.02)
    proj = series.projection
    assert list(proj["world_size"]) == [32, 64, 128]
    assert (proj["speedup_lo"] <= proj["speedup"]).all() and (proj["speedup"] <= proj["speedup_hi"]).all()
    assert (proj["speedup_lo"] > 0).all() and (proj["gustafson_scaled_speedup"] > 0).all()
    data = json.loads(json.dumps(result.to_json(), default=str))
    assert data["scaling"][0]["amdahl"]["ok"] and data["scaling"][0]["amdahl"]["interval"][0] <= serial
    md = render_markdown(result, [], "t")
    assert "95 % interval" in md and "Projection (beyond the measured GPU counts)" in md
    files = efficiency(result, tmp_path) + throughput(result, tmp_path)
    assert [f.name for f in files] == ["efficiency_vs_gpus.png", "throughput_vs_gpus.png"]


def test_two_point_sweep_reports_no_fit_and_projects_nothing(tmp_path):
    rng = np.random.default_rng(5)
    for gpus in (1, 2):
        for r in range(2):
            st = amdahl_times(gpus, 0.1, 1.0, 40, 0.01, rng) * (1.0 + 0.1 * r)
            synthetic_run(tmp_path, [f"cluster.gpus_per_node={gpus}", "training.global_batch_size=16"], st)
    result = analyse([str(tmp_path)], warmup=0)
    (series,) = result.scaling
    assert not series.amdahl.ok and series.projection is None
    md = render_markdown(result, [], "t")
    assert "Amdahl: 2 GPU counts, spread 10%: no fit (" in md and "No projection beyond the measured GPU counts." in md
    assert "Projection (" not in md and "serial fraction f =" not in md
    assert efficiency(result, tmp_path)  # the plot still shows the points with their spread, and the reason


def test_weak_scaling_is_detected_and_fitted(tmp_path):
    rng = np.random.default_rng(3)
    s = 0.2
    for gpus in (1, 2, 4, 8):
        # Same work per GPU; step times chosen so that the scaled speedup n T(1) / T(n) is n - s (n - 1).
        t = 1.0 * gpus / (gpus - s * (gpus - 1))
        st = t * (1 + 0.001 * rng.standard_normal((gpus, 50)))
        synthetic_run(tmp_path, [f"cluster.gpus_per_node={gpus}", "training.micro_batch_size=2"], st)
    result = analyse([str(tmp_path)], warmup=0)
    (series,) = result.scaling
    assert series.kind == "weak" and series.gustafson.ok, series.gustafson
    assert series.gustafson.serial_fraction == pytest.approx(s, abs=0.01)
    assert series.gustafson.interval[0] <= s + 0.005 and s - 0.005 <= series.gustafson.interval[1]
    assert (series.projection["scaled_speedup_lo"] > 0).all()
