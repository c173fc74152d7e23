"""Mixture of experts on Megatron-core, on CPU: expert-parallel layouts give the same losses, a checkpoint reshards
across EP sizes, the router figures are the same on every layout, and each CPU shim is needed.

One launch of 4 gloo ranks runs every layout (tests/integration/moe_driver.py): a tiny dropless MoE GPT (2 layers,
4 experts, top-2, ``alltoall`` dispatcher, fp32) loads one shared EP1 checkpoint and trains 4 steps under each layout.
EP only moves experts between ranks and TP2 + sequence parallelism splits the sequence; both change the order of
floating-point sums and nothing else, so the losses agree to fp32 summation order (measured within 5e-7 here; held
to LOSS_ATOL = 1e-5). One 1-rank launch (tests/integration/moe_shims_driver.py) checks the CPU shims. And
recipes/gpt_moe.yaml's ``local:`` profile (EP2 on 4 CPU ranks) trains through ``python -m hpc_tools submit``, with
the router figures in its records and summary.json (the report's line from such records:
tests/unit/test_moe_records.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import run_driver

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import moe_driver as driver  # noqa: E402

LOSS_ATOL = 1e-5
AUX_ATOL = 1e-5
REFERENCE = "EP1 (DP4)"
TOKENS_PER_STEP = 8 * 16  # global batch x sequence length
MOE_LAYERS, TOPK = 2, 2

SUBMIT_ITERS = 6
"""The local profile's run, cut to 6 steps (checkpoint at 3 and 6) to keep the slow tier short."""

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    data = run_driver("moe_driver.py", tmp_path_factory.mktemp("moe") / "results.json", timeout=900)
    for case, r in data.items():
        print(f"  {case:28s} losses {r['losses']}")
    return data


@pytest.fixture(scope="module")
def shims(tmp_path_factory) -> dict:
    return run_driver("moe_shims_driver.py", tmp_path_factory.mktemp("moe_shims") / "shims.json", timeout=600)


@pytest.mark.parametrize("case", [c for c in driver.CASES if c != REFERENCE])
def test_expert_parallel_layouts_give_ep1_losses(results, case):
    got, want = results[case]["losses"], results[REFERENCE]["losses"]
    assert len(got) == len(want) == driver.STEPS
    assert max(abs(a - b) for a, b in zip(got, want)) <= LOSS_ATOL, (case, got, want)


def test_the_model_learns(results):
    losses = results[REFERENCE]["losses"]
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("case", list(driver.CASES))
def test_router_figures_are_the_same_on_every_layout(results, case):
    """Tokens per expert are counted over every rank once per step (each token once per top-k expert and MoE
    layer), so every layout reports the reference's counts and aux loss."""
    r, ref = results[case], results[REFERENCE]
    for counts in r["tokens_per_expert"]:
        assert len(counts) == 4 and sum(counts) == TOKENS_PER_STEP * TOPK * MOE_LAYERS, counts
    assert r["tokens_per_expert"] == ref["tokens_per_expert"]
    assert r["imbalance"] == ref["imbalance"] and all(1.0 <= x <= 4 / TOPK for x in r["imbalance"])
    assert all(a is not None and abs(a - b) <= AUX_ATOL for a, b in zip(r["aux_loss"], ref["aux_loss"]))


def test_a_run_saved_at_ep2_resumes_at_ep4_with_the_uninterrupted_losses(results):
    r = results["resume EP2 -> EP4"]
    want = results[r["reference"]]["losses"]
    assert r["resumed_at"] == driver.RESUME_AT and "TP1" in r["layout"]
    assert r["losses"][: driver.RESUME_AT] == want[: driver.RESUME_AT]
    assert max(abs(a - b) for a, b in zip(r["losses"], want)) <= LOSS_ATOL, (r["losses"], want)


def test_moe_and_mla_train_on_cpu_with_the_shims(shims):
    import math

    assert math.isfinite(shims["with"]["moe"]) and math.isfinite(shims["with"]["mla"])
    assert shims["with"]["splits"] == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("shim, error", [
    ("streams", "torch.cuda.Stream requires CUDA"),
    ("splits", "all_to_all_single(): incompatible function arguments"),
    ("mla_have_te", "isinstance() arg 2 must be a type"),
    ("mla_channels", "unexpected keyword argument 'k_channels'"),
])
def test_each_cpu_shim_is_needed(shims, shim, error):
    """Without the shim (megatron-core's or torch's original put back), the same run fails with upstream's error."""
    assert shims["without"][shim] is not None and error in shims["without"][shim], shims["without"][shim]


def test_router_gemm_name_is_bound_by_the_model_builder_on_every_device(shims):
    """megatron-core binds moe_utils.te_general_gemm only when Transformer Engine imports; the fp32 router reads it.
    The model builder binds it (model.bind_router_gemm, on GPUs too), so deleting it before a run changes nothing
    (before issue 31 item 3 only a CPU shim did, and this run failed with NameError)."""
    assert shims["without"]["te_general_gemm"] is None, shims["without"]["te_general_gemm"]


@pytest.fixture(scope="module")
def submitted(tmp_path_factory) -> Path:
    from tests.helpers import run_cli

    runs = tmp_path_factory.mktemp("moe_runs")
    proc = run_cli("submit", "recipes/gpt_moe.yaml", "--executor", "local", "--profile", "local", "--wait",
                   "--runs-dir", str(runs), "--set", f"training.train_iters={SUBMIT_ITERS}",
                   "--set", "checkpoint.interval_iters=3", "--set", "profiling.communication_sample_interval=2")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "EP2xETP1xEDP2" in proc.stdout + proc.stderr
    (run,) = runs.iterdir()
    return run


def test_the_moe_recipe_trains_locally_end_to_end_with_router_figures(submitted):
    from tests.helpers import step_records

    assert json.loads((submitted / "manifest.json").read_text())["state"] == "COMPLETED"
    records = step_records(submitted)
    assert sorted(records) == [0, 1, 2, 3]
    for recs in records.values():
        assert [r["step"] for r in recs] == list(range(1, SUBMIT_ITERS + 1))
        for r in recs:
            counts = json.loads(r["moe_tokens_per_expert"])
            assert len(counts) == 4 and sum(counts) == 16 * 64 * 2 * 2  # global batch x seq x top-2 x MoE layers
            assert 1.0 <= r["moe_load_imbalance"] <= 2.0 and r["moe_aux_loss"] > 0
    assert records[0][-1]["loss"] < records[0][0]["loss"]
    summary = json.loads((submitted / "summary.json").read_text())
    assert summary["moe_load_imbalance_median"] >= 1.0 and summary["moe_aux_loss"] > 0
    assert any(row["kind"] == "all_to_all" for row in summary["comm"])  # the dispatcher's, timed by the collector

