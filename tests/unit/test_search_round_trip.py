"""`plan --search` prints the layouts it ranked: every row (text and JSON) names every dimension the search turns, and
its ``--set`` overrides, applied to the recipe as a user would, re-plan (``plan``, not a search) to the row's own
configuration, memory and step time. Checked for every shipped recipe that trains a model, ranked across every backend
kind (``--backends all``), and for the 8-node MoE search whose rows differ from the recipe's EP8."""

from __future__ import annotations

import json
import shlex

import pytest

from hpc_tools import backends
from hpc_tools.cli import main
from hpc_tools.recipe.load import load_recipe
from tests.helpers import REPO

NO_CAL = ["--no-calibration"]
TOP, LOSERS = "4", "4"  # 8 rows per search keeps the test within seconds per recipe
TRAINING = [p.name for p in sorted((REPO / "recipes").glob("*.yaml"))
            if backends.of(load_recipe(p, check=False)).trains_model]
# The --set keys of every dimension the search turns, per options section (each present in every row, always).
LAYOUT_KEYS = {"parallel.tensor_size", "parallel.pipeline_size", "parallel.virtual_pipeline_size",
               "parallel.context_size", "parallel.data_size", "parallel.sequence_parallel",
               "training.micro_batch_size", "training.global_batch_size", "training.recompute_granularity"}
EXPERT_KEYS = {"parallel.expert_size", "parallel.expert_tensor_size"}
FULL_RECOMPUTE_KEYS = {"training.recompute_method", "training.recompute_num_layers"}
OPTION_KEYS = {"megatron": {"backend.megatron.distributed_optimizer"},
               "deepspeed": {"backend.deepspeed.zero_stage", "backend.deepspeed.offload_optimizer",
                             "backend.deepspeed.offload_param"},
               "fsdp": {"backend.fsdp.strategy", "backend.fsdp.reshard_after_forward", "backend.fsdp.shard_size"},
               "horovod": {"backend.horovod.compression", "backend.horovod.fusion_threshold_mb"}}


def cli(capsys, *args: str) -> tuple[int, str]:
    code = main(list(args))
    return code, capsys.readouterr().out


def search_json(capsys, recipe: str, *extra: str) -> dict:
    code, out = cli(capsys, "plan", recipe, "--search", "--json", "--top", TOP, "--losers", LOSERS, *NO_CAL, *extra)
    data = json.loads(out)
    assert code == 0 and data["ok"], out[-500:]
    return data


def replan(capsys, recipe: str, overrides: list[str], *extra: str) -> dict:
    sets = [arg for o in overrides for arg in ("--set", o)]
    code, out = cli(capsys, "plan", recipe, "--json", *NO_CAL, *extra, *sets)
    data = json.loads(out)
    assert code == 0 and data["ok"], out[-500:]
    return data


def kind_of(overrides: list[str], recipe: str) -> str:
    kinds = [o.split("=", 1)[1] for o in overrides if o.startswith("backend.kind=")]
    return kinds[0] if kinds else load_recipe(REPO / "recipes" / recipe, check=False).backend.kind


def assert_row_round_trips(capsys, recipe: str, row: dict, *extra: str) -> dict:
    """The row's overrides name every turned dimension once, and re-plan to its configuration, memory, step time."""
    keys = [o.split("=", 1)[0] for o in row["overrides"]]
    assert len(keys) == len(set(keys)), row["overrides"]
    kind = kind_of(row["overrides"], recipe)
    plan = replan(capsys, recipe, row["overrides"], *extra)
    moe = plan["parameters_active"] != plan["parameters"]
    wanted = LAYOUT_KEYS | OPTION_KEYS[kind] | (EXPERT_KEYS if moe else set())
    wanted |= FULL_RECOMPUTE_KEYS if "training.recompute_granularity=full" in row["overrides"] else set()
    assert wanted <= set(keys), f"{row['config']}: missing {sorted(wanted - set(keys))}"
    label = row["config"].removeprefix(f"{kind} ") if row["overrides"][0].startswith("backend.kind=") \
        else row["config"]
    assert plan["config"] == label
    assert plan["memory"]["total_bytes"] == pytest.approx(row["memory_bytes"], rel=1e-12)
    assert plan["memory"]["peak_stage"] == row["peak_stage"]
    assert plan["step_time"]["total_s"] == pytest.approx(row["step_s"], rel=1e-12)
    return plan


def apply_line(text: str) -> list[str]:
    """The ``--set`` values of the text table's "Apply the best:" line, read as a shell reads them."""
    if "The best is the recipe's own layout: nothing to change" in text:
        return []
    lines = [ln for ln in text.splitlines() if ln.startswith("Apply the best: ")]
    assert len(lines) == 1, text[-800:]
    words = shlex.split(lines[0].removeprefix("Apply the best: "))
    assert words[0::2] == ["--set"] * (len(words) // 2) and len(words) % 2 == 0, lines[0]
    return words[1::2]


@pytest.mark.parametrize("name", TRAINING)
def test_every_row_across_backends_replans_to_itself(capsys, name):
    recipe = str(REPO / "recipes" / name)
    data = search_json(capsys, recipe, "--backends", "all")
    rows = data["top"] + data["next"] + [b["best"] for b in data["backends"] if b["best"]]
    assert len(data["top"]) >= 1 and all(r["overrides"][0].startswith("backend.kind=") for r in rows)
    for row in rows:
        assert_row_round_trips(capsys, recipe, row)


def test_the_text_table_across_backends_is_the_json_one(capsys):
    """The text table's rows are the JSON rows' labels and its apply line the JSON top row's overrides (one small
    recipe: the text and JSON come from the same search, and each search of the bigger recipes takes seconds)."""
    recipe = str(REPO / "recipes/gpt_3d.yaml")
    data = search_json(capsys, recipe, "--backends", "all")
    code, text = cli(capsys, "plan", recipe, "--search", "--backends", "all", "--top", TOP, "--losers", LOSERS,
                     *NO_CAL)
    # only what changes the recipe: the top row's overrides less those the recipe already sets
    assert code == 0 and apply_line(text) == data["apply"]
    assert set(data["apply"]) <= set(data["top"][0]["overrides"])
    for row in data["top"]:
        assert row["config"] in text


@pytest.mark.parametrize("name", TRAINING)
def test_the_text_apply_line_of_the_recipe_s_own_kind_replans_to_its_top_row(capsys, name):
    recipe = str(REPO / "recipes" / name)
    code, text = cli(capsys, "plan", recipe, "--search", "--top", "1", "--losers", "0", *NO_CAL)
    assert code == 0
    overrides = apply_line(text)
    assert not any(o.startswith("backend.kind=") for o in overrides)
    plan = replan(capsys, recipe, overrides)
    # the top row of the text table carries the re-planned label, step time and memory
    top = next(ln for ln in text.splitlines() if ln.startswith("1 "))
    assert plan["config"] in top
    assert f"{plan['step_time']['total_s']:.3f}" in top and f"{plan['memory']['total_bytes'] / 1e9:.1f}" in top


def test_the_8_node_moe_search_rows_keep_their_expert_sizes(capsys):
    """The issue's case: rows whose EP or ETP differ from the recipe's EP8 x ETP1 (or equal the defaults) must say
    so in their overrides, or applying them keeps the recipe's."""
    recipe = str(REPO / "recipes/gpt_moe.yaml")
    nodes = ("--set", "cluster.nodes=8")
    data = search_json(capsys, recipe, *nodes, "--top", "10", "--losers", "10")
    rows = data["top"] + data["next"]
    assert any("EP8xETP1" not in r["config"] for r in rows), [r["config"] for r in rows]
    for row in rows:
        assert "EP" in row["config"] and "CP" in row["config"] and "VPP" in row["config"]
        plan = assert_row_round_trips(capsys, recipe, row, *nodes)
        ep = next(o for o in row["overrides"] if o.startswith("parallel.expert_size=")).split("=")[1]
        assert f" EP{ep}x" in plan["config"]
    code, text = cli(capsys, "plan", recipe, "--search", *nodes, *NO_CAL)
    assert code == 0 and apply_line(text) == data["apply"] and set(data["apply"]) <= set(data["top"][0]["overrides"])


def test_measure_builds_its_runs_from_the_rows_overrides(capsys):
    """--measure's candidate runs are the recipe with exactly the overrides `plan --search` prints for those rows,
    and each resolves to the candidate it ranked (the 8-node MoE search: rows with other expert sizes than EP8)."""
    from hpc_tools.planner import plan_recipe
    from hpc_tools.planner.knobs import Knobs
    from hpc_tools.planner.search import search
    from hpc_tools.recipe.load import read_yaml, resolve
    from hpc_tools.sweep.measure import _candidate_cells, measure_overrides

    path = REPO / "recipes/gpt_moe.yaml"
    nodes = ["cluster.nodes=8"]
    data = search_json(capsys, str(path), "--set", nodes[0], "--top", "6", "--losers", "0")
    recipe = resolve(read_yaml(path), nodes, None, str(path), check=False)
    cands = search(recipe, top=6, losers=0, use_calibration=False).ranked
    cells = _candidate_cells(read_yaml(path), str(path), None, nodes, measure_overrides(recipe, 3), cands)
    assert [c.overrides for c in cells] == [r["overrides"] for r in data["top"]]
    assert any(c.recipe.parallel.expert_size != recipe.parallel.expert_size for c in cells)
    for cell, cand in zip(cells, cands):
        assert cell.valid, cell.reasons
        assert Knobs.from_recipe(cell.recipe).describe() == cand.knobs.describe()
        plan = plan_recipe(cell.recipe, use_calibration=False)
        assert plan.memory.total == pytest.approx(cand.memory_bytes, rel=1e-12)
        assert plan.time.total_s == pytest.approx(cand.step_s, rel=1e-12)
