#!/usr/bin/env bash
# Runs every benchmark; each rewrites only its own section of docs/benchmarks.md (with --smoke: of
# benchmarks/out/benchmarks-smoke.md, and tiny sizes). goodput comes last: it reads the raw results of
# the others (the full runs', also in smoke mode).
# Full mode runs one script at a time (timings must not share the machine); --smoke runs two lanes side
# by side (it asserts only that each script runs and writes its rows), each line prefixed by its lane.
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

# Runs the named scripts in turn; fails (after running all) if any failed.
lane() {
  local status=0 code script started
  for script in "$@"; do
    echo "== benchmarks/${script}.py ${mode[*]:-}"
    started=${SECONDS}
    code=0
    # SIGTERM on timeout lets the script kill every process it started; SIGKILL 60 s later if it cannot.
    timeout --kill-after=60 "${limit}" python "benchmarks/${script}.py" "${mode[@]}" || code=$?
    echo "== benchmarks/${script}.py: $((SECONDS - started)) s (exit ${code})"
    [[ ${code} -eq 0 ]] || status=${code}
  done
  return "${status}"
}

status=0
if [[ ${#mode[@]} -eq 0 ]]; then
  lane regain overhead reduction_ab fsdp_replication snapshot_stall accelerate_loop state_transfer torchft_compare coordinator_scale link_reroute || status=$?
else
  (lane accelerate_loop regain snapshot_stall reduction_ab 2>&1 | sed -u 's/^/[lane 1] /') &
  first=$!
  lane overhead fsdp_replication torchft_compare state_transfer coordinator_scale link_reroute 2>&1 | sed -u 's/^/[lane 2] /' || status=$?
  wait "${first}" || status=$?
fi
lane goodput || status=$?
echo "== all: ${SECONDS} s (exit ${status})"
exit "${status}"
