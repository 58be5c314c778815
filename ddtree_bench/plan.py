"""What the sweep runs: setups, the (setup, method, budget, batch) rows, skip rules, server arguments, start waves.

A *row* is one measurement: a setup (model pair + workload), a method (plain / dflash / ddtree), a budget (ddtree
only) and a batch size (that many concurrent requests). Rows of the same (setup, method, budget) share one server.
Servers start in *waves*: every server of a wave starts at once (imports, JIT and graph capture overlap on the CPU
cores), the sweep waits until all of them are up, then measures them one at a time (so no measurement shares the
GPU with another server's start-up or workload) and stops each after its rows.

Memory. Servers of a wave live on one GPU together, so a wave is packed by an estimate of each server's footprint:
weights + CUDA context + KV pool + CUDA-graph static buffers (+ a hybrid target's recurrent-state pool, one state per
verify node and request: `state_bytes`) stay resident; a verify forward's activations
(dominated by the fp32 verify logits, batch * (B+1) * vocab * 4 bytes) come and go with its workload, and only one
server runs a workload at a time, so a wave needs sum(resident) + max(activations). The estimates are deliberately
coarse (formulas below, 25% margin on activations); they decide packing and skips, never results.

Everything here is pure (no processes, no network): tests cover it on CPU.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
METHODS = ("plain", "dflash", "ddtree", "auto")  # auto: DDTREE with --speculative-ddtree-budget auto (one server)
ALL_BUDGETS = (16, 32, 64, 128, 256, 512, 1024)
ALL_BATCH_SIZES = (1, 4, 16, 64)
# Prompt kinds read from the long prompts file (ddtree_bench/long_prompts.py): `long`, prompts of prompt_tokens
# tokens of code; `shared`, prompts that share one prefix of prompt_tokens tokens, each with a suffix of its own of at
# most SHARED_SUFFIX_TOKENS (a radix cache's case).
LONG_PROMPT_KINDS = ("long", "shared")
PROMPT_KINDS = ("text", "ids") + LONG_PROMPT_KINDS
SHARED_SUFFIX_TOKENS = 200
CUDA_CONTEXT_GIB = 1.5  # CUDA context, cuBLAS/FlashInfer workspaces, allocator slack per server (measured: ~1.4 GB)
ACTIVATION_MARGIN = 1.25


# ------------------------------------------------------------------------------------------------ model shapes


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a config.json that size memory (bf16 weights and KV)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    max_positions: int
    aux_layers: int = 0  # DFlash drafter: target layers it reads (its fc input is aux_layers * hidden)
    block_size: int | None = None  # DFlash drafter block
    # A gated-delta-net hybrid target (Qwen3.5 / Qwen3-Next layout): its linear-attention layers (the others attend,
    # with the gated q_proj these families have) and their widths. 0: every layer attends.
    linear_layers: int = 0
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    conv_kernel: int = 0

    @classmethod
    def from_config(cls, folder: str | Path) -> "ModelShape":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ValueError(f"{path} does not exist; a setup needs a model folder with a config.json.")
        cfg = json.loads(path.read_text())
        heads = int(cfg["num_attention_heads"])
        dflash = cfg.get("dflash_config") or {}
        types = list(cfg.get("layer_types") or [])
        interval = cfg.get("full_attention_interval")
        if not types and interval and cfg.get("linear_num_value_heads"):  # SGLang's reading of a Qwen3.5 config
            types = ["full_attention" if (i + 1) % int(interval) == 0 else "linear_attention"
                     for i in range(int(cfg["num_hidden_layers"]))]
        linear = sum(t == "linear_attention" for t in types)
        return cls(
            layers=int(cfg["num_hidden_layers"]), hidden=int(cfg["hidden_size"]), heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            intermediate=int(cfg["intermediate_size"]), vocab=int(cfg["vocab_size"]),
            tied=bool(cfg.get("tie_word_embeddings", False)),
            max_positions=int(cfg.get("max_position_embeddings", 4096)),
            aux_layers=len(dflash.get("target_layer_ids") or []),
            block_size=int(dflash.get("block_size", cfg.get("block_size", 0))) or None,
            linear_layers=linear,
            linear_key_heads=int(cfg.get("linear_num_key_heads") or 0) if linear else 0,
            linear_value_heads=int(cfg.get("linear_num_value_heads") or 0) if linear else 0,
            linear_key_dim=int(cfg.get("linear_key_head_dim") or 0) if linear else 0,
            linear_value_dim=int(cfg.get("linear_value_head_dim") or 0) if linear else 0,
            conv_kernel=int(cfg.get("linear_conv_kernel_dim") or 0) if linear else 0,
        )

    def layer_params(self) -> int:
        """An attention layer with its MLP (a hybrid's attention is gated: q_proj holds q and the output gate)."""
        q = 2 * self.heads if self.linear_layers else self.heads
        attn = self.hidden * self.head_dim * (q + self.heads + 2 * self.kv_heads)  # q (+ gate), o, k, v
        return attn + 3 * self.hidden * self.intermediate

    def linear_layer_params(self) -> int:
        """A gated-delta-net layer with its MLP: in_proj_qkv, in_proj_z, in_proj_b / _a, out_proj, the conv."""
        kd, vd = self.linear_key_heads * self.linear_key_dim, self.linear_value_heads * self.linear_value_dim
        gdn = self.hidden * (2 * kd + 2 * vd + 2 * self.linear_value_heads) + vd * self.hidden
        return gdn + (2 * kd + vd) * self.conv_kernel + 3 * self.hidden * self.intermediate

    def params(self, *, embeddings: bool) -> int:
        """Weights: a target has embeddings (and an lm_head unless tied); a DFlash drafter has neither, but an fc
        from the aux hidden states."""
        n = ((self.layers - self.linear_layers) * self.layer_params() + self.linear_layers * self.linear_layer_params()
             + self.aux_layers * self.hidden * self.hidden)
        if embeddings:
            n += self.vocab * self.hidden * (1 if self.tied else 2)
        return n

    def kv_bytes_per_token(self) -> int:
        """bf16 K and V of the attention layers (a hybrid's linear-attention layers keep a state instead)."""
        return 2 * (self.layers - self.linear_layers) * self.kv_heads * self.head_dim * 2

    def state_bytes_per_request(self) -> int:
        """One request's recurrent state (SGLang's mamba_cache_per_req for a gated-delta-net target): per linear
        layer an fp32 SSM state [value heads, key dim, value dim] (SGLang's default SSM dtype) and a bf16 conv window
        of conv_kernel - 1 inputs over the q / k / v channels. 0 for an attention-only model."""
        kd, vd = self.linear_key_heads * self.linear_key_dim, self.linear_value_heads * self.linear_value_dim
        ssm = self.linear_value_heads * self.linear_key_dim * self.linear_value_dim * 4
        conv = (2 * kd + vd) * max(self.conv_kernel - 1, 0) * 2
        return self.linear_layers * (ssm + conv)


# ----------------------------------------------------------------------------------------------------- setups


@dataclass(frozen=True)
class Setup:
    """A model pair and its workload."""

    name: str
    target: str  # model folders, relative to the repository root or absolute
    drafter: str
    dummy: bool  # --load-format dummy --skip-tokenizer-init, token-id prompts
    prompt_kind: str  # "text" (prompts file / HumanEval), "ids" (seeded random token ids), "long" or "shared"
    # "ids": exact prompt length; "text": upper bound, only for KV sizing; "long": the long prompts' length (at most,
    # and at most long_prompts.tolerance under it); "shared": the shared prefix's
    prompt_tokens: int
    max_new_tokens: int
    warmup_new_tokens: int  # per (server, batch size) before the measured run: same batch shape, short
    context_length: int | None  # --context-length (None: the model's)
    graph_token_cap: int  # capture a decode graph for batch b only if b * verify width <= this (`auto`: its chain's)
    max_activation_gib: float  # skip rows whose verify activations would exceed this
    report_acceptance: bool  # False: random weights, acceptance is meaningless (costs only)
    methods: tuple[str, ...] = ("plain", "dflash", "ddtree")  # `auto` on request (--set SETUP.methods=...)
    budgets: tuple[int, ...] = ALL_BUDGETS
    batch_sizes: tuple[int, ...] = ALL_BATCH_SIZES
    est_step_floor_ms: tuple[tuple[str, float], ...] = (("plain", 3.0), ("dflash", 6.0), ("ddtree", 12.0))
    est_us_per_verify_token: float = 0.5  # crude step-time slope, for deadline decisions only
    est_tokens_per_step: float = 1.0  # speculative methods' tokens per step, for deadline decisions only
    # "KEY=VALUE" environment entries for this setup's servers (an A/B of a worker switch in one interleaved run:
    # bench_budgets.py --copy-setup tiny-off=tiny --set tiny-off.server_env=SGLANG_DDTREE_X=0)
    server_env: tuple[str, ...] = ()
    backend: str = "triton"  # --attention-backend: triton or flashinfer
    # built on demand by sglang_ddtree.widen (the tiny pair widened to this shape) when its folders hold no weights
    widen_shape: str | None = None
    # launch_server arguments appended for this setup's servers (an A/B of a server flag in one interleaved run:
    # --copy-setup real-nocal=real --set real-nocal.methods=auto
    # --set real-nocal.server_args=--speculative-ddtree-auto-calibration,off)
    server_args: tuple[str, ...] = ()
    # the small pair (a folder with target/ and drafter/) that widen_shape widens; None: the tiny pair (tiny_dir())
    widen_from: str | None = None
    # A pair trained on the device (models/tiny-hybrid): a folder with target/ and drafter/ config.json as the
    # trainer writes them, to plan from while the pair this setup serves (or, with widen_shape, widens) has no
    # config yet, so a dry run works on the CPU before the training.
    plan_configs: str | None = None
    # skip rows whose recurrent-state pool (a gated-delta-net target: SGLang's mamba slots and, for a speculative
    # method, one state per verify node per running request) would exceed this many GiB; None: no limit
    max_state_gib: float | None = None
    # the `auto` servers' --speculative-ddtree-auto-candidates, one string (e.g. plain,chain,7,15,63: --set
    # SETUP.auto_candidates=... keeps its commas, which server_args would split); None: the server's default
    auto_candidates: str | None = None

    def validate(self) -> None:
        if self.backend not in ("triton", "flashinfer"):
            raise ValueError(f"setup {self.name}: backend must be triton or flashinfer, got {self.backend!r}.")
        if self.prompt_kind not in PROMPT_KINDS:
            raise ValueError(f"setup {self.name}: prompt_kind must be one of {', '.join(PROMPT_KINDS)}, got "
                             f"{self.prompt_kind!r}.")
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            raise ValueError(f"setup {self.name}: methods must be a non-empty subset of {METHODS}, got {self.methods}.")
        if not self.batch_sizes or any(int(b) < 1 for b in self.batch_sizes):
            raise ValueError(f"setup {self.name}: batch sizes must be integers >= 1, got {self.batch_sizes}.")
        if "ddtree" in self.methods and (not self.budgets or any(not 1 <= int(b) <= 1024 for b in self.budgets)):
            raise ValueError(f"setup {self.name}: budgets must be integers in 1..1024, got {self.budgets}.")
        for name in ("max_new_tokens", "prompt_tokens", "graph_token_cap"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"setup {self.name}: {name} must be >= 1, got {getattr(self, name)}.")
        if self.warmup_new_tokens < 0:
            raise ValueError(f"setup {self.name}: warmup_new_tokens must be >= 0, got {self.warmup_new_tokens}.")
        if self.max_state_gib is not None and self.max_state_gib <= 0:
            raise ValueError(f"setup {self.name}: max_state_gib must be > 0 (or none), got {self.max_state_gib}.")
        bad = [e for e in self.server_env if not e.partition("=")[0] or "=" not in e]
        if bad:
            raise ValueError(f"setup {self.name}: server_env entries must be KEY=VALUE, got {bad}.")
        if any(a.partition("=")[0] == AUTO_CANDIDATES_FLAG for a in self.server_args):
            raise ValueError(f"setup {self.name}: set auto's candidates with --set {self.name}.auto_candidates=..., "
                             f"not in server_args (which splits the list at its commas).")
        if self.auto_candidates is not None:
            auto_candidates(self)  # a bad list is refused before any server starts

    def prompt_bound(self) -> int:
        """The most tokens one of its prompts holds (as far as the setup says: a text prompt's length is a bound)."""
        return self.prompt_tokens + (SHARED_SUFFIX_TOKENS if self.prompt_kind == "shared" else 0)

    def warmup_tokens(self, method: str) -> int:
        """New tokens per request of a row's warm-up: `auto` at least AUTO_WARMUP_NEW_TOKENS, so that its
        exploration of the candidates at the row's batch size, and their first-use graph captures, happen before
        the measured runs (measured at 8B shapes, batch 64, a 4-token warm-up: auto's first run 1207 tok/s with a
        32-ms mean tree stage, its second 1785)."""
        return max(self.warmup_new_tokens, AUTO_WARMUP_NEW_TOKENS) if method == "auto" else self.warmup_new_tokens

    def env(self) -> dict[str, str]:
        """server_env as a dict."""
        return dict(e.split("=", 1) for e in self.server_env)

    def path(self, which: str) -> Path:
        p = Path(getattr(self, which))
        return p if p.is_absolute() else REPO_ROOT / p

    def config_dir(self, which: str) -> Path:
        """The folder whose config.json sizes `which` (target / drafter): the setup's own, or plan_configs/<which>
        while a pair trained on the device has none yet (not for a widened setup: its configs come from the
        widening, bench_budgets.ensure_widened)."""
        path = self.path(which)
        if self.plan_configs and not self.widen_shape and not (path / "config.json").is_file():
            return self.path("plan_configs") / which
        return path

    def shapes(self) -> tuple[ModelShape, ModelShape]:
        return ModelShape.from_config(self.config_dir("target")), ModelShape.from_config(self.config_dir("drafter"))

    def est_step_ms(self, method: str, width: int, batch_size: int) -> float:
        floors = dict(self.est_step_floor_ms)
        return floors.get(method, floors["ddtree"]) + self.est_us_per_verify_token * batch_size * width / 1e3

    def params_for_signature(self) -> dict:
        keep = ("target", "drafter", "dummy", "prompt_kind", "prompt_tokens", "max_new_tokens", "warmup_new_tokens",
                "context_length", "graph_token_cap")
        out = {k: getattr(self, k) for k in keep}
        if self.server_env:  # only when set: the signatures of setups without it stay what they were
            out["server_env"] = sorted(self.server_env)
        if self.backend != "triton":  # likewise
            out["backend"] = self.backend
        if self.server_args:  # likewise (their order matters)
            out["server_args"] = list(self.server_args)
        for which in ("target", "drafter"):  # the same folder, however it was spelled
            path = self.path(which)
            out[which] = path.relative_to(REPO_ROOT).as_posix() if path.is_relative_to(REPO_ROOT) else str(path)
        return out


# The least warm-up of an `auto` row (Setup.warmup_tokens): exploration takes up to ~50 rounds per batch bucket
# (3 timed rounds per candidate, waits for each one's first timing), one token a round with random weights.
AUTO_WARMUP_NEW_TOKENS = 64


def default_setups() -> dict[str, Setup]:
    """The setups: the tiny pair, 8B shapes with random weights, the tiny pair widened to 8B shapes, and the tiny
    gated-delta-net hybrid pair and its widening to Qwen3.5-27B. Every number here can be overridden from the command
    line."""
    tiny = Setup(
        name="tiny", target="models/tiny/target", drafter="models/tiny/drafter", dummy=False, prompt_kind="text",
        prompt_tokens=512,  # HumanEval's first 64 prompts are at most 323 tiny-tokenizer tokens
        max_new_tokens=128, warmup_new_tokens=8, context_length=None,
        graph_token_cap=64 * 1025,  # vocab 4096: even B=1024 x 64 graphs cost ~3.5 GiB of buffers
        max_activation_gib=16.0, report_acceptance=True,
        est_step_floor_ms=(("plain", 3.0), ("dflash", 5.0), ("ddtree", 12.0)), est_us_per_verify_token=0.3,
        est_tokens_per_step=3.0,  # a trained pair: tau 4.5-7 for DFLASH and every DDTREE budget (measured)
    )
    dummy_8b = Setup(
        name="8b-dummy", target="benchmarks/configs/qwen3-8b-dummy/target",
        drafter="benchmarks/configs/qwen3-8b-dummy/drafter", dummy=True, prompt_kind="ids", prompt_tokens=128,
        max_new_tokens=32, warmup_new_tokens=4, context_length=4096,
        # ~0.8 MB of static graph buffers per captured verify token at this vocab (fp32 logits alone 0.6 MB):
        # 4200 tokens keeps a server's graphs near 3.5 GiB; larger verifies run eager, where at >= 4k tokens the
        # step is compute-bound and launch overhead does not matter.
        graph_token_cap=4200,
        max_activation_gib=24.0, report_acceptance=False,
        est_step_floor_ms=(("plain", 6.0), ("dflash", 9.0), ("ddtree", 15.0)), est_us_per_verify_token=25.0,
    )
    # The tiny pair widened to exact Qwen3-8B / z-lab-8B-drafter shapes (sglang_ddtree/widen.py): real 8B costs and
    # the tiny pair's acceptance. Built on the GPU machine (~20 s) into runs/8b-real when missing.
    # Its warm-up is a whole measured request long: at batch 16 and 64 requests finish at different rounds and the
    # batch passes through smaller CUDA-graph sizes, whose first-use stage captures (and `auto`'s exploration there)
    # a short warm-up leaves to the measured runs (a 64-token warm-up left 60 captures in `auto`'s batch-64 row and
    # 99 in the fixed 128-tree's).
    real_8b = dataclasses.replace(
        tiny, name="8b-real", target="runs/8b-real/target", drafter="runs/8b-real/drafter", widen_shape="qwen3-8b",
        warmup_new_tokens=tiny.max_new_tokens, context_length=4096, graph_token_cap=dummy_8b.graph_token_cap, max_activation_gib=24.0,
        est_step_floor_ms=(("plain", 6.0), ("dflash", 9.0), ("ddtree", 12.0)), est_us_per_verify_token=25.0,
        budgets=(16, 32, 64, 128, 256))
    # The tiny gated-delta-net hybrid pair (scripts/train_tiny_pair.py --target-arch qwen3_5_text, trained on the
    # device into models/tiny-hybrid: bash scripts/device/hybrid.sh train); a dry run plans from the trainer's
    # default configs (benchmarks/configs/tiny-hybrid) until the trained pair is there. No `auto` (refused on hybrid
    # targets). Budgets 16 and 64: SGLang keeps one recurrent state per verify node and request (docs/hybrid-design.md
    # §3), and its tree conv kernel unrolls over the nodes. A whole request's warm-up, as 8b-real (first-use stage
    # captures at the smaller batch sizes a batch passes through). Step times are guesses (no hybrid row measured).
    tiny_hybrid = dataclasses.replace(
        tiny, name="tiny-hybrid", target="models/tiny-hybrid/target", drafter="models/tiny-hybrid/drafter",
        plan_configs="benchmarks/configs/tiny-hybrid", context_length=4096, warmup_new_tokens=tiny.max_new_tokens,
        budgets=(16, 64), batch_sizes=(1, 4, 16), est_step_floor_ms=(("plain", 4.0), ("dflash", 7.0), ("ddtree", 15.0)),
        est_tokens_per_step=2.0)
    # The tiny hybrid pair widened to Qwen3.5-27B shapes (sglang_ddtree/widen_hybrid.py, 57.3 GB of bf16), built on the
    # device into runs/27b-hybrid when missing (bash scripts/device/hybrid.sh widen, which checks the disk first).
    # The GDN state is what limits it: 154 MB per request and verify node in fp32, so DDTREE 64 at batch 16 would need
    # ~158 GiB; max_state_gib skips the rows over 50 GiB, which leaves every row but that one to one H200 server at a
    # time (weights 53 GiB + state <= 50 GiB; on an H100, --set 27b-hybrid.max_state_gib=8 keeps batch 1).
    # Step times scale 8b-real's by the weights (guesses, for deadlines only).
    hybrid_27b = dataclasses.replace(
        tiny_hybrid, name="27b-hybrid", target="runs/27b-hybrid/target", drafter="runs/27b-hybrid/drafter",
        widen_shape="qwen3.5-27b", widen_from="models/tiny-hybrid", graph_token_cap=dummy_8b.graph_token_cap,
        max_activation_gib=24.0, max_state_gib=50.0,
        est_step_floor_ms=(("plain", 13.0), ("dflash", 17.0), ("ddtree", 20.0)), est_us_per_verify_token=80.0)
    return {s.name: s for s in (tiny, dummy_8b, real_8b, tiny_hybrid, hybrid_27b)}


# -------------------------------------------------------------------------------------------------------- rows


@dataclass(frozen=True)
class Row:
    setup: str
    method: str
    budget: int | None
    batch_size: int

    @property
    def key(self) -> str:
        return row_key(self.setup, self.method, self.budget, self.batch_size)


def row_key(setup: str, method: str, budget: int | None, batch_size: int) -> str:
    return f"{setup}|{method}|{budget if budget is not None else '-'}|{batch_size}"


def verify_width(method: str, budget: int | None, block_size: int, auto_candidates: str | None = None) -> int:
    """Tokens the target verifies per request per step: plain 1, DFLASH the block, DDTREE the tree (B+1), `auto` its
    widest candidate's (KV reservation and the largest verify graphs; auto_candidates: the server's flag, None: its
    default)."""
    if method == "plain":
        return 1
    if method == "dflash":
        return block_size
    if method == "ddtree":
        if budget is None:
            raise ValueError("ddtree rows need a budget.")
        return budget + 1
    if method == "auto":
        from sglang_ddtree.sglang.args import parse_auto_candidates

        return max(candidate_widths(parse_auto_candidates(auto_candidates), block_size))
    raise ValueError(f"unknown method {method!r}; allowed: {', '.join(METHODS)}.")


def candidate_widths(candidates, block_size: int) -> tuple[int, ...]:
    """Verify tokens a request of each `auto` candidate, in candidate order: a round without a draft 1, the chain the
    drafter's block, a tree B + 1. One verify graph runner each: the chain's and a tree's of the same width are two
    (one causal, one with the tree mask)."""
    return tuple(1 if c < 0 else block_size if c == 0 else c + 1 for c in candidates)


def server_name(setup: str, method: str, budget: int | None) -> str:
    return f"{setup}-{method}" + (f"-b{budget}" if method == "ddtree" else "")


# --------------------------------------------------------------------------------------------- memory estimate


def activation_bytes(target: ModelShape, drafter: ModelShape | None, tokens: int) -> float:
    """Transient memory of one target forward over `tokens` verify tokens: bf16 + fp32 logits, the MLP and
    attention intermediates, and the aux hidden states a DFlash drafter reads (margin included)."""
    per_token = (target.vocab * (4 + 2) + target.hidden * 2 * 12 + target.intermediate * 2 * 3
                 + (drafter.aux_layers if drafter else 0) * target.hidden * 2)
    return ACTIVATION_MARGIN * tokens * per_token


def logits_bytes(target: ModelShape, tokens: int) -> int:
    return tokens * target.vocab * 4


def graph_bytes_per_token(target: ModelShape, context: int, width: int, spec: bool) -> float:
    """Static CUDA-graph buffers per captured target token (docs/internal/sglang-notes-attention.md §2.5): shared fp32
    logits, Triton kv indices (int64 per context position), the verify mask (uint8), decode attn_logits, and the
    graph pool's activations (logits excluded, counted above)."""
    attn_logits = target.heads * 8 * target.head_dim * 4
    mask = (context + width) if spec else 0
    pool = activation_bytes(target, None, 1) / ACTIVATION_MARGIN - target.vocab * 6
    return target.vocab * 4 + context * 8 + mask + attn_logits + pool


@dataclass(frozen=True)
class MemoryEstimate:
    weights_gib: float
    kv_gib: float
    graph_gib: float
    resident_gib: float  # weights + context + KV + graphs: held while the server is up
    activation_gib: float  # peak extra while its largest batch runs
    kv_pool_tokens: int
    graph_batch_sizes: tuple[int, ...]
    state_gib: float = 0.0  # a hybrid target's recurrent-state pool (in resident_gib too)
    mamba_slots: int = 0  # --max-mamba-cache-size (0: not a hybrid target)

    @property
    def total_gib(self) -> float:
        return self.resident_gib + self.activation_gib


def request_tokens(prompt_tokens: int, new_tokens: int, width: int) -> int:
    """KV slots one request may hold at its longest: its prompt, its output and the 2 * width slots a speculative
    round reserves (DFLASH's prepare_for_decode keeps committed + 2 * num_draft_tokens allocated), + 32."""
    return prompt_tokens + new_tokens + 2 * width + 32


def kv_pool_tokens(setup: Setup, width: int, max_batch: int) -> int:
    """--max-total-tokens: every running request at its longest (request_tokens), 20% slack."""
    per_request = request_tokens(setup.prompt_bound(), setup.max_new_tokens, width)
    tokens = math.ceil(max_batch * per_request * 1.2) + 2048
    return max(8192, -(-tokens // 1024) * 1024)


def derive_context_length(setup: Setup, target: ModelShape, drafter: ModelShape) -> int | None:
    """--context-length for a setup's servers: its own (None: the model's), raised where its longest prompt, its new
    tokens and a round's reserve (twice the widest verify + 32, as the KV pool reserves) need more, rounded up to a
    multiple of 1024 within the models' max_position_embeddings. Long prompts need more than the 4096 the real-size
    setups pass; a need over the models' positions is refused before any server starts (SGLang refuses such
    prompts, and the rotary tables end there)."""
    width = max(verify_width(m, b, drafter.block_size or 16, setup.auto_candidates) for m in setup.methods
                for b in (setup.budgets if m == "ddtree" else [None]))
    need = request_tokens(setup.prompt_bound(), setup.max_new_tokens, width)
    limit = min([target.max_positions] + [drafter.max_positions for m in setup.methods if m != "plain"])
    if need > limit:
        raise ValueError(f"setup {setup.name}: prompts of up to {setup.prompt_bound()} tokens, {setup.max_new_tokens} "
                         f"new tokens and a verify of {width} need a context of {need} tokens, over the models' "
                         f"{limit} positions (max_position_embeddings).")
    if need <= (setup.context_length or limit):
        return setup.context_length
    return min(-(-need // 1024) * 1024, limit)


# SGLang's mamba state slots per running request with the radix cache on (kv_cache_configurator.py:
# MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO, also with SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK; the extra_buffer strategy
# would add 1-2, but SGLang 0.5.17 offers it to Qwen3_5ForConditionalGeneration, not to the text-only
# Qwen3_5ForCausalLM we serve). It caps max_running_requests at max_mamba_cache_size // this.
MAMBA_SLOTS_PER_REQUEST = 3


def mamba_cache_size(max_batch: int) -> int:
    """--max-mamba-cache-size for a hybrid server of max_batch requests: enough slots that SGLang does not cap
    max_running_requests below the batch. Set explicitly because otherwise SGLang gives the mamba pool a share
    (--mamba-full-memory-ratio) of whatever memory is free at the start, which a wave's parallel starts share."""
    return MAMBA_SLOTS_PER_REQUEST * max_batch


def state_bytes(target: ModelShape, width: int, max_batch: int, spec: bool) -> float:
    """A hybrid target's recurrent-state pool, as SGLang 0.5.17 sizes it with --max-mamba-cache-size K
    (kv_cache_configurator._handle_max_mamba_cache, memory_pool.MambaPool): K + 1 slots (one for padding), and for
    a speculative server intermediate states for max_running_requests + 1 slots x speculative_num_draft_tokens (the
    verify width: DDTREE's B + 1, DFLASH's block). 0 for an attention-only target."""
    per_request = target.state_bytes_per_request()
    slots = mamba_cache_size(max_batch) + 1
    return per_request * (slots + ((max_batch + 1) * width if spec else 0))


def graph_batch_sizes(setup: Setup, method: str, width: int, batch_sizes) -> tuple[int, ...]:
    """--cuda-graph-bs-decode: the batch sizes whose verify of `width` tokens a request fits the setup's graph token
    budget. `auto` passes its chain's width (the drafter's block): SGLang captures every candidate's verify at every
    size it is given, so a size in the list gives the chain and the small trees their graphs there, as a server
    started by hand does; the widest candidates' graphs at that size come with them and are counted in
    estimate_memory. Capping the list by the widest candidate instead left `auto` eager at batch 64 where DFLASH and
    the fixed trees replay graphs (4878 against 7507 tok/s with graphs, sweep_8b-real-autographs_2026-12-04)."""
    return tuple(sorted(b for b in set(batch_sizes) if method == "plain" or b * width <= setup.graph_token_cap))


AUTO_CANDIDATES_FLAG = "--speculative-ddtree-auto-candidates"


def auto_candidates(setup: Setup) -> tuple[int, ...]:
    """The candidates of a setup's `auto` servers: its auto_candidates, else the server's default."""
    from sglang_ddtree.sglang.args import parse_auto_candidates

    return parse_auto_candidates(setup.auto_candidates)


def auto_widths(setup: Setup, block_size: int) -> tuple[int, ...]:
    """candidate_widths of a setup's `auto` servers."""
    return candidate_widths(auto_candidates(setup), block_size)


def estimate_memory(setup: Setup, target: ModelShape, drafter: ModelShape, method: str, budget: int | None,
                    batch_sizes) -> MemoryEstimate:
    spec = method != "plain"
    block = drafter.block_size or 16
    width = verify_width(method, budget, block, setup.auto_candidates)
    max_batch = max(batch_sizes)
    context = setup.context_length or target.max_positions
    weights = 2 * (target.params(embeddings=True) + (drafter.params(embeddings=False) if spec else 0))
    pool = kv_pool_tokens(setup, width, max_batch)
    kv = pool * (target.kv_bytes_per_token() + (drafter.kv_bytes_per_token() if spec else 0))
    if method == "auto":
        # one verify runner per candidate width, each captured at every listed size; the fp32 logits buffer is
        # shared by all runners (SGLang's graph_shared_output), sized for the widest
        graphs = graph_batch_sizes(setup, method, block, batch_sizes)  # the chain's width (graph_batch_sizes)
        logits = target.vocab * 4
        per_size = width * logits + sum(w * (graph_bytes_per_token(target, context, w, spec) - logits)
                                        for w in auto_widths(setup, block))
        graph = max(graphs) * per_size if graphs else 0.0
    else:
        graphs = graph_batch_sizes(setup, method, width, batch_sizes)
        graph = (max(graphs) * width * graph_bytes_per_token(target, context, width, spec)) if graphs else 0.0
    act = activation_bytes(target, drafter if spec else None, max_batch * width)
    state = state_bytes(target, width, max_batch, spec)
    resident = weights + kv + graph + state + CUDA_CONTEXT_GIB * GIB
    slots = mamba_cache_size(max_batch) if target.linear_layers else 0
    return MemoryEstimate(weights / GIB, kv / GIB, graph / GIB, resident / GIB, act / GIB, pool, graphs, state / GIB,
                          slots)


def skip_reason(setup: Setup, target: ModelShape, drafter: ModelShape, method: str, budget: int | None,
                batch_size: int) -> str | None:
    """Why a row cannot run (None: it can). Deterministic, so resumed runs decide the same."""
    width = verify_width(method, budget, drafter.block_size or 16, setup.auto_candidates)
    tokens = batch_size * width
    act = activation_bytes(target, drafter if method != "plain" else None, tokens) / GIB
    if act > setup.max_activation_gib:
        return (f"verify of {batch_size} x {width} = {tokens} tokens needs ~{act:.1f} GiB of activations (the fp32 "
                f"verify logits alone are {batch_size}*{width}*{target.vocab}*4 B = "
                f"{logits_bytes(target, tokens) / GIB:.1f} GiB), over this setup's {setup.max_activation_gib:g} GiB "
                f"limit (--max-activation-gib)")
    state = state_bytes(target, width, batch_size, method != "plain") / GIB
    if setup.max_state_gib is not None and state > setup.max_state_gib:
        per = target.state_bytes_per_request() / 2**20
        nodes = f" + {batch_size + 1} x {width} verify-node states" if method != "plain" else ""
        return (f"the recurrent state of batch {batch_size} needs ~{state:.1f} GiB ({mamba_cache_size(batch_size) + 1} "
                f"mamba slots{nodes}, {per:.0f} MiB each), over this setup's {setup.max_state_gib:g} GiB limit "
                f"(--set {setup.name}.max_state_gib=...)")
    return None


# ------------------------------------------------------------------------------------------------ server plans


@dataclass
class ServerPlan:
    name: str
    setup: Setup
    method: str
    budget: int | None
    rows: list[Row]  # rows this server can run (skip rules passed), ascending batch size
    memory: MemoryEstimate
    args: list[str]
    signature: str = ""  # hash of the workload + server args; results rows carry it for resume
    width: int = 1  # verify tokens per request per step

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return tuple(r.batch_size for r in self.rows)

    def est_row_seconds(self, row: Row) -> float:
        """Warmup + measured run at the setup's tokens per step (random weights commit exactly one), + overhead."""
        tokens = self.setup.max_new_tokens + self.setup.warmup_tokens(self.method)
        steps = tokens if self.method == "plain" else tokens / self.setup.est_tokens_per_step
        # `auto` verifies its widest candidate only now and then: its time is estimated at its narrowest tree's
        # width (at real size, batch 64, its rounds by candidate were chain 117, 16-tree 138, 32-tree 52, 64-tree
        # 29; at the widest width a 3-server batch-64 row was estimated at 4.5 minutes and measured in under one)
        width = self.width
        if self.method == "auto":
            width = min(c for c in auto_candidates(self.setup) if c > 0) + 1
        return steps * self.setup.est_step_ms(self.method, width, row.batch_size) / 1e3 + 1.5


@dataclass
class Plan:
    servers: list[ServerPlan]
    skipped: list[tuple[Row, str]]  # rows no server will run, with the reason
    signatures: dict[str, str] = field(default_factory=dict)  # row key -> signature

    @property
    def rows(self) -> list[Row]:
        return [r for s in self.servers for r in s.rows]


def server_args(setup: Setup, method: str, budget: int | None, *, max_batch: int, pool_tokens: int,
                graph_bs: tuple[int, ...], mem_fraction: float, extra: tuple[str, ...] = (),
                mamba_slots: int = 0) -> list[str]:
    """The launch_server arguments (host and port are added by the launcher); mamba_slots: a hybrid target's
    --max-mamba-cache-size (mamba_cache_size)."""
    args = ["--model-path", str(setup.path("target"))]
    if setup.dummy:
        args += ["--load-format", "dummy", "--skip-tokenizer-init"]
    if setup.context_length:
        args += ["--context-length", str(setup.context_length)]
    args += [
        "--attention-backend", setup.backend,
        "--enable-metrics",  # decode_throughput in meta_info and the DDTREE stage histograms
        "--sleep-on-idle",  # idle servers of a wave must not spin a CPU core each while another one is measured
        "--disable-prefill-cuda-graph",  # prefill is not measured; its 58-size capture took ~79 s on an H200
        # Parallel starts: a capped pool (--max-total-tokens) with a loose fraction; the fraction only has to pass
        # SGLang's check "free memory - (1 - f) * free-before-load > 0" while the wave's other servers load.
        "--mem-fraction-static", f"{mem_fraction:g}",
        "--max-total-tokens", str(pool_tokens),
        "--max-running-requests", str(max_batch),
        "--random-seed", "0",
    ]
    if mamba_slots:
        args += ["--max-mamba-cache-size", str(mamba_slots)]
    if graph_bs:
        args += ["--cuda-graph-bs-decode", *map(str, graph_bs)]
    else:
        args += ["--disable-decode-cuda-graph"]
    if method == "dflash":
        args += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(setup.path("drafter"))]
    elif method in ("ddtree", "auto"):
        args += ["--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", str(setup.path("drafter")),
                 "--speculative-ddtree-budget", "auto" if method == "auto" else str(budget)]
        if method == "auto" and setup.auto_candidates is not None:
            args += [AUTO_CANDIDATES_FLAG, setup.auto_candidates]
    return args + list(setup.server_args) + list(extra)


def _signature(setup: Setup, method: str, budget: int | None, args: list[str], sampling: dict) -> str:
    # Paths differ between machines (repo root); hash them relative to it.
    rel = [a.replace(str(REPO_ROOT) + "/", "") for a in args]
    blob = json.dumps({"setup": setup.params_for_signature(), "method": method, "budget": budget, "args": rel,
                       "sampling": sampling}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def sampling_params(setup: Setup, max_new_tokens: int | None = None) -> dict:
    return {"temperature": 0.0, "max_new_tokens": int(max_new_tokens or setup.max_new_tokens), "ignore_eos": True}


def expand(setups: list[Setup], *, mem_fraction: float = 0.9, extra_args: tuple[str, ...] = (),
           mem_budget_gib: float | None = None) -> Plan:
    """Every (setup, method, budget, batch) row, grouped into servers, with skip rules applied. A server whose own
    estimate exceeds mem_budget_gib is dropped (its rows skipped with the reason)."""
    servers, skipped, sigs = [], [], {}
    for setup in setups:
        setup.validate()
        target, drafter = setup.shapes()
        if drafter.block_size is None and any(m != "plain" for m in setup.methods):
            raise ValueError(f"setup {setup.name}: the drafter config has no block_size.")
        setup = dataclasses.replace(setup, context_length=derive_context_length(setup, target, drafter))
        for method in setup.methods:
            # budgets in the order given: server order is wave priority (plan_waves), so a setup can keep the
            # budgets that must be measured together with `auto` and DFLASH in the first wave
            for budget in (list(dict.fromkeys(setup.budgets)) if method == "ddtree" else [None]):
                runnable = []
                for bs in sorted(set(setup.batch_sizes)):
                    row = Row(setup.name, method, budget, bs)
                    reason = skip_reason(setup, target, drafter, method, budget, bs)
                    if reason:
                        skipped.append((row, reason))
                    else:
                        runnable.append(row)
                if not runnable:
                    continue
                bss = [r.batch_size for r in runnable]
                mem = estimate_memory(setup, target, drafter, method, budget, bss)
                if mem_budget_gib is not None and mem.total_gib > mem_budget_gib:
                    reason = (f"server needs ~{mem.total_gib:.1f} GiB (resident {mem.resident_gib:.1f} + activations "
                              f"{mem.activation_gib:.1f}), over the {mem_budget_gib:.1f} GiB memory budget")
                    skipped += [(r, reason) for r in runnable]
                    continue
                args = server_args(setup, method, budget, max_batch=max(bss), pool_tokens=mem.kv_pool_tokens,
                                   graph_bs=mem.graph_batch_sizes, mem_fraction=mem_fraction, extra=extra_args,
                                   mamba_slots=mem.mamba_slots)
                sig = _signature(setup, method, budget, args, sampling_params(setup))
                width = verify_width(method, budget, drafter.block_size or 16, setup.auto_candidates)
                servers.append(ServerPlan(server_name(setup.name, method, budget), setup, method, budget, runnable,
                                          mem, args, sig, width))
                sigs.update({r.key: sig for r in runnable})
    return Plan(servers, skipped, sigs)


def plan_waves(servers: list[ServerPlan], *, mem_budget_gib: float, max_parallel: int) -> list[list[ServerPlan]]:
    """Split servers, in order, into waves that start together: a wave holds at most max_parallel servers and its
    sum of resident memory plus its largest activation stays within mem_budget_gib. Order is kept (it is the
    priority), so a server that does not fit closes the current wave."""
    if max_parallel < 1:
        raise ValueError(f"max_parallel must be >= 1, got {max_parallel}.")
    waves: list[list[ServerPlan]] = []
    current: list[ServerPlan] = []

    def need(group):
        return sum(s.memory.resident_gib for s in group) + max(s.memory.activation_gib for s in group)

    for server in servers:
        if current and (len(current) >= max_parallel or need(current + [server]) > mem_budget_gib):
            waves.append(current)
            current = []
        current.append(server)
    if current:
        waves.append(current)
    return waves


def with_overrides(setup: Setup, **changes) -> Setup:
    """dataclasses.replace that drops None values (unset command-line options)."""
    return dataclasses.replace(setup, **{k: v for k, v in changes.items() if v is not None})


# ------------------------------------------------------------------------------------- command-line changes

# the Setup fields --set may change, with their types
TUPLE_FIELDS = {"methods": str, "budgets": int, "batch_sizes": int, "server_env": str, "server_args": str}
SCALAR_FIELDS = {"max_new_tokens": int, "warmup_new_tokens": int, "prompt_tokens": int, "graph_token_cap": int,
                 "max_activation_gib": float, "context_length": int, "target": str, "drafter": str,
                 "backend": str, "max_state_gib": float, "widen_from": str, "prompt_kind": str,
                 "auto_candidates": str}
# fields that take none (context_length also `model` / empty)
NONE_FIELDS = ("context_length", "max_state_gib", "auto_candidates")


def csv_values(text: str, kind=str) -> tuple:
    try:
        return tuple(kind(x.strip()) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of {kind.__name__}s.") from None


def copy_setups(setups: dict[str, Setup], copies: list[str]) -> dict[str, Setup]:
    """--copy-setup NEW=BASE: a setup under a new name (its servers and rows carry that name), changed with --set."""
    out = dict(setups)
    for item in copies:
        new, sep, base = (x.strip() for x in item.partition("="))
        if not sep or not new or base not in out:
            raise ValueError(f"--copy-setup expects NEW=BASE with BASE one of {', '.join(out)}, got {item!r}.")
        if new in out or new == "all" or "|" in new:
            raise ValueError(f"--copy-setup: {new!r} is taken or not a valid setup name.")
        out[new] = dataclasses.replace(out[base], name=new)
    return out


def apply_sets(setups: dict[str, Setup], sets: list[str]) -> dict[str, Setup]:
    """--set SETUP.FIELD=VALUE (SETUP may be `all`)."""
    out = dict(setups)
    for item in sets:
        lhs, sep, value = item.partition("=")
        name, dot, fld = lhs.partition(".")
        if not sep or not dot:
            raise ValueError(f"--set expects SETUP.FIELD=VALUE, got {item!r}.")
        targets = list(out) if name == "all" else [name]
        for t in targets:
            if t not in out:
                raise ValueError(f"--set names unknown setup {t!r}; known: {', '.join(out)}, all.")
            if fld in TUPLE_FIELDS:
                parsed = csv_values(value, TUPLE_FIELDS[fld])
            elif fld in SCALAR_FIELDS:
                kind = SCALAR_FIELDS[fld]
                if fld in NONE_FIELDS and value.lower() in ("", "none", "model"):
                    parsed = None
                else:
                    try:
                        parsed = kind(value)
                    except ValueError:
                        raise ValueError(f"--set {lhs} needs a {kind.__name__}, got {value!r}.") from None
            else:
                raise ValueError(f"--set cannot change {fld!r}; allowed: "
                                 f"{', '.join(sorted({**TUPLE_FIELDS, **SCALAR_FIELDS}))}.")
            out[t] = dataclasses.replace(out[t], **{fld: parsed})
    return out
