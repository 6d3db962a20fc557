#!/bin/sh
# The GPU runs of the SGLang adapter, on the device machine (an H200 with Python 3.12 and torch, no network):
# kvfsm's runtime wheels (.whl/) and the sglang site (`make device-sglang-site` -> .device/) must travel with
# the working tree. Extra arguments go to pytest.
set -e
. tests/upstream/device_env.sh
# -p no:anyio: the anyio carried for sglang shadows the device's own, whose pytest plugin it does not carry
exec python3 -m pytest -p no:anyio -q -m gpu -p no:cacheprovider tests/dataplane/test_layer_pool.py \
    tests/upstream/test_adapter_gpu.py "$@"
