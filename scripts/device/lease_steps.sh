#!/usr/bin/env bash
# Steps of a GPU lease that run next to the suite (docs/gpu-suite.md): background training, kernel benchmarks,
# swapping in a freshly trained drafter. Usage, from the repo root on the device:
#   bash scripts/device/lease_steps.sh train-bg GPU [train_tiny_pair.py args...]   # detached, survives the call
#   bash scripts/device/lease_steps.sh bench-tree GPU OUTDIR                      # bench + /tmp/picked.env
#   bash scripts/device/lease_steps.sh use-new-drafter [OUTDIR]                   # wait for training, swap it in
#   bash scripts/device/lease_steps.sh profile-sweep OUTDIR COMMIT MINUTES       # two GPUs: profile on 0, sweep on 1
#   bash scripts/device/lease_steps.sh ab-sweep OUTDIR COMMIT MINUTES GPU_ON GPU_OFF [bench_budgets args...]
#        the same sweep with the round's stage graphs on (SGLANG_DDTREE_ROUND_GRAPHS=1) and off: side by side when
#        the two GPUs differ (same host load for both), one after the other when they are the same
#   bash scripts/device/lease_steps.sh parallel OUTDIR 'commands for GPU 0' 'commands for GPU 1'
#        two independent jobs side by side (e.g. GPU tests next to a benchmark): each sees one GPU, logs to
#        OUTDIR/gpu<N>.log; exit status 1 when either failed
#   bash scripts/device/lease_steps.sh checks-and-bench OUTDIR COMMIT    # two GPUs, ~8 minutes (lease 13, below)
#   bash scripts/device/lease_steps.sh tiny-auto-sweep OUTDIR COMMIT [bench_budgets args...]   # one GPU, ~8 min
#   bash scripts/device/lease_steps.sh kernel-checks OUTDIR COMMIT [WAIT_S]   # one GPU, ~8 min: core + kernel GPU
#        tests, then bench_tree's production stages (triton_fused) with an unsure and a confident drafter; with
#        BASE_KERNELS=FILE BASE_COMMIT=SHA also batch 1 with that kernels.py (~1 min more)
#   bash scripts/device/lease_steps.sh hybrid-oracle OUTDIR      # one GPU, ~7 min: the hybrid module, fast and
#        oracle servers at B = 16, 64 and 256 eager
#   bash scripts/device/lease_steps.sh server-and-8b OUTDIR COMMIT   # one GPU, ~7 min: the DDTREE server module,
#        then DFLASH and auto at 8B shapes, batch 1 / 4 / 16
#   bash scripts/device/lease_steps.sh pad-checks-and-8b OUTDIR COMMIT   # two GPUs, ~9.5 min: GPU 0 the padded
#        stage test and the server module with SGLANG_DDTREE_PAD_STAGES=1; GPU 1 DFLASH / auto at 8B shapes batch
#        64, then benchmarks/profile_kernels.py on confident drafts
#   bash scripts/device/lease_steps.sh kernels-and-server OUTDIR COMMIT   # two GPUs, ~9 min: GPU 0 kernel-checks
#        (the tree kernels' live bound, issue 2); GPU 1 the DDTREE server module (greedy equality with the same
#        kernels in the server), then profile_kernels
#   bash scripts/device/lease_steps.sh b64-graphed OUTDIR COMMIT   # one GPU, ~4 min: DFLASH and auto at 8B shapes,
#        batch 64, both with decode CUDA graphs (the graph-token cap raised), 3 repeats
#   bash scripts/device/lease_steps.sh tiny-pad-ab OUTDIR COMMIT [bench_budgets args...]   # one GPU, ALONE on the
#        machine, ~8 min: the tiny pair's interleaved sweep, DFLASH / fixed / auto with the stage graphs padded,
#        and fixed 32 / auto without (a copied setup, tiny-nopad), in one run
#   bash scripts/device/lease_steps.sh start-chains COMMIT   # two GPUs, returns at once: two `detach` steps (they
#        outlive the call): GPU 0 kernel-checks then profile_kernels, GPU 1 the DDTREE server module then
#        b64-graphed (~10-11 min each); results under /tmp/chains, logs and exit statuses /tmp/detached/gpuN.*
#   bash scripts/device/lease_steps.sh collect-chains OUTDIR WAIT_S   # waits up to WAIT_S for both chains; when
#        both ended, copies their results into OUTDIR (6 files); exit 3 while one still runs
#   bash scripts/device/lease_steps.sh tiny-auto-profile OUTDIR COMMIT   # one GPU, ALONE, ~4 min: profile_rounds of
#        the tiny pair's DDTREE 128 and auto at batch 4 (TAP_METHODS, TAP_BUDGETS, TAP_BATCH_SIZE choose others, e.g.
#        TAP_METHODS=dflash,ddtree TAP_BUDGETS=16,128: where a DDTREE round's host time goes beyond DFLASH's)
#   bash scripts/device/lease_steps.sh tiny-twins OUTDIR COMMIT   # one GPU, ALONE, ~3-7 min: two servers each of
#        DDTREE 128 and auto (setup tiny and its copy tiny-b), interleaved, batch TW_BATCH_SIZES (default 1)
#   bash scripts/device/lease_steps.sh tiny-paired OUTDIR COMMIT   # one GPU, ALONE, ~10 min (detach it): the tiny
#        pair's DFLASH, DDTREE 32 / 128 and auto, a second DDTREE 128 (the noise left) and a second auto (with
#        TP_TWIN_ENV, if set), every server pinned to TP_CPUS (2-9)
#        once ready, interleaved, prompts rotating per run, TP_REPEATS (30) short runs (TP_NEW_TOKENS 512) per batch
#        size of TP_BATCH_SIZES (1,4,16,64); then benchmarks/paired_ratios.py over DDTREE 128. TP_TWIN_BASE=DIR
#        (scripts/device/pack_base.sh COMMIT, under runs/bench): the second setup runs that commit's package
#   bash scripts/device/lease_steps.sh tiny-ab OUTDIR COMMIT   # one GPU, ALONE, ~7 min (detach it): the in-process
#        A/B (SGLANG_DDTREE_AUTO_AB) of `auto` servers (TA_ARMS: NAME:ENV ...), each against its own fixed 128-tree
#        arm, next to DFLASH and DDTREE 128 (TA_RIVALS=0: without); paired_ratios.py prints the A/B table; the
#        chooser logs every TA_LOG_EVERY (1000) `auto` rounds
#   bash scripts/device/lease_steps.sh tiny-starts OUTDIR COMMIT   # one GPU, ALONE, ~5-8 min: TS_COPIES (3) auto
#        servers per arm (TS_ENV_A / TS_ENV_B; TS_ARMS="a b c" adds TS_ENV_C) and one DDTREE 128, started together,
#        pinned, interleaved, batch TS_BATCH_SIZES (1), TS_REPEATS (24) runs; then benchmarks/paired_ratios.py over
#        DDTREE 128
#   bash scripts/device/lease_steps.sh detach NAME STEP [ARGS...]   # any step above, detached (outlives the call)
#        from a copy of the repo in /tmp/detached/NAME/repo; log /tmp/detached/NAME.log, exit status NAME.rc
#   bash scripts/device/lease_steps.sh wait-detached NAME WAIT_S   # waits up to WAIT_S; exit 3 while it runs
#   bash scripts/device/lease_steps.sh host-profile OUTDIR COMMIT   # one GPU, ALONE, ~6 min: the tiny pair's DFLASH,
#        DDTREE 16 / 128 and auto at batch HP_BATCH_SIZE (4) with SGLANG_DDTREE_HOST_PROFILE (a cProfile of each
#        scheduler's decode loop, decode batches 300..899; HP_METHODS / HP_BUDGETS pick fewer servers); the sweep's
#        throughput is not a result (the profiler slows its servers)
#   bash scripts/device/lease_steps.sh server-kernels-1gpu OUTDIR COMMIT   # one GPU, ~8 min (detach it): the server
#        module next to the core + kernel GPU tests, then kernel-bench alone (batch 1; BASE_KERNELS as kernel-checks)
#   bash scripts/device/lease_steps.sh kernel-bench OUTDIR COMMIT   # one GPU, ALONE: kernel-checks' benchmarks only
#   bash scripts/device/lease_steps.sh auto-8b OUTDIR COMMIT   # one GPU, ~4-6 min: DFLASH and `auto` at 8B shapes
#        (dummy weights), interleaved, batch A8_BATCH_SIZES (1,4,16,64), decode graphs everywhere, A8_REPEATS (6) x 4
#        prompt groups, next to one `auto` server per A8_ARMS entry (NAME:ENV, ENV comma-separated; setup
#        8b-NAME), e.g. A8_ARMS="c:SGLANG_DDTREE_AUTO_FORCE=chain"; then
#        benchmarks/paired_ratios.py over DFLASH
#   bash scripts/device/lease_steps.sh auto-final OUTDIR COMMIT   # one GPU, ALONE, ~20 min (detach it): the server
#        module, then the tiny pair's DFLASH / DDTREE 32 / 128 / auto and 8B shapes' DFLASH / auto, batch 1 / 4 / 16 /
#        64, interleaved (AF_REPEATS, AF_TINY_MINUTES, AF_8B_MINUTES, AF_SKIP_SERVER=1, AF_SKIP_TINY=1,
#        AF_8B_BATCH_SIZES=1,4; AF_NOCAL_AB=1 adds setup tiny-nocal: auto with --speculative-ddtree-auto-calibration
#        off, same run)
set -euo pipefail
step=${1:?step}
shift
TRAIN=/tmp/train

kernel_bench() {  # COMMIT: bench_tree's production stages (triton_fused), unsure and confident drafts, into /tmp/kc
    # KC_BATCH_SIZES (default 1,8,32). BASE_KERNELS=FILE (a kernels.py of an earlier commit, BASE_COMMIT): the same
    # batch-1 stages with it, in the same run, from a copy of the repo holding it: a kernel change is judged by the
    # ratio, not against a number measured on another machine.
    local scale rc
    for scale in 4 12; do
        rc=0
        timeout 150 python3 benchmarks/bench_tree.py --device cuda --impls triton_fused \
            --budgets 16,32,64,128,256,512,1024 --batch-sizes "${KC_BATCH_SIZES:-1,8,32}" --repeats 30 \
            --draft-scale "$scale" --out "/tmp/kc/tree_kernels_scale$scale.json" --commit "$1" \
            > "/tmp/kc/bench$scale.log" 2>&1 || rc=$?
        echo "bench scale $scale exit $rc" >> "/tmp/kc/bench$scale.log"
    done
    [ -n "${BASE_KERNELS:-}" ] || return 0
    rm -rf /tmp/kbase && mkdir -p /tmp/kbase
    cp -r sglang_ddtree benchmarks pyproject.toml /tmp/kbase/
    cp "$BASE_KERNELS" /tmp/kbase/sglang_ddtree/kernels.py
    for scale in 4 12; do
        rc=0
        (cd /tmp/kbase && PYTHONPATH=/tmp/kbase:${PYTHONPATH:-} timeout 120 python3 benchmarks/bench_tree.py \
            --device cuda --impls triton_fused --budgets 16,32,64,128,256,512,1024 --batch-sizes 1 --repeats 30 \
            --draft-scale "$scale" --out "/tmp/kc/tree_kernels_base_scale$scale.json" \
            --commit "${BASE_COMMIT:-unknown}") > "/tmp/kc/bench_base$scale.log" 2>&1 || rc=$?
        echo "base bench scale $scale exit $rc" >> "/tmp/kc/bench_base$scale.log"
    done
}

unpack_jit_cache() {  # a JIT cache carried in (.device-cache/jit), unpacked where env.sh points the JIT caches
    # (run_gpu_suite.py does this with a version check; lease 24 ran tiny-paired without it: ~115 s server starts
    # instead of ~50-70)
    if [ -f .device-cache/jit/jit-cache.tar.xz ] && [ -n "${DDTREE_JIT_ROOT:-}" ]; then
        mkdir -p "$DDTREE_JIT_ROOT" && tar -xJf .device-cache/jit/jit-cache.tar.xz -C "$DDTREE_JIT_ROOT" || true
    fi
}

paired_outputs() {  # NAME OUTDIR RC: a pinned interleaved tiny sweep run in /tmp/<ws> (tp: tiny-paired, ts:
    # tiny-starts) -> OUTDIR/sweep_NAME.jsonl, its rows over DDTREE 128 run by run (paired_ratios.json), the logs
    local name=$1 out=$2 rc=$3 ws=/tmp/t${1:0:1}
    echo "tiny $name exit $rc" | tee -a "$ws/run.log"
    cp "$ws/sweep/bench_budgets.jsonl" "$out/sweep_$name.jsonl" || true
    python3 benchmarks/paired_ratios.py "$ws/sweep/bench_budgets.jsonl" --base "tiny|ddtree-128" \
        --json "$out/paired_ratios.json" 2>&1 | tee -a "$ws/run.log" || true
    tar -cJf "$out/tiny_${name}_logs.tar.xz" -C /tmp "${ws#/tmp/}/run.log" "${ws#/tmp/}/logs"
    tail -n 30 "$ws/run.log"
}

auto_arm_copies() {  # PREFIX BASE ENV ARMS...: per NAME:EXTRA arm (EXTRA comma-separated, may be empty) an `auto`
    # copy of setup BASE named PREFIX-NAME with server_env ENV,EXTRA, appended to the caller's setups and copies
    # arrays (tiny-ab, auto-8b)
    local prefix=$1 base=$2 env=$3 arm name extra
    shift 3
    for arm in "$@"; do
        name="$prefix-${arm%%:*}"
        extra=${arm#*:}
        setups+=("$name")
        copies+=(--copy-setup "$name=$base" --set "$name.methods=auto" --set "$name.server_env=$env${extra:+,$extra}")
    done
}
pinned_sweep() {  # WS TIMEOUT_S COMMIT ARGS...: bench_budgets.py on GPU 0 with what tiny-paired, tiny-starts and
    # tiny-ab share (a 128-token warm-up, one prompt group rotating per run, interleaved, HumanEval prompts), results
    # in WS/sweep, server logs in WS/logs, its output in WS/run.log; ARGS: setups, rows, CPUs, repeats, minutes, and
    # --set items, which come after the shared warm-up (--set applies in order) so a setup can change it
    local ws=$1 timeout_s=$2 commit=$3
    shift 3
    CUDA_VISIBLE_DEVICES=0 timeout "$timeout_s" python3 benchmarks/bench_budgets.py \
        --set all.warmup_new_tokens=128 "$@" --prompt-groups 1 --rotate-prompts --interleave \
        --prompts-file runs/bench/humaneval_prompts.jsonl --out "$ws/sweep" --log-dir "$ws/logs" --commit "$commit" \
        > "$ws/run.log" 2>&1
}

profile_kernels() {  # GPU OUTDIR COMMIT TIMEOUT_S: the select kernel's split on confident drafts, B = 256 and 1024
    CUDA_VISIBLE_DEVICES=$1 timeout "$4" python3 benchmarks/profile_kernels.py --budgets 256,1024 --warps 8 \
        --repeats 20 --commit "$3" --out "$2/profile_kernels.json" > "$2/pk.log" 2>&1
}

case "$step" in
train-bg)
    gpu=${1:?gpu}
    shift
    rm -rf "$TRAIN" /tmp/repo-train
    mkdir -p "$TRAIN" /tmp/repo-train/.cache
    cp -r models/tiny "$TRAIN/tiny"                 # --reuse-target reads the committed target from here
    cp -r scripts sglang_ddtree pyproject.toml /tmp/repo-train/
    cp -r .cache/corpus /tmp/repo-train/.cache/corpus
    # setsid: a new session, so the training outlives this call (the tool ends the call's own processes)
    CUDA_VISIBLE_DEVICES=$gpu PYTHONUNBUFFERED=1 setsid bash -c \
        "cd /tmp/repo-train && python3 scripts/train_tiny_pair.py --out $TRAIN/tiny --device cuda $* \
         > $TRAIN/train.log 2>&1; echo \$? > $TRAIN/rc" < /dev/null > /dev/null 2>&1 &
    sleep 15
    tail -n 5 "$TRAIN/train.log"
    ;;
bench-tree)
    gpu=${1:?gpu}
    out=${2:?outdir}
    mkdir -p "$out"
    export CUDA_VISIBLE_DEVICES=$gpu
    # ${DDTREE_COMMIT:-}: the device copy's git HEAD can be stale; export DDTREE_COMMIT=<sha> before this step
    # ${DDTREE_BENCH_IMPLS}: a shorter list when the call has no time for all (pick_tree_setup.py then only knows
    # the kernels measured)
    python3 benchmarks/bench_tree.py --device cuda \
        --impls "${DDTREE_BENCH_IMPLS:-triton,triton_rank,triton_select,triton_select_topk,triton_fused}" \
        --budgets 16,32,64,128,256,512,1024 --batch-sizes 1,8,32 --repeats 30 --out "$out/tree_kernels.json" \
        ${DDTREE_COMMIT:+--commit "$DDTREE_COMMIT"}
    python3 scripts/device/pick_tree_setup.py "$out/tree_kernels.json" | tee /tmp/picked.env "$out/picked.env"
    ;;
use-new-drafter)
    out=${1:-}
    for _ in $(seq 1 120); do [ -f "$TRAIN/rc" ] && break; sleep 5; done
    tail -n 12 "$TRAIN/train.log"
    if [ "$(cat "$TRAIN/rc" 2>/dev/null)" != "0" ]; then
        echo "training did not finish cleanly (rc=$(cat "$TRAIN/rc" 2>/dev/null || echo none)); keeping the committed drafter"
        exit 1
    fi
    rm -rf models/tiny/drafter
    cp -r "$TRAIN/tiny/drafter" models/tiny/drafter
    cp "$TRAIN/tiny/training_log.json" models/tiny/training_log.json
    if [ -n "$out" ] && [ ! -f "$out/new_drafter.tar.xz" ]; then
        tar -cJf "$out/new_drafter.tar.xz" -C "$TRAIN" tiny/drafter tiny/training_log.json train.log
    fi
    echo "new drafter in models/tiny/drafter"
    ;;
profile-sweep)
    # GPU 0: profiler traces of batch-1 rounds (benchmarks/profile_rounds.py); GPU 1 at the same time: the batch-1
    # budget sweep with the per-stage split. Each packs its outputs into one archive in OUTDIR.
    out=${1:?outdir}
    commit=${2:?commit}
    minutes=${3:?minutes}
    mkdir -p "$out" /tmp/prof /tmp/sw
    (CUDA_VISIBLE_DEVICES=0 timeout $((minutes * 60)) python3 benchmarks/profile_rounds.py --out /tmp/prof \
        --setups 8b-dummy,tiny --methods plain,dflash,ddtree --budgets 32,256 --steps 40 \
        --prompts-file runs/bench/humaneval_prompts.jsonl --commit "$commit" > /tmp/prof/run.log 2>&1
     echo "profile exit $?" >> /tmp/prof/run.log) &
    (CUDA_VISIBLE_DEVICES=1 python3 benchmarks/bench_budgets.py --out /tmp/sw --log-dir /tmp/sw/logs \
        --setups tiny,8b-dummy --set tiny.budgets=32,64,128,256,512 --set 8b-dummy.budgets=32,256 \
        --set all.batch_sizes=1 --prompts-file runs/bench/humaneval_prompts.jsonl \
        --max-minutes "$((minutes - 1))" --commit "$commit" > /tmp/sw/run.log 2>&1
     echo "sweep exit $?" >> /tmp/sw/run.log) &
    wait
    tail -n 30 /tmp/prof/run.log /tmp/sw/run.log
    tar -cJf "$out/profile.tar.xz" -C /tmp prof
    tar -cJf "$out/sweep.tar.xz" -C /tmp sw
    ls -la "$out"
    ;;
ab-sweep)
    out=${1:?outdir}
    commit=${2:?commit}
    minutes=${3:?minutes}
    gpu_on=${4:?gpu for graphs on}
    gpu_off=${5:?gpu for graphs off}
    shift 5
    mkdir -p "$out"
    one() {  # graphs (1|0), gpu, bench_budgets args...
        local graphs=$1 gpu=$2
        shift 2
        CUDA_VISIBLE_DEVICES=$gpu SGLANG_DDTREE_ROUND_GRAPHS=$graphs python3 benchmarks/bench_budgets.py \
            --out "$out/graphs$graphs" --log-dir "$out/graphs$graphs/logs" \
            --prompts-file runs/bench/humaneval_prompts.jsonl --max-minutes "$minutes" \
            --commit "$commit+graphs$graphs" "$@" > "$out/graphs$graphs.log" 2>&1
        echo "graphs=$graphs exit $?" >> "$out/graphs$graphs.log"
    }
    if [ "$gpu_on" = "$gpu_off" ]; then
        one 1 "$gpu_on" "$@"
        one 0 "$gpu_off" "$@"
    else
        one 1 "$gpu_on" "$@" &
        one 0 "$gpu_off" "$@" &
        wait
    fi
    tail -n 16 "$out/graphs1.log" "$out/graphs0.log"
    ;;
parallel)
    out=${1:?outdir}
    mkdir -p "$out"
    for gpu in 0 1; do
        cmd=${2:?commands for GPU 0}
        [ "$gpu" = 1 ] && cmd=${3:?commands for GPU 1}
        (rc=0; CUDA_VISIBLE_DEVICES=$gpu bash -c "$cmd" > "$out/gpu$gpu.log" 2>&1 || rc=$?
         echo "gpu$gpu exit $rc" >> "$out/gpu$gpu.log") &
    done
    wait
    tail -n 40 "$out/gpu0.log" "$out/gpu1.log"
    ! grep -q "exit [1-9]" <(tail -n 1 "$out/gpu0.log"; tail -n 1 "$out/gpu1.log")
    ;;
kernel-checks)
    # WAIT_S: let a job on the other GPU restore the JIT cache first (restoring while this compiles crashed a
    # compile in lease 12). Each part records its exit status; one archive. KC_BENCH=0: the tests only (when the
    # GPU is shared: kernel-bench runs later, alone).
    out=${1:?outdir}
    commit=${2:?commit}
    sleep "${3:-0}"
    mkdir -p "$out" /tmp/kc
    rc=0
    timeout 450 python3 scripts/device/run_gpu_suite.py tests/gpu/test_core_cuda.py tests/gpu/test_kernels_cuda.py \
        --out /tmp/kc/suite --deadline-s 420 > /tmp/kc/tests.log 2>&1 || rc=$?
    echo "gpu tests exit $rc" >> /tmp/kc/tests.log
    [ "${KC_BENCH:-1}" = 0 ] || kernel_bench "$commit"
    tar -cJf "$out/kernel_checks.tar.xz" -C /tmp kc
    tail -n 4 /tmp/kc/*.log
    ;;
kernel-bench)
    out=${1:?outdir}
    commit=${2:?commit}
    mkdir -p "$out" /tmp/kc
    kernel_bench "$commit"
    tar -cJf "$out/kernel_checks.tar.xz" -C /tmp kc
    tail -n 4 /tmp/kc/*.log
    ;;
server-kernels-1gpu)
    # One GPU, ~8 min: the DDTREE server module next to the core + kernel GPU tests (correctness only, so they may
    # share the GPU; the kernel tests start after the suite restored the JIT cache), then kernel-bench alone.
    out=${1:?outdir}
    commit=${2:?commit}
    mkdir -p "$out" /tmp/sk
    (rc=0
     python3 scripts/device/run_gpu_suite.py tests/gpu/test_ddtree_server.py --out /tmp/sk/server --deadline-s 420 \
        --jit-cache .device-cache/jit/jit-cache.tar.xz > /tmp/sk/server.log 2>&1 || rc=$?
     echo "server module exit $rc" >> /tmp/sk/server.log) &
    (rc=0
     KC_BENCH=0 bash scripts/device/lease_steps.sh kernel-checks /tmp/sk/kc "$commit" 30 > /tmp/sk/kc.log 2>&1 || rc=$?
     echo "kernel checks exit $rc" >> /tmp/sk/kc.log) &
    wait
    rc=0
    KC_BATCH_SIZES=${KC_BATCH_SIZES:-1} bash scripts/device/lease_steps.sh kernel-bench "$out" "$commit" \
        > /tmp/sk/kb.log 2>&1 || rc=$?
    echo "kernel bench exit $rc" >> /tmp/sk/kb.log
    cp /tmp/sk/server/gpu_suite.json "$out/gpu_suite_server.json" || true
    tar -cJf "$out/server_logs.tar.xz" -C /tmp/sk/server . || true
    tail -n 6 /tmp/sk/server.log /tmp/sk/kc.log /tmp/sk/kb.log
    ;;
hybrid-oracle)
    out=${1:?outdir}
    mkdir -p "$out"
    rc=0
    DDTREE_HYBRID_CONFIGS=hybrid-ddtree-16,hybrid-ddtree-16-oracle,hybrid-ddtree-64,hybrid-ddtree-64-oracle,hybrid-ddtree-256-eager,hybrid-ddtree-256-eager-oracle \
        python3 scripts/device/run_gpu_suite.py tests/gpu/test_ddtree_hybrid.py --out /tmp/hy --deadline-s 520 \
        --jit-cache .device-cache/jit/jit-cache.tar.xz > /tmp/hy.log 2>&1 || rc=$?
    echo "hybrid exit $rc" >> /tmp/hy.log
    cp /tmp/hy/gpu_suite.json "$out/gpu_suite_hybrid.json" || true
    tail -n 30 /tmp/hy.log
    ;;
server-and-8b)
    out=${1:?outdir}
    commit=${2:?commit}
    mkdir -p "$out" /tmp/s8
    rc=0
    python3 scripts/device/run_gpu_suite.py tests/gpu/test_ddtree_server.py --out /tmp/s8/server --deadline-s 240 \
        > /tmp/s8/server.log 2>&1 || rc=$?
    echo "server module exit $rc" >> /tmp/s8/server.log
    rc=0
    timeout 270 python3 benchmarks/bench_budgets.py --setups 8b-dummy --set 8b-dummy.methods=dflash,auto \
        --set 8b-dummy.batch_sizes=1,4,16 --repeats 3 --prompt-groups 4 --max-minutes 4.2 --out /tmp/s8/sweep \
        --log-dir /tmp/s8/sweep/logs --commit "$commit" > /tmp/s8/sweep.log 2>&1 || rc=$?
    echo "8b sweep exit $rc" >> /tmp/s8/sweep.log
    cp /tmp/s8/server/gpu_suite.json "$out/gpu_suite_server.json" || true
    tar -cJf "$out/server_and_8b.tar.xz" -C /tmp s8
    tail -n 6 /tmp/s8/server.log /tmp/s8/sweep.log
    ;;
checks-and-bench)
    # GPU 0: the core / kernel GPU tests named in DDTREE_CHECK_K (pytest -k; all when empty), then the kernel bench
    # of select, the Triton top-K and the fused top-K. GPU 1: tests/gpu/test_tree_conv_cuda.py, then the 8B-shape
    # A/B of the draft logsumexp: DFLASH and auto with SGLANG_DDTREE_DRAFT_LSE=torch, then =triton, one after the
    # other on the same GPU. Set -e would end a subshell at its first failing command: each records its status.
    out=${1:?outdir}
    commit=${2:?commit}
    mkdir -p "$out" /tmp/k /tmp/ab
    (rc=0; sleep 20
     CUDA_VISIBLE_DEVICES=0 python3 scripts/device/run_gpu_suite.py tests/gpu/test_core_cuda.py \
        tests/gpu/test_kernels_cuda.py --out /tmp/k/suite --deadline-s 200 ${DDTREE_CHECK_K:+-- -k "$DDTREE_CHECK_K"} \
        > /tmp/k.log 2>&1 || rc=$?
     echo "gpu tests exit $rc" >> /tmp/k.log
     rc=0
     DDTREE_COMMIT=$commit DDTREE_BENCH_IMPLS=triton_select,triton_select_topk,triton_fused timeout 300 \
        bash scripts/device/lease_steps.sh bench-tree 0 /tmp/k/bench >> /tmp/k.log 2>&1 || rc=$?
     echo "bench exit $rc" >> /tmp/k.log) &
    (rc=0
     CUDA_VISIBLE_DEVICES=1 python3 scripts/device/run_gpu_suite.py tests/gpu/test_tree_conv_cuda.py --out /tmp/ab/conv \
        --deadline-s 120 --jit-cache .device-cache/jit/jit-cache.tar.xz > /tmp/ab/conv.log 2>&1 || rc=$?
     echo "tree conv exit $rc" >> /tmp/ab/conv.log
     for lse in torch triton; do
        rc=0
        CUDA_VISIBLE_DEVICES=1 SGLANG_DDTREE_DRAFT_LSE=$lse timeout 250 python3 benchmarks/bench_budgets.py \
            --setups 8b-dummy --set 8b-dummy.methods=dflash,auto --set 8b-dummy.batch_sizes=1,4,16 --repeats 3 \
            --prompt-groups 4 --max-minutes 3.6 --out /tmp/ab/$lse --log-dir /tmp/ab/$lse/logs \
            --commit "$commit+draft_lse=$lse" > /tmp/ab/$lse.log 2>&1 || rc=$?
        echo "8b $lse exit $rc" >> /tmp/ab/$lse.log
     done) &
    wait
    cp /tmp/k/suite/gpu_suite.json "$out/gpu_suite_kernels.json" || true
    cp /tmp/k/bench/tree_kernels.json "$out/" || true
    cp /tmp/k.log "$out/kernels_run.log" || true
    tar -cJf "$out/ab_8b.tar.xz" -C /tmp ab
    tail -n 8 /tmp/k.log /tmp/ab/conv.log /tmp/ab/torch.log /tmp/ab/triton.log
    ;;
tiny-auto-sweep)
    # The tiny pair's auto sweep alone on GPU 0 (issue 10's command of sweep_auto_tiny_lease12.jsonl, now with the
    # runs of a batch size interleaved across the servers; more bench_budgets args after COMMIT override it, e.g.
    # --prompt-groups 8); one archive.
    out=${1:?outdir}
    commit=${2:?commit}
    shift 2
    mkdir -p "$out" /tmp/swt
    rc=0
    CUDA_VISIBLE_DEVICES=0 timeout "${TINY_TIMEOUT_S:-560}" python3 benchmarks/bench_budgets.py --setups tiny \
        --set tiny.methods=dflash,ddtree,auto --set tiny.budgets=16,32,64,128 --set tiny.batch_sizes=1,4,16,64 \
        --set tiny.max_new_tokens=256 --set tiny.warmup_new_tokens=128 --repeats 3 --prompt-groups 4 --interleave \
        --prompts-file runs/bench/humaneval_prompts.jsonl --max-minutes 7.3 --out /tmp/swt --log-dir /tmp/swt/logs \
        --commit "$commit" "$@" > /tmp/swt/run.log 2>&1 || rc=$?
    echo "tiny exit $rc" >> /tmp/swt/run.log
    tar -cJf "$out/sweep_tiny.tar.xz" -C /tmp swt
    tail -n 12 /tmp/swt/run.log
    ;;
pad-checks-and-8b)
    out=${1:?outdir}
    commit=${2:?commit}
    mkdir -p "$out" /tmp/p0 /tmp/p1
    (rc=0
     CUDA_VISIBLE_DEVICES=0 python3 scripts/device/run_gpu_suite.py tests/gpu/test_core_cuda.py --out /tmp/p0/core \
        --deadline-s 110 --jit-cache .device-cache/jit/jit-cache.tar.xz -- -k auto_stages > /tmp/p0/core.log 2>&1 || rc=$?
     echo "core padded exit $rc" >> /tmp/p0/core.log
     rc=0
     CUDA_VISIBLE_DEVICES=0 SGLANG_DDTREE_PAD_STAGES=1 python3 scripts/device/run_gpu_suite.py \
        tests/gpu/test_ddtree_server.py --out /tmp/p0/server --deadline-s 420 > /tmp/p0/server.log 2>&1 || rc=$?
     echo "server module (padded stages) exit $rc" >> /tmp/p0/server.log) &
    (sleep 30  # the JIT cache restore on GPU 0 first (lease 12: a restore next to a compile crashed it)
     rc=0
     CUDA_VISIBLE_DEVICES=1 timeout 290 python3 benchmarks/bench_budgets.py --setups 8b-dummy \
        --set 8b-dummy.methods=dflash,auto --set 8b-dummy.batch_sizes=64 --repeats 3 --prompt-groups 4 \
        --max-minutes 4.5 --out /tmp/p1/b64 --log-dir /tmp/p1/b64/logs --commit "$commit" > /tmp/p1/b64.log 2>&1 || rc=$?
     echo "8b batch 64 exit $rc" >> /tmp/p1/b64.log
     rc=0
     profile_kernels 1 /tmp/p1 "$commit" 230 || rc=$?
     echo "profile kernels exit $rc" >> /tmp/p1/pk.log) &
    wait
    cp /tmp/p0/core/gpu_suite.json "$out/gpu_suite_core_padded.json" || true
    cp /tmp/p0/server/gpu_suite.json "$out/gpu_suite_server_padded.json" || true
    cp /tmp/p1/profile_kernels.json "$out/" || true
    tar -cJf "$out/pad_checks_and_8b.tar.xz" -C /tmp p0 p1
    tail -n 5 /tmp/p0/core.log /tmp/p0/server.log /tmp/p1/b64.log /tmp/p1/pk.log
    ;;
kernels-and-server)
    # GPU 0: kernel-checks (~8 min in lease 15). GPU 1: the server module (~3.5 min in lease 16), then
    # profile_kernels (~2 min). Each part records its exit status.
    out=${1:?outdir}
    commit=${2:?commit}
    mkdir -p "$out" /tmp/ks
    (rc=0
     CUDA_VISIBLE_DEVICES=0 bash scripts/device/lease_steps.sh kernel-checks /tmp/ks/kc "$commit" 30 > /tmp/ks/kc.log \
        2>&1 || rc=$?
     echo "kernel checks exit $rc" >> /tmp/ks/kc.log) &
    (rc=0
     CUDA_VISIBLE_DEVICES=1 python3 scripts/device/run_gpu_suite.py tests/gpu/test_ddtree_server.py --out /tmp/ks/server \
        --deadline-s 480 --jit-cache .device-cache/jit/jit-cache.tar.xz > /tmp/ks/server.log 2>&1 || rc=$?
     echo "server module exit $rc" >> /tmp/ks/server.log
     rc=0
     profile_kernels 1 /tmp/ks "$commit" 180 || rc=$?
     echo "profile kernels exit $rc" >> /tmp/ks/pk.log) &
    wait
    cp /tmp/ks/kc/kernel_checks.tar.xz "$out/" || true
    cp /tmp/ks/profile_kernels.json "$out/" || true
    cp /tmp/ks/server/gpu_suite.json "$out/gpu_suite_server.json" || true
    tail -n 5 /tmp/ks/kc.log /tmp/ks/pk.log /tmp/ks/server.log
    ;;
b64-graphed)
    out=${1:?outdir}
    commit=${2:?commit}
    mkdir -p "$out"
    rc=0
    timeout 330 python3 benchmarks/bench_budgets.py --setups 8b-dummy --set 8b-dummy.methods=dflash,auto \
        --set 8b-dummy.batch_sizes=64 --set 8b-dummy.graph_token_cap=8300 --repeats 3 --prompt-groups 4 \
        --max-minutes 5.2 --out "$out/b64" --log-dir /tmp/b64g/logs --commit "$commit" || rc=$?
    echo "8b batch 64 graphed exit $rc"
    grep -h "DDTREE auto after\|captured" /tmp/b64g/logs/*auto*.log | tail -n 3 || true
    ;;
tiny-pad-ab)
    out=${1:?outdir}
    commit=${2:?commit}
    shift 2
    mkdir -p "$out" /tmp/swp
    rc=0
    CUDA_VISIBLE_DEVICES=0 timeout 570 python3 benchmarks/bench_budgets.py --setups tiny,tiny-nopad \
        --copy-setup tiny-nopad=tiny --set tiny.methods=dflash,ddtree,auto --set tiny.budgets=32,128 \
        --set tiny.server_env=SGLANG_DDTREE_PAD_STAGES=1 --set tiny-nopad.methods=ddtree,auto \
        --set tiny-nopad.budgets=32 --set tiny-nopad.server_env=SGLANG_DDTREE_PAD_STAGES=0 \
        --set all.batch_sizes=1,4,16,64 --set all.max_new_tokens=256 --set all.warmup_new_tokens=128 --repeats 3 \
        --prompt-groups 4 --interleave --prompts-file runs/bench/humaneval_prompts.jsonl --max-minutes 7.6 \
        --out /tmp/swp --log-dir /tmp/swp/logs --commit "$commit" "$@" > /tmp/swp/run.log 2>&1 || rc=$?
    echo "tiny pad A/B exit $rc" >> /tmp/swp/run.log
    for f in /tmp/swp/logs/server-*.log; do echo "$(grep -c 'DDTREE: captured' "$f") captures $(basename "$f")"; done \
        | tee /tmp/swp/captures.txt
    cp /tmp/swp/bench_budgets.jsonl "$out/" || true
    tar -cJf "$out/sweep_tiny_pad_ab.tar.xz" -C /tmp swp
    tail -n 16 /tmp/swp/run.log
    ;;
start-chains)
    # A call lasts at most 10 minutes and the machine is given back 30 s after one ends: chains longer than a call
    # run detached, while short calls keep the machine warm and collect.
    commit=${1:?commit}
    rm -rf /tmp/chains
    mkdir -p /tmp/chains
    for gpu in 0 1; do
        CUDA_VISIBLE_DEVICES=$gpu bash scripts/device/lease_steps.sh detach "gpu$gpu" "chain-gpu$gpu" "$commit"
    done
    ;;
chain-gpu0)  # (started by start-chains) the tree kernels' GPU tests and benchmarks, then their profile
    commit=${1:?commit}
    rc=0
    # 30 s: GPU 1's suite restores the JIT cache first (lease 12: a restore next to a compile crashed the compile)
    bash scripts/device/lease_steps.sh kernel-checks /tmp/chains/gpu0 "$commit" 30 || rc=$?
    echo "kernel checks exit $rc"
    rc=0
    profile_kernels "${CUDA_VISIBLE_DEVICES:-0}" /tmp/chains/gpu0 "$commit" 180 || rc=$?
    echo "profile kernels exit $rc"
    ;;
chain-gpu1)  # (started by start-chains) the DDTREE server module, then 8B batch 64 with both servers graphed
    commit=${1:?commit}
    mkdir -p /tmp/chains/gpu1
    rc=0
    python3 scripts/device/run_gpu_suite.py tests/gpu/test_ddtree_server.py --out /tmp/chains/gpu1/server \
        --deadline-s 360 --jit-cache .device-cache/jit/jit-cache.tar.xz || rc=$?
    echo "server module exit $rc"
    rc=0
    bash scripts/device/lease_steps.sh b64-graphed /tmp/chains/gpu1 "$commit" || rc=$?
    echo "b64-graphed exit $rc"
    ;;
collect-chains)
    out=${1:?outdir}
    wait_s=${2:?wait seconds}
    mkdir -p "$out"
    for _ in $(seq 1 "$wait_s"); do
        [ -f /tmp/detached/gpu0.rc ] && [ -f /tmp/detached/gpu1.rc ] && break
        sleep 1
    done
    tail -n 6 /tmp/detached/gpu0.log /tmp/detached/gpu1.log
    if ! [ -f /tmp/detached/gpu0.rc ] || ! [ -f /tmp/detached/gpu1.rc ]; then
        echo "chains still running"
        exit 3
    fi
    cp /tmp/chains/gpu0/kernel_checks.tar.xz /tmp/chains/gpu0/profile_kernels.json "$out/" || true
    cp /tmp/chains/gpu1/server/gpu_suite.json "$out/gpu_suite_server.json" || true
    cp /tmp/chains/gpu1/b64/bench_budgets.jsonl "$out/sweep_8b_bs64_graphed.jsonl" || true
    tar -cJf "$out/chain_logs.tar.xz" -C /tmp detached/gpu0.log detached/gpu1.log chains/gpu0/pk.log b64g/logs \
        2>/dev/null || tar -cJf "$out/chain_logs.tar.xz" -C /tmp detached/gpu0.log detached/gpu1.log
    ls -la "$out"
    ;;
auto-cost)
    # Lease 23: after a change to `auto`'s cost per round, in one detached step (~20 min without a JIT cache): the
    # graphed auto stages against eager (test_core_cuda), the paired tiny sweep of DFLASH / DDTREE 128 / `auto`
    # (tiny-paired with TP_TWIN=0 TP_BUDGETS=128; AC_REPEATS rounds, default 60), then the `ddtree-auto` server
    # module (lossless), returning its JIT cache. Stops after a failed core test. AC_SKIP_CORE=1 leaves the core
    # module out (a change on the host side only); AC_TWIN=1 adds tiny-paired's twin setup (TP_TWIN_METHODS,
    # TP_TWIN_ENV, TP_ENV pass through); AC_SERVER_ENV=NAME=VALUE is exported for the server module's servers.
    out=${1:?outdir}
    commit=${2:?commit}
    mkdir -p "$out" /tmp/ac
    rc=0
    jit=()  # a JIT cache carried in (.device-cache/jit, from an earlier lease's --return-jit-cache): servers start faster
    [ -f .device-cache/jit/jit-cache.tar.xz ] && jit=(--jit-cache .device-cache/jit/jit-cache.tar.xz)
    if [ "${AC_SKIP_CORE:-0}" != 1 ]; then
        python3 scripts/device/run_gpu_suite.py tests/gpu/test_core_cuda.py --out /tmp/ac/core --deadline-s 300 \
            "${jit[@]}" > /tmp/ac/core.log 2>&1 || rc=$?
        echo "core module exit $rc" | tee -a /tmp/ac/core.log
        cp /tmp/ac/core/gpu_suite.json "$out/gpu_suite_core.json" || true
        [ "$rc" = 0 ] || { tail -n 30 /tmp/ac/core.log; exit "$rc"; }
    fi
    TP_TWIN="${AC_TWIN:-0}" TP_BUDGETS=128 TP_REPEATS="${AC_REPEATS:-60}" TP_MINUTES="${AC_MINUTES:-11}" \
        bash scripts/device/lease_steps.sh tiny-paired "$out" "$commit"
    rc=0
    [ -z "${AC_SERVER_ENV:-}" ] || export "${AC_SERVER_ENV?}"
    DDTREE_GPU_CONFIGS=ddtree-auto python3 scripts/device/run_gpu_suite.py tests/gpu/test_ddtree_server.py \
        --out /tmp/ac/server --deadline-s "${AC_SERVER_S:-540}" "${jit[@]}" --return-jit-cache \
        > /tmp/ac/server.log 2>&1 || rc=$?
    echo "server module exit $rc" | tee -a /tmp/ac/server.log
    cp /tmp/ac/server/gpu_suite.json "$out/gpu_suite_server_auto.json" || true
    cp /tmp/ac/server/jit-cache.tar.xz "$out/" 2>/dev/null || true
    tail -n 5 /tmp/ac/server.log
    ;;
tiny-auto-profile)
    out=${1:?outdir}
    commit=${2:?commit}
    mkdir -p "$out" /tmp/tp
    rc=0
    timeout 420 python3 benchmarks/profile_rounds.py --setups tiny --methods "${TAP_METHODS:-ddtree,auto}" \
        --budgets "${TAP_BUDGETS:-128}" --batch-size "${TAP_BATCH_SIZE:-4}" --steps 40 \
        --prompts-file runs/bench/humaneval_prompts.jsonl --commit "$commit" \
        --out /tmp/tp/profile > /tmp/tp/run.log 2>&1 || rc=$?
    echo "tiny auto profile exit $rc" >> /tmp/tp/run.log
    tar -cJf "$out/tiny_auto_profile.tar.xz" -C /tmp tp
    tail -n 12 /tmp/tp/run.log
    ;;
tiny-twins)
    # Two servers of each configuration started together (setup tiny and its copy tiny-b: DDTREE 128 and auto),
    # interleaved: how far identical servers lie apart on this host, and which trees two auto servers run (lease
    # 21b: x0.887 between two DDTREE 128 servers). TW_BATCH_SIZES (default 1), TW_REPEATS (3), TW_MINUTES (6.8).
    out=${1:?outdir}
    commit=${2:?commit}
    rm -rf /tmp/tw
    mkdir -p "$out" /tmp/tw
    rc=0
    CUDA_VISIBLE_DEVICES=0 timeout 540 python3 benchmarks/bench_budgets.py --setups tiny,tiny-b \
        --copy-setup tiny-b=tiny --set all.methods=ddtree,auto --set all.budgets=128 \
        --set all.batch_sizes="${TW_BATCH_SIZES:-1}" --set all.max_new_tokens=1024 --set all.warmup_new_tokens=128 \
        --set all.server_env=SGLANG_DDTREE_AUTO_LOG_EVERY=100 \
        --repeats "${TW_REPEATS:-3}" --prompt-groups 4 \
        --interleave --prompts-file runs/bench/humaneval_prompts.jsonl --max-minutes "${TW_MINUTES:-6.8}" \
        --out /tmp/tw/sweep --log-dir /tmp/tw/logs --commit "$commit" > /tmp/tw/run.log 2>&1 || rc=$?
    echo "tiny twins exit $rc" | tee -a /tmp/tw/run.log
    cp /tmp/tw/sweep/bench_budgets.jsonl "$out/sweep_twins.jsonl" || true
    tar -cJf "$out/tiny_twins_logs.tar.xz" -C /tmp tw/run.log tw/logs
    tail -n 8 /tmp/tw/run.log
    ;;
tiny-starts)
    # Lease 24: at a server's start the few rounds `auto`'s exploration times vary from server to server by more than
    # a chooser change moves them (one 16-tree read 5.4 ms in one server, 3.3 in its twin), so one server per arm is
    # one draw. Here TS_COPIES servers per arm (setups a1..aN with TS_ENV_A, b1..bN with TS_ENV_B, all `auto`) start
    # together with one DDTREE 128 server (setup tiny), pinned and interleaved as in tiny-paired, at TS_BATCH_SIZES
    # (default 1: the start is what is compared). Every copy's rounds over DDTREE 128 in paired_ratios.json; pool a
    # copy's ratios per arm. E.g. TS_ENV_B=SGLANG_DDTREE_AUTO_EXPLORE_ALL=1.
    out=${1:?outdir}
    commit=${2:?commit}
    rm -rf /tmp/ts
    mkdir -p "$out" /tmp/ts
    rc=0
    unpack_jit_cache
    setups=tiny
    copies=()
    for arm in ${TS_ARMS:-a b}; do  # TS_ARMS="a b c" adds a third arm (TS_ENV_C)
        env_var="TS_ENV_${arm^^}"
        env="SGLANG_DDTREE_AUTO_LOG_EVERY=100${!env_var:+,${!env_var}}"
        for i in $(seq 1 "${TS_COPIES:-3}"); do
            setups="$setups,$arm$i"
            copies+=(--copy-setup "$arm$i=tiny" --set "$arm$i.methods=auto" --set "$arm$i.server_env=$env")
        done
    done
    pinned_sweep /tmp/ts "${TS_TIMEOUT_S:-540}" "$commit" --setups "$setups" \
        "${copies[@]}" --set tiny.methods=ddtree --set all.budgets=128 \
        --set all.batch_sizes="${TS_BATCH_SIZES:-1}" --set all.max_new_tokens="${TS_NEW_TOKENS:-512}" \
        --server-cpus "${TS_CPUS:-2-9}" --repeats "${TS_REPEATS:-24}" --max-minutes "${TS_MINUTES:-14}" || rc=$?
    paired_outputs starts "$out" "$rc"
    ;;
tiny-ab)
    # Lease 31: the in-process A/B (SGLANG_DDTREE_AUTO_AB: an `auto` server alternating blocks of TA_BLOCK decode
    # rounds with the fixed 128-tree, each arm tallied apart), which the host's speed from run to run cannot move.
    # TA_ARMS: space-separated NAME:ENV (ENV comma-separated, may be empty), one `auto` server (setup tiny-NAME) per
    # arm, each against its own fixed arm; default ab (`auto` as it is) and f (held on the 128-tree: `auto`'s own
    # cost alone). With TA_RIVALS=1 (default) DFLASH and DDTREE 128 servers run
    # next to them (the cross-server ratios, as tiny-paired). Pinned, interleaved, prompts rotating, TA_REPEATS (20)
    # runs of TA_NEW_TOKENS (512) a row at TA_BATCH_SIZES (1,4,16,64); then benchmarks/paired_ratios.py over
    # DDTREE 128 (or, without rivals, the A/B table alone).
    out=${1:?outdir}
    commit=${2:?commit}
    rm -rf /tmp/ta
    mkdir -p "$out" /tmp/ta
    rc=0
    unpack_jit_cache
    # the chooser's log line (every TA_LOG_EVERY `auto` rounds, 1000; 100 before lease 39) is `auto`'s arm's own cost
    # in the A/B: its export and format take 63 us for one bucket on the dev CPU (auto_bookkeeping_cpu.json), an
    # estimated 0.5-2 ms with four buckets in the server, 5-20 us a round at 100 (the production default is 2000)
    ab="SGLANG_DDTREE_AUTO_LOG_EVERY=${TA_LOG_EVERY:-1000},SGLANG_DDTREE_AUTO_AB=${TA_BLOCK:-8}"
    arms=${TA_ARMS:-"ab: f:SGLANG_DDTREE_AUTO_FORCE=128"}
    setups=()
    copies=()
    if [ "${TA_RIVALS:-1}" = 1 ]; then
        setups=(tiny)
        copies=(--set tiny.methods=dflash,ddtree --set tiny.server_env=SGLANG_DDTREE_AUTO_LOG_EVERY=100)
    fi
    auto_arm_copies tiny tiny "$ab" $arms
    # TA_SETS: space-separated SETUP.FIELD=VALUE for bench_budgets.py's --set, after the arms' (lease 36: a longer
    # warm-up for some arms, e.g. TA_SETS="tiny-w1.warmup_new_tokens=640")
    for item in ${TA_SETS:-}; do
        copies+=(--set "$item")
    done
    list=$(IFS=,; echo "${setups[*]}")
    pinned_sweep /tmp/ta "${TA_TIMEOUT_S:-1080}" "$commit" --setups "$list" \
        "${copies[@]}" --set all.budgets=128 \
        --set all.batch_sizes="${TA_BATCH_SIZES:-1,4,16,64}" --set all.max_new_tokens="${TA_NEW_TOKENS:-512}" \
        --server-cpus "${TA_CPUS:-2-9}" --repeats "${TA_REPEATS:-20}" --max-minutes "${TA_MINUTES:-13}" || rc=$?
    paired_outputs ab "$out" "$rc"
    ;;
tiny-paired)
    # Lease 21: a ratio of two host-bound servers' medians moved by 3-11% with nothing different between them. Here
    # every server runs on the same vCPUs (--server-cpus), each round's runs send the same prompt (--rotate-prompts)
    # and the ratios are taken round by round with a 95% interval (sglang_ddtree/bench/paired.py).
    out=${1:?outdir}
    commit=${2:?commit}
    rm -rf /tmp/tp
    mkdir -p "$out" /tmp/tp
    rc=0
    unpack_jit_cache
    # TP_TWIN=0 leaves out the second setup (TP_TWIN_METHODS, default a DDTREE 128 twin and an `auto`, with
    # TP_TWIN_ENV, default none), for more rounds. TP_ENV: more server environment for setup tiny (e.g. an A/B:
    # TP_TWIN_METHODS=auto TP_TWIN_ENV=SGLANG_DDTREE_AUTO_FORCE=128: `auto` next to `auto` held on the 128-tree).
    # --set applies in order: the setups' server_env after all.server_env.
    # TP_TWIN_BASE=DIR (scripts/device/pack_base.sh COMMIT, carried in runs/bench): the twin setup's servers run
    # that commit's package, an A/B of two commits in one run (TP_TWIN_METHODS=auto: `tiny-b|auto` is the other
    # commit's auto). PYTHONSAFEPATH=1 because the servers start in the repository root and `python -m` puts it
    # before PYTHONPATH (lease 28's first try, PYTHONPATH alone, ran this checkout in both setups).
    if [ -n "${TP_TWIN_BASE:-}" ]; then
        base_dir=$(cd "$TP_TWIN_BASE" && pwd)
        base_env="PYTHONSAFEPATH=1,PYTHONPATH=$DDTREE_SITE:$base_dir"
        loaded=$(env PYTHONSAFEPATH=1 PYTHONPATH="$DDTREE_SITE:$base_dir" python3 -c \
                 'import sglang_ddtree; print(sglang_ddtree.__file__)')
        mkdir -p /tmp/tp/logs  # (returned in the logs' archive; each DDTREE server's log names its package too)
        echo "twin package: $loaded (commit $(cat "$base_dir/COMMIT" 2>/dev/null || echo unknown))" \
            | tee /tmp/tp/logs/twin_package.txt
        case "$loaded" in "$base_dir"/*) ;; *) echo "TP_TWIN_BASE: the twin would not load $base_dir"; exit 2;; esac
        TP_TWIN_ENV="${TP_TWIN_ENV:+$TP_TWIN_ENV,}$base_env"
    fi
    twin=(--setups tiny,tiny-b --copy-setup tiny-b=tiny --set "tiny-b.methods=${TP_TWIN_METHODS:-ddtree,auto}"
          --set tiny-b.budgets=128)
    twin_env=(--set "tiny-b.server_env=SGLANG_DDTREE_AUTO_LOG_EVERY=100${TP_TWIN_ENV:+,$TP_TWIN_ENV}")
    [ "${TP_TWIN:-1}" = 1 ] || { twin=(--setups tiny); twin_env=(); }
    main_env=()
    [ -z "${TP_ENV:-}" ] || main_env=(--set "tiny.server_env=SGLANG_DDTREE_AUTO_LOG_EVERY=100,$TP_ENV")
    pinned_sweep /tmp/tp "${TP_TIMEOUT_S:-1080}" "$commit" "${twin[@]}" \
        --set tiny.methods="${TP_METHODS:-dflash,ddtree,auto}" --set tiny.budgets="${TP_BUDGETS:-32,128}" \
        --set all.batch_sizes="${TP_BATCH_SIZES:-1,4,16,64}" --set all.max_new_tokens="${TP_NEW_TOKENS:-512}" \
        --set all.server_env=SGLANG_DDTREE_AUTO_LOG_EVERY=100 "${main_env[@]}" "${twin_env[@]}" \
        --server-cpus "${TP_CPUS:-2-9}" --repeats "${TP_REPEATS:-30}" --max-minutes "${TP_MINUTES:-17}" || rc=$?
    paired_outputs paired "$out" "$rc"
    ;;
detach)
    name=${1:?name}
    shift
    rm -rf "/tmp/detached/$name" "/tmp/detached/$name.rc"
    mkdir -p "/tmp/detached/$name"
    cp -a . "/tmp/detached/$name/repo"
    printf -v args '%q ' "$@"
    setsid bash -c "cd /tmp/detached/$name/repo && source scripts/device/env.sh \
        && bash scripts/device/lease_steps.sh $args > /tmp/detached/$name.log 2>&1; echo \$? > /tmp/detached/$name.rc" \
        < /dev/null > /dev/null 2>&1 &
    sleep 3
    tail -n 3 "/tmp/detached/$name.log" 2>/dev/null || true  # (not written yet when the step is slow to start)
    ;;
wait-detached)
    name=${1:?name}
    wait_s=${2:?wait seconds}
    for _ in $(seq 1 "$wait_s"); do [ -f "/tmp/detached/$name.rc" ] && break; sleep 1; done
    tail -n 8 "/tmp/detached/$name.log"
    [ -f "/tmp/detached/$name.rc" ] || { echo "$name still running"; exit 3; }
    echo "$name exit $(cat "/tmp/detached/$name.rc")"
    ;;
host-profile)
    out=${1:?outdir}
    commit=${2:?commit}
    rm -rf /tmp/hp
    mkdir -p "$out" /tmp/hp
    unpack_jit_cache  # lease 27's bench call without it: servers ready in 141-155 s, not ~50
    rc=0
    CUDA_VISIBLE_DEVICES=0 timeout 420 python3 benchmarks/bench_budgets.py --setups tiny \
        --set "tiny.methods=${HP_METHODS:-dflash,ddtree,auto}" --set "tiny.budgets=${HP_BUDGETS:-16,128}" \
        --set "tiny.batch_sizes=${HP_BATCH_SIZE:-4}" \
        --set tiny.max_new_tokens=1024 --set tiny.warmup_new_tokens=128 \
        --set tiny.server_env=SGLANG_DDTREE_HOST_PROFILE=/tmp/hp,SGLANG_DDTREE_HOST_PROFILE_ROUNDS=300:600 \
        --repeats 2 --prompt-groups 4 --interleave --prompts-file runs/bench/humaneval_prompts.jsonl \
        --max-minutes 6.5 --out /tmp/hp/sweep --log-dir /tmp/hp/sweep/logs --commit "$commit" > /tmp/hp/run.log \
        2>&1 || rc=$?
    echo "host profile sweep exit $rc" >> /tmp/hp/run.log
    ls /tmp/hp/*.txt 2>/dev/null | tee -a /tmp/hp/run.log
    tar -cJf "$out/host_profile.tar.xz" -C /tmp hp
    tail -n 8 /tmp/hp/run.log
    ;;
auto-8b)
    # The 8B shapes' check of `auto` knobs (lease 30's sweep_auto_8b command, with arms): GPU-bound, DFLASH is the
    # rival there, so each arm is read against the DFLASH server of the same interleaved run.
    out=${1:?outdir}
    commit=${2:?commit}
    rm -rf /tmp/a8
    mkdir -p "$out" /tmp/a8
    rc=0
    unpack_jit_cache
    setups=(8b-dummy)
    copies=()
    auto_arm_copies 8b 8b-dummy SGLANG_DDTREE_AUTO_LOG_EVERY=100 ${A8_ARMS:-}
    list=$(IFS=,; echo "${setups[*]}")
    CUDA_VISIBLE_DEVICES=0 timeout "${A8_TIMEOUT_S:-480}" python3 benchmarks/bench_budgets.py --setups "$list" \
        ${copies[@]+"${copies[@]}"} --set 8b-dummy.methods=dflash,auto \
        --set all.batch_sizes="${A8_BATCH_SIZES:-1,4,16,64}" --set all.graph_token_cap=8300 \
        --set 8b-dummy.server_env=SGLANG_DDTREE_AUTO_LOG_EVERY=100 --repeats "${A8_REPEATS:-6}" --prompt-groups 4 \
        --interleave --max-minutes "${A8_MINUTES:-6.8}" --out /tmp/a8/sweep --log-dir /tmp/a8/logs \
        --commit "$commit" > /tmp/a8/run.log 2>&1 || rc=$?
    echo "8b sweep exit $rc" | tee -a /tmp/a8/run.log
    cp /tmp/a8/sweep/bench_budgets.jsonl "$out/sweep_auto_8b.jsonl" || true
    python3 benchmarks/paired_ratios.py /tmp/a8/sweep/bench_budgets.jsonl --base "8b-dummy|dflash" \
        --json "$out/paired_ratios_8b.json" 2>&1 | tee -a /tmp/a8/run.log || true
    tar -cJf "$out/auto_8b_logs.tar.xz" -C /tmp a8/run.log a8/logs 2>/dev/null || true
    tail -n 30 /tmp/a8/run.log
    ;;
auto-final)
    # Issue 10's judging run after lease 18 (detach it, ~20 min): the server module (greedy equality with auto's
    # bucket captures and policy), then the tiny pair ALONE (DFLASH, DDTREE 32 / 128, auto, interleaved, batch
    # 1 / 4 / 16 / 64, 1024 tokens, AF_REPEATS repeats), then 8B shapes (DFLASH and auto, interleaved, batch
    # 1 / 4 / 16 / 64, decode graphs at 64 too). AF_SKIP_SERVER=1 leaves the server module out.
    out=${1:?outdir}
    commit=${2:?commit}
    rm -rf /tmp/af
    mkdir -p "$out" /tmp/af
    rc=0
    if [ "${AF_SKIP_SERVER:-0}" != 1 ]; then
        python3 scripts/device/run_gpu_suite.py tests/gpu/test_ddtree_server.py --out /tmp/af/server \
            --deadline-s "${AF_SERVER_S:-420}" --jit-cache .device-cache/jit/jit-cache.tar.xz \
            > /tmp/af/server.log 2>&1 || rc=$?
        echo "server module exit $rc" | tee -a /tmp/af/server.log
        cp /tmp/af/server/gpu_suite.json "$out/gpu_suite_server.json" || true
    fi
    rc=0
    if [ "${AF_SKIP_TINY:-0}" != 1 ]; then
    ab=()
    if [ "${AF_NOCAL_AB:-0}" = 1 ]; then  # auto without the calibration table next to it, interleaved in one run
        ab=(--copy-setup tiny-nocal=tiny --set tiny-nocal.methods=auto
            --set tiny-nocal.server_args=--speculative-ddtree-auto-calibration,off
            --set tiny-nocal.server_env=SGLANG_DDTREE_AUTO_LOG_EVERY=100)
    fi
    # all.*: what a copied setup shares (a copy is taken before the --set changes)
    CUDA_VISIBLE_DEVICES=0 timeout 800 python3 benchmarks/bench_budgets.py --setups "tiny${ab:+,tiny-nocal}" \
        ${ab[@]+"${ab[@]}"} \
        --set tiny.methods=dflash,ddtree,auto --set tiny.budgets=32,128 --set all.batch_sizes=1,4,16,64 \
        --set all.max_new_tokens=1024 --set all.warmup_new_tokens=128 --repeats "${AF_REPEATS:-4}" \
        --set tiny.server_env=SGLANG_DDTREE_AUTO_LOG_EVERY=100 \
        --prompt-groups 4 --interleave --prompts-file runs/bench/humaneval_prompts.jsonl \
        --max-minutes "${AF_TINY_MINUTES:-11}" --out /tmp/af/tiny --log-dir /tmp/af/tiny/logs --commit "$commit" \
        > /tmp/af/tiny.log 2>&1 || rc=$?
    echo "tiny sweep exit $rc" | tee -a /tmp/af/tiny.log
    cp /tmp/af/tiny/bench_budgets.jsonl "$out/sweep_tiny.jsonl" || true
    fi
    rc=0
    CUDA_VISIBLE_DEVICES=0 timeout 480 python3 benchmarks/bench_budgets.py --setups 8b-dummy \
        --set 8b-dummy.methods=dflash,auto --set 8b-dummy.batch_sizes="${AF_8B_BATCH_SIZES:-1,4,16,64}" \
        --set 8b-dummy.graph_token_cap=8300 --set 8b-dummy.server_env=SGLANG_DDTREE_AUTO_LOG_EVERY=100 \
        --repeats 3 --prompt-groups 4 --interleave \
        --max-minutes "${AF_8B_MINUTES:-7}" --out /tmp/af/8b --log-dir /tmp/af/8b/logs --commit "$commit" \
        > /tmp/af/8b.log 2>&1 || rc=$?
    echo "8b sweep exit $rc" | tee -a /tmp/af/8b.log
    cp /tmp/af/8b/bench_budgets.jsonl "$out/sweep_8b.jsonl" || true
    grep -h "captured together\|after the bucket's stages" /tmp/af/tiny/logs/*auto*.log /tmp/af/8b/logs/*auto*.log \
        > /tmp/af/captures.txt 2>/dev/null || true
    tar -cJf "$out/auto_final_logs.tar.xz" -C /tmp af/server.log af/tiny.log af/8b.log af/captures.txt af/tiny/logs \
        af/8b/logs 2>/dev/null || tar -cJf "$out/auto_final_logs.tar.xz" -C /tmp af/tiny.log
    tail -n 10 /tmp/af/tiny.log /tmp/af/8b.log
    ;;
*)
    echo "unknown step $step" >&2
    exit 2
    ;;
esac
