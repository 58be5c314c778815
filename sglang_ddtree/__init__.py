"""DDTree speculative decoding: budgeted draft trees from one block-diffusion drafter pass.

Core (plain torch, CPU and CUDA): `tree`, `layout`, `walk`, `metrics`, `drafter`.
Engines on top: `offline` (transformers reference decoders) and `sglang` (server plugin).
"""

__version__ = "0.1.0"
