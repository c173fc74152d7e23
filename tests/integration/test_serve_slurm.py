"""``serve --executor slurm`` on the Slurm test cluster (environment/slurm-dev): the tiny trained Llama's export
served by Triton as a Slurm job on a node of its own (--exclusive), reached at the node's name; ``generate`` there
returns transformers' greedy ids (single and --file); ``status`` shows the endpoint; ``cancel`` ends the job (squeue no
longer lists it) and no process of it is left. One server per module."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers import need_slurm, run_cli
from tests.integration.serving_setup import reference_ids, serving_env, trained_run

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.extra_env]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    need_slurm(1)
    serving_env(tmp_path_factory)
    run = trained_run(tmp_path_factory, "serve-slurm")
    out = run_cli("serve", str(run), "--executor", "slurm", "--time", "0:15", "--http-port", "0", "--grpc-port",
                  "0", "--ready-timeout", "600", "--json", timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout)
    yield {"run": run, **result}
    if subprocess.run(["squeue", "-h", "-j", str(result["job_id"])], capture_output=True, text=True).stdout.strip():
        subprocess.run(["scancel", str(result["job_id"])], capture_output=True)  # a test failed before cancel's


def test_the_server_runs_as_a_slurm_job_on_a_node_of_its_own(served):
    info = subprocess.run(["scontrol", "show", "job", str(served["job_id"])], capture_output=True, text=True).stdout
    assert "JobState=RUNNING" in info and "NumNodes=1 " in info and "OverSubscribe=NO" in info, info
    node = info.split(" NodeList=")[1].split()[0]
    assert served["endpoint"]["host"] == node  # reached at the node's own name
    script = (served["run"] / "serve" / "serve.sbatch").read_text()
    assert "#SBATCH --exclusive" in script and "#SBATCH --time=0:15:00" in script
    status = json.loads(run_cli("status", str(served["run"]), "--json").stdout)
    assert status["endpoint"] == served["endpoint"] and status["serve"]["job_id"] == served["job_id"]


def test_generate_against_the_slurm_server_is_transformers_greedy(served, tmp_path):
    model = Path(served["model_dir"])
    out = run_cli("generate", str(served["run"]), "--ids", "3,1,4,1,5", "--max-tokens", str(MAX_TOKENS), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["output_ids"] == reference_ids(model, [3, 1, 4, 1, 5], MAX_TOKENS)
    prompts = [[9, 2, 6], [5, 3, 5], [8, 9, 7, 9]]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    endpoint = served["endpoint"]
    out = run_cli("generate", f"{endpoint['host']}:{endpoint['http_port']}", "--file", str(tmp_path / "p.jsonl"),
                  "--max-tokens", str(MAX_TOKENS), "--json")
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout)["results"]
    assert [r["output_ids"] for r in results] == [reference_ids(model, p, MAX_TOKENS) for p in prompts]


def test_cancel_ends_the_job_and_leaves_nothing_running(served):
    out = run_cli("cancel", str(served["run"]), timeout=180)
    assert out.returncode == 0 and f"Slurm job {served['job_id']}" in out.stderr, out.stderr
    assert not subprocess.run(["squeue", "-h", "-j", str(served["job_id"])], capture_output=True,
                              text=True).stdout.strip()
    left = subprocess.run(["pgrep", "-f", str(served["run"])], capture_output=True, text=True).stdout.split()
    assert not left, left
    status = json.loads(run_cli("status", str(served["run"]), "--json").stdout)
    assert status["endpoint"] is None and status["serve"]["state"] == "CANCELLED"
