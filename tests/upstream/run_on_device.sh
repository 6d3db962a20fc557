#!/bin/sh
# The GPU runs of the SGLang adapter, on the device machine (an H200 with Python 3.12 and torch, no network):
# kvfsm's runtime wheels (.whl/) and the sglang site (`make device-sglang-site` -> .device/) must travel with
# the working tree. Extra arguments go to pytest.
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
rm -rf /tmp/sg && mkdir -p /tmp/sg && tar -xJf .device/sglang-site.tar.xz -C /tmp/sg
export PYTHONPATH="/tmp/site:/tmp/sg:$PWD" PYTHONUNBUFFERED=1
# -p no:anyio: the anyio carried for sglang shadows the device's own, whose pytest plugin it does not carry
exec python3 -m pytest -p no:anyio -q -m gpu -p no:cacheprovider tests/dataplane/test_layer_pool.py \
    tests/upstream/test_adapter_gpu.py "$@"
