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


GPU_ONLY = {"liger-kernel"}
"""In the GPU set alone: Liger Kernel imports triton, which a CPU torch lacks (backend.<kind>.liger notes it on CPU)."""


def test_gpu_and_cpu_sets_pin_the_same_versions():
    cpu, gpu = _pins(ENV / "requirements-cpu.txt"), _pins(ENV / "requirements-gpu.txt")
    assert GPU_ONLY <= gpu.keys() and not GPU_ONLY & cpu.keys()
    gpu = {k: v for k, v in gpu.items() if k not in GPU_ONLY}
    assert cpu == gpu, {k: (cpu.get(k), gpu.get(k)) for k in cpu.keys() | gpu.keys() if cpu.get(k) != gpu.get(k)}


TE_COMMAND = re.compile(r'pip install --no-build-isolation "transformer_engine\[pytorch,core_cu12\]==([\w.]+)"')


def test_transformer_engine_is_pinned_where_megatron_core_accepts_it():
    """The GPU install names one TE version, inside the range the installed megatron-core's metadata accepts: the
    pin install.sh installs from, and the command requirements-gpu.txt and environment.yml show. It is a separate
    command (its torch extension builds against the installed torch), never a line pip -r would build."""
    from packaging.specifiers import SpecifierSet

    from hpc_tools.doctor import megatron_te_range, pins

    found = {name: TE_COMMAND.findall((ENV / name).read_text()) for name in ("requirements-gpu.txt", "environment.yml")}
    assert all(len(v) == 1 for v in found.values()), found
    pin = re.search(r'^te="transformer_engine==([\w.]+)"', (ENV / "install.sh").read_text(), re.M).group(1)
    assert found == {"requirements-gpu.txt": [pin], "environment.yml": [pin]} and pins()["transformer-engine"] == pin
    accepted = megatron_te_range()
    assert accepted and pin in SpecifierSet(accepted), (pin, accepted)
    assert not any(k.startswith("transformer_engine") or k.startswith("transformer-engine")
                   for k in _pins(ENV / "requirements-gpu.txt")), "not a line pip -r would build"
    for cpu_side in ("requirements-cpu.txt", "requirements-test.txt"):
        assert "transformer_engine" not in (ENV / cpu_side).read_text().replace("-", "_"), cpu_side


def test_install_sh_installs_transformer_engine_on_a_cuda_torch_only():
    """install.sh (the documented GPU install, issue 31 item 9) installs TE, with its build tools and without build
    isolation, in the branch where torch's CUDA version is set, and never on a CPU torch (CI runs the CPU path)."""
    text = (ENV / "install.sh").read_text()
    function = text[text.index("install_transformer_engine() {"):text.index("\n}\n", text.index("install_"
                                                                                               "transformer_engine"))]
    assert 'pip_install setuptools wheel ninja "pybind11[global]"' in function
    assert 'pip_install --no-build-isolation "${te/==/[pytorch,core_cu$1]==}"' in function
    assert "import transformer_engine.pytorch" in function  # a container's own TE is kept
    calls = [line.strip() for line in text.splitlines() if "install_transformer_engine " in line
             and not line.startswith("install_transformer_engine()")]
    assert calls == ['install_transformer_engine "${cuda%%.*}"'], calls
    branch = re.search(r'cuda="\$\("\$py" -c \'import torch; print\(torch.version.cuda or ""\)\'\)"\n'
                       r'if \[ -n "\$cuda" \] && \[ "\$\{HPC_TOOLS_TE:-\}" != skip \]; then\n'
                       r'  install_transformer_engine "\$\{cuda%%\.\*\}"\nfi\n', text)
    assert branch, "the TE step must sit in the CUDA-torch branch"
