#!/usr/bin/env bash
# Headless Chromium (Debian's package) for the report test that opens report.html in a browser. environment/test.sh
# starts this beside the first tests, once the Slurm test cluster's own packages are in; the browser tests run it
# again when they find no browser (test.sh exports HPC_TOOLS_CHROMIUM_LOCK for them), which waits here for the first
# to finish and then finds it installed.
#   bash environment/install-chromium.sh
set -uo pipefail
lock="${HPC_TOOLS_CHROMIUM_LOCK:-/tmp/hpc_tools-install-chromium.lock}"
have() { command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; }
exec 9>"$lock"
flock 9
if have; then
  echo "hpc_tools: chromium already installed: $(command -v chromium || command -v chromium-browser)"; exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "hpc_tools: chromium is not installed and installing it needs root: apt-get install -y chromium" >&2; exit 1
fi
start=$SECONDS
export DEBIAN_FRONTEND=noninteractive
wait_lock=(-o DPkg::Lock::Timeout=600)  # another apt-get (up.sh's) may hold the lock: wait for it
if ! { apt-get "${wait_lock[@]}" update -qq && apt-get "${wait_lock[@]}" install -y -qq chromium >/dev/null; }; then
  echo "hpc_tools: apt-get install chromium failed; the browser tests will fail (CI) or skip" >&2; exit 1
fi
echo "hpc_tools: chromium installed in $((SECONDS - start)) s"
