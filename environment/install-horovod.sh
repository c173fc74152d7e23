#!/usr/bin/env bash
# Install Horovod (backend.kind: horovod) into the current Python, built once against the torch installed here and
# cached as a wheel. Run it after environment/install.sh:
#   bash environment/install-horovod.sh
# Horovod 0.28.1 is the last release (2023-06) and the package index has only its source. Its CMake files ask for
# C++14 while torch >= 2.1's headers need C++17 (fixed on Horovod's master after the release, horovod PR #3998): the
# build raises the standard to 17 in CMakeLists.txt and horovod/torch/CMakeLists.txt, then builds the PyTorch
# extension with gloo (CPU collectives; on a CUDA torch add HOROVOD_GPU_OPERATIONS=NCCL to the environment for
# NCCL) and without MPI, TensorFlow and MXNet. Needs g++ (12 works), make and cmake >= 3.13 (installed from the
# package index when missing); about 10 minutes on 2 cores.
# The wheel is cached in $HPC_TOOLS_WHEEL_CACHE (default ~/.cache/hpc_tools/wheels), in a folder named after the
# Python and torch it was built for (hpc_tools.doctor.horovod_wheel_dir), so a later run, or a new environment with
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

cache="$(PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$py" -c \
  'from hpc_tools.doctor import horovod_wheel_dir; print(horovod_wheel_dir())')"
# One install at a time: environment/test.sh starts this beside the first tests, and the Horovod tests' set-up runs
# it again, which waits here for the first to finish and then finds Horovod importable.
mkdir -p "$cache"
exec 9>"$cache/.install.lock"
flock 9
if "$py" -c "import horovod, horovod.torch, sys; sys.exit(horovod.__version__ != '$version')" 2>/dev/null; then
  echo "hpc_tools: horovod $version already imports with this torch: kept"; exit 0
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
  mkdir -p "$cache"
  echo "hpc_tools: building horovod $version for $("$py" -c 'import torch; print("torch", torch.__version__)')" \
       "(about 10 minutes on 2 cores); the wheel goes to $cache"
  if ! HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITHOUT_MPI=1 \
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
echo "hpc_tools: horovod $version installed in $((SECONDS - start)) s from $wheel"
