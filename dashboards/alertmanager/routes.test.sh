#!/bin/sh
# Validate alertmanager.yml and its routing with the real amtool (Debian prometheus-alertmanager).
# Run from anywhere: sh dashboards/alertmanager/routes.test.sh
set -eu
here=$(cd "$(dirname "$0")" && pwd)
cfg="$here/alertmanager.yml"
command -v amtool >/dev/null || { echo "amtool not installed (Debian package prometheus-alertmanager)" >&2; exit 1; }

amtool check-config "$cfg"

expect() {  # expect RECEIVER LABEL=VALUE...
  receiver=$1; shift
  amtool config routes test --config.file="$cfg" --verify.receivers="$receiver" "$@" >/dev/null \
    || { echo "FAIL: $* should route to $receiver" >&2; exit 1; }
  echo "ok: $* -> $receiver"
}

expect pager alertname=TrainvitalsLateDivergence severity=page run=r1
expect pager alertname=TrainvitalsStraggler severity=page run=r1 subject=17
expect pager alertname=TrainvitalsRunStalled severity=page run=r1
expect pager alertname=TrainvitalsCollectorDown severity=page instance=c1:8000
expect tickets alertname=TrainvitalsGradNormDrift severity=ticket run=r1
expect tickets alertname=TrainvitalsMfuGap severity=ticket run=r1
expect tickets alertname=TrainvitalsSomethingNew run=r1
# A wrong expectation must fail (guards against a check that cannot fail).
if amtool config routes test --config.file="$cfg" --verify.receivers=tickets \
    alertname=TrainvitalsLateDivergence severity=page run=r1 >/dev/null 2>&1; then
  echo "FAIL: a page routed to tickets" >&2; exit 1
fi
echo "all routes ok"
