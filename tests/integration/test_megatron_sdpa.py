"""The ``sdpa`` attention path through the real entry point (issue 43): recipes/gpt_3d.yaml's local profile (TP2 x PP2,
4 CPU ranks) trained 20 steps with SDPA attention (``use_flash_attention: true``, the default) and with Megatron's
unfused attention (``false``) gives the same losses within 1e-5, and so does a grouped-query Llama of the same layout
(4 heads, 2 groups: 1 group per TP rank); the rank log's start line names the path each run got.

Tolerance 1e-5 (the issue's): the two paths compute the same softmax(QK^T / sqrt(d)) V with their sums in another order
(torch's CPU flash kernel against Megatron's baddbmm + fp32 softmax + bmm), a few float32 ulps per step that the
optimizer carries forward.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_tools.executors.local import run_local
from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.load import load_recipe
from tests.helpers import REPO

RECIPE = REPO / "recipes" / "gpt_3d.yaml"
STEPS = 20
LOSS_ATOL = 1e-5
SHORT = [f"training.train_iters={STEPS}", "training.eval_interval=null", "checkpoint.interval_iters=1000",
         "training.log_interval=10"]
LLAMA = ["model.family=llama", "model.num_query_groups=2", "model.ffn_hidden_size=160"]
RUNS = {
    "gpt sdpa": [],
    "gpt unfused": ["backend.megatron.use_flash_attention=false"],
    "llama gqa sdpa": LLAMA,
    "llama gqa unfused": [*LLAMA, "backend.megatron.use_flash_attention=false"],
}

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


def losses(run_dir: Path) -> dict[int, float]:
    found: dict[int, float] = {}
    for path in sorted((run_dir / "records").glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("loss") is not None:
                found.setdefault(rec["step"], rec["loss"])
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    from hpc_tools.submission import new_run

    root = tmp_path_factory.mktemp("sdpa_runs")
    out = {}
    for name, sets in RUNS.items():
        recipe = load_recipe(RECIPE, [*SHORT, *sets], profile="local")
        run = new_run(recipe, root, "local", source=str(RECIPE))
        code = run_local(run, ParallelLayout.from_recipe(recipe).world_size)
        log = (run.logs_dir / "rank00000.out").read_text()
        assert code == 0, f"{name}: {log[-3000:]}"
        out[name] = {"losses": losses(run.path), "log": log}
    return out


@pytest.mark.parametrize("family", ["gpt", "llama gqa"])
def test_sdpa_gives_the_unfused_losses(runs, family):
    sdpa, unfused = runs[f"{family} sdpa"]["losses"], runs[f"{family} unfused"]["losses"]
    assert sorted(sdpa) == sorted(unfused) == list(range(1, STEPS + 1))
    diffs = [abs(sdpa[s] - unfused[s]) for s in sdpa]
    print(f"\n{family}: max |sdpa - unfused| over {STEPS} steps = {max(diffs):.2e}; last loss {sdpa[STEPS]:.6f}")
    assert max(diffs) <= LOSS_ATOL, (family, max(diffs), sdpa, unfused)
    assert sdpa[STEPS] < sdpa[1] - 0.1  # it trains


@pytest.mark.parametrize("name", list(RUNS))
def test_the_rank_log_names_the_attention_path(runs, name):
    path = "sdpa" if name.endswith("sdpa") else "unfused"
    start = next(line for line in runs[name]["log"].splitlines() if "megatron: " in line and "layers=" in line)
    assert f"layers=local, attention={path}" in start, start
