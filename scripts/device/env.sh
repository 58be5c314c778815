# Source on the GPU machine after the chunks are in:   source scripts/device/env.sh
#
# - PYTHONPATH=$DDTREE_SITE:<repo>: the carried site dir (sglang, sgl_kernel, transformers 5.12.1, ...) comes
#   before the image's site-packages, so its pinned versions win; the repo root makes `sglang_ddtree` importable
#   straight from the working tree.
# - Writes $DDTREE_SITE/sglang_ddtree-<version>.dist-info from pyproject.toml (write_dist_info.py), so
#   importlib.metadata sees the project and SGLang loads our `sglang.srt.plugins` entry point.
# - Points every JIT cache under $DDTREE_JIT_ROOT (default /tmp/jit) so run_gpu_suite.py can return it in one
#   archive and restore it on the next machine.
# - Offline: nothing can be fetched there, so Hugging Face libraries must not try.

# bash knows where this file is; a plain sh does not, and then the repo root must be the working directory.
if [ -n "${BASH_SOURCE:-}" ]; then
    _ddtree_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
else
    _ddtree_here=$PWD/scripts/device
fi
export DDTREE_REPO=$(cd "$_ddtree_here/../.." && pwd)
export DDTREE_SITE=${DDTREE_SITE:-/tmp/site}
export DDTREE_JIT_ROOT=${DDTREE_JIT_ROOT:-/tmp/jit}

case ":${PYTHONPATH:-}:" in
    *":$DDTREE_SITE:"*) ;;
    *) export PYTHONPATH="$DDTREE_SITE:$DDTREE_REPO${PYTHONPATH:+:$PYTHONPATH}" ;;
esac

# JIT caches: flashinfer uses $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer; SGLang's tvm-ffi kernels
# $TVM_FFI_CACHE_DIR; Triton $TRITON_CACHE_DIR; torch.compile $TORCHINDUCTOR_CACHE_DIR; the driver's PTX JIT
# $CUDA_CACHE_PATH.
export FLASHINFER_WORKSPACE_BASE=$DDTREE_JIT_ROOT/flashinfer
export TVM_FFI_CACHE_DIR=$DDTREE_JIT_ROOT/tvm-ffi
export TRITON_CACHE_DIR=$DDTREE_JIT_ROOT/triton
export TORCHINDUCTOR_CACHE_DIR=$DDTREE_JIT_ROOT/inductor
export CUDA_CACHE_PATH=$DDTREE_JIT_ROOT/nv-compute
mkdir -p "$DDTREE_SITE" "$FLASHINFER_WORKSPACE_BASE" "$TVM_FFI_CACHE_DIR" "$TRITON_CACHE_DIR" \
    "$TORCHINDUCTOR_CACHE_DIR" "$CUDA_CACHE_PATH"

# JIT builds call nvcc and ninja by name (tvm_ffi/cpp/extension.py, flashinfer/jit/cpp_ext.py).
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH=/usr/local/cuda/bin:$PATH
fi
if [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then
    export CUDA_HOME=/usr/local/cuda
fi
if ! command -v ninja >/dev/null 2>&1; then
    _ddtree_ninja=$(python3 -c 'import ninja; print(ninja.BIN_DIR)' 2>/dev/null) \
        && export PATH=$_ddtree_ninja:$PATH
    unset _ddtree_ninja
fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export PYTHONUNBUFFERED=1

python3 "$_ddtree_here/write_dist_info.py" "$DDTREE_SITE" >/dev/null \
    || echo "env.sh: warning: could not write the sglang-ddtree dist-info into $DDTREE_SITE" >&2
unset _ddtree_here
