"""The tree-build Triton kernel compiles for the H200 (sm_90) on this CPU machine: Triton's front end and the
bundled ptxas need no GPU. The interpreter (tests/test_kernels.py) checks what the kernels compute but accepts code
the compiler refuses (e.g. a loop-carried value whose type changes in the loop), and such an error would otherwise
first show on a GPU machine."""

import shutil
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")


def _ptxas_available() -> bool:
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return bundled.exists() or shutil.which("ptxas") is not None


pytestmark = pytest.mark.skipif(not _ptxas_available(), reason="no ptxas for an ahead-of-time sm_90 compile")

SIGNATURE = {"values_ptr": "*fp32", "tokens_ptr": "*i64", "pair_parent_ptr": "*i32", "pair_rank_ptr": "*i32",
             "budget_ptr": "*i64", "root_ptr": "*i64", "log_prune": "fp32", "scratch_ptr": "*i64",
             "lvl_key_ptr": "*i64", "lvl_parent_ptr": "*i32", "lvl_rank_ptr": "*i32", "inv_ptr": "*i32",
             "out_tokens_ptr": "*i64", "out_parents_ptr": "*i64", "out_depth_ptr": "*i64",
             "out_scores_ptr": "*fp32", "out_ranks_ptr": "*i64", "out_valid_ptr": "*i8"}


@pytest.mark.parametrize("width,radix", [(64, False), (256, True)])
def test_tree_build_kernel_compiles_for_sm90(width, radix):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sglang_ddtree import kernels

    kernel = kernels.tree_build._tree_build_kernel
    wp, cp = kernels.common._pow2(width), kernels.tree_build._pairs(width, width, "cpu")[2]
    gp = kernels.common._pow2(15 * wp)
    consts = dict(L=15, K=width, W=width, WP=wp, CP=cp, SP=wp if radix else max(cp, gp), GP=gp, RADIX=radix, LP=16)
    names = kernel.arg_names
    assert set(names) == set(SIGNATURE) | set(consts), "the kernel's arguments changed: update this test"
    source = ASTSource(fn=kernel, signature={n: SIGNATURE.get(n, "constexpr") for n in names},
                       constexprs={(names.index(n),): v for n, v in consts.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": kernels.common._warps(max(cp, gp))})
    assert len(compiled.asm["cubin"]) > 10_000


@pytest.mark.parametrize("key_bits", [16, 32])
def test_topk_selection_kernels_compile_for_sm90(key_bits):
    """The top-K's two radix selections (the threshold over group maxima, the exact top K of the candidates) with
    the passes a bfloat16 (16 key bits) and a float32 (32) lm_head output take."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sglang_ddtree import kernels

    k, groups, chunks = 256, 4748, 38
    cases = [
        (kernels.topk._group_threshold_kernel,
         {"gmax_ptr": "*i32", "thresh_ptr": "*i64", "pm_ptr": "*fp32", "ps_ptr": "*fp32", "parg_ptr": "*i32",
          "lse_ptr": "*fp32", "max_ptr": "*fp32", "arg_ptr": "*i64", "groups": "i32", "parts": "i32"},
         dict(K=k, GP=kernels.common._pow2(groups), LSE=True, PP=kernels.common._pow2(chunks), KEY_BITS=key_bits),
         kernels.common._warps(kernels.common._pow2(groups))),
        (kernels.topk._candidate_topk_kernel,
         {"x_ptr": "*bf16" if key_bits == 16 else "*fp32", "counts_ptr": "*i32", "cand_ptr": "*i32",
          "scratch_ptr": "*i64", "out_values_ptr": "*fp32", "out_ids_ptr": "*i64", "stride_x": "i32",
          "chunks": "i32", "cap": "i32", "id_offset": "i32"},
         dict(K=k, KP=k, BLOCK=2048, CHP=kernels.common._pow2(chunks), KEY_BITS=key_bits), 4),
    ]
    for kernel, signature, consts, warps in cases:
        names = kernel.arg_names
        assert set(names) == set(signature) | set(consts), "the kernel's arguments changed: update this test"
        source = ASTSource(fn=kernel, signature={n: signature.get(n, "constexpr") for n in names},
                           constexprs={(names.index(n),): v for n, v in consts.items()})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        assert len(compiled.asm["cubin"]) > 5_000


def test_the_ahead_of_time_compile_catches_what_the_interpreter_runs():
    """The check can fail: a loop-carried variable whose type changes in the loop (int32 -> fp32) runs in the
    interpreter and is refused here."""
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def retypes_a_carried_value(ptr, N: tl.constexpr):
        x = tl.full([], 0, tl.int32)
        for i in range(N):
            x = x + tl.load(ptr + i).to(tl.float32)
        tl.store(ptr, x)

    source = ASTSource(fn=retypes_a_carried_value, signature={"ptr": "*i32", "N": "constexpr"}, constexprs={(1,): 4})
    with pytest.raises(triton.compiler.errors.CompilationError, match="Loop-carried variable"):
        triton.compile(source, target=GPUTarget("cuda", 90, 32))
