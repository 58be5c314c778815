"""Offline reference decoders on transformers (batch size 1, CPU or GPU) and the runner that writes baseline files.

plain decoding, the DFLASH chain and DDTree at any budget; see `decoders` for the round structure and `target` for
how the tree is verified and committed.
"""

from sglang_ddtree.offline.decoders import plain_decode, speculative_decode

__all__ = ["plain_decode", "speculative_decode"]
