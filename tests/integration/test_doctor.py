"""`doctor` on this machine and against the Slurm test cluster: the package rows pass against the pins, Slurm answers,
a recipe's partition is checked live, and a broken Slurm configuration fails with its fix."""

from __future__ import annotations

import json

import pytest
import yaml

from hpc_tools.doctor import PACKAGES, pins
from tests.helpers import run_cli


def rows(out) -> dict[str, list[dict]]:
    data = json.loads(out.stdout)
    found: dict[str, list[dict]] = {}
    for row in data["checks"]:
        found.setdefault(row["name"], []).append(row)
    return found


@pytest.mark.slurm
@pytest.mark.extra_env  # the horovod row: Horovod installs beside the first tests (environment/test.sh)
def test_doctor_passes_on_this_machine_against_the_test_cluster(slurm):
    out = run_cli("doctor", "--json", timeout=300)  # with torch: the CUDA row reads torch's build
    table = rows(out)
    assert out.returncode == 0 and json.loads(out.stdout)["ok"] is True, out.stdout
    for name in PACKAGES:
        [row] = table[name]
        assert row["status"] == "pass" and pins()[name] in row["detail"], row
    assert table["python"][0]["status"] == "pass" and table["runs folder"][0]["status"] == "pass"
    assert table["slurm"][0]["status"] == "pass" and "partitions:" in table["slurm"][0]["detail"]
    assert table["cuda"][0]["status"] in ("pass", "skip")  # a CPU build here, a GPU one on a GPU machine


@pytest.mark.slurm
def test_doctor_checks_a_recipe_against_the_live_partition(slurm, tmp_path):
    ok = run_cli("doctor", "recipes/comm_check.yaml", "--profile", "local", "--no-torch", "--json", timeout=120)
    table = rows(ok)
    assert ok.returncode == 0, ok.stdout
    assert table["recipe"][0]["status"] == "pass" and "slurm job" in table["recipe"][0]["detail"]
    assert table["partition"][0]["status"] == "pass" and table["container"][0]["status"] == "skip"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({
        "name": "doctor", "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                                    "vocab_size": 512},
        "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu_type": "cpu", "cpus_per_task": 1, "partition": "nosuch",
                    "setup": {"container": {"kind": "apptainer", "image": "docker://ubuntu:22.04"}}}}))
    out = run_cli("doctor", str(bad), "--no-torch", "--json", "--runs-dir", str(tmp_path / "runs"), timeout=120)
    table = rows(out)
    assert out.returncode == 1
    [partition] = table["partition"]
    assert partition["status"] == "fail" and "cluster.partition=nosuch" in partition["detail"]
    assert "use one of:" in partition["fix"]
    container = table["container"][0]
    assert container["status"] == "pass" or ("apptainer" in container["fix"] and container["status"] == "fail")


@pytest.mark.slurm
def test_a_bogus_slurm_conf_fails_the_slurm_check_with_its_fix(slurm, tmp_path):
    """sinfo with a missing SLURM_CONF retries for a minute: doctor gives up after 3 s and names the variable."""
    out = run_cli("doctor", "--no-torch", "--json", "--runs-dir", str(tmp_path / "runs"),
                  env={"SLURM_CONF": str(tmp_path / "missing.conf")}, timeout=120)
    [row] = rows(out)["slurm"]
    assert out.returncode == 1
    assert row["status"] == "fail" and "did not answer within 3 s" in row["detail"], row
    assert f"SLURM_CONF={tmp_path / 'missing.conf'} is not a file" in row["fix"]
    text = run_cli("doctor", "--no-torch", env={"SLURM_CONF": str(tmp_path / "missing.conf")}, timeout=120)
    assert "FAIL" in text.stdout and "fix: SLURM_CONF=" in text.stdout and text.returncode == 1
