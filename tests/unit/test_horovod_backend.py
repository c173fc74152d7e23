"""backend.kind: horovod in the control plane and the rendezvous it builds without horovodrun: the rank slots and
Horovod's environment, the recipe's rules, the planner's row (DDP's memory, a ring all-reduce), the refusal before
submission when Horovod is missing, and doctor's one line when it does not load or did not build. None of these
import Horovod (tests/integration/test_horovod_train.py trains with it)."""

from __future__ import annotations

import subprocess

import pytest

from hpc_tools import doctor, world
from hpc_tools.errors import RecipeError
from hpc_tools.planner import plan_recipe
from hpc_tools.planner.arch import arch_for, fsdp_parameters
from hpc_tools.planner.collectives import allreduce_s
from hpc_tools.planner.hardware import hardware_for
from hpc_tools.planner.knobs import Knobs
from hpc_tools.planner.memory import BUCKETS, GRADIENTS, OPTIMIZER, PARAMETERS, estimate_memory
from hpc_tools.planner.sharding import HVD_COPIES
from hpc_tools.recipe.load import resolve
from hpc_tools.train.horovod.rendezvous import MIB, environment, slots

LLAMA_1B = {"family": "llama", "num_layers": 16, "hidden_size": 2048, "num_attention_heads": 32,
            "num_query_groups": 8, "ffn_hidden_size": 8192, "seq_length": 4096, "vocab_size": 128256,
            "untie_embeddings": False}
BASE = {"name": "h", "model": LLAMA_1B,
        "training": {"micro_batch_size": 2, "global_batch_size": 256, "precision": "bf16",
                     "recompute_granularity": "full"},
        "backend": {"kind": "horovod"},
        "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu_type": "H100-SXM"}}


def recipe(*overrides: str):
    return resolve(BASE, list(overrides))


def test_slots_follow_horovods_host_assignment():
    """Two nodes of two ranks: local ranks 0/1 on each, cross ranks by node; an uneven third node (one rank) joins
    the cross group of local rank 0 only."""
    got = [(s.hostname, s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size)
           for s in slots(["n1", "n1", "n2", "n2", "n3"])]
    assert got == [("n1", 0, 0, 2, 0, 3), ("n1", 1, 1, 2, 0, 2), ("n2", 2, 0, 2, 1, 3), ("n2", 3, 1, 2, 1, 2),
                   ("n3", 4, 0, 1, 2, 3)]
    assert {s.size for s in slots(["a", "b"])} == {2}
    one = slots(["x", "x"])
    assert [(s.local_rank, s.local_size, s.cross_size) for s in one] == [(0, 2, 1), (1, 2, 1)]


def test_environment_is_horovodruns_gloo_environment():
    env = environment(slots(["n1", "n2"])[1], "n1", 41234, fusion_mb=64, timeout_s=1200, iface="eth0")
    assert env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "n1" and env["HOROVOD_GLOO_RENDEZVOUS_PORT"] == "41234"
    assert env["HOROVOD_CONTROLLER"] == env["HOROVOD_CPU_OPERATIONS"] == "gloo"
    assert (env["HOROVOD_RANK"], env["HOROVOD_SIZE"], env["HOROVOD_HOSTNAME"]) == ("1", "2", "n2")
    assert (env["HOROVOD_CROSS_RANK"], env["HOROVOD_CROSS_SIZE"], env["HOROVOD_LOCAL_SIZE"]) == ("1", "2", "1")
    assert env["HOROVOD_FUSION_THRESHOLD"] == str(64 * MIB) and env["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "1200"
    assert env["HOROVOD_GLOO_IFACE"] == "eth0"
    bare = environment(slots(["n1"])[0], "127.0.0.1", 1, fusion_mb=0)
    assert "HOROVOD_GLOO_IFACE" not in bare and "HOROVOD_GLOO_TIMEOUT_SECONDS" not in bare
    assert bare["HOROVOD_FUSION_THRESHOLD"] == "0"


def test_rules_refuse_what_horovod_does_not_have_in_one_line_each():
    def errors(*overrides):
        try:
            recipe(*overrides)
        except RecipeError as exc:
            return [str(v) for v in exc.violations]
        return []

    assert errors() == [] and errors("backend.horovod.compression=fp16", "training.precision=fp32") == []
    assert errors("training.precision=fp16") == [
        "training.precision=fp16 is not available with backend.kind=horovod (no loss scaler) (use bf16 (autocast, "
        "as DDP) or fp32)"]
    assert any(e.startswith("parallel.tensor_size=2 must be 1 with backend.kind=horovod")
               for e in errors("parallel.tensor_size=2"))
    assert any(e.startswith("checkpoint.async_save=true is not available with backend.kind=horovod (the Horovod "
                            "backend writes its checkpoints synchronously)")
               for e in errors("checkpoint.async_save=true"))
    assert any(e.startswith("backend.horovod.compression=fp8") for e in errors("backend.horovod.compression=fp8"))


def test_planner_row_is_ddps_memory_and_a_ring_all_reduce():
    hvd, ddp = recipe(), resolve({**BASE, "backend": {"kind": "fsdp", "fsdp": {"strategy": "ddp"}}})
    kh, kd = Knobs.from_recipe(hvd), Knobs.from_recipe(ddp)
    arch = arch_for(hvd)
    mh, md = estimate_memory(arch, kh).peak.terms, estimate_memory(arch, kd).peak.terms
    for term in (PARAMETERS, GRADIENTS, OPTIMIZER):
        assert mh[term] == md[term]
    n = fsdp_parameters(arch, 1)
    assert mh[PARAMETERS] + mh[GRADIENTS] + mh[OPTIMIZER] == 16 * n
    assert mh[HVD_COPIES] == 2 * n  # bf16 autocast copies, as DDP's
    assert mh[BUCKETS] - md[BUCKETS] == 128 * MIB  # the fusion buffer
    hw = hardware_for(hvd.cluster)
    compute = 1.0
    exposed, _ = kh.scheme.dp_time(arch, kh, hw, compute)
    ring = allreduce_s(4 * n, 16, hw.link_bw(spans_nodes=True))  # 2 (d-1)/d of the fp32 gradients
    m = kh.layout.num_microbatches
    assert exposed == pytest.approx(max(ring - 2 * compute / m / 3, ring / (arch.layers + 1)))
    fp16 = Knobs.from_recipe(recipe("backend.horovod.compression=fp16", "backend.horovod.fusion_threshold_mb=32"))
    assert fp16.scheme.dp_time(arch, fp16, hw, 1e-9)[0] == pytest.approx(ring / 2)  # nothing to hide behind
    terms = estimate_memory(arch, fp16).peak.terms
    assert terms[HVD_COPIES] == 4 * n and terms[BUCKETS] - md[BUCKETS] == 32 * MIB
    plan = plan_recipe(hvd)
    assert plan.fits and plan.knobs.describe().endswith(" hvd")
    assert any(note.startswith("Horovod: ring all-reduce") for note in plan.notes().values())


def test_missing_horovod_is_refused_before_submission_in_one_line(monkeypatch):
    monkeypatch.setattr(world, "horovod_problem", lambda: "Horovod is not installed in this Python")
    (v,) = world.package_violations(recipe())
    line = str(v)
    assert "\n" not in line and line.startswith("backend.kind=horovod needs Horovod")
    assert "bash environment/install-horovod.sh" in line
    assert world.package_violations(recipe("backend.kind=fsdp")) == []
    assert world.package_violations(recipe("cluster.setup.venv=/opt/venv")) == []  # the job's Python, not this one
    monkeypatch.setattr(world, "horovod_problem", lambda: None)
    assert world.package_violations(recipe()) == []


def test_horovod_problem_reads_the_installed_package(monkeypatch, tmp_path):
    import importlib.util
    from types import SimpleNamespace

    pkg = tmp_path / "horovod"
    (pkg / "torch").mkdir(parents=True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: SimpleNamespace(
        submodule_search_locations=[str(pkg)]))
    assert "without its PyTorch extension" in world.horovod_problem()
    (pkg / "torch" / "mpi_lib_v2.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    assert world.horovod_problem() is None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert world.horovod_problem() == "Horovod is not installed in this Python"


def test_doctor_says_in_one_line_that_horovod_does_not_load_with_this_torch(monkeypatch, tmp_path):
    monkeypatch.setenv("HPC_TOOLS_WHEEL_CACHE", str(tmp_path))
    versions = {"horovod": "0.28.1", "torch": "9.0.0+cpu"}
    monkeypatch.setattr(doctor, "_installed", lambda *names: versions.get(names[0]))
    error = ("ImportError: /site-packages/horovod/torch/mpi_lib_v2.cpython-311-x86_64-linux-gnu.so: undefined "
             "symbol: _ZN3c1017RegisterOperatorsD1Ev")
    monkeypatch.setattr(doctor.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 1, "", "Traceback (most recent call last):\n  ...\n" + error))
    row = doctor.horovod_check("horovod")
    assert row.status == "fail" and "\n" not in row.detail
    assert row.detail.startswith("horovod 0.28.1 does not load with torch 9.0.0+cpu") and "undefined symbol" in \
        row.detail
    assert row.fix.startswith("bash environment/install-horovod.sh")
    assert doctor.horovod_check("fsdp").status == "warn"
    monkeypatch.setattr(doctor.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, "", ""))
    assert doctor.horovod_check("horovod").status == "pass"


def test_doctor_reports_a_failed_build_against_this_torch(monkeypatch, tmp_path):
    monkeypatch.setenv("HPC_TOOLS_WHEEL_CACHE", str(tmp_path))
    monkeypatch.setattr(doctor, "_installed", lambda *names: {"torch": "9.0.0+cpu"}.get(names[0]))
    assert doctor.horovod_check("horovod") is None  # never tried: the package row says "not installed"
    folder = doctor.horovod_wheel_dir(torch_version="9.0.0+cpu")
    assert folder.parent == tmp_path and folder.name.startswith("horovod-0.28.1-py3") and folder.name.endswith(
        "-torch9.0.0+cpu")
    folder.mkdir()
    (folder / "build-failed.log").write_text("error: 'optional' in namespace 'std' does not name a template type\n")
    row = doctor.horovod_check("horovod")
    assert row.status == "fail" and "\n" not in row.detail
    assert row.detail.startswith("the build of Horovod against torch 9.0.0+cpu failed (its log: ")


def test_doctor_names_the_install_script_for_a_missing_horovod(monkeypatch):
    import importlib.metadata

    real = importlib.metadata.version

    def version(name):
        if name == "horovod":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    (row,) = [r for r in doctor.package_checks("horovod") if r.name == "horovod"]
    assert row.status == "fail" and row.detail == "not installed (needed by backend.kind: horovod)"
    assert row.fix.startswith("bash environment/install-horovod.sh")
    (other,) = [r for r in doctor.package_checks("fsdp") if r.name == "horovod"]
    assert other.status == "warn"


def test_install_script_builds_the_source_release_with_cxx17_and_caches_the_wheel():
    from tests.helpers import REPO

    text = (REPO / "environment" / "install-horovod.sh").read_text()
    assert doctor.pins()["horovod"] == "0.28.1"  # the script's spec is the pin doctor compares with
    assert "--no-binary :all:" in text and "--no-build-isolation" in text  # the source release, against this torch
    assert ("sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \"$src/CMakeLists.txt\" "
            "\"$src/horovod/torch/CMakeLists.txt\"") in text
    for flag in ("HOROVOD_WITH_PYTORCH=1", "HOROVOD_WITH_GLOO=1", "HOROVOD_WITHOUT_MPI=1",
                 "HOROVOD_WITHOUT_TENSORFLOW=1", "HOROVOD_WITHOUT_MXNET=1"):
        assert flag in text, flag
    assert "horovod_wheel_dir" in text and "build-failed.log" in text  # doctor's cache folder and failure log
