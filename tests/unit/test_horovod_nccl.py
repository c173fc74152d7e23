"""Horovod on GPUs (issue 46 item 5): built with NCCL (HOROVOD_GPU_OPERATIONS=NCCL) when torch is a CUDA build, else
GPU tensors reduce through host memory over gloo. The build needs nvcc, refused in one line without it; the wheel's
cache folder names NCCL (a gloo-only wheel is never reused for a CUDA torch); doctor and the rank's start refuse a
Horovod without NCCL for a GPU recipe. Here (a CPU torch) the Horovod installed is gloo-only, which is what those
refusals must catch."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from hpc_tools import doctor
from tests.helpers import REPO

FAKE_CUDA_TORCH = "__version__ = '2.13.0+cu128'\nclass version:\n    cuda = '12.8'\n"


def test_a_cuda_torch_without_nvcc_is_refused_in_one_line_before_anything_is_built(tmp_path):
    fake = tmp_path / "site"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text(FAKE_CUDA_TORCH)
    bin_dir = tmp_path / "bin"  # PATH without nvcc: bash's tools and this Python only
    bin_dir.mkdir()
    for tool in ("dirname", "flock", "mkdir", "ls", "head", "awk", "sort", "tail", "cat"):
        path = subprocess.run(["bash", "-c", f"command -v {tool}"], capture_output=True, text=True).stdout.strip()
        if path:
            os.symlink(path, bin_dir / tool)
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(fake), "PATH": str(bin_dir),
           "CUDA_HOME": str(tmp_path / "no-cuda"), "HPC_TOOLS_WHEEL_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([shutil.which("bash"), str(REPO / "environment" / "install-horovod.sh")], env=env,
                         capture_output=True,
                         text=True, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert lines[0].startswith("hpc_tools: torch is built for CUDA 12.8 but nvcc is not on PATH") and \
        "HOROVOD_GPU_OPERATIONS=NCCL" in lines[0], lines[0]
    assert not (tmp_path / "cache").exists(), "nothing is built or cached"


def test_the_wheel_cache_names_nccl():
    gloo, nccl = doctor.horovod_wheel_dir(torch_version="2.13.0"), doctor.horovod_wheel_dir(torch_version="2.13.0",
                                                                                            nccl=True)
    assert nccl.name == gloo.name + "-nccl"
    text = (REPO / "environment" / "install-horovod.sh").read_text()
    assert "HOROVOD_GPU_OPERATIONS=NCCL" in text and "horovod_wheel_dir(nccl=bool($nccl))" in text
    assert "h.nccl_built()" in text  # a gloo-only Horovod on a CUDA torch is not kept


@pytest.mark.extra_env
def test_doctor_and_the_rank_refuse_a_horovod_without_nccl_for_a_gpu_recipe():
    torch = pytest.importorskip("torch")
    hvd = pytest.importorskip("horovod.torch")
    assert not hvd.nccl_built(), "this test needs the gloo-only build of a CPU torch"
    row = doctor.horovod_check("horovod", gpus=True)
    assert row.status == "fail" and "\n" not in row.detail and "built without NCCL" in row.detail, row
    assert row.fix.startswith("bash environment/install-horovod.sh")
    assert doctor.horovod_check("horovod", gpus=False).status == "pass"

    from hpc_tools.errors import UserError
    from hpc_tools.train.horovod.trainer import check_nccl

    check_nccl(hvd, torch.device("cpu"))
    with pytest.raises(UserError) as err:
        check_nccl(hvd, torch.device("cuda"))
    assert "\n" not in str(err.value) and "built without NCCL" in str(err.value)
