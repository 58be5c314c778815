#!/usr/bin/env bash
# The hybrid pair on the GPU machine (docs/gpu-suite.md, "The hybrid pair"): the tiny gated-delta-net hybrid pair,
# trained there (setup tiny-hybrid, models/tiny-hybrid, git-ignored), and its widening to Qwen3.5-27B shapes (setup
# 27b-hybrid, runs/27b-hybrid, built there), swept and checked. From the repo root, after the install chunks:
#
#   bash scripts/device/hybrid.sh train OUT COMMIT [train_tiny_pair.py args...]
#       scripts/train_tiny_pair.py --target-arch qwen3_5_text with its default budgets (~6 min; needs .cache/corpus,
#       built here by scripts/build_corpus.py: carry it) into models/tiny-hybrid, kept there while the machine is
#       warm; then the pair (~37 MB) as a tar.xz in parts of at most 16 MB (the tool returns files of at most 16 MiB),
#       OUT/tiny-hybrid-partK/{tiny-hybrid.tar.xz.part-K-of-N, parts.json} (scripts/device/split_chunk.py's layout),
#       with OUT/train.log and OUT/training_log.json. Here, afterwards (F: the call's files_at):
#           rm -rf .device-cache/tiny-hybrid-part* && cp -r F/tiny-hybrid-part* .device-cache/
#           bash scripts/device/hybrid.sh restore .device-cache/tiny-hybrid-part*
#       (joins the parts, checks the archive's sha256, unpacks models/tiny-hybrid). Keep the part folders: a later
#       machine gets the pair back with one `restore .device-cache/tiny-hybrid-partK` call per part (carry that
#       folder; each is ~16 MB next to the ~41 MiB tree), instead of training again.
#   bash scripts/device/hybrid.sh restore PART_DIR...
#       install_chunk.sh's part handling into /tmp/hybrid/restore; once the last part is in, the pair replaces
#       models/tiny-hybrid. Runs here or on the device (no SGLang needed).
#   bash scripts/device/hybrid.sh sweep OUT COMMIT NAME MINUTES [bench_budgets args...]
#       the budget sweep, `--setups tiny-hybrid` unless the args name others (`--setups 27b-hybrid`: run `widen`
#       first, in its own call); resumable: a second call with the same NAME continues the same results file (kept
#       in /tmp/hybrid while the machine is warm); copies the JSONL, the sweep's log and a tarball of the server logs
#       into OUT
#   bash scripts/device/hybrid.sh lossless OUT COMMIT BACKEND [PAIR]
#       tests/gpu/test_real8b.py on PAIR (tiny-hybrid, the default, or 27b-hybrid): greedy == plain up to ties at
#       B 16 / 64 and the in-server oracle (27b-hybrid: B 16 and its oracle, the servers one at a time, plain first),
#       and the KV-leak check; results in OUT/lossless_PAIR_BACKEND
#   bash scripts/device/hybrid.sh widen OUT
#       runs/27b-hybrid from models/tiny-hybrid (python -m sglang_ddtree.widen_hybrid --if-missing: 57.3 GB of bf16,
#       refused before anything is written when the disk has no room; the device disk is 64 GiB); OUT/widen.log
#
# sweep and lossless need `runs/bench/humaneval_prompts.jsonl` (bench_budgets.py --write-prompts; carry runs/bench).
set -uo pipefail
step=${1:?step (train, restore, sweep, lossless, widen)}
shift
cd "$(dirname "$0")/../.."
SMALL=models/tiny-hybrid
BIG=runs/27b-hybrid
TMP=${HYBRID_TMP:-/tmp/hybrid}  # workspaces (tests point it elsewhere)

restore() {  # PART_DIR...: the pair's archive parts (split_chunk.py layout) -> models/tiny-hybrid when complete
    DDTREE_SITE=$TMP/restore bash scripts/device/install_chunk.sh "$@" || return 1
    if [ -d "$TMP/restore/tiny-hybrid" ]; then
        rm -rf "$SMALL"
        mkdir -p "$(dirname "$SMALL")"
        mv "$TMP/restore/tiny-hybrid" "$SMALL"
        rm -f "$TMP/restore/.ddtree-chunks/tiny-hybrid.sha256"  # a later restore unpacks again
        echo "restored $SMALL: $(du -sh "$SMALL" | cut -f1)"
    fi
}

widen_27b() {  # LOG: runs/27b-hybrid when missing (the disk checked first)
    mkdir -p "$(dirname "$BIG")"
    # /dev/shm too: runs/27b-hybrid may be a link to a RAM-backed folder, which loads faster than the disk and leaves
    # it to the site (docs/gpu-suite.md §7)
    df -h "$(dirname "$BIG")/" /dev/shm 2>/dev/null | tee -a "$1"
    local t0=$SECONDS rc=0
    python3 -m sglang_ddtree.widen_hybrid --shape qwen3.5-27b --small "$SMALL" --out "$BIG" --if-missing \
        >> "$1" 2>&1 || rc=$?
    echo "widen exit $rc after $((SECONDS - t0)) s" | tee -a "$1"
    tail -n 5 "$1"
    return $rc
}

if [ "$step" = restore ]; then
    [ "$#" -ge 1 ] || { echo "restore needs the part folders (tiny-hybrid-partK)" >&2; exit 2; }
    restore "$@"
    exit $?
fi
out=${1:?outdir}
mkdir -p "$out" "$TMP"
source scripts/device/env.sh

case "$step" in
train)
    commit=${2:?commit}
    shift 2
    export DDTREE_COMMIT=$commit
    ws=$TMP/train
    rm -rf "$ws"
    mkdir -p "$ws"
    if [ ! -f .cache/corpus/manifest.json ]; then
        echo "no .cache/corpus: build it on the CPU (python scripts/build_corpus.py) and carry .cache/corpus" >&2
        exit 2
    fi
    rc=0
    timeout "${TRAIN_TIMEOUT_S:-500}" python3 scripts/train_tiny_pair.py --target-arch qwen3_5_text \
        --data .cache/corpus --out "$SMALL" --device cuda "$@" > "$ws/train.log" 2>&1 || rc=$?
    echo "train exit $rc" >> "$ws/train.log"
    cp "$ws/train.log" "$out/train.log"
    cp "$SMALL/training_log.json" "$out/training_log.json" 2>/dev/null
    if [ "$rc" = 0 ]; then
        mkdir -p "$ws/tiny-hybrid"
        tar -C "$(dirname "$SMALL")" -cf - "$(basename "$SMALL")" | xz -T0 -6 > "$ws/tiny-hybrid/tiny-hybrid.tar.xz"
        python3 scripts/device/split_chunk.py "$ws/tiny-hybrid" --part-mb 16 > /dev/null || rc=$?
        cp -r "$ws"/tiny-hybrid-part* "$out"/ || rc=$?
        ls -l "$ws/tiny-hybrid" "$out"/tiny-hybrid-part*
    fi
    tail -n 25 "$ws/train.log"
    exit $rc
    ;;
sweep)
    commit=${2:?commit}
    name=${3:?name}
    minutes=${4:?minutes}
    shift 4
    export DDTREE_COMMIT=$commit
    ws=$TMP/$name
    mkdir -p "$ws"
    case " $* " in *27b-hybrid*) widen_27b "$ws/widen.log" || exit $? ;; esac
    timeout $(( ${minutes%.*} * 60 + 90 )) python3 benchmarks/bench_budgets.py --setups tiny-hybrid \
        --prompts-file runs/bench/humaneval_prompts.jsonl --out "$ws/sweep" --log-dir "$ws/logs" \
        --commit "$commit" --max-minutes "$minutes" --interleave "$@" >> "$ws/run.log" 2>&1
    rc=$?
    cp "$ws/sweep/bench_budgets.jsonl" "$out/sweep_${name}.jsonl" 2>/dev/null
    cp "$ws/run.log" "$out/sweep_${name}.log"
    tar -C "$ws" -cJf "$out/logs_${name}.tar.xz" logs 2>/dev/null
    tail -n 30 "$ws/run.log"
    exit $rc
    ;;
lossless)
    commit=${2:?commit}
    backend=${3:-triton}
    pair=${4:-tiny-hybrid}
    export DDTREE_COMMIT=$commit
    case "$pair" in
    tiny-hybrid) ;;
    27b-hybrid)
        widen_27b "$out/widen.log" || exit $?
        ;;
    *) echo "lossless: PAIR must be tiny-hybrid or 27b-hybrid, got $pair" >&2; exit 2 ;;
    esac
    jit=()
    [ -f .device-cache/jit/jit-cache.tar.xz ] && jit=(--jit-cache .device-cache/jit/jit-cache.tar.xz)
    DDTREE_GPU_MODELS=$pair DDTREE_GPU_BACKEND=$backend python3 scripts/device/run_gpu_suite.py \
        tests/gpu/test_real8b.py --deadline-s "${DEADLINE_S:-540}" --out "$out/lossless_${pair}_$backend" \
        ${jit[@]+"${jit[@]}"}
    ;;
widen)
    widen_27b "$out/widen.log"
    ;;
*)
    echo "unknown step $step (train, restore, sweep, lossless, widen)" >&2
    exit 2
    ;;
esac
