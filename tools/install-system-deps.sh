#!/usr/bin/env bash
# Debian packages the tests need: promtool (prometheus) and amtool (prometheus-alertmanager).
# Idempotent; a no-op when both are already installed.
set -euo pipefail
if command -v promtool >/dev/null && command -v amtool >/dev/null && command -v prometheus >/dev/null; then
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends prometheus prometheus-alertmanager >/dev/null
# The packages try to start daemons on :9090/:9093; the tests start their own Prometheus.
$SUDO pkill -x prometheus 2>/dev/null || true
$SUDO pkill -x prometheus-alertmanager 2>/dev/null || true
promtool --version | head -1
