#!/usr/bin/env bash
# Run one jaxinfer job as N processes on this host, as a multi-host job would run on N hosts:
#   launch/local.sh 2 --mesh dp=2,tp=4 --model /ckpt/Llama-3.1-8B --prompt "Hello"
# Each process gets mesh-size / N devices (CPU devices where there is no accelerator) and the same
# flags; process 0 prints the result. Logs of every process go to $JAXINFER_LOG_DIR (default: a temp dir).
# JAXINFER_MODULE=jaxinfer.serve runs the server instead (process 0 listens; the others follow it).
set -euo pipefail
n=${1:?usage: launch/local.sh NUM_PROCESSES [jaxinfer.launch flags...]}
shift
python=${PYTHON:-python3}
module=${JAXINFER_MODULE:-jaxinfer.launch}
port=${JAXINFER_PORT:-$((20000 + RANDOM % 20000))}
logs=${JAXINFER_LOG_DIR:-$(mktemp -d)}
pids=()
for ((i = 0; i < n; i++)); do
  JAXINFER_COORDINATOR=127.0.0.1:$port JAXINFER_NUM_PROCESSES=$n JAXINFER_PROCESS_ID=$i \
    "$python" -m "$module" "$@" >"$logs/process-$i.out" 2>"$logs/process-$i.err" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
grep -v '^\[Gloo\]' "$logs/process-0.out" || true   # CPU collectives log connections to stdout
if [ "$status" -ne 0 ]; then
  echo "a process failed (exit $status); logs in $logs" >&2
  tail -n 20 "$logs"/process-*.err >&2
fi
exit "$status"
