"""The GPU path's checkpoint contract, checked on CPU (issue 12 items 1 and 4), in one 2-rank launch
(tests/integration/megatron_gpu_path_driver.py).

1. Resume under Transformer Engine's FusedAdam: megatron-core wraps TE's FusedAdam whenever TE imports; its
   ``state_dict()``/``load_state_dict()`` map every per-parameter key through ``name_to_dtype_map`` and keep the step
   per parameter group. ``hpc_tools.testing.te_fused_adam.FusedAdamDouble`` reproduces that contract on CPU (its
   docstring cites the source lines); a per-parameter ``step`` (what checkpoint.py used to add) raises
   ``KeyError: 'step'`` there, exactly as TE does. Resume must be bit-identical to the uninterrupted run.
2. ``overlap_param_gather`` + save: megatron-core's overlap works on gloo; the weights a checkpoint holds right after
   an optimizer step must equal the gathered weights (those of the same run with overlap off), and resuming with
   overlap on must be bit-identical. Without the forced gather, (DP-1)/DP of every weight is one step stale (2e-3
   here).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers import run_driver

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import megatron_gpu_path_driver as driver  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_driver("megatron_gpu_path_driver.py", tmp_path_factory.mktemp("mg_gpu_path") / "results.json",
                      timeout=900)


@pytest.mark.parametrize("case", list(driver.TE_CASES))
def test_resume_under_te_fused_adam_is_bit_identical(results, case):
    r = results[case]
    assert r["optimizer"] == "FusedAdamDouble"  # the TE branch of megatron-core really ran
    assert r["group_steps_after_load"] == [driver.RESUME_AT]  # the step lives in the param groups, as an int
    assert r["resumed"] == r["straight"]
    assert len(r["resumed"]) == driver.STEPS
    assert r["saved_layers"] == "local" and "layers=local" in r["plan"]  # the layer kind is in the checkpoint's meta


def test_overlap_param_gather_saves_gathered_weights(results):
    for rank in results["overlap"]["per_rank"]:
        assert rank["saved_vs_gathered"] == 0.0
        assert rank["live_vs_gathered"] == 0.0


def test_overlap_param_gather_resume_is_bit_identical(results):
    r = results["overlap"]
    assert r["optimizer"] == "AdamW"
    assert r["resumed"] == r["straight"]
    assert r["saved_midway"] == r["straight"]  # the forced gather and re-armed hooks leave training unchanged
