#!/usr/bin/env bash
# mypy over the trainvitals.* packages. The import names differ from the folder names (setuptools
# package-dir maps agent/ to trainvitals.agent, ...) and mypy cannot follow an editable install's
# import hook, so it checks a tree of symlinks that has the import layout.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tree="$root/build/typecheck"
mkdir -p "$tree/trainvitals"
packages=(agent service wire dashboards examples migrations testing)
args=()
for p in "${packages[@]}"; do
  ln -sfn "$root/$p" "$tree/trainvitals/$p"
  args+=(-p "trainvitals.$p")
done
cd "$root"
MYPYPATH="$tree" exec "${MYPY:-mypy}" "${args[@]}" "$@"
