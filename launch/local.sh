#!/usr/bin/env bash
# One JAX job of NUM_PROCESSES processes on this machine, each with DEVICES_PER_PROCESS CPU devices.
#
#   launch/local.sh NUM_PROCESSES DEVICES_PER_PROCESS python train.py --config=... [--config.KEY=VALUE ...]
#
# Each process gets JAX_PLATFORMS=cpu, XLA_FLAGS=--xla_force_host_platform_device_count=N and
# EMBER_COORDINATOR_ADDRESS / EMBER_NUM_PROCESSES / EMBER_PROCESS_ID, which ember reads to call
# jax.distributed.initialize (CPU collectives over gloo). The coordinator is process 0 on a free
# port of 127.0.0.1 (EMBER_PORT to choose one). SIGTERM / SIGINT to this script go to every process
# (ember saves a checkpoint and exits 0); if one process fails the others are stopped. Exits 0 if
# every process did, else with the first failure's status. An error line that several processes print
# alike ("error: ...", bad input, status 2) is printed once.
set -uo pipefail

if [[ $# -lt 3 ]] || ! [[ $1 =~ ^[1-9][0-9]*$ && $2 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 NUM_PROCESSES DEVICES_PER_PROCESS COMMAND [ARGS...]" >&2
  exit 2
fi
num_processes=$1
devices=$2
shift 2

port=${EMBER_PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}

# Every process writes to one stderr through this filter: each line goes on at once, except an "error: "
# line another process already printed. A bad flag, config value or path fails every process alike and
# is said once (one line, exit 2, as with one process). The filter ignores Ctrl-C and SIGTERM: it ends
# when the last process has closed its stderr, so a stopping process's last lines still get through.
exec 2> >(trap '' INT TERM; exec awk '!/^error: / || !seen[$0]++ { print; fflush() }' >&2)

pids=()
forward() {  # forward SIGNAL: pass it to every process still running.
  for pid in "${pids[@]}"; do kill -s "$1" "$pid" 2>/dev/null || true; done
}
trap 'forward TERM' TERM
trap 'forward TERM' INT  # Ctrl-C: a clean stop with a checkpoint, as on preemption.

for ((i = 0; i < num_processes; i++)); do
  JAX_PLATFORMS=cpu \
  XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=${devices}" \
  EMBER_COORDINATOR_ADDRESS="127.0.0.1:${port}" \
  EMBER_NUM_PROCESSES="${num_processes}" \
  EMBER_PROCESS_ID="${i}" \
    "$@" &
  pids+=($!)
done

status=0
killer=""
running=("${pids[@]}")
while ((${#running[@]} > 0)); do
  finished=""
  wait -n -p finished "${running[@]}"
  rc=$?
  [[ -z ${finished:-} ]] && continue  # A trapped signal interrupted the wait; the processes go on.
  left=()
  for pid in "${running[@]}"; do [[ $pid != "$finished" ]] && left+=("$pid"); done
  running=("${left[@]}")
  if ((rc != 0 && status == 0)); then
    status=$rc
    # Status 2 is bad input, which the process has said in its one line.
    ((rc != 2)) && echo "launch/local.sh: process $finished exited with status $rc; stopping the others" >&2
    forward TERM
    # A process blocked in a collective with the failed one never reaches its SIGTERM step.
    ( sleep "${EMBER_KILL_AFTER_S:-20}"; forward KILL ) >/dev/null 2>&1 &
    killer=$!
  fi
done
[[ -n $killer ]] && kill "$killer" 2>/dev/null
exit "$status"
