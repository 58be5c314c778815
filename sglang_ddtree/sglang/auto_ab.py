"""`auto`'s measuring modes, each behind one variable read when the worker starts; off, they cost nothing.

- SGLANG_DDTREE_AUTO_AB=N (auto_ab_block, ABSchedule): an `auto` server's decode rounds alternate in blocks of N
  between `auto` and the fixed widest candidate tree (the fixed-budget server's own round), each arm's tokens and time
  tallied apart (stats.ABTallies, Prometheus `sglang:ddtree_ab_*{arm}`). Why: on a host-bound pair the host's speed
  moves by a third between runs and servers, so two servers' ratio cannot resolve a few percent; rounds a few
  milliseconds apart in one process share the host's speed and the text, and the arms' ratio cancels both.
- SGLANG_DDTREE_AUTO_HOST_DETAIL=1 (auto_host_detail): `auto`'s rounds mark its own host work apart
  (stages.AUTO_HOST_DETAIL: the chooser block's parts, the walk variant, the feedback and table work after the
  commit); each mark costs a clock read and a list append.
"""

from __future__ import annotations

import os

from sglang_ddtree.config import at_least, env_value, switch

MEASURING_MODES = ("SGLANG_DDTREE_AUTO_AB", "SGLANG_DDTREE_AUTO_HOST_DETAIL")


def auto_ab_block(environ=None) -> int:
    """SGLANG_DDTREE_AUTO_AB: the A/B block length in decode rounds (unset or 0: off)."""
    env = os.environ if environ is None else environ
    return env_value(env, "SGLANG_DDTREE_AUTO_AB", at_least(0), "a block length in rounds >= 0 (0: off)") or 0


def auto_host_detail(environ=None) -> bool:
    """SGLANG_DDTREE_AUTO_HOST_DETAIL=1: `auto`'s own host work marked apart (unset or 0: off)."""
    env = os.environ if environ is None else environ
    return bool(env_value(env, "SGLANG_DDTREE_AUTO_HOST_DETAIL", switch, "0 or 1"))


class ABSchedule:
    """The A/B's arms round by round: `block` decode rounds of `auto`, then `block` of the fixed widest tree, and so
    on (block 0: `auto` every round). Counted over decode rounds whatever their batch size, so both arms meet every
    batch size and every stretch of the text alike."""

    def __init__(self, block: int):
        if block < 0:
            raise ValueError(f"an A/B block is >= 0 rounds, got {block}.")
        self.block = block
        self.rounds = 0

    def next_is_fixed(self) -> bool:
        """Whether the next decode round is the fixed arm's."""
        if not self.block:
            return False
        fixed = (self.rounds // self.block) % 2 == 1
        self.rounds += 1
        return fixed
