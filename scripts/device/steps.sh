#!/usr/bin/env bash
# Device steps that run next to (or instead of) the GPU suite (docs/gpu-suite.md). From the repo root on the
# device, after `source scripts/device/env.sh`:
#   bash scripts/device/steps.sh train-bg GPU [train_tiny_pair.py args...]   # train the tiny pair, detached
#   bash scripts/device/steps.sh use-new-drafter [OUTDIR]                   # wait for train-bg, swap its drafter in
#   bash scripts/device/steps.sh bench-tree GPU OUTDIR                      # every tree-stage variant timed
#   bash scripts/device/steps.sh parallel OUTDIR 'commands for GPU 0' 'commands for GPU 1'
#        two independent jobs side by side, each seeing one GPU, logs OUTDIR/gpu<N>.log; exit 1 when either failed
#   bash scripts/device/steps.sh kernel-checks OUTDIR COMMIT [WAIT_S]   # one GPU, ~8 min: core + kernel GPU tests,
#        then kernel-bench (KC_BENCH=0: the tests only)
#   bash scripts/device/steps.sh kernel-bench OUTDIR COMMIT   # one GPU, alone: bench_tree's production stages with
#        an unsure (randn x 4) and a confident (randn x 12) drafter; BASE_KERNELS=PATH BASE_COMMIT=SHA also times
#        batch 1 with that kernels package (or an older commit's kernels.py) in the same run (judge a change by the
#        ratio)
#   bash scripts/device/steps.sh hybrid-oracle OUTDIR   # one GPU, ~7 min: the hybrid module, fast and oracle
#        servers at B = 16, 64 and 256 eager
#   bash scripts/device/steps.sh tiny-paired OUTDIR COMMIT   # one GPU, alone, ~10 min (detach it): the tiny pair's
#        DFLASH, DDTREE 32 / 128 and `auto` plus a twin setup (tiny-b: TP_TWIN_METHODS, TP_TWIN_ENV), every server
#        pinned to TP_CPUS (2-9), interleaved, prompts rotating, TP_REPEATS (30) runs of TP_NEW_TOKENS (512) per
#        batch size of TP_BATCH_SIZES (1,4,16,64); ratios run by run over DDTREE 128 (benchmarks/paired_ratios.py).
#        TP_TWIN_BASE=DIR (scripts/device/pack_base.sh COMMIT, under runs/bench): the twin runs that commit's package
#   bash scripts/device/steps.sh tiny-ab OUTDIR COMMIT   # one GPU, alone, ~7 min (detach it): the in-process A/B
#        (SGLANG_DDTREE_AUTO_AB) of `auto` servers (TA_ARMS: NAME:ENV ...), each against its own fixed 128-tree arm,
#        next to DFLASH and DDTREE 128 (TA_RIVALS=0: without)
#   bash scripts/device/steps.sh auto-8b OUTDIR COMMIT   # one GPU, ~4-6 min: DFLASH and `auto` at 8B shapes,
#        interleaved, batch A8_BATCH_SIZES (1,4,16,64), A8_REPEATS (6) x 4 prompt groups, plus one `auto` server per
#        A8_ARMS entry (NAME:ENV); ratios over DFLASH
#   bash scripts/device/steps.sh host-profile OUTDIR COMMIT   # one GPU, alone, ~6 min: a cProfile of each tiny-pair
#        server's decode loop (SGLANG_DDTREE_HOST_PROFILE) at batch HP_BATCH_SIZE (4); its tokens/s are no result
#   bash scripts/device/steps.sh detach NAME STEP [ARGS...]   # any step, detached (outlives the call), from a copy
#        of the repo in /tmp/detached/NAME/repo; log /tmp/detached/NAME.log, exit status NAME.rc
#   bash scripts/device/steps.sh wait-detached NAME WAIT_S   # waits up to WAIT_S; exit 3 while it runs
set -euo pipefail
step=${1:?step}
shift
TRAIN=/tmp/train

kernel_bench() {  # COMMIT: bench_tree's production stages (triton_fused), unsure and confident drafts, into /tmp/kc
    # KC_BATCH_SIZES (default 1,8,32). BASE_KERNELS=PATH (the kernels of an earlier commit, BASE_COMMIT): the same
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
    rm -rf /tmp/kbase/sglang_ddtree/kernels /tmp/kbase/sglang_ddtree/kernels.py
    if [ -d "$BASE_KERNELS" ]; then cp -r "$BASE_KERNELS" /tmp/kbase/sglang_ddtree/kernels
    else cp "$BASE_KERNELS" /tmp/kbase/sglang_ddtree/kernels.py; fi
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
    # (run_gpu_suite.py does this with a version check; without it a server starts in ~115 s instead of ~50-70)
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
bench-tree)
    gpu=${1:?gpu}
    out=${2:?outdir}
    mkdir -p "$out"
    export CUDA_VISIBLE_DEVICES=$gpu
    # ${DDTREE_COMMIT:-}: the device copy's git HEAD can be stale; export DDTREE_COMMIT=<sha> before this step
    # ${DDTREE_BENCH_IMPLS}: a shorter list when the call has no time for all
    python3 benchmarks/bench_tree.py --device cuda \
        --impls "${DDTREE_BENCH_IMPLS:-triton,triton_select,triton_fused}" \
        --budgets 16,32,64,128,256,512,1024 --batch-sizes 1,8,32 --repeats 30 --out "$out/tree_kernels.json" \
        ${DDTREE_COMMIT:+--commit "$DDTREE_COMMIT"}
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
    # compile once). Each part records its exit status; one archive. KC_BENCH=0: the tests only (when the
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
tiny-paired)
    # A ratio of two host-bound servers' medians moves by 3-11% with nothing different between them. Here
    # every server runs on the same vCPUs (--server-cpus), each round's runs send the same prompt (--rotate-prompts)
    # and the ratios are taken round by round with a 95% interval (ddtree_bench/paired.py).
    out=${1:?outdir}
    commit=${2:?commit}
    rm -rf /tmp/tp
    mkdir -p "$out" /tmp/tp
    rc=0
    unpack_jit_cache
    # TP_TWIN=0 leaves out the second setup (TP_TWIN_METHODS, default a DDTREE 128 twin and an `auto`, with
    # TP_TWIN_ENV, default none: a plain twin), for more rounds. TP_ENV: more server environment for setup tiny (e.g. an A/B:
    # TP_TWIN_METHODS=auto TP_TWIN_ENV=SGLANG_DDTREE_AUTO_WARM_ROUNDS=0: `auto` at the default next to a knob).
    # --set applies in order: the setups' server_env after all.server_env.
    # TP_TWIN_BASE=DIR (scripts/device/pack_base.sh COMMIT, carried in runs/bench): the twin setup's servers run
    # that commit's package, an A/B of two commits in one run (TP_TWIN_METHODS=auto: `tiny-b|auto` is the other
    # commit's auto). PYTHONSAFEPATH=1 because the servers start in the repository root and `python -m` puts it
    # before PYTHONPATH (PYTHONPATH alone runs this checkout in both setups).
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
tiny-ab)
    # The in-process A/B (SGLANG_DDTREE_AUTO_AB: an `auto` server alternating blocks of TA_BLOCK decode
    # rounds with the fixed 128-tree, each arm tallied apart), which the host's speed from run to run cannot move.
    # TA_ARMS: space-separated NAME:ENV (ENV comma-separated, may be empty), one `auto` server (setup tiny-NAME) per
    # arm, each against its own fixed arm; default ab (`auto` as it is), f (held on the 128-tree: `auto`'s own cost
    # alone). With TA_RIVALS=1 (default) DFLASH and DDTREE 128 servers run
    # next to them (the cross-server ratios, as tiny-paired). Pinned, interleaved, prompts rotating, TA_REPEATS (20)
    # runs of TA_NEW_TOKENS (512) a row at TA_BATCH_SIZES (1,4,16,64); then benchmarks/paired_ratios.py over
    # DDTREE 128 (or, without rivals, the A/B table alone).
    out=${1:?outdir}
    commit=${2:?commit}
    rm -rf /tmp/ta
    mkdir -p "$out" /tmp/ta
    rc=0
    unpack_jit_cache
    # the chooser's log line (every TA_LOG_EVERY `auto` rounds, 1000) is `auto`'s arm's own cost
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
    # TA_SETS: space-separated SETUP.FIELD=VALUE for bench_budgets.py's --set, after the arms' (e.g. a longer
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
auto-8b)
    # The 8B shapes' check of `auto` knobs: GPU-bound, DFLASH is the
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
host-profile)
    out=${1:?outdir}
    commit=${2:?commit}
    rm -rf /tmp/hp
    mkdir -p "$out" /tmp/hp
    unpack_jit_cache  # without it servers are ready in 141-155 s, not ~50
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
detach)
    name=${1:?name}
    shift
    rm -rf "/tmp/detached/$name" "/tmp/detached/$name.rc"
    mkdir -p "/tmp/detached/$name"
    cp -a . "/tmp/detached/$name/repo"
    printf -v args '%q ' "$@"
    setsid bash -c "cd /tmp/detached/$name/repo && source scripts/device/env.sh \
        && bash scripts/device/steps.sh $args > /tmp/detached/$name.log 2>&1; echo \$? > /tmp/detached/$name.rc" \
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
*)
    echo "unknown step $step" >&2
    exit 2
    ;;
esac
