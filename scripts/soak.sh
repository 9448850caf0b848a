#!/usr/bin/env bash
# `make soak`: the slow tests RUNS times in a row (default 5), two at a time, beside a busy loop on one
# core (the other work a volunteer's or a CI host has), stopping at the first red run and saying which;
# then the soak tests (-m soak: minutes of chaos each, which `make test` leaves out) once.
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-5}"
python="${PY:-.venv/bin/python}"
"$python" -c "while True: pass" &
busy=$!
trap 'kill $busy 2>/dev/null' EXIT
for run in $(seq 1 "$runs"); do
  echo "soak: run $run of $runs"
  if ! "$python" -m pytest -q -n 2 --dist loadfile -m slow -p no:cacheprovider; then
    echo "soak: run $run of $runs failed"
    exit 1
  fi
done
echo "soak: $runs runs in a row passed beside a busy loop; now the soak tests (minutes of chaos each)"
"$python" -m pytest -q -m soak -p no:cacheprovider -s
echo "soak: the soak tests passed"
