#!/usr/bin/env bash
# System packages the tests use: Debian's headless Chromium (report test) and Slurm 22.05
# with munge (profile test: tests/slurm_cluster.py starts them), iproute2 (two-host
# multi-node test in network namespaces). Installed when
# missing and we are root (CI, a fresh machine); otherwise the tests that need them say
# so and skip, except in CI (CI=true), where a missing tool fails the test.
set -euo pipefail
need=()
command -v chromium >/dev/null || need+=(chromium)
command -v slurmctld >/dev/null || need+=(slurmctld)
command -v slurmd >/dev/null || need+=(slurmd)
command -v sbatch >/dev/null || need+=(slurm-client)
command -v munged >/dev/null || need+=(munge)
command -v ip >/dev/null || need+=(iproute2)
if ((${#need[@]})); then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing ${need[*]} (Debian packages) for the tests"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "note: ${need[*]} missing and not root; tests needing them will skip" >&2
  fi
fi
