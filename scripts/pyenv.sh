#!/usr/bin/env bash
# Prints the path of a Python virtual environment with the worker's requirements, creating it when
# needed. It lives outside the clone, keyed by a hash of the requirements, so reruns are fast and a
# changed requirements file gets a fresh environment.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
req="$root/engines/torch/requirements.txt"
hash=$(sha256sum "$req" | cut -c1-16)
venv="${SLIMEN_VENV_CACHE:-$HOME/.cache/slimen}/venv-$hash"
if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.complete" ]; then
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install -q --upgrade pip >&2
  "$venv/bin/pip" install -q -r "$req" >&2
  touch "$venv/.complete"
fi
echo "$venv"
