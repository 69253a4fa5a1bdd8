#!/usr/bin/env bash
# Set-up and the whole test suite on CPU with 8 fake devices (tests/conftest.py sets them), in two worker
# processes (one per core; each test file stays on one worker, so its module-scoped models are built once).
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/bootstrap.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
