#!/usr/bin/env bash
# Creates .venv with Python 3.12 (pyenv resolves python3 via .python-version) and installs jaxinfer
# with its test extras. Re-runs pip only when pyproject.toml changed since the last install.
set -euo pipefail
cd "$(dirname "$0")/.."
py=python3
if ! $py -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
  py=python3.12
fi
[ -x .venv/bin/python ] || $py -m venv .venv
if [ ! -f .venv/.installed ] || [ pyproject.toml -nt .venv/.installed ]; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e '.[test]'
  touch .venv/.installed
fi
