"""``serve`` on the local executor: a tiny trained Llama (FSDP, one rank) exported and served by Triton Inference
Server (PyTriton, in the serving environment); ``generate`` with greedy decoding returns exactly the token ids that
transformers' own ``generate`` gives for the exported model, for single requests (ids and text) and for a --file of
concurrent requests that Triton's dynamic batcher batches; ``status`` shows the endpoint; bad input is one line, exit 2,
nothing left running; ``cancel`` stops the server (its process group gone, its ports free). One server per module."""

from __future__ import annotations

import json
import os
import socket
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import run_cli
from tests.integration.serving_setup import reference_ids, serving_env, trained_run

pytestmark = [pytest.mark.slow, pytest.mark.extra_env]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    serving_env(tmp_path_factory)
    run = trained_run(tmp_path_factory, "serve-local")
    out = run_cli("serve", str(run), "--executor", "local", "--http-port", "0", "--grpc-port", "0", "--json",
                  timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout)
    yield {"run": run, **result}
    manifest = json.loads((run / "manifest.json").read_text())
    if (manifest.get("serve") or {}).get("state") == "RUNNING":  # a test failed before the cancel test
        run_cli("cancel", str(run), timeout=120)


def generate(served, *args) -> dict:
    out = run_cli("generate", str(served["run"]), "--max-tokens", str(MAX_TOKENS), "--json", *args, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout)


def tokenizer(served):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(served["model_dir"])


def test_serve_returns_ready_with_the_endpoint_recorded(served):
    endpoint = served["endpoint"]
    assert endpoint["host"] == "127.0.0.1" and endpoint["http_port"] > 0 and endpoint["grpc_port"] > 0
    with urllib.request.urlopen(f"http://127.0.0.1:{endpoint['http_port']}/v2/models/generate/ready") as r:
        assert r.status == 200
    status = run_cli("status", str(served["run"]), "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["endpoint"] == endpoint
    text = run_cli("status", str(served["run"])).stdout
    assert f"endpoint http://127.0.0.1:{endpoint['http_port']} (gRPC {endpoint['grpc_port']})" in text
    model_dir = Path(served["model_dir"])  # the run was exported first, into its one export of that checkpoint
    assert model_dir.parent == served["run"] / "exports" and model_dir.name.startswith("iter_")


def test_greedy_ids_equal_transformers_generate(served):
    ids = [5, 17, 3, 99, 250, 7]
    got = generate(served, "--ids", ",".join(map(str, ids)))
    want = reference_ids(Path(served["model_dir"]), ids, MAX_TOKENS)
    assert got["output_ids"] == want and len(want) > 0


def test_text_prompt_is_tokenized_and_decoded_as_the_folder_does(served):
    tok = tokenizer(served)
    got = generate(served, "--prompt", "The cluster said:")
    ids = tok("The cluster said:", add_special_tokens=False)["input_ids"]
    want = reference_ids(Path(served["model_dir"]), ids, MAX_TOKENS)
    assert got["output_ids"] == want
    assert got["text"] == tok.decode(want)


def test_batched_file_requests_equal_single_generate(served, tmp_path):
    """Eight concurrent requests (five of one length, so the dynamic batcher decodes them as one batch), each equal to
    transformers' generate of that prompt alone; some were decoded in one batch (the server says how many)."""
    prompts = [[i, i + 1, i + 2, i + 3] for i in range(10, 60, 10)] + [[7, 8], [300, 301, 302, 303, 304, 305],
                                                                       [42]]
    lines = [json.dumps({"input_ids": p}) for p in prompts[:-1]] + [json.dumps({"prompt": "hi", "max_tokens": 3})]
    (tmp_path / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    results = generate(served, "--file", str(tmp_path / "prompts.jsonl"))["results"]
    assert len(results) == len(lines)
    model = Path(served["model_dir"])
    for p, r in zip(prompts[:-1], results):
        assert r["prompt"] == p and r["output_ids"] == reference_ids(model, p, MAX_TOKENS), p
    hi = tokenizer(served)("hi", add_special_tokens=False)["input_ids"]
    assert results[-1]["output_ids"] == reference_ids(model, hi, 3)
    assert max(r["batch_size"] for r in results) > 1, results  # decoded together: the dynamic batcher batched


def one_line_refusal(out):
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    return lines[0]


def processes_naming(text: str) -> set[int]:
    """Processes whose command line holds ``text`` (a server started for a refused folder would name it)."""
    found = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if text.encode() in cmd:
                found.add(int(proc.name))
    return found


def test_bad_input_is_one_line_and_starts_nothing(served, tmp_path):
    run = served["run"]
    # a run without a checkpoint
    bare = tmp_path / run.name
    bare.mkdir()
    for name in ("recipe.yaml", "job.sbatch"):
        (bare / name).write_bytes((run / name).read_bytes())
    manifest = json.loads((run / "manifest.json").read_text())
    manifest.pop("serve"), manifest.pop("endpoint")
    (bare / "manifest.json").write_text(json.dumps(manifest))
    (bare / "checkpoints").mkdir()
    line = one_line_refusal(run_cli("serve", str(bare), "--executor", "local", "--http-port", "0",
                                    "--grpc-port", "0"))
    assert "checkpoint" in line and not (bare / "serve").exists()
    # a port in use
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        taken = s.getsockname()[1]
        line = one_line_refusal(run_cli("serve", served["model_dir"], "--executor", "local", "--http-port",
                                        str(taken), "--grpc-port", "0", "--runs-dir", str(tmp_path / "runs")))
    assert f"--http-port={taken} is in use" in line
    # a model larger than the node's memory by the planner's count
    line = one_line_refusal(run_cli("serve", served["model_dir"], "--executor", "local", "--http-port", "0",
                                    "--grpc-port", "0", "--mem", "0.0001", "--runs-dir", str(tmp_path / "runs")))
    assert "needs about" in line and "--mem 0.0001 GB" in line
    # no serving environment
    line = one_line_refusal(run_cli("serve", served["model_dir"], "--executor", "local", "--http-port", "0",
                                    "--grpc-port", "0", "--runs-dir", str(tmp_path / "runs"),
                                    env={"HPC_TOOLS_SERVE_ENV": str(tmp_path / "no-env")}))
    assert "bash environment/install-serve.sh" in line
    # vLLM on a machine without a GPU
    line = one_line_refusal(run_cli("serve", served["model_dir"], "--engine", "vllm", "--executor", "local",
                                    "--runs-dir", str(tmp_path / "runs")))
    assert "GPU" in line
    # the served run served again
    line = one_line_refusal(run_cli("serve", str(run), "--executor", "local", "--http-port", "0", "--grpc-port", "0"))
    assert "already served" in line
    assert not (tmp_path / "runs").exists()  # nothing written for the refused folders
    assert not processes_naming(str(tmp_path))  # nothing started


def test_cancel_stops_the_server(served):
    """Last: the process group is gone, both ports are free, status shows no endpoint, generate says so."""
    run, endpoint = served["run"], served["endpoint"]
    pid = json.loads((run / "manifest.json").read_text())["serve"]["pid"]
    out = run_cli("cancel", str(run), timeout=120)
    assert out.returncode == 0, out.stderr
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
    for port in (endpoint["http_port"], endpoint["grpc_port"]):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server binds (TIME_WAIT allowed)
            s.bind(("0.0.0.0", port))
            s.listen()  # free again: no listener left
    status = json.loads(run_cli("status", str(run), "--json").stdout)
    assert status["endpoint"] is None and status["serve"]["state"] == "CANCELLED"
    line = one_line_refusal(run_cli("generate", str(run), "--prompt", "x"))
    assert "no serving endpoint (CANCELLED)" in line
    assert one_line_refusal(run_cli("cancel", str(run)))
