#!/bin/bash
# The scheduler-floor verdict on the device machine (docs/performance.md): the serving loop at 4096 live with the
# store in process, in its own process and sharded over four, the SGLang adapter as SGLang's scheduler calls it
# beside offload_batch and the bare floor (store in process, in one child, in four), the submit at full model
# size, and the GPU tests of the child store. Needs kvfsm's runtime wheels in .whl/ and the sglang site in .device/
# (`make device-sglang-site`), both carried. Every step has its own time limit; each result JSON and log is
# packed into $OUT/verdict.tgz as soon as its step ends, so a call stopped at its limit keeps what finished.
#
#   bash bench/h200_verdict.sh [step ...]      # steps: see STEPS below; none given runs them all
#
# All steps together need more than one call's 10 minutes (on 2026-12-05 the serving loop took 129 s, the
# adapter's 12 configurations over 170 s; on an H100 host on 2026-12-06 they took 298 s, and `adapter_compact`
# did not finish its 16/16 configuration in 202 s): split them, `serving adapter` in one call and the rest in the
# next, and give `adapter_compact` and `phases` a call of their own.
set -u
: "${OUT:?set OUT to the folder whose files come back}"
. tests/upstream/device_env.sh || exit 2
W=$OUT/verdict && mkdir -p "$W"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$W/machine.txt" 2>&1
nproc >> "$W/machine.txt"
TAG=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'h100|h200' | tr A-Z a-z)
TAG=${TAG:-gpu}  # the results are named for the card that gave them

step() {  # name, seconds, command...
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$W/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$W/steps.txt"
    tail -4 "$W/$name.log"
    tar -czf "$OUT/verdict.tgz" -C "$W" .
}

STEPS=${*:-"serving adapter adapter_compact process_tests adapter_process adapter_sharded sharded phases submit launch gil gil_sharded lock"}
for s in $STEPS; do
    case $s in
    serving) step serving_loop 280 python3 bench/serving_loop.py --live 4096 --pages 64/64 16/16 --tables cuda \
        --storage file process --no-baseline --out "$W/serving_loop_4096-$TAG.json" ;;
    serving32) step serving_loop_32 150 python3 bench/serving_loop.py --live 512 --layers 32 --host-gib 16 \
        --tables cuda --no-baseline --out "$W/serving_loop_32layers-$TAG.json" ;;
    adapter) step sglang_adapter 330 python3 bench/sglang_adapter_gpu.py --out "$W/sglang_adapter_gpu-$TAG.json" ;;
    adapter4096) # the adapter's targets at 4096 live alone (64/64 and 16/16), when a call has room for no more;
        # the calls past 15 ms (no median is near it) sampled for their stacks (stall_stacks.py)
        step sglang_adapter_4096 280 python3 bench/sglang_adapter_gpu.py --live 4096 --stall-ms 15 \
        --out "$W/sglang_adapter_gpu-4096-$TAG.json" ;;
    adapter4096_16) # the adapter's targets at 4096 live, 16/16 alone, when a call has room for one configuration
        step sglang_adapter_4096_16 120 python3 bench/sglang_adapter_gpu.py --live 4096 --pages 16/16 --stall-ms 15 \
        --out "$W/sglang_adapter_gpu-4096-16-$TAG.json" ;;
    adapter_compact) # the calls back to back before the wait, the order of every run before the first in SGLang's order (ORDERS)
        step sglang_adapter_compact 300 python3 bench/sglang_adapter_gpu.py --live 4096 --order compact \
        --out "$W/sglang_adapter_gpu-compact-$TAG.json" ;;
    adapter_process) step sglang_adapter_process 200 python3 bench/sglang_adapter_gpu.py --live 4096 --store-process \
        --out "$W/sglang_adapter_gpu-store-process-$TAG.json" ;;
    adapter_sharded) step sglang_adapter_sharded 330 python3 bench/sglang_adapter_gpu.py --live 4096 --pages 16/16 64/64 \
        --store-process 4 --stall-ms 15 --out "$W/sglang_adapter_gpu-sharded-$TAG.json" ;;
    sharded) step serving_loop_sharded 300 python3 bench/serving_loop.py --live 4096 --pages 16/16 64/64 --tables cuda \
        --storage sharded process --store-processes 4 --no-baseline --out "$W/serving_loop_sharded-$TAG.json" ;;
    phases) # each door's phases and the steps inside them, and the in-situ limit probes: the no-op door (bare_door) and
        # the least-read door (bare_read_door)
        step door_phases 240 python3 bench/probes/door_phases.py --live 4096 --pages 64 16 --detail \
        --modes adapter batch bare_door bare_read_door --out "$W/door_phases-$TAG.json" ;;
    phases1024) # the same probes at 1024 live, where the door's share of an iteration is the same and the batch's less
        step door_phases_1024 150 python3 bench/probes/door_phases.py --live 1024 --pages 64 16 \
        --modes adapter batch bare_door bare_read_door --out "$W/door_phases-1024-$TAG.json" ;;
    ab) # a change measured against the tree before it, alternating (bench/ab_trees.py): AB_BASE names that tree
        # (`git archive REV kvfsm generated spec | tar -x -C DIR`, carried), AB_ARGS the adapter bench's arguments
        step ab_trees 540 python3 bench/ab_trees.py --base "${AB_BASE:?set AB_BASE to the tree before the change}" \
            --pairs 2 --timeout 130 --out "$W/ab_trees-$TAG.json" -- bench/sglang_adapter_gpu.py \
            ${AB_ARGS:---live 4096 --pages 16/16 --iterations 200 --warmup 60} ;;
    submit) step submit_cost 60 python3 bench/submit_cost.py --launcher off on --out "$W/submit_cost-$TAG.json" ;;
    launch) step launch_probe 120 python3 bench/probes/launch_probe.py --out "$W/launch_probe-$TAG.json" ;;
    gil) step store_gil_share 60 python3 bench/probes/store_gil_share.py --pin --out "$W/store_gil_share-$TAG.json" ;;
    gil_sharded) for busy in 16 5; do  # the adapter's and the batch path's scheduler Python at 4096 live, 16/16
        step store_gil_share_sharded_busy$busy 90 python3 bench/probes/store_gil_share.py --pin --page 16 --batch 256 \
            --busy-ms $busy --idle-ms $((27 - busy)) --modes none process sharded --hashed-keys --seconds 6 \
            --out "$W/store_gil_share_sharded_busy$busy-$TAG.json"; done ;;
    lock) # where the scheduler's thread lets go of the interpreter lock: each phase quiet, then beside a thread
        # running Python with a 0.5 ms switch interval (docs/performance.md, "The interpreter lock ...")
        step serving_loop_lock_quiet 200 python3 bench/serving_loop.py --live 4096 --pages 64/64 16/16 --tables cuda \
            --storage sharded --store-processes 4 --no-baseline --floors bare --out "$W/serving_loop_lock_quiet-$TAG.json"
        step serving_loop_lock_contender 230 python3 bench/serving_loop.py --live 4096 --pages 64/64 16/16 \
            --tables cuda --storage sharded --store-processes 4 --no-baseline --floors bare --contender --switch-interval-ms 0.5 \
            --iterations 100 --warmup 40 --out "$W/serving_loop_lock_contender-$TAG.json" ;;
    process_tests) step process_storage_tests 90 python3 -m pytest -q -p no:cacheprovider -p no:anyio -o addopts= \
        tests/dataplane/test_process_storage.py tests/dataplane/test_host_pool.py ;;
    adapter4096_ungrouped) # the same with no free group open around the calls: what SGLang's group changes
        step sglang_adapter_4096_ungrouped 200 python3 bench/sglang_adapter_gpu.py --live 4096 --no-free-group \
        --out "$W/sglang_adapter_gpu-4096-ungrouped-$TAG.json" ;;
    gpu_tests_sglang) # the SGLang adapter's GPU tests and the sync-debug tests alone
        step gpu_tests_sglang 150 python3 -m pytest -q -p no:cacheprovider -p no:randomly -p no:anyio -o addopts= \
        --tb=short -m gpu tests/upstream/test_adapter_gpu.py tests/upstream/test_adapter_devices_gpu.py tests/gpu ;;
    gpu_tests) step gpu_tests 400 python3 -m pytest -q -p no:cacheprovider -p no:randomly -p no:anyio -o addopts= \
        --tb=short -m gpu tests/dataplane tests/engine/test_demo.py tests/upstream/test_adapter_gpu.py tests/gpu ;;
    *) echo "unknown step $s" >&2; exit 2 ;;
    esac
done
