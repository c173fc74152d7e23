#!/usr/bin/env bash
# The serving environment of `hpc_tools serve`: a virtual environment of its own (nvidia-pytriton pins numpy<2, which
# the training set does not accept), with Triton Inference Server (the binary inside the nvidia-pytriton wheel), CPU
# torch and transformers (environment/requirements-serve.txt).
#   bash environment/install-serve.sh                 # into $HPC_TOOLS_SERVE_ENV, default <repo>/.venv-serve
#   HPC_TOOLS_SERVE_ENV=/shared/venvs/serve bash environment/install-serve.sh
#   HPC_TOOLS_SERVE_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" bash ...  # CUDA torch
# The venv is made from the system's own Python 3 (SERVE_PYTHON, default /usr/bin/python3): Triton's Python backend
# stub runs the venv's standard library, and a stub built for another 3.x release fails to load models under a
# pyenv/conda interpreter. Quick (seconds) when the environment is already complete.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
env_dir="${HPC_TOOLS_SERVE_ENV:-$repo/.venv-serve}"
base="${SERVE_PYTHON:-/usr/bin/python3}"
stamp="$env_dir/.hpc_tools-serve-complete"
want="$(cat "$here/requirements-serve.txt")${HPC_TOOLS_SERVE_TORCH:-torch==2.13.0}"

# One install at a time: environment/test.sh starts this beside the first tests, and the serving tests' set-up runs
# it again, which waits here for the first to finish and then finds the environment complete.
mkdir -p "$(dirname "$env_dir")"
exec 9>"$env_dir.lock"
flock 9
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$env_dir/bin/python" -c "import importlib.util as u; assert all(map(u.find_spec, ('pytriton', 'torch', 'transformers')))" 2>/dev/null; then
  echo "hpc_tools: serving environment $env_dir already complete"; exit 0
fi
start=$SECONDS
if [ ! -x "$env_dir/bin/python" ]; then
  if ! "$base" -c "import venv, ensurepip" 2>/dev/null; then
    echo "hpc_tools: $base cannot make a virtual environment (no venv/ensurepip): install python3-venv" \
         "(apt-get install python3-venv) or set SERVE_PYTHON to a Python 3.8-3.12 that can" >&2
    exit 1
  fi
  "$base" -m venv "$env_dir"
fi
py="$env_dir/bin/python"
pip_install() { "$py" -m pip install --disable-pip-version-check -q "$@"; }
# torch first, pinned as environment/install.sh pins it (that pin is the CPU build; an unpinned torch, as
# transformers' requirement, would pull several GB of CUDA wheels).
# shellcheck disable=SC2086  # HPC_TOOLS_SERVE_TORCH may carry an --index-url
pip_install ${HPC_TOOLS_SERVE_TORCH:-torch==2.13.0}
pip_install -r "$here/requirements-serve.txt"
"$py" -c "import pytriton, torch, transformers, numpy; assert numpy.__version__ < '2'"
printf '%s' "$want" > "$stamp"
echo "hpc_tools: serving environment $env_dir installed in $((SECONDS - start)) s ($("$py" -c 'import torch; print("torch", torch.__version__)'))"
