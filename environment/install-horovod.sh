#!/usr/bin/env bash
# Install Horovod (backend.kind: horovod) into the current Python, built once against the torch installed here and
# cached as a wheel. Run it after environment/install.sh:
#   bash environment/install-horovod.sh
# Horovod 0.28.1 is the last release (2023-06) and the package index has only its source. Its CMake files ask for
# C++14 while torch >= 2.1's headers need C++17 (fixed on Horovod's master after the release, horovod PR #3998): the
# build raises the standard to 17 in CMakeLists.txt and horovod/torch/CMakeLists.txt, then builds the PyTorch
# extension with gloo (CPU collectives) and, when torch is a CUDA build, NCCL for GPU tensors
# (HOROVOD_GPU_OPERATIONS=NCCL, against the NCCL torch's own wheel brings, nvidia-nccl-*; without it GPU tensors
# would be reduced through host memory over gloo), without MPI, TensorFlow and MXNet. It builds Horovod's Release
# configuration (-O3, as its default RelWithDebInfo, without the debug information: on 2 cores 271 CPU-s instead of
# 346, a 1.1 MB wheel instead of 18.6 MB). Needs g++ (12 works), make and cmake >= 3.13 (installed from the package
# index when missing), and on a CUDA torch the CUDA toolkit's nvcc (on PATH or in $CUDA_HOME/bin; refused in one line
# without it); about 3 minutes on 2 idle cores with gloo only.
# The wheel is cached in $HPC_TOOLS_WHEEL_CACHE (default ~/.cache/hpc_tools/wheels), in a folder named after the
# Python and torch it was built for and whether it has NCCL (hpc_tools.doctor.horovod_wheel_dir), so a later run, or a new environment with
# the same Python and torch, installs it in seconds; another torch builds a new one. A failed build leaves its log
# there (build-failed.log), which `python -m hpc_tools doctor` reports in one line.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
py="${PYTHON:-python3}"
pip_install() { "$py" -m pip install --disable-pip-version-check --root-user-action=ignore -q "$@"; }
spec="horovod==0.28.1"  # doctor reads this pin
version="${spec#*==}"
start=$SECONDS

# NCCL when torch is a CUDA build: its CUDA version, empty for a CPU build
cuda="$("$py" -c 'import torch; print(torch.version.cuda or "")')"
nccl=0
nccl_env=()
if [ -n "$cuda" ]; then
  nccl=1
  nvcc="$(command -v nvcc || true)"
  [ -n "$nvcc" ] || { [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ] && nvcc="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"; }
  if [ -z "$nvcc" ]; then
    echo "hpc_tools: torch is built for CUDA $cuda but nvcc is not on PATH nor in \$CUDA_HOME/bin: Horovod's NCCL" \
         "operations (HOROVOD_GPU_OPERATIONS=NCCL) build with the CUDA toolkit (load its module, e.g. module load" \
         "cuda, or set CUDA_HOME), else GPU tensors would reduce through host memory over gloo" >&2
    exit 1
  fi
  nccl_env=(HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED "CUDA_HOME=$(dirname "$(dirname "$nvcc")")")
  # the NCCL torch loads (its nvidia-nccl wheel: include/ and lib/), else the system's
  nccl_home="$("$py" -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null || true)"
  [ -z "$nccl_home" ] || nccl_env+=("HOROVOD_NCCL_HOME=$nccl_home")
fi
cache="$(PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$py" -c \
  "from hpc_tools.doctor import horovod_wheel_dir; print(horovod_wheel_dir(nccl=bool($nccl)))")"
# One install at a time: environment/test.sh starts this beside the first tests, and the Horovod tests' set-up runs
# it again, which waits here for the first to finish and then finds Horovod importable.
mkdir -p "$cache"
exec 9>"$cache/.install.lock"
flock 9
# kept when it imports, and has NCCL where torch has CUDA (a gloo-only build on a CUDA torch is rebuilt)
if "$py" -c "import horovod, horovod.torch as h, sys; sys.exit(horovod.__version__ != '$version' or
             ($nccl and not h.nccl_built()))" 2>/dev/null; then
  echo "hpc_tools: horovod $version already imports with this torch$([ $nccl = 1 ] && echo ', with NCCL'): kept"
  exit 0
fi

wheel="$(ls "$cache"/horovod-"$version"-*.whl 2>/dev/null | head -n 1 || true)"
if [ -z "$wheel" ]; then
  pip_install wheel setuptools packaging  # the build runs without isolation (it must see this torch)
  if ! cmake_version="$(cmake --version 2>/dev/null | head -n 1 | awk '{print $3}')" \
      || [ "$(printf '%s\n3.13\n' "$cmake_version" | sort -V | head -n 1)" != 3.13 ]; then
    pip_install "cmake>=3.13,<4"
  fi
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  "$py" -m pip download --disable-pip-version-check -q --no-deps --no-binary :all: "$spec" -d "$work"
  tar -xzf "$work/horovod-$version.tar.gz" -C "$work"
  src="$work/horovod-$version"
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
  grep -q 'set(CMAKE_CXX_STANDARD 17)' "$src/horovod/torch/CMakeLists.txt" \
    || { echo "hpc_tools: horovod $version's CMake files changed; the C++17 change did not apply" >&2; exit 1; }
  sed -i "s/else 'RelWithDebInfo'/else 'Release'/" "$src/setup.py"  # -O3 without -g: a quarter less compile time
  grep -q "else 'Release'" "$src/setup.py" \
    || { echo "hpc_tools: horovod $version's setup.py changed; the Release build did not apply" >&2; exit 1; }
  mkdir -p "$cache"
  echo "hpc_tools: building horovod $version for $("$py" -c 'import torch; print("torch", torch.__version__)')" \
       "$([ $nccl = 1 ] && echo "with NCCL (CUDA $cuda)" || echo "with gloo only")" \
       "(about 3 minutes on 2 cores); the wheel goes to $cache"
  if ! env ${nccl_env[@]+"${nccl_env[@]}"} HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITHOUT_MPI=1 \
      HOROVOD_WITH_GLOO=1 HOROVOD_CPU_OPERATIONS=GLOO MAKEFLAGS="-j$(nproc)" \
      "$py" -m pip wheel --disable-pip-version-check --no-build-isolation --no-deps -w "$work/dist" "$src" \
      > "$work/build.log" 2>&1; then
    cp "$work/build.log" "$cache/build-failed.log"
    tail -n 30 "$cache/build-failed.log" >&2
    echo "hpc_tools: the build of horovod $version failed; its log: $cache/build-failed.log" >&2
    exit 1
  fi
  rm -f "$cache/build-failed.log"
  mv "$work"/dist/horovod-"$version"-*.whl "$cache/"
  wheel="$(ls "$cache"/horovod-"$version"-*.whl | head -n 1)"
fi
pip_install "$wheel"  # with its own requirements (cloudpickle, psutil, pyyaml, packaging; torch is already here)
"$py" -c "import horovod.torch" \
  || { echo "hpc_tools: $wheel does not import with this torch; delete $cache and rerun" >&2; exit 1; }
if [ "$nccl" = 1 ] && ! "$py" -c "import horovod.torch as h, sys; sys.exit(not h.nccl_built())"; then
  echo "hpc_tools: $wheel was built without NCCL although torch has CUDA $cuda; delete $cache and rerun" >&2; exit 1
fi
echo "hpc_tools: horovod $version installed in $((SECONDS - start)) s from $wheel"
