#!/bin/sh
# The GPU mutation pass on the device machine (Python 3.12 with torch, no network): kvfsm's runtime wheels
# (.whl/) and the sglang site (`make device-sglang-site` -> .device/) travel with the working tree, so the
# SGLang adapter's GPU test runs too. The pass's gpu_pass.json and log land in $OUT. Extra arguments go to
# `gpu_pass.py run` (--jobs, --limit, --previous).
set -e
: "${OUT:?set OUT to the folder whose files come back}"
. tests/upstream/device_env.sh
exec python3 tests/mutation/gpu_pass.py run --out "$OUT" "$@"
