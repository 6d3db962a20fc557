#!/usr/bin/env bash
# `make test` on a fresh clone of this checkout's HEAD while CPU-bound processes run beside it: the load
# the suite must bear without failing (on the 2-core CI machine, two of them; about 20 minutes). The burners
# are killed at the end, however the run ends; prints make's exit status and the wall time.
#
#   tests/load_check.sh [BURNERS] [DIR]      # defaults: 2 burners, a clone in /tmp/kvfsm-load-check; 0: idle
#
# The clone has no venvs, so the time includes the set-up, as CI's does; the log is DIR.log.
set -uo pipefail

ROOT=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
BURNERS=${1:-2}
DIR=${2:-/tmp/kvfsm-load-check}

rm -rf "$DIR"
git clone -q "$ROOT" "$DIR" || exit 2

burners=()
stop_burners() {
    for pid in "${burners[@]}"; do kill "$pid" 2>/dev/null; done
    for pid in "${burners[@]}"; do wait "$pid" 2>/dev/null; done
    burners=()
}
trap stop_burners EXIT
trap 'stop_burners; exit 130' INT TERM

for _ in $(seq "$BURNERS"); do
    python3 -c 'while True: pass' &
    burners+=($!)
done

start=$(date +%s)
(cd "$DIR" && make test) >"$DIR.log" 2>&1
rc=$?
end=$(date +%s)
stop_burners

echo "make test beside $BURNERS CPU-bound processes: exit $rc after $((end - start)) s ($(( (end - start) / 60 )) min $(( (end - start) % 60 )) s); log: $DIR.log"
grep -E "^[0-9]+ passed|passed|failed|error" "$DIR.log" | grep -E "passed|failed" | tail -n 4
exit "$rc"
