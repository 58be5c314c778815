"""Lossless contract on the committed tiny pair (models/tiny), greedy, float32 CPU. Skipped until the pair exists."""

from __future__ import annotations

import pytest

from fixtures.offline_models import needs_tiny_pair, one_thread, tiny_pair

pytestmark = needs_tiny_pair

MAX_NEW = 32


@pytest.fixture(scope="module")
def pair():
    with tiny_pair() as loaded:
        yield loaded


def test_tiny_pair_is_lossless_at_t0(pair):
    from sglang_ddtree.datasets import encode_prompt, load_prompts
    from sglang_ddtree.offline.decoders import plain_decode, speculative_decode
    from sglang_ddtree.offline.drafts import DFlashDraftSource

    tok, target, drafter = pair
    draft = DFlashDraftSource(drafter, target)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    accepted_any = False
    with one_thread():
        for prompt in load_prompts("humaneval", limit=2):
            ids = encode_prompt(tok, prompt)
            plain = plain_decode(target, ids, max_new_tokens=MAX_NEW, eos_token_ids=eos)
            for method, budget in [("dflash", None), ("ddtree", 1), ("ddtree", 16), ("ddtree", 64)]:
                rec = speculative_decode(target, draft, ids, method=method, budget=budget, max_new_tokens=MAX_NEW,
                                         eos_token_ids=eos)
                assert rec.output_ids == plain.output_ids, (prompt.id, method, budget)
                assert rec.finish_reason == plain.finish_reason
                accepted_any |= max(rec.accept_lengths, default=1) > 1
    assert accepted_any  # the trained drafter gets drafts accepted, so the tree path is exercised
