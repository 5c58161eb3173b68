#!/usr/bin/env bash
# Runs every benchmark in turn; each rewrites only its own section of docs/benchmarks.md
# (with --smoke: of benchmarks/out/benchmarks-smoke.md, and tiny sizes). goodput comes after the
# measurements: it reads their raw results (the full runs', also in smoke mode).
# Usage: benchmarks/run_all.sh [--smoke]
set -euo pipefail

cd "$(dirname "$0")/.."
mode=()
limit=3600  # hard bound per script, on top of the per-run timeouts inside each script
if [[ "${1:-}" == "--smoke" ]]; then
  mode=(--smoke)
  limit=600
elif [[ $# -gt 0 ]]; then
  echo "usage: $0 [--smoke]" >&2
  exit 2
fi

status=0
for script in regain overhead fsdp_replication snapshot_stall accelerate_loop state_transfer torchft_compare goodput; do
  echo "== benchmarks/${script}.py ${mode[*]:-}"
  started=${SECONDS}
  # SIGTERM on timeout lets the script kill every process it started; SIGKILL 60 s later if it cannot.
  timeout --kill-after=60 "${limit}" python "benchmarks/${script}.py" "${mode[@]}" || status=$?
  echo "== benchmarks/${script}.py: $((SECONDS - started)) s"
done
exit "${status}"
