#!/usr/bin/env bash
# Install hpc_tools and everything it needs into the current Python, in the order that works:
# torch first (CPU build by default), then the pinned set, deepspeed without build isolation, then the package itself,
# and, when that torch is a CUDA build, Transformer Engine (the default Megatron recipes need it on GPUs).
#   bash environment/install.sh            # CPU (laptops, CI)
#   HPC_TOOLS_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" bash environment/install.sh
#   HPC_TOOLS_TORCH=keep bash environment/install.sh   # keep the torch already here (an NGC PyTorch container)
# Transformer Engine on a CUDA torch: kept when `import transformer_engine.pytorch` already works (NGC containers ship
# it built against their torch); else its torch extension is built here against this torch (pip has no prebuilt wheel
# of it), which needs the CUDA toolkit (nvcc: CUDA_HOME or PATH) and cuDNN; HPC_TOOLS_TE=skip leaves it out.
# `python -m hpc_tools doctor` checks the result (docs/gpu-path.md).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
py="${PYTHON:-python3}"
pip_install() { "$py" -m pip install --disable-pip-version-check --root-user-action=ignore -q "$@"; }
te="transformer_engine==2.11.0"  # the version megatron-core 0.16.1 accepts (>=2.9,<2.12); doctor reads this pin

install_transformer_engine() {  # $1: torch's CUDA major version (12, 13)
  if "$py" -c "import transformer_engine.pytorch" 2>/dev/null; then
    echo "hpc_tools: Transformer Engine already importable here: kept"; return 0
  fi
  if [ -z "${CUDA_HOME:-}" ] && ! command -v nvcc > /dev/null; then
    echo "hpc_tools: Transformer Engine's torch extension builds here and needs the CUDA toolkit (nvcc), which is" \
         "not on PATH and CUDA_HOME is unset: load it (e.g. module load cuda) and rerun, use an NGC PyTorch" \
         "container (HPC_TOOLS_TORCH=keep), or set HPC_TOOLS_TE=skip" >&2
    return 1
  fi
  pip_install setuptools wheel ninja "pybind11[global]"  # TE's build requirements (--no-build-isolation)
  pip_install --no-build-isolation "${te/==/[pytorch,core_cu$1]==}"
}

start=$SECONDS
if [ "${HPC_TOOLS_TORCH:-}" != keep ]; then
  # shellcheck disable=SC2086  # HPC_TOOLS_TORCH may carry an --index-url
  pip_install ${HPC_TOOLS_TORCH:-torch==2.13.0}
fi
pip_install -r "$here/requirements-cpu.txt" -r "$here/requirements-test.txt"
"$py" -c "import deepspeed" 2>/dev/null || pip_install --no-build-isolation deepspeed==0.19.8
pip_install --no-deps --no-build-isolation -e "$repo"
cuda="$("$py" -c 'import torch; print(torch.version.cuda or "")')"
if [ -n "$cuda" ] && [ "${HPC_TOOLS_TE:-}" != skip ]; then
  install_transformer_engine "${cuda%%.*}"
fi
echo "hpc_tools: installed in $((SECONDS - start)) s ($("$py" -c 'import torch; print("torch", torch.__version__)'))"
