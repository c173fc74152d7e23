#!/usr/bin/env bash
# The test command (README, .ci/run): install everything, bring up the Slurm test cluster (2 nodes, each in its own
# network namespace), run the whole test suite against it, and tear the cluster down even when tests fail.
#   bash environment/test.sh [extra pytest args]
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
cd "$repo"
t0=$SECONDS
phase() { printf 'hpc_tools test: %-10s %4d s\n' "$1" "$2"; }

# The serving environment (a venv with Triton), Horovod (a C++ build) and Chromium take minutes on a fresh machine:
# they install beside the main install and the first tests. The serving venv needs nothing of the main install and
# starts at once (pip of the main install leaves a core free); Horovod builds against its torch, after it; Chromium
# (below) once the cluster's own packages are in. Each script holds a lock while it installs; the tests that need
# them run the script again in their set-up (tests/integration/serving_setup.py, test_horovod_train.py,
# test_report_local_sweep.py), which waits for the lock and then finds the install complete. All are quick when
# already there (the Horovod wheel is cached, install-horovod.sh).
extras_log="$(mktemp -d)"
bash "$here/install-serve.sh" > "$extras_log/serve.log" 2>&1 &
serve_pid=$!

bash "$here/install.sh" || { echo "hpc_tools test: install failed" >&2; exit 1; }
t_install=$((SECONDS - t0))

bash "$here/install-horovod.sh" > "$extras_log/horovod.log" 2>&1 &
horovod_pid=$!

started_cluster=0
cleanup() {
  if [ "$started_cluster" = 1 ]; then
    local t=$SECONDS
    bash "$here/slurm-dev/down.sh" >/dev/null 2>&1 || echo "hpc_tools test: down.sh failed" >&2
    phase tear-down $((SECONDS - t))
  fi
}
trap cleanup EXIT

t=$SECONDS
if bash "$here/slurm-dev/up.sh" --nodes 2; then
  started_cluster=1
else
  started_cluster=1
  echo "hpc_tools test: the Slurm test cluster did not come up; Slurm tests will fail" >&2
fi
t_up=$((SECONDS - t))

# Headless Chromium renders report.html in the report tests: Debian's package, installed beside the tests too, once
# up.sh's own packages are in (one apt at a time); the browser tests run the script again and wait for its lock.
export HPC_TOOLS_CHROMIUM_LOCK="$extras_log/chromium.lock"
bash "$here/install-chromium.sh" > "$extras_log/chromium.log" 2>&1 &
chromium_pid=$!

t=$SECONDS
export HPC_TOOLS_REQUIRE_SLURM=1  # Slurm tests fail instead of skipping when the cluster is missing
# The suite starts thousands of Python processes: let them reuse the bytecode of this checkout.
unset PYTHONDONTWRITEBYTECODE
# One pytest-xdist worker per core (setup.cfg's addopts: -n auto --dist loadgroup; two here): most integration tests
# wait (for Slurm, a time limit, a requeue) rather than compute, so one worker trains while the other waits. The
# Slurm tests are one group (one worker submits at a time) and each other integration module is one group (its
# module-scoped launch runs once): tests/conftest.py sets the groups. The 40 slowest tests, where the wall time went
# and how busy the CPUs were meanwhile (tests/timeline.py), are printed at the end.
export HPC_TOOLS_TEST_TIMELINE="$extras_log/timeline.jsonl"  # each test's worker and times: summed up below
python3 -m pytest -q -p no:cacheprovider --timeout=900 --durations=40 "$@"
rc=$?
t_tests=$((SECONDS - t))
[ -s "$HPC_TOOLS_TEST_TIMELINE" ] && { python3 -m tests.timeline "$HPC_TOOLS_TEST_TIMELINE" || true; }
[ "$rc" = 5 ] && { echo "hpc_tools test: pytest collected no tests" >&2; rc=1; }

for extra in serve horovod chromium; do  # how the installs beside the tests ended (their tests fail if they did not)
  pid_var="${extra}_pid"
  wait "${!pid_var}" || echo "hpc_tools test: install-$extra.sh failed: $(tail -n 3 "$extras_log/$extra.log")" >&2
  echo "hpc_tools test: beside the tests: $(tail -n 1 "$extras_log/$extra.log")"
done
phase install "$t_install"; phase cluster-up "$t_up"; phase tests "$t_tests"
exit "$rc"
