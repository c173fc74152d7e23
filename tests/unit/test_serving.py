"""The serving control plane without a server (hpc_tools.serving.job / client, cli serve and generate): the rendered
job script for both engines and executors, the one-line refusals, the memory count, endpoint references and the
--file format. The server itself is tested in tests/integration/test_serve*.py."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
from pathlib import Path

import pytest

from hpc_tools.errors import UserError
from hpc_tools.registry import RunFolder
from hpc_tools.serving import client, job


def run_folder(tmp_path) -> RunFolder:
    folder = tmp_path / "runs" / "r1"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"run_id": "r1", "state": "COMPLETED", "events": []}))
    return RunFolder(folder)


def test_slurm_script_asks_for_a_node_of_its_own_and_runs_the_server_in_the_serving_env(tmp_path):
    run = run_folder(tmp_path)
    opts = job.ServeOptions(executor="slurm", time="2:30", partition="gpu", gpus=0, mem_gb=64, http_port=9000,
                            grpc_port=9001)
    script = job.render_script(run, tmp_path / "model dir", opts, Path("/envs/serve/bin/python"))
    lines = script.splitlines()
    for want in ("#SBATCH --nodes=1", "#SBATCH --exclusive", "#SBATCH --time=2:30:00", "#SBATCH --partition=gpu",
                 "#SBATCH --mem=64G", f"#SBATCH --output={run.path}/serve/serve-%j.out"):
        assert want in lines, want
    assert not any("--gpus" in line for line in lines)
    server = lines[-1]
    assert server.startswith('exec "${LIMIT[@]}" /envs/serve/bin/python ') and str(job.SERVER) in server
    assert f"--model '{tmp_path}/model dir'" in server and "--http-port 9000 --grpc-port 9001" in server
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_local_time_limit_is_coreutils_timeout_and_slurm_keeps_its_own(tmp_path):
    run = run_folder(tmp_path)
    script = job.render_script(run, tmp_path, job.ServeOptions(time="0:02"), Path("/bin/echo"))
    body = script.replace('exec "${LIMIT[@]}" /bin/echo', 'echo "${LIMIT[@]}"')
    local = subprocess.run(["bash", "-c", body], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert local.stdout.startswith(f"timeout --kill-after=30 120 {job.SERVER} "), local.stdout
    slurm = subprocess.run(["bash", "-c", body], capture_output=True, text=True,
                           env={"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "7"})
    assert slurm.stdout.startswith(f"{job.SERVER} "), slurm.stdout  # no timeout: Slurm's --time limits it


def test_vllm_script_runs_the_openai_server_and_writes_the_endpoint_when_healthy(tmp_path):
    run = run_folder(tmp_path)
    opts = job.ServeOptions(engine="vllm", executor="slurm", gpus=4, http_port=8100)
    script = job.render_script(run, tmp_path / "m", opts, Path("python3"))
    assert "#SBATCH --gpus-per-node=4" in script
    assert "-m vllm.entrypoints.openai.api_server" in script and "--port 8100 --tensor-parallel-size 4" in script
    assert 'curl -sf "http://127.0.0.1:8100/health"' in script and "endpoint.json" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


@pytest.mark.parametrize("value", ["", "90", "1:60", "0:00", "1:5", "a:bc", "1:00:00"])
def test_time_must_be_h_mm(value):
    with pytest.raises(UserError, match="--time="):
        job.check_time(value)


def test_time_minutes():
    assert job.check_time("0:15") == 15 and job.check_time("12:05") == 725


def test_vllm_needs_a_gpu():
    with pytest.raises(UserError, match="vLLM's wheels are CUDA builds"):
        job.check_engine(job.ServeOptions(engine="vllm", executor="slurm", gpus=0))
    job.check_engine(job.ServeOptions(engine="vllm", executor="slurm", gpus=1))
    job.check_engine(job.ServeOptions(engine="triton", executor="local"))


def test_a_port_in_use_is_refused_locally():
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(UserError, match=f"--grpc-port={port} is in use"):
            job.check_ports(job.ServeOptions(http_port=0, grpc_port=port))
        job.check_ports(job.ServeOptions(executor="slurm", http_port=0, grpc_port=port))  # checked on the node
    with pytest.raises(UserError, match="both 9000"):
        job.check_ports(job.ServeOptions(http_port=9000, grpc_port=9000))


def test_missing_serving_env_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv(job.ENV_VAR, str(tmp_path / "nothing"))
    with pytest.raises(UserError, match="bash environment/install-serve.sh"):
        job.serve_python()


def safetensors(path: Path, tensors: dict[str, tuple[int, int]]) -> None:
    header = {"__metadata__": {}, **{k: {"dtype": "F32", "shape": [1], "data_offsets": list(v)}
                                     for k, v in tensors.items()}}
    raw = json.dumps(header).encode()
    end = max(v[1] for v in tensors.values())
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(end))


def test_memory_counts_safetensors_bytes_and_the_kv_cache(tmp_path):
    safetensors(tmp_path / "model.safetensors", {"a": (0, 4000), "b": (4000, 10000)})
    assert job.folder_weight_bytes(tmp_path) == 10000
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
              "max_position_embeddings": 32}
    assert job.kv_cache_bytes(config, 8) == 2 * 2 * 2 * 16 * 32 * 8 * 4
    need = 1.2 * 10000 + job.kv_cache_bytes(config, 8)
    job.check_memory(10000, config, job.ServeOptions(mem_gb=need / 1e9 * 1.01))
    with pytest.raises(UserError, match=r"needs about .* GB to serve .*\(--mem"):
        job.check_memory(10000, config, job.ServeOptions(mem_gb=need / 1e9 * 0.99))


def test_host_port_or_a_served_run(tmp_path, monkeypatch):
    assert client.resolve("n1:8000", str(tmp_path)) == client.Endpoint("n1", 8000)
    run = run_folder(tmp_path)
    with pytest.raises(UserError, match="no serving endpoint"):
        client.resolve(str(run.path), str(tmp_path / "runs"))
    run.update(serve={"state": "RUNNING", "executor": "slurm", "job_id": "5", "engine": "triton"},
               endpoint={"host": "n2", "http_port": 8000, "grpc_port": 8001})
    monkeypatch.setattr(job, "alive", lambda record: True)  # the Slurm job is running
    assert client.resolve("r1", str(tmp_path / "runs")) == client.Endpoint("n2", 8000)
    monkeypatch.setattr(job, "alive", lambda record: False)  # gone: recorded ENDED, the endpoint cleared
    with pytest.raises(UserError, match=r"no serving endpoint \(ENDED\)"):
        client.resolve("r1", str(tmp_path / "runs"))
    assert run.manifest()["endpoint"] is None


def test_request_body_is_kserve_v2():
    body = client.request_body(None, [1, 2, 3], 5)
    assert body["inputs"][0] == {"name": "input_ids", "datatype": "INT64", "shape": [1, 3], "data": [1, 2, 3]}
    assert body["inputs"][1] == {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], "data": [5]}
    text = client.request_body("hi", None, 2, temperature=0.5)
    assert [i["name"] for i in text["inputs"]] == ["text", "max_tokens", "temperature"]


@pytest.mark.parametrize("line", ['{"prompt": 3}', '{"input_ids": []}', '{"input_ids": [1, -2]}', '[1, 2]',
                                  '{"prompt": "a", "input_ids": [1]}', "not json"])
def test_a_bad_prompts_file_line_is_one_line(cli, tmp_path, line):
    (tmp_path / "p.jsonl").write_text('{"prompt": "fine"}\n' + line + "\n")
    out = cli("generate", "127.0.0.1:1", "--file", str(tmp_path / "p.jsonl"))
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "line 2 is not a JSON object" in out.stderr
