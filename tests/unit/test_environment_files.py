"""The install paths agree: the conda file installs what install.sh installs (DeepSpeed, hpc_tools),
at the same pins."""

import re
from pathlib import Path

import yaml

from tests.helpers import REPO

ENV = REPO / "environment"


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-\[\]]+)==([^\s#]+)", line.strip())
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


def test_conda_file_installs_deepspeed_and_the_package_at_install_sh_pins():
    pip_lines = next(d["pip"] for d in yaml.safe_load((ENV / "environment.yml").read_text())["dependencies"]
                     if isinstance(d, dict))
    install_sh = (ENV / "install.sh").read_text()
    ds_pin = re.search(r"deepspeed==([\w.]+)", install_sh).group(1)
    torch_pin = re.search(r"torch==([\w.]+)", install_sh).group(1)
    assert f"deepspeed=={ds_pin}" in pip_lines
    assert f"torch=={torch_pin}" in pip_lines
    assert "-e .." in pip_lines, "environment.yml must install hpc_tools itself"
    assert "-r requirements-gpu.txt" in pip_lines


def test_gpu_and_cpu_sets_pin_the_same_versions():
    cpu, gpu = _pins(ENV / "requirements-cpu.txt"), _pins(ENV / "requirements-gpu.txt")
    assert cpu == gpu, {k: (cpu.get(k), gpu.get(k)) for k in cpu.keys() | gpu.keys() if cpu.get(k) != gpu.get(k)}


TE_COMMAND = re.compile(r'pip install --no-build-isolation "transformer_engine\[pytorch,core_cu12\]==([\w.]+)"')


def test_transformer_engine_is_pinned_where_megatron_core_accepts_it_and_only_for_gpu_clusters():
    """The GPU install (requirements-gpu.txt and environment.yml) names one TE version, inside the range the installed
    megatron-core's metadata accepts; it is a separate command there (its torch extension builds against the
    installed torch), and nothing the CPU install runs names it."""
    from packaging.specifiers import SpecifierSet

    from hpc_tools.doctor import megatron_te_range

    found = {name: TE_COMMAND.findall((ENV / name).read_text()) for name in ("requirements-gpu.txt", "environment.yml")}
    assert all(len(v) == 1 for v in found.values()), found
    pin = found["requirements-gpu.txt"][0]
    assert found["environment.yml"] == [pin]
    accepted = megatron_te_range()
    assert accepted and pin in SpecifierSet(accepted), (pin, accepted)
    assert not any(k.startswith("transformer_engine") or k.startswith("transformer-engine")
                   for k in _pins(ENV / "requirements-gpu.txt")), "not a line pip -r would build"
    for cpu_side in ("install.sh", "requirements-cpu.txt", "requirements-test.txt"):
        assert "transformer_engine" not in (ENV / cpu_side).read_text().replace("-", "_"), cpu_side
