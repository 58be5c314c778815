#!/usr/bin/env bash
# Real-size runs on the GPU machine (after the install chunks): the widened Qwen3-8B-shaped pair (setup 8b-real,
# built into runs/8b-real by sglang_ddtree.widen on first use) swept and checked.
#
#   bash scripts/device/real8b.sh sweep OUT COMMIT NAME MINUTES [bench_budgets args...]
#       the budget sweep (`--setups 8b-real` unless the args name others: the last --setups wins; `--copy-setup
#       8b-real-fi=8b-real --set 8b-real-fi.backend=flashinfer` adds flashinfer); resumable: a second call with the
#       same NAME continues the same results file (kept in /tmp/real8b while the machine is warm); copies the JSONL,
#       the sweep's log and a tarball of the server logs into OUT
#   bash scripts/device/real8b.sh lossless OUT COMMIT BACKEND
#       tests/gpu/test_real8b.py: greedy == plain up to ties at B 16/64/256, batch 1 and 16, and the KV-leak check
#   bash scripts/device/real8b.sh profile OUT COMMIT NAME [profile_rounds args...]
#       torch-profiler traces of DFLASH and DDTREE rounds on 8b-real (benchmarks/profile_rounds.py; default
#       --methods dflash,ddtree --budgets 16,64, batch 1): where a tree round's extra time over a chain round goes
#
# Needs `runs/bench/humaneval_prompts.jsonl` (bench_budgets.py --write-prompts; carry runs/bench).
set -uo pipefail
step=${1:?step}
out=${2:?outdir}
commit=${3:?commit}
backend=${4:-triton}  # sweep: the workspace name; lossless: the attention backend
shift 4 || shift $#
cd "$(dirname "$0")/../.."
source scripts/device/env.sh
mkdir -p "$out" /tmp/real8b
ws=/tmp/real8b/$backend
mkdir -p "$ws"
export DDTREE_COMMIT=$commit

case "$step" in
sweep)
    minutes=${1:?minutes}
    shift
    python3 -m sglang_ddtree.widen --shape qwen3-8b --out runs/8b-real --if-missing || exit 1
    timeout $(( ${minutes%.*} * 60 + 90 )) python3 benchmarks/bench_budgets.py \
        --prompts-file runs/bench/humaneval_prompts.jsonl --out "$ws/sweep" --log-dir "$ws/logs" \
        --commit "$commit" --max-minutes "$minutes" --interleave --setups 8b-real "$@" >> "$ws/run.log" 2>&1
    rc=$?
    cp "$ws/sweep/bench_budgets.jsonl" "$out/sweep_${backend}.jsonl" 2>/dev/null
    cp "$ws/run.log" "$out/sweep_${backend}.log"
    tar -C "$ws" -cJf "$out/logs_${backend}.tar.xz" logs 2>/dev/null
    tail -30 "$ws/run.log"
    exit $rc
    ;;
lossless)
    python3 -m sglang_ddtree.widen --shape qwen3-8b --out runs/8b-real --if-missing || exit 1
    DDTREE_GPU_MODELS=8b-real DDTREE_GPU_BACKEND=$backend python3 scripts/device/run_gpu_suite.py \
        tests/gpu/test_real8b.py --deadline-s "${DEADLINE_S:-540}" --out "$out/lossless_$backend"
    ;;
profile)
    python3 -m sglang_ddtree.widen --shape qwen3-8b --out runs/8b-real --if-missing || exit 1
    python3 benchmarks/profile_rounds.py --out "$out/profile_$backend" --setups 8b-real --methods dflash,ddtree \
        --budgets 16,64 --prompts-file runs/bench/humaneval_prompts.jsonl --commit "$commit" "$@"
    ;;
*)
    echo "unknown step $step (sweep, lossless, profile)" >&2
    exit 2
    ;;
esac
