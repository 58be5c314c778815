#!/usr/bin/env bash
# A lease's GPU work as one detached queue, so that the GPU never waits between device calls: the plan runs in its
# own session (it outlives the call that started it, until the machine goes back) and each later call only waits
# and brings back what is done. Device side, after the install chunks:
#
#   bash scripts/device/queue.sh start PLAN COMMIT    # runs PLAN detached; returns at once
#   bash scripts/device/queue.sh collect WAIT_S       # waits up to WAIT_S s for PLAN to end, prints its log's tail,
#                                                     # packs the results into $OUT (also when PLAN is still running)
#
# PLAN is a bash file sourced with R (the results folder, /tmp/queue/results), C (COMMIT), GPU_MIB (the GPU's memory)
# and step NAME COMMAND... (runs COMMAND, logging its start, end and exit status); e.g.
#
#   step kernel python3 scripts/device/run_gpu_suite.py tests/gpu/test_verify_attention_cuda.py --out $R/kernel
#   step sweep bash scripts/device/real8b.sh sweep $R/sweep $C wide 9 --set all.batch_sizes=16,64 ...
#
# Plans are written per lease (runs/bench is carried and ignored by git); the results that matter are committed
# under benchmarks/results. collect writes $OUT/results.tar.xz (no profiler traces, no server-log tarballs) and
# $OUT/logs.tar (the server-log tarballs, left behind by the device tool when over 16 MiB). Make each call right
# after the last one returns: the machine goes back 30 s after a call, the queue with it.
set -uo pipefail
cd "$(dirname "$0")/../.."
Q=${QUEUE_DIR:-/tmp/queue}  # (QUEUE_DIR: tests only)
case "${1:-}" in
start)
    plan=${2:?plan file}
    commit=${3:?commit}
    [ -f "$plan" ] || { echo "no plan file $plan" >&2; exit 2; }
    rm -rf "$Q" && mkdir -p "$Q/results"
    setsid bash -c "bash scripts/device/queue.sh run '$plan' '$commit' > $Q/queue.log 2>&1; touch $Q/DONE" \
        < /dev/null > /dev/null 2>&1 &
    sleep 2
    echo "queue started: $plan ($commit), log $Q/queue.log"
    ;;
run)
    plan=${2:?plan file}
    source scripts/device/env.sh
    R=$Q/results
    C=${3:?commit}
    GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    step() {
        local name=$1 rc
        shift
        echo "== $name start $(date +%T)"
        "$@"
        rc=$?
        echo "== $name exit $rc $(date +%T)"
        return 0  # a failed step does not stop the queue
    }
    echo "queue: $plan, commit $C, GPU memory $GPU_MIB MiB, $(date +%T)"
    source "$plan"
    echo "queue: done $(date +%T)"
    ;;
collect)
    wait_s=${2:?wait seconds}
    out=${OUT:?OUT: the folder the device tool brings back}
    for _ in $(seq 1 "$wait_s"); do [ -f "$Q/DONE" ] && break; sleep 1; done
    [ -f "$Q/DONE" ] || echo "queue still running after ${wait_s} s"
    grep -E "^(== |queue: )" "$Q/queue.log"
    tail -n 15 "$Q/queue.log"
    tar -C "$Q" -cJf "$out/results.tar.xz" --exclude='*.trace.json.gz' --exclude='logs*.tar.xz' results queue.log
    (cd "$Q" && find results -name 'logs*.tar.xz' -print0 | tar -cf "$out/logs.tar" --null -T -)
    ls -l "$out"
    ;;
*)
    echo "usage: queue.sh start PLAN COMMIT | collect WAIT_S" >&2
    exit 2
    ;;
esac
