#!/usr/bin/env bash
# The environment of `hpc_tools serve --engine vllm`: a virtual environment of its own with vLLM at the pin in
# environment/requirements-vllm.txt (vLLM brings its own CUDA torch, which must not replace the training one).
#   bash environment/install-vllm.sh                  # into $HPC_TOOLS_VLLM_ENV, default <repo>/.venv-vllm
#   HPC_TOOLS_VLLM_ENV=/shared/venvs/vllm bash environment/install-vllm.sh
# Run it on a GPU node (or a login node of the same image): vLLM's wheels are CUDA builds of several GB, so without
# an NVIDIA GPU it refuses in one line (HPC_TOOLS_VLLM_ANYWAY=1 installs all the same, e.g. to build a shared
# environment on a CPU login node). `serve --engine vllm` runs $HPC_TOOLS_VLLM_PYTHON, else this environment's python
# when it is complete, and checks that it imports vLLM before anything is submitted.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
env_dir="${HPC_TOOLS_VLLM_ENV:-$repo/.venv-vllm}"
base="${VLLM_BASE_PYTHON:-python3}"
stamp="$env_dir/.hpc_tools-vllm-complete"
want="$(grep -v '^#' "$here/requirements-vllm.txt")"

if [ "${HPC_TOOLS_VLLM_ANYWAY:-}" != 1 ] && ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  echo "hpc_tools: install-vllm.sh: no NVIDIA GPU here (nvidia-smi lists none) and vLLM's wheels are CUDA builds of" \
       "several GB: run it on a GPU node, or set HPC_TOOLS_VLLM_ANYWAY=1 to install all the same" >&2
  exit 1
fi
mkdir -p "$(dirname "$env_dir")"
exec 9>"$env_dir.lock"
flock 9
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$env_dir/bin/python" -c "import vllm" 2>/dev/null; then
  echo "hpc_tools: vLLM environment $env_dir already complete"; exit 0
fi
start=$SECONDS
[ -x "$env_dir/bin/python" ] || "$base" -m venv "$env_dir"
"$env_dir/bin/python" -m pip install --disable-pip-version-check -q -r "$here/requirements-vllm.txt"
"$env_dir/bin/python" -c "import vllm" || { echo "hpc_tools: vllm does not import in $env_dir" >&2; exit 1; }
printf '%s' "$want" > "$stamp"
echo "hpc_tools: vLLM environment $env_dir installed in $((SECONDS - start)) s ($("$env_dir/bin/python" -c \
  'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'))"
