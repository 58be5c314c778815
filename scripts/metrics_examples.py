"""The examples of docs/metrics.md, from real runs of the code on CPU:

  prometheus  the server's series (sglang/prometheus.py, as DDTreeStats feeds them) after the recorded tiny-pair rounds
              of tests/fixtures/recorded_rounds_tiny.jsonl (DDTree, budget 64, 4 HumanEval prompts x 96 tokens),
              in prometheus_client's exposition (what /metrics serves); a selection of the lines
  meta_info   plugin.ddtree_meta_info (the keys added to /generate's meta_info) for the first prompt of that file,
              from its accept-length and branch histograms, as SGLang's tokenizer process would get them
  dump        one --speculative-ddtree-debug line (DDTreeStats.record_round) for a real round: the offline decoder on
              the tiny pair (budget 16, first HumanEval prompt, greedy), its tree and walk captured at the first round

  python scripts/metrics_examples.py [prometheus|meta_info|dump ...]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIXTURE = ROOT / "tests" / "fixtures" / "recorded_rounds_tiny.jsonl"

def _keep() -> tuple[str, ...]:
    """The sample names the example shows (metric_names: the server's own)."""
    from sglang_ddtree import metric_names as mn

    return (mn.ROUNDS.name, mn.ACCEPTED_TOKENS.name, mn.DEPTH_REACHED.name, mn.BRANCH_ACCEPTED.name,
            mn.TREE_NODES.name, mn.EXPECTED_TOKENS.name, mn.STAGE_SECONDS.sum, mn.STAGE_SECONDS.count,
            mn.STAGE_HOST_SECONDS.name, mn.STAGE_HOST_ROUNDS.name, mn.ACCEPT_LENGTH.name)


def prometheus() -> str:
    from sglang_ddtree.dashboard import ReplayServer, replay_rounds

    rounds, depth_limit = replay_rounds(FIXTURE, "ddtree_tb64")
    srv = ReplayServer("64", depth_limit, num_draft_tokens=65)
    for b in rounds:
        srv.feed(b)
    srv.flush()
    text = srv.exposition().decode()
    keep = _keep()
    out = []
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if line.startswith("#") or name not in keep:
            continue
        if ('depth="' in line and not any(f'depth="{d}"' in line for d in (1, 2, 3))) or \
                ('tokens="' in line and not any(f'tokens="{d}"' in line for d in (1, 2, 3))):
            continue
        if "stage=" in line and not any(f'stage="{s}"' in line for s in ("draft", "verify")):
            continue
        out.append(line)
    return "\n".join(out)


def meta_info() -> dict:
    from sglang_ddtree.baseline import read_baseline
    from sglang_ddtree.sglang.plugin import ddtree_meta_info

    base = read_baseline(FIXTURE)
    rec = next(r for r in base.records if r.method == "ddtree_tb64")
    depth_limit = int(base.header.block_size) - 1
    accepted = [a - 1 for a in rec.accept_lengths]
    branches = [sum(1 for r in ranks if r != 0) for ranks in rec.accepted_ranks]
    hist = [accepted.count(k) for k in range(depth_limit + 1)]
    branch_hist = [branches.count(k) for k in range(depth_limit + 1)]
    info = ddtree_meta_info(hist, depth_limit, branch_hist)
    return {"prompt": rec.prompt_id, "spec_correct_drafts_histogram": hist, "meta_info": info}


def dump() -> dict:
    import torch

    from sglang_ddtree import tiny
    from sglang_ddtree.datasets import encode_prompt, load_prompts
    from sglang_ddtree.drafter import DFlashDrafter
    from sglang_ddtree.offline import decoders
    from sglang_ddtree.offline.drafts import DFlashDraftSource
    from sglang_ddtree.sglang.stats import DDTreeStats

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(str(tiny.tiny_dir() / "tokenizer"), local_files_only=True)
    target = AutoModelForCausalLM.from_pretrained(str(tiny.tiny_dir() / "target"), dtype=torch.float32,
                                                  attn_implementation="sdpa", local_files_only=True).eval()
    drafter = DFlashDrafter.from_pretrained(str(tiny.tiny_dir() / "drafter"), device="cpu", dtype=torch.float32).eval()
    prompt = load_prompts("humaneval", limit=1)[0]
    ids = encode_prompt(tok, prompt)
    captured = []
    original = decoders._Sampler.walk

    def walk(self, tree, logits):
        result = original(self, tree, logits)
        captured.append((tree, result))
        return result

    decoders._Sampler.walk = walk
    try:
        rec = decoders.speculative_decode(target, DFlashDraftSource(drafter, target), ids, method="ddtree",
                                          budget=16, max_new_tokens=8)
    finally:
        decoders._Sampler.walk = original
    tree, result = captured[0]

    class Req:  # what the dump reads of an SGLang request
        rid = "example-request"
        origin_input_ids = ids

    class Timer:  # the round's stage times as the offline decoder measured them (the server's are CUDA events)
        enabled, end_event, marks = False, None, []

        def elapsed_ms(self):
            return {s: round(v[0], 3) for s, v in rec.stage_ms.items()}

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dump.jsonl"
        stats = DDTreeStats(enable_metrics=False, debug_path=str(path), depth_limit=tree.depth_limit, budget=16)
        # seq_lens: committed tokens before the round = the prompt + the prefill's token - 1 (the root is not in the
        # KV cache yet)
        stats.record_round(tree, result, Timer(), batch_size=1, reqs=[Req()], seq_lens=torch.tensor([len(ids)]))
        stats.debug.close()
        header, row = [json.loads(x) for x in path.read_text().splitlines()]
    return {"header": header, "row": row}


def main(argv: list[str]) -> int:
    which = argv or ["prometheus", "meta_info", "dump"]
    for name in which:
        value = {"prometheus": prometheus, "meta_info": meta_info, "dump": dump}[name]()
        print(f"## {name}")
        print(value if isinstance(value, str) else json.dumps(value, separators=(", ", ": ")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
