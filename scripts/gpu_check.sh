#!/usr/bin/env bash
# The GPU check (jaxinfer/bench/gpu_check.py): kernel tests compiled on the GPU, decode tok/s and MBU of a
# Llama-3-8B-shaped random-weight model, the serving benchmark; one JSON and one markdown file in OUTDIR.
#
#   bash scripts/gpu_check.sh OUTDIR              # on one GPU, about 8.5 minutes
#   bash scripts/gpu_check.sh OUTDIR --dry-run    # tiny shapes on CPU, every part end to end
#
# OUTDIR defaults to $OUT. PYTHON picks the interpreter (default python3). Nothing comes from the network:
# when that interpreter does not already import jaxinfer from this checkout, jaxinfer is installed in
# editable mode without dependencies or build isolation; should pip refuse, the source tree is put on
# PYTHONPATH instead. GPU_CHECK_TIMEOUT (default 515 s) bounds the check itself: at the limit it gets
# SIGTERM, writes what it has, and exits 124.
set -uo pipefail
py=${PYTHON:-python3}
out=${OUT:-}
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
  out=$1
  shift
fi
if [ -z "$out" ]; then
  echo "usage: bash scripts/gpu_check.sh OUTDIR [--dry-run]   (or set OUT)" >&2
  exit 2
fi
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 2
cd "$(dirname "$0")/.." || exit 2
repo=$PWD
export PYTHONSAFEPATH=1   # the working directory never shadows the installed (or linked) package

from_here() {  # does $py import jaxinfer from this checkout? (found, not imported: that would start JAX)
  "$py" - "$repo" <<'EOF' 2>/dev/null
import importlib.util, pathlib, sys
spec = importlib.util.find_spec("jaxinfer")
sys.exit(spec is None or pathlib.Path(spec.origin).resolve().parent != pathlib.Path(sys.argv[1], "jaxinfer").resolve())
EOF
}

if ! "$py" -c "import jax" 2>/dev/null; then
  echo "jax is not importable by $py (set PYTHON to the interpreter that has it)" >&2
  exit 2
fi
if ! from_here; then
  log=$(mktemp)
  if ! "$py" -m pip install -q --no-index --no-deps --no-build-isolation -e "$repo" >"$log" 2>&1; then
    tail -n 1 "$log" >&2
    # The package maps models/, pallas_kernels/ and meshes/ into jaxinfer (pyproject's package-dir): mirror
    # that with links in a scratch directory put first on the path.
    shim=$(mktemp -d)
    mkdir "$shim/jaxinfer"
    ln -s "$repo"/jaxinfer/* "$shim/jaxinfer/"
    for sub in models pallas_kernels meshes; do ln -s "$repo/$sub" "$shim/jaxinfer/$sub"; done
    export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
    echo "pip could not install jaxinfer; running it from the source tree through $shim" >&2
  fi
  from_here || { echo "jaxinfer from $repo is still not importable by $py" >&2; exit 2; }
fi

timeout -k 15 "${GPU_CHECK_TIMEOUT:-515}" "$py" -m jaxinfer.bench.gpu_check "$out" "$@"
