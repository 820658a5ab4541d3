#!/usr/bin/env bash
# Debian packages the tests need: promtool (prometheus), amtool (prometheus-alertmanager) and nginx
# (tests/e2e/test_scaleout.py: two collector replicas behind it).
# Idempotent; a no-op when all are already installed.
set -euo pipefail
if command -v promtool >/dev/null && command -v amtool >/dev/null && command -v prometheus >/dev/null \
  && { command -v nginx >/dev/null || [ -x /usr/sbin/nginx ]; }; then
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends prometheus prometheus-alertmanager nginx-light >/dev/null
# The packages try to start daemons on :9090/:9093 (and nginx on :80); the tests start their own.
$SUDO pkill -x prometheus 2>/dev/null || true
$SUDO pkill -x prometheus-alertmanager 2>/dev/null || true
[ -f /run/nginx.pid ] && $SUDO nginx -s quit 2>/dev/null || true
promtool --version | head -1
