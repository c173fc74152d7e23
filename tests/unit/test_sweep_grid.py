"""Sweep grid expansion: product of axes, zipped axes, invalid cells dropped with the violation, --set precedence."""

from __future__ import annotations

import copy

import pytest
import yaml

from hpc_tools.errors import RecipeError, UserError
from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.load import read_yaml
from hpc_tools.sweep.grid import check_world, expand
from tests.helpers import REPO, run_cli


@pytest.fixture
def gpt3d() -> dict:
    return read_yaml(REPO / "recipes/gpt_3d.yaml")


def with_sweep(raw: dict, sweep: dict) -> dict:
    out = copy.deepcopy(raw)
    out["sweep"] = sweep
    return out


def test_product_and_zipped_axes(gpt3d):
    raw = with_sweep(gpt3d, {"grid": {"cluster.gpus_per_node": [2, 4],
                                      "parallel.tensor_size,parallel.pipeline_size": [[2, 1], [2, 2]]}})
    plan = expand(raw, profile="local")
    assert [c.params for c in plan.cells] == [
        {"cluster.gpus_per_node": 2, "parallel.tensor_size": 2, "parallel.pipeline_size": 1},
        {"cluster.gpus_per_node": 2, "parallel.tensor_size": 2, "parallel.pipeline_size": 2},
        {"cluster.gpus_per_node": 4, "parallel.tensor_size": 2, "parallel.pipeline_size": 1},
        {"cluster.gpus_per_node": 4, "parallel.tensor_size": 2, "parallel.pipeline_size": 2}]
    layouts = [ParallelLayout.from_recipe(c.recipe) for c in plan.valid]
    assert [(layout.world_size, layout.tensor_size, layout.pipeline_size, layout.data_size) for layout in layouts] == [
        (2, 2, 1, 1), (4, 2, 1, 2), (4, 2, 2, 1)]
    # TP2 x PP2 does not fit on 2 ranks: dropped with the rule's own text.
    (bad,) = plan.invalid
    assert bad.index == 1 and "must divide the world size" in bad.reasons[0] and "= 2" in bad.reasons[0]


def test_cell_overrides_parse_back_to_the_same_values(gpt3d):
    raw = with_sweep(gpt3d, {"grid": {"training.lr": [1.0e-3], "checkpoint.dir": [None],
                                      "data.text_field": ["body: text"]}})
    (cell,) = expand(raw, profile="local").cells
    assert cell.valid, cell.reasons
    assert cell.recipe.training.lr == 1.0e-3 and cell.recipe.checkpoint.dir is None
    assert cell.recipe.data.text_field == "body: text"


def test_set_beats_the_grid_and_duplicates_are_dropped(gpt3d):
    raw = with_sweep(gpt3d, {"grid": {"cluster.gpus_per_node": [2, 4]}, "repeats": 3})
    plan = expand(raw, ["cluster.gpus_per_node=4"], profile="local")
    assert len(plan.valid) == 1 and plan.valid[0].recipe.cluster.gpus_per_node == 4
    assert plan.invalid[0].reasons == ["is the same recipe as cell 0 after the --set overrides"]
    assert plan.config.repeats == 3


def test_bad_sweep_sections_are_one_line_errors(gpt3d):
    with pytest.raises(RecipeError) as exc:
        expand(with_sweep(gpt3d, {"grid": {"nodes": [1, 2]}}))
    assert str(exc.value).count("\n") == 0
    assert "sweep.grid" in str(exc.value) and "'nodes' is not a dotted recipe key" in str(exc.value)
    with pytest.raises(RecipeError, match="not a list of 2 values"):
        expand(with_sweep(gpt3d, {"grid": {"parallel.tensor_size,parallel.pipeline_size": [2]}}))
    with pytest.raises(RecipeError, match="sweep.repeats=0"):
        expand(with_sweep(gpt3d, {"grid": {"cluster.nodes": [1]}, "repeats": 0}))
    with pytest.raises(UserError, match="has no sweep: section"):
        expand(gpt3d)


def test_unknown_key_in_a_cell_is_reported_per_cell(gpt3d):
    plan = expand(with_sweep(gpt3d, {"grid": {"cluster.nodez": [1]}}), profile="local")
    (cell,) = plan.invalid
    assert "cluster.nodez" in cell.reasons[0] and "did you mean 'nodes'" in cell.reasons[0]


def test_shipped_sweep_recipe_expands(repo):
    raw = read_yaml(repo / "recipes/gpt_3d_sweep.yaml")
    plan = expand(raw, profile="local")
    worlds = sorted({ParallelLayout.from_recipe(c.recipe).world_size for c in plan.valid})
    assert worlds == [1, 2, 4]
    assert all(c.reasons for c in plan.invalid)


def test_cells_whose_files_are_missing_are_refused_before_anything_is_made(gpt3d, tmp_path):
    """`sweep` applies submit's world checks to every cell: a data path that does not exist drops the cells that
    name it with the rule's text, and when no cell is left the command fails in one line, leaving no sweep folder."""

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("text\n" * 100)
    raw = with_sweep(gpt3d, {"grid": {"data.paths": [[str(corpus)], [str(tmp_path / "gone.txt")]]}})
    raw["data"] = {**raw.get("data", {}), "source": "files"}
    plan = expand(raw, profile="local")
    check_world(plan, slurm=False)
    assert [c.params["data.paths"] for c in plan.valid] == [[str(corpus)]]
    (bad,) = plan.invalid
    assert "data.paths[0]" in bad.reasons[0] and "does not exist" in bad.reasons[0]

    recipe = tmp_path / "sweep.yaml"
    raw["sweep"] = {"grid": {"training.micro_batch_size": [1, 2]}}
    raw["data"]["paths"] = [str(tmp_path / "gone.txt")]
    recipe.write_text(yaml.safe_dump(raw))
    out = run_cli("sweep", str(recipe), "--executor", "local", "--runs-dir", str(tmp_path / "runs"))
    *dropped, error = out.stderr.strip().splitlines()  # each dropped cell named, then the one-line error
    assert out.returncode == 2 and error.startswith("error: every cell") and "does not exist" in error, out.stderr
    assert [line.split(":")[0] for line in dropped] == ["dropped cell 0 (micro_batch_size=1)",
                                                        "dropped cell 1 (micro_batch_size=2)"]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("sweep.json"))
