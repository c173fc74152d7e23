"""hpc_tools.testing.matrix: a variant's own environment variables (a test-only fault such as
HPC_TOOLS_TEST_SLOW_RANK) hold for that variant only; the next variant in the same processes meets the environment as
it was, whether the variable was set before or not, and also after the variant raised."""

from __future__ import annotations

import os

import pytest

from hpc_tools.testing.matrix import variant_env


def test_variant_env_sets_then_restores(monkeypatch):
    monkeypatch.setenv("HPCT_MATRIX_KEPT", "before")
    monkeypatch.delenv("HPCT_MATRIX_NEW", raising=False)
    with variant_env({"HPCT_MATRIX_KEPT": "during", "HPCT_MATRIX_NEW": 3}):
        assert os.environ["HPCT_MATRIX_KEPT"] == "during" and os.environ["HPCT_MATRIX_NEW"] == "3"
    assert os.environ["HPCT_MATRIX_KEPT"] == "before" and "HPCT_MATRIX_NEW" not in os.environ


def test_variant_env_restores_after_an_error(monkeypatch):
    monkeypatch.delenv("HPCT_MATRIX_NEW", raising=False)
    with pytest.raises(RuntimeError), variant_env({"HPCT_MATRIX_NEW": "x"}):
        raise RuntimeError("the variant failed")
    assert "HPCT_MATRIX_NEW" not in os.environ
