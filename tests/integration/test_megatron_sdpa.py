"""The ``sdpa`` attention path through the Megatron trainer's real run (issue 43): recipes/gpt_3d.yaml's local profile
(TP2 x PP2, 4 CPU ranks) trained 20 steps with SDPA attention (``use_flash_attention: true``, the default) and with
Megatron's unfused attention (``false``) gives the same losses within 1e-5, and so does a grouped-query Llama of the
same layout (4 heads, 2 groups: 1 group per TP rank); the rank log's start line names the path each run got.

Tolerance 1e-5 (the issue's): the two paths compute the same softmax(QK^T / sqrt(d)) V with their sums in another order
(torch's CPU flash kernel against Megatron's baddbmm + fp32 softmax + bmm), a few float32 ulps per step that the
optimizer carries forward.

The four runs share ONE launch of 4 ranks (``hpc_tools.testing.matrix``: each variant is the recipe run through the
Megatron trainer's real ``run(ctx)`` in its own run folder, one after the other in the same processes), not four: a
launch's start-up (torch, Megatron-core, the gloo world) was most of each run's time. Each variant's lines of rank
0's log are those before the matrix's ``variant NAME:`` line that closes it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hpc_tools.recipe.load import load_recipe
from hpc_tools.testing.matrix import launch
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


def logs_by_variant(log: str) -> dict[str, str]:
    """Rank 0's matrix log cut at the ``variant NAME: S s`` line the matrix writes after each variant."""
    out, lines = {}, []
    for line in log.splitlines():
        found = re.search(r"\] variant (.+): [0-9.]+ s$", line)
        if found:
            out[found.group(1)], lines = "\n".join(lines), []
        else:
            lines.append(line)
    return out


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
    work = tmp_path_factory.mktemp("sdpa_runs")
    names = {name: name.replace(" ", "_") for name in RUNS}  # a variant's name is its run folder's
    variants = [{"name": names[name], "recipe": load_recipe(RECIPE, [*SHORT, *sets], profile="local").model_dump(
        mode="json", exclude={"local", "sweep"})} for name, sets in RUNS.items()]
    results = launch(variants, 4, work)
    logs = logs_by_variant((work / "matrix_logs" / "rank0.log").read_text())
    return {name: {"losses": losses(Path(results[names[name]]["run_dir"])), "log": logs[names[name]]}
            for name in RUNS}


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
