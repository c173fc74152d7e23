"""``eval`` of a model on GPUs (issue 46 items 2 and 10): loaded in the run's precision, not the export's fp32;
spread over the node's GPUs when one cannot hold it; refused in one line when the node cannot; the job array asks
for the GPUs that hold it; lm-eval's ``auto`` batch size on GPUs. Before, every export loaded with ``dtype=auto``
(fp32) on one device at batch size 1, and each array task asked for one GPU: gpt_moe (187 GB in fp32) and
llama3_405b ended in CUDA out of memory."""

from __future__ import annotations

import json

import pytest

from hpc_tools.errors import UserError
from hpc_tools.evaluate.harness import OVERHEAD, load_args, parameter_count
from hpc_tools.recipe.load import load_recipe
from tests.helpers import REPO

torch = pytest.importorskip("torch")

GB = 10**9


@pytest.fixture
def folder(tmp_path):
    """A model folder of 1,000 fp32 parameters (an export)."""
    from safetensors.torch import save_file

    save_file({"a.weight": torch.zeros(20, 40), "b.weight": torch.zeros(200)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    return tmp_path


def test_the_parameter_count_is_read_from_the_headers(folder, tmp_path):
    assert parameter_count(folder) == 1000
    assert parameter_count(tmp_path / "nothing") is None


def test_one_gpu_the_node_or_a_one_line_refusal(folder):
    fp32, bf16 = OVERHEAD * 4000, OVERHEAD * 2000  # bytes the folder needs as stored, and in bf16
    assert load_args(folder, "auto", []) == {"pretrained": str(folder), "dtype": "auto"}  # CPU: as it is
    assert load_args(folder, "auto", [int(fp32) + 1]) == {"pretrained": str(folder), "dtype": "auto"}
    # fp32 on one GPU too small: spread over the node's GPUs; in the run's bf16 one GPU holds it
    assert load_args(folder, "auto", [int(fp32) - 1] * 2)["parallelize"] is True
    assert "parallelize" not in load_args(folder, "bfloat16", [int(bf16) + 1] * 2)
    with pytest.raises(UserError) as err:
        load_args(folder, "bfloat16", [int(bf16 / 3)] * 2)
    line = str(err.value)
    assert "\n" not in line and "in bfloat16" in line and "the 2 GPU(s) here hold" in line and "quantize" in line


def test_the_array_asks_for_the_gpus_that_hold_the_model_in_the_runs_precision(tmp_path):
    from hpc_tools.evaluate.evaljob import array_gpus
    from hpc_tools.render.batch import render_eval_array as render_array

    moe = load_recipe(REPO / "recipes" / "gpt_moe.yaml")
    gpus = array_gpus(moe)
    assert 1 < gpus <= moe.cluster.gpus_per_node, gpus  # ~47B parameters in bf16 exceed one 80 GB GPU
    text = render_array(moe, tmp_path / "run", [10], ["--tasks", "a"], gpus)
    assert f"#SBATCH --gpus-per-node={gpus}\n" in text
    assert array_gpus(load_recipe(REPO / "recipes" / "llama_fsdp.yaml")) == 1
    with pytest.raises(UserError) as err:
        array_gpus(load_recipe(REPO / "recipes" / "llama3_405b.yaml"))
    line = str(err.value)
    assert "\n" not in line and "in bf16" in line and "quantize the export first" in line, line


def test_an_array_task_gets_no_batch_size_unless_given():
    """lm-eval's auto batch size on the task's GPUs (``--batch-size`` passed on only when the user gave one)."""
    from types import SimpleNamespace

    from hpc_tools.evaluate.evaljob import EvalRequest, eval_args

    plan = SimpleNamespace(tasks=["a"], include_path=None, request=EvalRequest("r", "a"))
    assert "--batch-size" not in eval_args(plan)
    plan.request.batch_size = "auto"
    assert eval_args(plan)[-2:] == ["--batch-size", "auto"]
