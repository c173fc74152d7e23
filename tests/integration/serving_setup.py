"""What the serving tests share (tests/integration/test_serve*.py): the serving environment, built through
environment/install-serve.sh when it is missing (seconds when it is complete), and one tiny trained run per test
session, which each module copies into a run folder of its own (a run's serving record is per folder)."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
from pathlib import Path

from tests.helpers import REPO, run_cli, shared_once

RECIPE = "recipes/llama_fsdp.yaml"
# The recipe's local profile (a 2-layer Llama, byte tokenizer, vocabulary 512) cut to one rank and 6 steps, with a
# checkpoint at the end: the run `serve` exports.
TRAIN = ["--profile", "local", "--set", "local.cluster.gpus_per_node=1", "--set", "local.training.train_iters=6",
         "--set", "local.checkpoint.interval_iters=6", "--set", "local.training.global_batch_size=4"]


def serving_env(tmp_path_factory) -> None:
    """environment/install-serve.sh into $HPC_TOOLS_SERVE_ENV (default .venv-serve): part of the set-up, once per
    session; a failure fails the tests (it is never a skip)."""
    def install(_folder: Path) -> dict:
        proc = subprocess.run(["bash", str(REPO / "environment" / "install-serve.sh")], capture_output=True,
                              text=True, timeout=1800)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return {"out": proc.stdout[-500:]}

    shared_once(tmp_path_factory, "serving-env", install)


def trained_run(tmp_path_factory, name: str) -> Path:
    """A copy, for this module, of the session's tiny trained run (one verified checkpoint at step 6)."""
    def train(folder: Path) -> dict:
        out = run_cli("submit", RECIPE, *TRAIN, "--executor", "local", "--json", "--runs-dir", str(folder),
                      timeout=900)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return json.loads(out.stdout)

    source = Path(shared_once(tmp_path_factory, "serving-run", train)["run_dir"])
    copy = tmp_path_factory.mktemp(name) / source.name
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns(".lock", "serve"))
    return copy


@functools.lru_cache(maxsize=2)
def _model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def reference_ids(model_dir: Path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """What transformers' own greedy generate gives for one prompt alone (the tokens after it)."""
    import torch

    model = _model(str(model_dir))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()
