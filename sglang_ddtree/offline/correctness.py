"""The CI correctness check: the offline decoders on the committed tiny pair against committed baselines.

`run_check_decoders` decodes a fixed, small set (`CHECK`) on CPU in float32 at T=0 and returns a Baseline; tests
compare it, with `sglang_ddtree.compare`, against
  * `benchmarks/results/baselines/ci_tiny_t0.jsonl`: the same run in our format, with per-round accept lengths,
    tree hashes and the target's top-2 gaps (the exact rule fails on any difference in any of them);
  * `benchmarks/results/baselines/ci_tiny_t0_reference.pt`: the same run in the DDTree paper's reference file shape
    (`torch.save` of per-prompt SimpleNamespaces, `save_tree_traces` round trees, the reference loop's extra final
    round, prompts named by index), written by `export_reference_style` from a longer run of our decoder (that
    extra round is the round our decoder runs next); it tests the import path, not the paper's code;
  * `benchmarks/results/baselines/offline_humaneval_t0.jsonl.xz` (40 prompts x 128 tokens, all budgets): the prompts
    and methods the check shares with it.
The prompts are the HumanEval prompts of that 40-prompt file with the most full-depth (16-token) rounds, so that a
bug that only trees of depth 15 reach (e.g. a wrong position for the deepest nodes) changes what is recorded.
`scripts/make_ci_baselines.py` rewrites the two ci_tiny files; `scripts/planted_bugs.py` runs the planted bugs.
"""

from __future__ import annotations

import contextlib
import platform
import types
from dataclasses import dataclass
from pathlib import Path

BASELINE_DIR = Path(__file__).resolve().parent.parent.parent / "benchmarks" / "results" / "baselines"
OURS_PATH = BASELINE_DIR / "ci_tiny_t0.jsonl"
REFERENCE_PATH = BASELINE_DIR / "ci_tiny_t0_reference.pt"
WIDE_PATH = BASELINE_DIR / "offline_humaneval_t0.jsonl.xz"


@dataclass(frozen=True)
class CheckSettings:
    prompt_indices: tuple[int, ...] = (0, 8, 13, 16, 23, 39)  # HumanEval file order
    methods: tuple[str, ...] = ("plain", "dflash", "ddtree_tb16", "ddtree_tb64", "ddtree_tb256")
    reference_methods: tuple[str, ...] = ("plain", "dflash", "ddtree_tb16", "ddtree_tb64")  # in the .pt file
    max_new_tokens: int = 128
    dataset: str = "humaneval"


CHECK = CheckSettings()


@contextlib.contextmanager
def one_thread():
    """Tiny models on a shared 2-core box: torch's intra-op thread pool costs ~100x on microsecond ops."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


class TinyPair:
    """The committed tiny pair loaded once (float32, CPU, sdpa) with the check's prompts encoded."""

    def __init__(self, settings: CheckSettings = CHECK):
        from sglang_ddtree import tiny
        from sglang_ddtree.baseline import fingerprint_dir
        from sglang_ddtree.datasets import encode_prompt, load_prompts
        from sglang_ddtree.offline.drafts import DFlashDraftSource
        from sglang_ddtree.offline.runner import PromptInput

        self.settings = settings
        self.tokenizer = tiny.load_tokenizer()
        self.target = tiny.load_target()
        self.target.config._attn_implementation = "sdpa"
        self.drafter = tiny.load_drafter()
        self.draft = DFlashDraftSource(self.drafter, self.target)
        prompts = load_prompts(settings.dataset, limit=max(settings.prompt_indices) + 1)
        self.prompts = [PromptInput(prompts[i].id, prompts[i].index, encode_prompt(self.tokenizer, prompts[i]))
                        for i in settings.prompt_indices]
        self.eos = [int(self.tokenizer.eos_token_id)] if self.tokenizer.eos_token_id is not None else []
        self.fingerprints = {"target": fingerprint_dir(tiny.tiny_dir() / "target"),
                             "drafter": fingerprint_dir(tiny.tiny_dir() / "drafter")}

    def header(self, max_new_tokens: int):
        import torch
        import transformers

        from sglang_ddtree.baseline import BaselineHeader

        return BaselineHeader(
            source="offline", target={"path": "models/tiny/target", "fingerprint": self.fingerprints["target"]},
            drafter={"path": "models/tiny/drafter", "fingerprint": self.fingerprints["drafter"]},
            tokenizer="models/tiny/tokenizer", dtype="float32", device="cpu", attn_implementation="sdpa",
            temperature=0.0, top_k=0, top_p=1.0, seed=0, max_new_tokens=max_new_tokens,
            block_size=int(self.drafter.config.block_size), dataset=self.settings.dataset,
            versions={"python": platform.python_version(), "torch": torch.__version__,
                      "transformers": transformers.__version__},
            extra={"methods": list(self.settings.methods), "prompt_indices": list(self.settings.prompt_indices),
                   "chat": "auto", "commit": "gather", "eos_token_ids": self.eos, "record_trees": False,
                   "made_by": "sglang_ddtree/offline/correctness.py"},
        )

    def decode(self, methods=None, *, max_new_tokens: int | None = None, bug: str | None = None,
               record_trees: bool = False):
        """Baseline of the check's prompts x methods (optionally with a planted bug switched on)."""
        from sglang_ddtree.baseline import Baseline
        from sglang_ddtree.offline.planted_bugs import planted
        from sglang_ddtree.offline.runner import RunSettings, decode_one

        methods = list(methods or self.settings.methods)
        n = max_new_tokens or self.settings.max_new_tokens
        s = RunSettings(methods=methods, max_new_tokens=n, eos_token_ids=self.eos, record_trees=record_trees)
        ctx = planted(bug) if bug else contextlib.nullcontext()
        with one_thread(), ctx:
            records = [decode_one(self.target, self.draft, p, m, s) for p in self.prompts for m in methods]
        for r in records:  # wall times are not part of a correctness baseline
            r.stage_ms, r.prefill_ms, r.total_ms = None, None, None
        return Baseline(self.header(n), records)


def export_reference_style(long_run, prompts, max_new_tokens: int, block_size: int, methods, *,
                           stop_token_ids=(), args: dict | None = None) -> dict:
    """A dict shaped like the DDTree reference harness's `torch.save` output, from a run of our decoder with at least
    `max_new_tokens + block_size` new tokens and dumped trees (`long_run`, a Baseline).

    Emulates the reference loop: a round runs while its root lies below prompt + max_new_tokens (so one more round
    runs after an exactly full output, the round our longer run did next) and the loop stops after a round that
    emitted a stop token; the output is cut to max_new_tokens and at the first stop token. Round trees follow
    `save_tree_traces`: {"accepted_indices": [0, ...], "tree": {"node_token_ids", "node_depths", "parents"}} with
    the draft nodes in our node order. `baseline` is the reference's name for plain decoding."""
    import torch

    responses = []
    stop = {int(t) for t in stop_token_ids}
    for p in prompts:
        resp = {}
        for m in methods:
            rec = long_run.get(p.id, m)
            if rec is None:
                raise ValueError(f"the long run has no record for prompt {p.id!r} method {m!r}.")
            if len(rec.output_ids) < max_new_tokens and rec.finish_reason != "eos":
                raise ValueError(f"prompt {p.id!r} {m}: the long run has {len(rec.output_ids)} tokens, fewer than "
                                 f"{max_new_tokens}, and did not stop at a stop token.")
            out = list(rec.output_ids[:max_new_tokens])
            for i, t in enumerate(out):
                if t in stop:
                    out = out[: i + 1]
                    break
            acc, trees, root = [], [], 0
            for r, a in enumerate(rec.accept_lengths):
                if root >= max_new_tokens:
                    break
                acc.append(a)
                if m != "plain" and m != "dflash":
                    trees.append(_trace(rec.trees[r], rec.output_ids, root, a, p.id, r))
                emitted = rec.output_ids[root: root + a + 1]
                root += a
                if any(t in stop for t in emitted):
                    break
            resp["baseline" if m == "plain" else m] = types.SimpleNamespace(
                output_ids=torch.tensor([list(p.token_ids) + out]),
                num_input_tokens=len(p.token_ids), num_output_tokens=len(out),
                time_to_first_token=0.0, time_per_output_token=0.0,
                acceptance_lengths=acc, decode_rounds=len(acc), stage_times={}, round_timestamps=[0.0] * len(acc),
                **({"round_trees": trees} if m not in ("plain", "dflash") else {}),
            )
        responses.append(resp)
    return {"responses": responses, "block_size": block_size, "draft_attn_implementation": "sdpa",
            "target_attn_implementation": "sdpa", "args": dict(args or {})}


def _trace(tree: dict, output_ids: list[int], root: int, accept: int, pid: str, r: int) -> dict:
    tokens, parents = tree["tokens"], tree["parents"]
    depth = [0] * len(tokens)
    for i in range(1, len(tokens)):
        depth[i] = depth[parents[i]] + 1
    path, node = [0], 0
    for d in range(1, accept):
        want = output_ids[root + d]
        child = next((i for i in range(1, len(tokens)) if parents[i] == node and tokens[i] == want), None)
        if child is None:
            raise ValueError(f"prompt {pid!r} round {r}: accepted token {want} at depth {d} is not in the tree.")
        path.append(child)
        node = child
    return {"accepted_indices": path,
            "tree": {"node_token_ids": tokens[1:], "node_depths": depth[1:], "parents": parents}}


def load_reference_baseline(path=REFERENCE_PATH):
    """The committed reference-format file, imported (it records dtype and device in its args)."""
    from sglang_ddtree.reference_import import import_reference

    return import_reference(path, dataset=CHECK.dataset)


def check(run, baselines: dict, *, methods=None, thresholds=None) -> dict[str, dict]:
    """compare(baseline, run) for each named baseline; returns the reports by name."""
    from sglang_ddtree.compare import compare

    out = {}
    for name, base in baselines.items():
        common = [m for m in (methods or run.methods) if m in base.methods]
        out[name] = compare(base, run, methods=common, n_boot=200, thresholds=thresholds)
    return out


def called_noise(report: dict) -> int:
    """Differences a report classes as noise (divergences and trees)."""
    n = 0
    for r in report["methods"].values():
        n += r.get("divergence_counts", {}).get("noise", 0)
        n += r.get("tree_difference_counts", {}).get("noise", 0)
    return n
