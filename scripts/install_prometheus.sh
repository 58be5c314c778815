#!/usr/bin/env bash
# Installs Debian's `prometheus` package (the server binary) for tests/test_dashboard.py, which starts its own
# Prometheus on 127.0.0.1 to check the Grafana dashboard's queries. Idempotent and quiet: does nothing when a
# `prometheus` binary is already on PATH; skips (exit 0, one line) without apt-get or without root.
# The package's own service is not started: policy-rc.d denies it while the package installs (a daemon on :9090
# is not wanted on a CI or build machine).
set -euo pipefail
if command -v prometheus >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "[setup] no apt-get here: install Prometheus yourself to run tests/test_dashboard.py (it skips without it)"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "[setup] not root: 'apt-get install prometheus' to run tests/test_dashboard.py (it skips without it)"
  exit 0
fi
echo "[setup] installing Debian's prometheus package (for the dashboard test)"
log=$(mktemp)
policy=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' > "$policy"
  chmod +x "$policy"
  made_policy=1
fi
cleanup() { if [ "$made_policy" = 1 ]; then rm -f "$policy"; fi; rm -f "$log"; }
trap cleanup EXIT
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus; } >"$log" 2>&1; then
  echo "[setup] could not install prometheus (tests/test_dashboard.py will skip); apt-get said:"
  tail -n 5 "$log" | sed 's/^/[setup]   /'
  exit 0
fi
echo "[setup] $(prometheus --version 2>&1 | head -n 1)"
