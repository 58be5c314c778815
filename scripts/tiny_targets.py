"""The target architectures of scripts/train_tiny_pair.py (`--target-arch`), and the few things that differ by arch.

- `qwen3`: a dense transformers Qwen3ForCausalLM (the committed pair in models/tiny).
- `qwen3_5_text`: a dense-MLP gated-delta-net hybrid, transformers Qwen3_5ForCausalLM: every 4th layer gated full
  attention, the others gated-delta-net linear attention. Its default shape widens exactly (bf16) to Qwen3.5-27B
  with sglang_ddtree.widen_hybrid: hidden 320 (x16), full-attention head_dim 64 (x4) with partial rotary 0.25,
  linear-attention key / value head dims 128 (kept), conv kernel 4, and a drafter of head_dim 128 (kept). The
  trainer refuses a shape that would not widen exactly to `--widen-shape` before it trains anything.

What differs by arch, and only that, lives here: the shape defaults (full run and --smoke; also the target batch,
which memory decides), the target config and model, the drafter's default feature layers, the final norm's effective
gain (Qwen3.5 norms compute (1 + w) * x, the drafter's Qwen3-style norm w * x), and the flat config keys SGLang 0.5.17
reads for a Qwen3.5 text model. The data, the drafter objective and the evaluation are shared and live in the trainer.
"""

from __future__ import annotations

ARCHS = ("qwen3", "qwen3_5_text")
DEFAULT_ARCH = "qwen3"
# Every 4th layer full attention, as in Qwen3.5-27B (widen_hybrid maps each small layer onto a big one of its type).
FULL_ATTENTION_INTERVAL = 4
ROPE_THETA = 10000.0

# Options that only the hybrid reads.
HYBRID_ONLY_KEYS = ("linear_key_heads", "linear_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                    "conv_kernel", "partial_rotary")

_QWEN3 = dict(hidden=256, layers=6, heads=4, kv_heads=2, head_dim=64, intermediate=768, target_batch=128)
_QWEN3_SMOKE = dict(hidden=64, layers=4, heads=2, kv_heads=1, head_dim=32, intermediate=128)
# 2 key / 4 value heads of 128: the 27B has 16 / 48 (at most 3 value heads per key head fit); 4 q / 2 kv heads of 64
# (at most 6 q per kv and 4 kv fit); the drafter's 4 q / 2 kv heads of 128 fit its 32 / 8.
# Target batch 32 x 1024 tokens: transformers' torch fallback of the chunked delta rule keeps ~4.7x the dense pair's
# activations per token for the backward (counted on the CPU: ~97 GiB at 128 rows in float32, ~24 GiB at 32).
_HYBRID = dict(hidden=320, layers=8, heads=4, kv_heads=2, head_dim=64, intermediate=1024,
               linear_key_heads=2, linear_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128,
               conv_kernel=4, partial_rotary=0.25, drafter_heads=4, drafter_kv_heads=2, drafter_head_dim=128,
               target_batch=32)
# The smoke shape keeps every width that decides the widening, with one 3 : 1 group of layers and a narrower MLP.
_HYBRID_SMOKE = dict(_HYBRID, layers=4, intermediate=256, drafter_intermediate=256)

ARCH_DEFAULTS = {"qwen3": (_QWEN3, _QWEN3_SMOKE), "qwen3_5_text": (_HYBRID, _HYBRID_SMOKE)}


def add_hybrid_options(group) -> None:
    """The hybrid's own shape options (argparse); None = the arch's default."""
    group.add_argument("--linear-key-heads", type=int, default=None, help="hybrid: linear-attention key heads")
    group.add_argument("--linear-value-heads", type=int, default=None, help="hybrid: linear-attention value heads")
    group.add_argument("--linear-key-head-dim", type=int, default=None)
    group.add_argument("--linear-value-head-dim", type=int, default=None)
    group.add_argument("--conv-kernel", type=int, default=None, help="hybrid: linear-attention conv kernel")
    group.add_argument("--partial-rotary", type=float, default=None, help="hybrid: rotary fraction of the head dim")


def arch_defaults(arch: str, smoke: bool) -> dict:
    """Defaults of the shape options (and the target batch) for `arch`; --smoke's own settings come first."""
    return dict(ARCH_DEFAULTS[arch][1 if smoke else 0])


def is_hybrid(arch: str) -> bool:
    return arch == "qwen3_5_text"


def target_config(args, vocab_size: int, eos_id: int):
    """The transformers config of a fresh target of `args.target_arch` with the shape in args."""
    common = dict(vocab_size=vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                  intermediate_size=args.intermediate, hidden_act="silu", max_position_embeddings=4096,
                  rms_norm_eps=1e-6, attention_bias=False, attention_dropout=0.0, bos_token_id=eos_id,
                  eos_token_id=eos_id, pad_token_id=eos_id, initializer_range=0.02)
    if args.target_arch == "qwen3":
        from transformers import Qwen3Config

        config = Qwen3Config(rope_theta=ROPE_THETA,  # transformers 5 turns this into rope_parameters
                             tie_word_embeddings=True, use_sliding_window=False, **common)
        config.architectures = ["Qwen3ForCausalLM"]
        return config
    if args.target_arch == "qwen3_5_text":
        from transformers import Qwen3_5TextConfig

        config = Qwen3_5TextConfig(
            # untied, as Qwen3.5-27B (widen_hybrid writes an untied lm_head either way)
            tie_word_embeddings=False, full_attention_interval=FULL_ATTENTION_INTERVAL,
            rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA,
                             "partial_rotary_factor": args.partial_rotary},
            linear_num_key_heads=args.linear_key_heads, linear_num_value_heads=args.linear_value_heads,
            linear_key_head_dim=args.linear_key_head_dim, linear_value_head_dim=args.linear_value_head_dim,
            linear_conv_kernel_dim=args.conv_kernel, **common)
        config.architectures = ["Qwen3_5ForCausalLM"]
        return config
    raise ValueError(f"unknown --target-arch {args.target_arch!r}; one of {ARCHS}.")


def build_target(config):
    """A randomly initialised target of that config (transformers' own init), sdpa attention."""
    from transformers import Qwen3_5ForCausalLM, Qwen3ForCausalLM

    cls = Qwen3_5ForCausalLM if config.model_type == "qwen3_5_text" else Qwen3ForCausalLM
    try:
        return cls._from_config(config, attn_implementation="sdpa")
    except (TypeError, ValueError):
        return cls(config)


def default_feature_layers(arch: str, n_layers: int) -> list[int]:
    """Target layers whose outputs the drafter reads (unless --target-layer-ids). The dense pair reads layers 1 and
    n - 2. The hybrid adds one in the middle (layer 3, a full-attention layer, of 8): with 8 layers, [1, 3, 6] land
    on the 27B's feature layers 1, 31 and 61 once widened."""
    ids = {1, n_layers - 2}
    if is_hybrid(arch):
        ids.add(n_layers // 2 - 1)
    return sorted(ids)


def final_norm_gain(model):
    """The target's final-norm gain as a Qwen3-style norm (w * x) would hold it: the drafter's norm starts there."""
    w = model.model.norm.weight.detach().float()
    return 1.0 + w if model.config.model_type == "qwen3_5_text" else w


def serving_config_keys(config) -> dict:
    """Flat keys to add to the saved config.json. SGLang 0.5.17's Qwen3.5 text config (a subclass of its own
    Qwen3NextConfig) derives the layer types from `full_attention_interval`, which transformers 5 folds into
    `layer_types` when it saves, and reads the rotary settings flat."""
    if config.model_type != "qwen3_5_text":
        return {}
    types = list(config.layer_types)
    expected = ["full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
                for i in range(len(types))]
    if types != expected:
        raise ValueError(f"layer_types {types} are not the every-{FULL_ATTENTION_INTERVAL}th pattern SGLang derives.")
    rope = config.rope_parameters or {}
    return {"full_attention_interval": FULL_ATTENTION_INTERVAL,
            "rope_theta": float(rope.get("rope_theta", ROPE_THETA)),
            "partial_rotary_factor": float(rope.get("partial_rotary_factor", 1.0))}


def check_widening(shape: str, config, drafter_config: dict) -> dict:
    """sglang_ddtree.widen_hybrid's plan for a target config (transformers) and its drafter's config.json content;
    ValueError if the pair does not fit `shape`, or fits it only inexactly in bf16."""
    from sglang_ddtree.widen_hybrid import HYBRID_SHAPES, check_hybrid_pair

    if shape not in HYBRID_SHAPES:
        raise ValueError(f"--widen-shape {shape!r} is not one of {sorted(HYBRID_SHAPES)} (or 'none').")
    result = check_hybrid_pair(config.to_dict(), HYBRID_SHAPES[shape], drafter_config)
    if not result["scales"]["bf16_exact"]:
        raise ValueError(f"this pair widens to {shape} only inexactly in bf16 (scales {result['scales']}): the hidden "
                         "ratio and the head-dim ratios must be powers of 4 (docs/hybrid-design.md, section 8); change "
                         "the shape or pass --widen-shape none.")
    return result
