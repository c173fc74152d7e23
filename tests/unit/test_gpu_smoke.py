"""benchmarks/gpu_smoke.sh without a GPU: its dry run validates the Megatron runs' recipes, plans every other step
in order with the commands it would run, and writes the one summary file."""

from __future__ import annotations

import json
import subprocess

from tests.helpers import REPO

STEPS = ["env", "gpu_mfu", "gpu_mfu_fsdp", "side_by_side", "benchmark_plans", "megatron_recipes",
         "megatron_save", "megatron_resume", "export", "hf_forward", "eval_bf16", "serve_gpu", "horovod_nccl",
         "moe_local", "mla_local", "profiling", "gpu_units", "deepspeed", "fsdp", "megatron_gpu"]
CHECKED = {"megatron_recipes", "benchmark_plans"}  # what a dry run runs: the recipes, and the benchmarks' dry runs


def test_dry_run_plans_every_step_and_writes_the_summary(tmp_path):
    out = tmp_path / "smoke"
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_smoke.sh"), "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    status = {s["step"]: s["status"] for s in summary["steps"]}
    assert list(status) == STEPS and summary["failed"] == []
    assert status["megatron_recipes"] == "passed"  # the two Megatron runs' recipes validate here
    assert status["benchmark_plans"] == "passed"  # gpu_mfu --backend fsdp and gpu_side_by_side dry runs
    assert {s for s, v in status.items() if v != "planned"} == CHECKED
    planned = {s["step"]: (out / "logs" / f"{s['step']}.log").read_text() for s in summary["steps"]}
    for words in ("--set training.precision=bf16", "--set backend.megatron.transformer_impl=local",
                  "--set cluster.gpus_per_node=1", "--executor local"):
        assert words in planned["megatron_save"] and words in planned["megatron_resume"], words
    assert "training.train_iters=10" in planned["megatron_save"]
    assert "training.train_iters=20" in planned["megatron_resume"]
    assert "checkpoint.load_path=RUN/checkpoints/iter_0000010" in planned["megatron_resume"]
    assert "benchmarks/gpu_mfu.py --size 1.3b" in planned["gpu_mfu"]
    assert "benchmarks/gpu_mfu.py --backend fsdp --size 1.3b" in planned["gpu_mfu_fsdp"]
    assert "benchmarks/gpu_side_by_side.py" in planned["side_by_side"]
    assert "tests/integration/test_fused_kernels_gpu.py" in planned["fsdp"]
    # the side-by-side dry run wrote torchtitan's config and printed its three commands
    assert (out / "side_by_side" / "hpc_side_by_side_titan.py").is_file()
    for path in ("torchtitan: ", "megatron: ", "fsdp: "):
        assert path in planned["benchmark_plans"], path
    assert "FSDP2 1 rank, compiled blocks" in planned["benchmark_plans"]
    assert "tests/integration/test_gpu_tier.py" in planned["megatron_gpu"]
    for words in ("recipes/gpt_moe.yaml", "--set backend.megatron.transformer_impl=local",
                  "--set backend.megatron.use_flash_attention=false", "--set cluster.gpus_per_node=1"):
        assert words in planned["moe_local"] and words in planned["mla_local"], words
    assert "model.multi_latent_attention=true" in planned["mla_local"]
    assert "doctor recipes/gpt_3d.yaml" in planned["env"]  # the job's own packages: no step here needs Horovod
    assert "tests/unit/test_prefetch.py" in planned["gpu_units"]
    # issue 46's steps: eval in the run's precision at lm-eval's auto batch size, serve on the GPU, Horovod's NCCL
    assert "--batch-size auto" in planned["eval_bf16"] and "--include-path" in planned["eval_bf16"]
    assert "--gpus 1" in planned["serve_gpu"] and "nvidia-smi" in planned["serve_gpu"]
    assert "install-horovod.sh" in planned["horovod_nccl"] and "nccl_built" in planned["horovod_nccl"]


def test_only_runs_the_named_steps(tmp_path):
    out = tmp_path / "smoke"
    subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_smoke.sh"), "--dry-run", "--only", "env,gpu_units",
                    "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path, check=True)
    steps = [s["step"] for s in json.loads((out / "summary.json").read_text())["steps"]]
    assert steps == ["env", "benchmark_plans", "megatron_recipes", "gpu_units"]  # the dry run's checks always run


def test_an_unknown_argument_is_one_line_naming_help(tmp_path):
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_smoke.sh"), "--bogus"], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == "gpu_smoke: unknown argument --bogus (see --help)"


def test_pytest_steps_run_without_xdist(tmp_path):
    """One GPU: the smoke's pytest steps run one module at a time (-n 0), never xdist's one worker per module."""
    out = tmp_path / "smoke"
    subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_smoke.sh"), "--dry-run", "--out", str(out)],
                   capture_output=True, text=True, timeout=300, cwd=tmp_path, check=True)
    for step in ("profiling", "gpu_units", "deepspeed", "fsdp", "megatron_gpu"):
        assert " -n 0 " in (out / "logs" / f"{step}.log").read_text(), step


def test_every_gpu_marked_test_is_in_one_xdist_group():
    """Under xdist (-n auto --dist loadgroup) two GPU modules would run at once on one GPU: conftest puts every
    gpu-marked test in the group ``gpu``; other integration modules keep a group each."""
    import pytest

    from tests.conftest import INTEGRATION, pytest_collection_modifyitems

    class Item:
        def __init__(self, name: str, gpu: bool):
            self.path, self.fixturenames, self.markers = INTEGRATION / name, [], [pytest.mark.gpu.mark] if gpu else []

        def get_closest_marker(self, name):
            return next((m for m in self.markers if m.name == name), None)

        def add_marker(self, mark):
            self.markers.append(getattr(mark, "mark", mark))

    items = [Item("test_profiling_gpu.py", True), Item("test_deepspeed_gpu.py", True),
             Item("test_megatron_run.py", False)]
    pytest_collection_modifyitems(None, items)
    groups = [item.get_closest_marker("xdist_group").args[0] for item in items]
    assert groups == ["gpu", "gpu", "test_megatron_run"]


def test_fetch_wheels_gathers_liger_at_the_gpu_pin_and_torchtitan_apart():
    """(pip download needs the network: the fetch itself is run by hand, docs/gpu-path.md.) Liger Kernel is fetched
    at requirements-gpu.txt's pin into the main set; torchtitan 0.3.0 and its import set go to titan/, which
    titan_install installs without dependencies (torchtitan pins datasets<4.8, the project 5.2)."""
    import re

    script = (REPO / "benchmarks" / "gpu_smoke.sh").read_text()
    fetch = script[script.index("--fetch-wheels)"):script.index("-h|--help)")]
    gpu_pin = re.search(r"^liger-kernel==(\S+)", (REPO / "environment" / "requirements-gpu.txt").read_text(), re.M)
    assert f'-d "$dest" liger-kernel=={gpu_pin.group(1)}' in fetch
    titan = fetch[fetch.index('-d "$dest/titan"'):]
    for wheel in ("torchtitan==0.3.0", "torchdata==", "torch_checkpointing==", "spmd_types==", "tyro==",
                  "tensorboard=="):
        assert wheel in titan, wheel
    assert 'titan_install 300 "$py" -m pip install --no-index --no-deps "$wheels"/titan/*.whl' in script


def test_the_open_issues_figures_come_before_the_regression_checks():
    """A budgeted call (one 10-minute device call) gets the figures first: the MFU benchmarks and the side by side
    before the Megatron run, and those before the regression checks."""
    assert STEPS.index("side_by_side") < STEPS.index("megatron_save") < STEPS.index("moe_local")


def test_a_budget_spent_skips_every_step_and_runs_nothing(tmp_path):
    out = tmp_path / "smoke"
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_smoke.sh"), "--budget-s", "0", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = json.loads((out / "summary.json").read_text())["steps"]
    assert steps and all(s["status"] == "skipped" for s in steps), steps
    budget = [s["step"] for s in steps if s["tail"] == ["budget: 0 s spent before this step"]]
    assert {"env", "gpu_mfu_fsdp", "side_by_side", "megatron_save", "horovod_nccl", "moe_local"} <= set(budget)
    assert not (out / "runs").exists()  # nothing ran


def test_a_budget_that_is_not_a_number_is_one_line(tmp_path):
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_smoke.sh"), "--budget-s", "ten"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "gpu_smoke: --budget-s ten must be a whole number of seconds"
