"""benchmarks/gpu_smoke.sh without a GPU: its dry run validates the Megatron runs' recipes, plans every other step
in order with the commands it would run, and writes the one summary file."""

from __future__ import annotations

import json
import subprocess

from tests.helpers import REPO

STEPS = ["env", "profiling", "deepspeed", "megatron_recipes", "megatron_save", "megatron_resume", "export",
         "hf_forward", "megatron_gpu", "gpu_mfu"]


def test_dry_run_plans_every_step_and_writes_the_summary(tmp_path):
    out = tmp_path / "smoke"
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_smoke.sh"), "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    status = {s["step"]: s["status"] for s in summary["steps"]}
    assert list(status) == STEPS and summary["failed"] == []
    assert status["megatron_recipes"] == "passed"  # the two Megatron runs' recipes validate here
    assert {s for s, v in status.items() if v != "planned"} == {"megatron_recipes"}
    planned = {s["step"]: (out / "logs" / f"{s['step']}.log").read_text() for s in summary["steps"]}
    for words in ("--set training.precision=bf16", "--set backend.megatron.transformer_impl=local",
                  "--set cluster.gpus_per_node=1", "--executor local"):
        assert words in planned["megatron_save"] and words in planned["megatron_resume"], words
    assert "training.train_iters=10" in planned["megatron_save"]
    assert "training.train_iters=20" in planned["megatron_resume"]
    assert "checkpoint.load_path=RUN/checkpoints/iter_0000010" in planned["megatron_resume"]
    assert "benchmarks/gpu_mfu.py --size 1.3b" in planned["gpu_mfu"]
    assert "tests/integration/test_gpu_tier.py" in planned["megatron_gpu"]


def test_an_unknown_argument_is_one_line_naming_help(tmp_path):
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_smoke.sh"), "--bogus"], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == "gpu_smoke: unknown argument --bogus (see --help)"
