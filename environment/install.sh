#!/usr/bin/env bash
# Install hpc_tools and everything it needs into the current Python, in the order that works:
# torch first (CPU build by default), then the pinned set, deepspeed without build isolation, then the package itself.
#   bash environment/install.sh            # CPU (laptops, CI)
#   HPC_TOOLS_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" bash environment/install.sh
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
py="${PYTHON:-python3}"
pip_install() { "$py" -m pip install --disable-pip-version-check --root-user-action=ignore -q "$@"; }

start=$SECONDS
# shellcheck disable=SC2086  # HPC_TOOLS_TORCH may carry an --index-url
pip_install ${HPC_TOOLS_TORCH:-torch==2.13.0}
pip_install -r "$here/requirements-cpu.txt" -r "$here/requirements-test.txt"
"$py" -c "import deepspeed" 2>/dev/null || pip_install --no-build-isolation deepspeed==0.19.8
pip_install --no-deps --no-build-isolation -e "$repo"
echo "hpc_tools: installed in $((SECONDS - start)) s ($("$py" -c 'import torch; print("torch", torch.__version__)'))"
