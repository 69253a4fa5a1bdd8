#!/usr/bin/env bash
# Set-up and the main job: serves the embedded random-weight default model (or pass launch flags).
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/bootstrap.sh
exec .venv/bin/python -m jaxinfer.launch "$@"
