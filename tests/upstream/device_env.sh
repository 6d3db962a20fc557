# Sourced by the scripts that run on the device machine (Python 3.12 with torch, no network): installs kvfsm's
# runtime wheels (.whl/) and unpacks the sglang site (`make device-sglang-site` -> .device/), both carried with
# the working tree, and puts them and the checkout on PYTHONPATH. Returns 2 when either step fails.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 2
rm -rf /tmp/sg && mkdir -p /tmp/sg && tar -xJf .device/sglang-site.tar.xz -C /tmp/sg || return 2
export PYTHONPATH="/tmp/site:/tmp/sg:$PWD" PYTHONUNBUFFERED=1
