"""benchmarks/long_context_offline.py on the committed tiny pair with short synthetic prompts (CPU, seconds): the NLL
bins, the windowed reference, the loop measures, lossless decoding and the result file's fields."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from fixtures.offline_models import needs_tiny_pair, one_thread, tiny_pair

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import long_context_offline as lc  # noqa: E402


CODE = '''
def parse_header(data, offset=0):
    """Read a chunk header: a 4-byte name and a big-endian size."""
    name = data[offset:offset + 4]
    size = int.from_bytes(data[offset + 4:offset + 8], "big")
    if size < 0:
        raise ValueError("negative chunk size")
    return name, size


class Reader:
    def __init__(self, data):
        self.data = data
        self.offset = 0
        self.chunks = []

    def read_all(self):
        while self.offset + 8 <= len(self.data):
            name, size = parse_header(self.data, self.offset)
            self.chunks.append((name, self.offset + 8, size))
            self.offset += 8 + size + (size & 1)
        return self.chunks

    def find(self, wanted):
        for name, start, size in self.chunks:
            if name == wanted:
                return self.data[start:start + size]
        return None
'''


@pytest.fixture(scope="module")
def pair():
    with tiny_pair() as loaded:
        yield loaded


def _ids(tok, n):
    ids = tok.encode(CODE * 8, add_special_tokens=False)
    assert len(ids) >= n
    return ids[:n]


@needs_tiny_pair
def test_chunked_nll_and_window_agree_with_one_forward(pair):
    tok, target, _ = pair
    ids = _ids(tok, 300)
    with one_thread(), torch.no_grad():
        whole = torch.nn.functional.cross_entropy(target(input_ids=torch.tensor([ids])).logits[0, :-1].float(),
                                                  torch.tensor(ids[1:]), reduction="none").double()
        chunked = lc.prompt_nll(target, ids, chunk=64)
        win = lc.windowed_nll(target, ids, window=128, stride=64)
    assert torch.isnan(chunked[0]) and torch.isnan(win[0])
    torch.testing.assert_close(chunked[1:], whole, atol=1e-4, rtol=1e-4)
    # inside the first window the windowed reference is the full context; past it, every token is scored once
    torch.testing.assert_close(win[1:128], whole[:127], atol=1e-4, rtol=1e-4)
    assert not torch.isnan(win[1:]).any()
    assert not torch.allclose(win[128:], whole[127:])  # it really dropped context

    bins = lc.bin_sums(chunked, edges=(0, 100, 200, 400, 800))
    assert [(b["lo"], b["hi"], b["count"]) for b in bins] == [(0, 100, 99), (100, 200, 100), (200, 400, 100)]
    assert sum(b["sum"] for b in bins) == pytest.approx(float(whole.sum()))
    pooled = lc.pool_bins([bins, bins[:1]])
    assert pooled[0]["tokens"] == 198 and pooled[0]["prompts"] == 2 and pooled[2]["prompts"] == 1
    assert pooled[0]["nll"] == pytest.approx(bins[0]["sum"] / 99)

    rep = lc.nll_report(target, ids, chunk=128, window=128, stride=64)
    stored = lc.compact_nll(rep)
    assert stored["bins"][0]["lo"] == 0 and stored["bins"][0]["tokens"] == 299
    assert stored["bins"][0]["delta"] == pytest.approx(stored["bins"][0]["nll"] - stored["bins"][0]["nll_windowed"],
                                                       abs=2e-4)


def test_loop_measures():
    assert lc.loop_stats([7] * 80)["loop_share_p4"] == 1.0
    distinct = list(range(100))
    assert lc.loop_stats(distinct) == {"loop_share_p4": 0.0, "loop_share_p32": 0.0, "distinct_4gram_share": 1.0}
    period3 = list(range(60)) + [1, 2, 3] * 10  # the last 30 tokens loop with period 3
    mask = lc.loop_mask(period3, 4)
    assert not any(mask[:60]) and all(mask[60:])
    assert lc.loop_stats(period3, tail=60)["loop_share_p4"] == pytest.approx(0.5)
    # a period-10 block repeated twice is no short loop, but a long one once it has 3 copies
    block = list(range(100, 110))
    assert not any(lc.loop_mask(list(range(20)) + block * 2, 4))
    assert any(lc.loop_mask(list(range(20)) + block * 3, 32)) and not any(lc.loop_mask(block * 2, 32))
    assert lc.common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2


@needs_tiny_pair
def test_decoders_equal_plain_and_taus_pool(pair):
    from sglang_ddtree.offline.drafts import DFlashDraftSource

    tok, target, drafter = pair
    draft = DFlashDraftSource(drafter, target)
    recs = []
    with one_thread():
        for n in (120, 260):
            recs.append(lc.decode_methods(target, draft, _ids(tok, n), max_new_tokens=16, eos_token_ids=[0],
                                          budgets=[4, 16]))
    methods = ["dflash", "ddtree_b4", "ddtree_b16"]
    for r in recs:
        assert len(r["plain"]["output_ids"]) == 16
        for m in methods:
            assert r[m]["equals_plain"], m
            assert 1.0 <= r[m]["tau"] <= 16 and r[m]["tokens"] >= 15  # the first token comes from the prefill
    pooled = lc.pool_taus(recs, methods)
    for m in methods:
        assert pooled[m]["lossless"] == "2/2"
        assert pooled[m]["tau"] == pytest.approx(pooled[m]["tokens"] / pooled[m]["rounds"])


@needs_tiny_pair
def test_main_writes_every_field(pair, tmp_path, capsys):
    tok = pair[0]
    prompts = tmp_path / "prompts.jsonl"
    with prompts.open("w") as f:
        for i, n in enumerate((200, 150)):
            text = tok.decode(_ids(tok, n))
            f.write(json.dumps({"id": f"code-256-{i:02d}", "kind": "long_code", "target_tokens": 256, "text": text,
                                "tokens": len(tok.encode(text, add_special_tokens=False))}) + "\n")
    out = tmp_path / "r.json"
    with one_thread():
        assert lc.main(["--out", str(out), "--prompts", str(prompts), "--nll-prompts", "256:2",
                        "--decode-prompts", "256:1", "--max-new-tokens", "8", "--budgets", "4", "--short", "64",
                        "--window", "128", "--stride", "64", "--chunk", "64"]) == 0
    res = json.loads(out.read_text())
    setup = res["setup"]
    for key in ("command", "commit", "versions", "models", "prompts_sha256", "reference", "elapsed_s", "cpu_s"):
        assert key in setup, key
    assert setup["models_match_training_log"] is True and setup["reference"]["train_seq_len"] == 1024
    pooled = res["nll_pooled"]["256"]
    assert pooled["prompts"] == ["code-256-00", "code-256-01"]
    assert pooled["bins"][0]["tokens"] == 199 + 149 and pooled["bins"][0]["lo"] == 0
    assert set(res["nll_per_prompt"]["256"]) == {"code-256-00", "code-256-01"}
    group = res["decode_groups"]["256"]
    assert group["prompts"] == ["code-256-00"]
    for name in ("long", "head", "tail"):
        assert set(group[name]["taus"]) == {"dflash", "ddtree_b4"}
        assert group[name]["taus"]["dflash"]["lossless"] == "1/1"
        assert 0.0 <= group[name]["loop_share_p4"] <= 1.0
    entry = res["decode_per_prompt"]["code-256-00"]
    assert entry["head"]["plain"]["new_tokens"] == 8 and "text" in entry["long"]["plain"]
    assert res["lossless_all"] is True
    assert "lossless (every speculative output equals plain): True" in capsys.readouterr().out


def test_help_runs():
    with pytest.raises(SystemExit) as e:
        lc.main(["--help"])
    assert e.value.code == 0
