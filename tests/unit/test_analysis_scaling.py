"""Scaling fits: Amdahl's serial fraction recovered within 1 % from noisy synthetic runs, Gustafson exact."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_tools.analysis.analyze import analyse
from hpc_tools.analysis.scaling import fit_amdahl, fit_gustafson
from hpc_tools.testing.synthetic import amdahl_times, synthetic_run

SERIAL = 0.05


@pytest.mark.parametrize("seed", range(10))
def test_amdahl_fit_on_noisy_step_times(seed):
    rng = np.random.default_rng(seed)
    n = np.repeat([1, 2, 4, 8, 16, 32], 3)
    t = 2.0 * (SERIAL + (1 - SERIAL) / n) * (1 + 0.002 * rng.standard_normal(n.size))  # 0.2 % noise on medians
    fit = fit_amdahl(n, t)
    assert abs(fit.serial_fraction - SERIAL) <= 0.01 * SERIAL
    assert fit.t1_s == pytest.approx(2.0, rel=0.01)


def test_amdahl_fit_needs_two_gpu_counts():
    with pytest.raises(ValueError, match="two or more GPU counts"):
        fit_amdahl(np.array([4, 4]), np.array([1.0, 1.1]))


def test_gustafson_fit_is_exact_without_noise():
    n = np.array([1, 2, 4, 8, 16], dtype=float)
    assert fit_gustafson(n, n - 0.1 * (n - 1)) == pytest.approx(0.1, abs=1e-12)


def test_end_to_end_from_records(tmp_path):
    """Per-step noise (3 %) in real record files; the fit goes through medians of the slowest rank per step."""
    rng = np.random.default_rng(7)
    for gpus in (1, 2, 4, 8, 16):
        for _ in range(2):
            st = amdahl_times(gpus, SERIAL, 1.5, 400, 0.03, rng)
            synthetic_run(tmp_path, [f"cluster.gpus_per_node={gpus}", "training.global_batch_size=16"], st)
    result = analyse([str(tmp_path)], warmup=0)
    (series,) = result.scaling
    assert series.kind == "strong"
    assert abs(series.amdahl.serial_fraction - SERIAL) <= 0.01 * SERIAL, series.amdahl
    table = series.table
    assert list(table["world_size"]) == [1, 2, 4, 8, 16] and list(table["repeats"]) == [2] * 5
    expected = (SERIAL + (1 - SERIAL)) / (SERIAL + (1 - SERIAL) / table["world_size"])
    np.testing.assert_allclose(table["speedup"], expected, rtol=0.01)
    proj = series.projection
    assert list(proj["world_size"]) == [32, 64, 128, 256]
    assert (proj["speedup"] < 1 / SERIAL * 1.02).all() and proj["speedup"].is_monotonic_increasing


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
    assert series.kind == "weak"
    assert series.gustafson_serial == pytest.approx(s, abs=0.01)
