"""hpc_tools.evaluate's light parts: reading lm-eval's results JSON under <run>/eval/ (status, report), the Slurm job
array's script, and the linear-weight byte count of quantize (from safetensors headers)."""

from __future__ import annotations

import json

import pytest

from hpc_tools.evaluate import results
from tests.helpers import REPO


def write(folder, name, task_metrics: dict, **meta):
    (folder / "eval").mkdir(exist_ok=True)
    (folder / "eval" / name).write_text(json.dumps({"results": task_metrics, "hpc_tools": meta}))


def test_rows_take_metrics_not_sample_counts_and_pair_quantized_with_unquantized(tmp_path):
    write(tmp_path, results.results_name(20), {"t": {"alias": "t", "sample_len": 8, "acc,none": 0.5,
                                                       "acc_stderr,none": 0.1, "acc_norm,none": "N/A"}},
          iteration=20, tokens=1000, scheme=None, limit=8)
    write(tmp_path, results.results_name(20, "int8"), {"t": {"acc,none": 0.25, "acc_stderr,none": "N/A"}},
          iteration=20, tokens=1000, scheme="int8", limit=8)
    (tmp_path / "eval" / "broken.json").write_text("{")
    info = results.summary(tmp_path)
    assert [(r["model"], r["metric"], r["value"], r["stderr"]) for r in info["results"]] == [
        ("unquantized", "acc", 0.5, 0.1), ("int8", "acc", 0.25, None)]
    assert info["score_deltas"] == [{"model": "int8", "iteration": 20, "task": "t", "metric": "acc",
                                     "unquantized": 0.5, "quantized": 0.25, "delta": -0.25}]
    assert any("0.5000 -> 0.2500 (-0.2500)" in line for line in results.table_lines(tmp_path))


def test_no_eval_folder_is_empty(tmp_path):
    assert results.summary(tmp_path) == {"results": [], "quantized": [], "score_deltas": []}


@pytest.mark.parametrize("iterations", [[10], [10, 20, 30]])
def test_the_array_script_has_one_task_per_checkpoint(tmp_path, iterations):
    from hpc_tools.recipe.load import load_recipe
    from hpc_tools.render.batch import render_eval_array as render_array

    recipe = load_recipe(REPO / "recipes" / "llama_fsdp.yaml")
    text = render_array(recipe, tmp_path / "run x", iterations, ["--tasks", "a,b", "--limit", "5"])
    assert f"#SBATCH --array=0-{len(iterations) - 1}\n" in text and "#SBATCH --nodes=1\n" in text
    assert "#SBATCH --gpus-per-node=1\n" in text and "#SBATCH --ntasks-per-node=1\n" in text
    assert f"ITERATIONS=({' '.join(map(str, iterations))})" in text
    assert f"-m hpc_tools eval '{tmp_path / 'run x'}' --iterations \"$ITERATION\" --executor local --tasks a,b " \
           "--limit 5" in text


def test_linear_bytes_from_headers(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    from hpc_tools.evaluate.quantize import linear_bytes

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    save_file({"l.weight": torch.zeros(8, 16), "n.weight": torch.zeros(16)}, str(tmp_path / "a" / "model.safetensors"))
    save_file({"l._weight_qdata": torch.zeros(8, 16, dtype=torch.int8), "l._weight_scale": torch.zeros(8, 1),
               "n.weight": torch.zeros(16, dtype=torch.bfloat16)}, str(tmp_path / "b" / "model.safetensors"))
    got = linear_bytes(tmp_path / "a", tmp_path / "b")
    assert got == {"linear_modules": 1, "linear_bytes_before": 512, "linear_bytes_bf16": 256,
                   "linear_bytes_after": 128 + 32, "ratio_vs_bf16": 160 / 256, "ratio_vs_before": 160 / 512}


def test_a_later_eval_of_the_same_checkpoint_keeps_the_other_tasks(tmp_path):
    path = tmp_path / "iter.json"
    path.write_text(json.dumps({"results": {"a": {"acc,none": 0.1}, "b": {"acc,none": 0.2}},
                                "versions": {"a": 1, "b": 1}}))
    merged = results.keep_other_tasks(path, {"results": {"b": {"acc,none": 0.9}, "c": {"acc,none": 0.3}},
                                             "versions": {"b": 2, "c": 1}})
    assert merged["results"] == {"a": {"acc,none": 0.1}, "b": {"acc,none": 0.9}, "c": {"acc,none": 0.3}}
    assert merged["versions"] == {"a": 1, "b": 2, "c": 1}
    assert results.keep_other_tasks(tmp_path / "none.json", {"results": {}}) == {"results": {}}
