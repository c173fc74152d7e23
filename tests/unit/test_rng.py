"""One RNG capture/restore for both backends: every generator a step draws from comes back exactly."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hpc_tools.train import rng

torch = pytest.importorskip("torch")


def draws() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_restore_replays_the_same_draws_after_a_round_trip_through_torch_save(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = rng.capture()
    assert set(state) == {"python", "numpy", "torch", "cuda"}
    torch.save(state, tmp_path / "rng.pt")
    expected = draws()
    random.seed(10)
    np.random.seed(20)
    torch.manual_seed(30)
    assert draws() != expected
    rng.restore(torch.load(tmp_path / "rng.pt", weights_only=False))
    assert draws() == expected


def test_a_state_without_cuda_restores_on_any_machine():
    state = rng.capture()
    expected = draws()
    state.pop("cuda")  # files written by older versions on CPU hosts
    rng.restore(state)
    assert draws() == expected
