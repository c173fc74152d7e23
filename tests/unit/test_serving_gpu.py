"""Serving on GPUs (issue 46 items 6 and 7). Triton: the server loads the model on the GPU in bf16 when torch sees
one, and ``--gpus`` with a CPU-only serving environment is refused in one line (the GPUs would sit idle). vLLM: its
interpreter must import vLLM before the job is submitted, and its tensor-parallel size must divide the heads."""

from __future__ import annotations

import sys

import pytest

from hpc_tools.errors import UserError
from hpc_tools.serving import job


def fake_python(tmp_path, name: str, body: str):
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def test_triton_gpus_with_a_cpu_only_serving_torch_is_refused(tmp_path):
    cpu = fake_python(tmp_path, "cpu-python", "echo 2.13.0+cpu")
    cuda = fake_python(tmp_path, "cuda-python", "echo 2.13.0+cu128")
    opts = job.ServeOptions(engine="triton", executor="slurm", gpus=1)
    with pytest.raises(UserError) as err:
        job.check_gpus(opts, cpu)
    line = str(err.value)
    assert "\n" not in line and "torch 2.13.0+cpu is a CPU-only build" in line and "install-serve.sh" in line
    job.check_gpus(opts, cuda)
    job.check_gpus(job.ServeOptions(engine="triton", executor="slurm", gpus=0), cpu)  # CPU serving: nothing asked


def test_the_server_loads_on_the_gpu_in_bf16_when_torch_sees_one(monkeypatch):
    torch = pytest.importorskip("torch")
    from hpc_tools.serving.triton_server import load_model

    calls = []

    class Loaded:
        def to(self, device):
            calls.append(("to", device))
            return self

        def eval(self):
            return self

    class Auto:
        @staticmethod
        def from_pretrained(folder, **kwargs):
            calls.append(("load", folder, kwargs))
            return Loaded()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    load_model(Auto, "/m", torch)
    assert calls == [("load", "/m", {"torch_dtype": torch.bfloat16}), ("to", "cuda")]
    calls.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    load_model(Auto, "/m", torch)
    assert calls == [("load", "/m", {})]  # CPU: as the folder stores it


def test_vllm_must_import_before_the_job_is_submitted(monkeypatch):
    monkeypatch.setenv(job.VLLM_ENV, sys.executable)  # the training environment: no vLLM (and must get none)
    with pytest.raises(UserError) as err:
        job.check_vllm(job.ServeOptions(engine="vllm", executor="slurm", gpus=1), {})
    line = str(err.value)
    assert "\n" not in line and f"{sys.executable} cannot import vllm" in line and job.VLLM_ENV in line


def test_vllm_tensor_parallel_size_must_divide_the_heads(tmp_path, monkeypatch):
    monkeypatch.setenv(job.VLLM_ENV, str(fake_python(tmp_path, "vllm-python", "exit 0")))  # imports vLLM
    with pytest.raises(UserError) as err:
        job.check_vllm(job.ServeOptions(engine="vllm", executor="slurm", gpus=5), {"num_attention_heads": 12})
    assert str(err.value) == ("--gpus 5: vLLM's tensor-parallel size must divide the model's 12 attention heads "
                              "(give --gpus 1, 2, 3, 4, 6)")
    job.check_vllm(job.ServeOptions(engine="vllm", executor="slurm", gpus=4), {"num_attention_heads": 12})


def test_vllm_runs_in_the_environment_install_vllm_completed(tmp_path, monkeypatch):
    """No $HPC_TOOLS_VLLM_PYTHON: the python of the environment install-vllm.sh completed, else python3; the check
    and the rendered server line use the same interpreter."""
    monkeypatch.delenv(job.VLLM_ENV, raising=False)
    venv = tmp_path / "vllm-env"
    monkeypatch.setenv(job.VLLM_VENV, str(venv))
    assert job.vllm_python() == "python3"  # nothing installed there
    (venv / "bin").mkdir(parents=True)
    fake_python(venv / "bin", "python", "exit 0")
    assert job.vllm_python() == "python3"  # not complete: install-vllm.sh writes its stamp last
    (venv / ".hpc_tools-vllm-complete").write_text("vllm==0.34.0")
    assert job.vllm_python() == str(venv / "bin" / "python")
    job.check_vllm(job.ServeOptions(engine="vllm", executor="slurm", gpus=2), {"num_attention_heads": 4})
    monkeypatch.setenv(job.VLLM_ENV, "/opt/vllm/bin/python")  # the variable wins
    assert job.vllm_python() == "/opt/vllm/bin/python"


def test_install_vllm_refuses_without_a_gpu_in_one_line(tmp_path):
    """vLLM's wheels are several GB of CUDA builds: without an NVIDIA GPU the script says so and writes nothing."""
    import subprocess

    from tests.helpers import REPO

    env_dir = tmp_path / "venv"
    out = subprocess.run(["bash", str(REPO / "environment" / "install-vllm.sh")], capture_output=True, text=True,
                         timeout=60, env={"PATH": "/usr/bin:/bin", "HPC_TOOLS_VLLM_ENV": str(env_dir)})
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "no NVIDIA GPU here" in out.stderr and "HPC_TOOLS_VLLM_ANYWAY=1" in out.stderr
    assert not env_dir.exists() and not (tmp_path / "venv.lock").exists()


def test_the_vllm_pin_is_one_exact_version():
    from tests.helpers import REPO

    lines = [ln.strip() for ln in (REPO / "environment" / "requirements-vllm.txt").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert len(lines) == 1 and lines[0].startswith("vllm==") and lines[0].count(".") == 2
