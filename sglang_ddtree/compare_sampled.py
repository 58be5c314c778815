"""Sampled (T > 0) runs: does the candidate draw from the same distribution as the baseline?

Sampled outputs are not expected to match token for token, but a lossless decoder's outputs and acceptance follow
one distribution given the prompt, the model pair and the sampling settings. The comparator tests that with a
paired permutation test over prompts (`sampled_tests`):

  * Null hypothesis: for every prompt, the baseline's and the candidate's records are two independent draws from
    the same distribution (the same decoder up to its random numbers; runs with different seeds, or identical
    runs). Then swapping the two records of any prompt leaves the joint distribution unchanged, so the observed
    statistic is one draw among its values under random swaps: the p-value is the share of `n_perm` random swap
    patterns (plus the observed one) whose statistic is at least the observed one. Its false-alarm rate is at most
    the significance level, whatever the statistic, the number of prompts or the vocabulary.
  * Acceptance (speculative methods): per depth d, pooled over the prompts' rounds, the share of rounds that
    reached depth d - 1 and accepted depth d too (conditional acceptance); the statistic is the sum over depths of
    the squared two-proportion z score (candidate rate minus baseline rate, pooled-variance scaled), combined with
    the squared tau difference by the smaller p-value (`acceptance_test`).
  * Token frequencies (every method): per output position k, how often each token (or the end of the output)
    appears there in each file; the statistic is the sum over positions and tokens of (baseline count - candidate
    count)^2 / (both counts), the chi-square statistic of homogeneity, over all prompts and again per prompt for
    prompts that appear several times (`token_test`). Position 0 is the prefill's sample, later positions the
    walk's; a walk whose draws are not independent per node (one noise draw shared by the nodes) leaves each node's
    own sample right and changes which tokens follow which.
Rounds of one prompt and positions of one output are correlated; swapping whole records per prompt keeps that
structure, which is why no independence between rounds or positions is assumed.

With n prompts there are 2^n swap patterns and both statistics are unchanged when every record is swapped, so no
p-value is below 2 / 2^n: a comparison of too few prompts cannot reject at the level and says so instead.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from sglang_ddtree.baseline import MethodRecord

END = -1  # the token "no token here": the output ended before this position
MIN_PERMUTATIONS = 2000
MIN_ROUNDS = 20  # depths reached by fewer rounds (both files together) are left out of the acceptance statistic


def permutations_for(alpha: float) -> int:
    """Monte Carlo swap patterns for a test at level `alpha`: enough that p-values near alpha are resolved."""
    return max(MIN_PERMUTATIONS, int(math.ceil(20 / alpha)))


def min_prompts_for(alpha: float) -> int:
    """Fewest prompts whose smallest attainable p-value (2 / 2^n) is below `alpha`."""
    return max(2, int(math.floor(math.log2(2 / alpha))) + 1)


def _swaps(n: int, n_perm: int, seed: int) -> np.ndarray:
    """[n_perm, n] 0/1 (int8, small at many prompts): 1 where a prompt's two records change sides."""
    return np.random.default_rng(seed).integers(0, 2, size=(n_perm, n), dtype=np.int8)


def _chunks(swaps: np.ndarray, rows: int = 2000):
    """The swap patterns as float64 blocks of `rows` (the statistics are matrix products over them)."""
    for i in range(0, len(swaps), rows):
        yield swaps[i:i + rows].astype(np.float64)


def _p_value(observed: float, permuted: np.ndarray) -> float:
    tol = 1e-9 * max(1.0, abs(observed))
    return float((1 + np.count_nonzero(permuted >= observed - tol)) / (1 + permuted.size))


def _depth_counts(rec: MethodRecord, depths: int) -> tuple[np.ndarray, np.ndarray]:
    """(attempts, successes) per depth 1..depths: rounds that accepted depth d - 1, and of those depth d."""
    a = np.asarray(rec.accept_lengths, dtype=np.int64) - 1  # accepted draft tokens per round
    d = np.arange(1, depths + 1)[:, None]
    return (a[None, :] >= d - 1).sum(1).astype(np.float64), (a[None, :] >= d).sum(1).astype(np.float64)


def _ranked_p(values: np.ndarray) -> np.ndarray:
    """Each entry's p-value within the set: the share of entries at least as large (itself included)."""
    tol = 1e-9 * max(1.0, float(np.abs(values).max(initial=0.0)))
    ordered = np.sort(values)
    return (len(values) - np.searchsorted(ordered, values - tol, side="left")) / len(values)


def acceptance_test(pairs: list[tuple[MethodRecord, MethodRecord]], swaps: np.ndarray) -> dict[str, Any] | None:
    """Permutation test of acceptance (see the module docstring); None without rounds.

    Two statistics on the same swap patterns: the per-depth chi-square (any change of shape) and the squared tau
    difference (a shift of every depth the same way, which the per-depth statistic spreads over many degrees of
    freedom). They are combined by their smaller p-value, itself calibrated over the swap patterns, so the combined
    test keeps its level."""
    n = len(pairs)
    depths = max((max(r.accept_lengths, default=1) for p in pairs for r in p), default=1) - 1
    if depths < 1:
        return None
    att = np.zeros((2, n, depths))
    acc = np.zeros((2, n, depths))
    tok = np.zeros((2, n))
    rnd = np.zeros((2, n))
    for i, pair in enumerate(pairs):
        for side, rec in enumerate(pair):
            att[side, i], acc[side, i] = _depth_counts(rec, depths)
            tok[side, i], rnd[side, i] = sum(rec.accept_lengths), len(rec.accept_lengths)
    tot_att, tot_acc = att.sum((0, 1)), acc.sum((0, 1))
    # depths with enough rounds in both files together, where acceptance varies at all (totals do not change under
    # swaps, so choosing depths by them keeps the test exact)
    keep = (tot_att >= MIN_ROUNDS) & (tot_acc > 0) & (tot_acc < tot_att)
    if not keep.any():
        return None
    att, acc, tot_att, tot_acc = att[:, :, keep], acc[:, :, keep], tot_att[keep], tot_acc[keep]
    pooled = tot_acc / tot_att

    def stat(s: np.ndarray):
        """s [m, n] swap patterns -> (chi-square [m], squared tau difference [m], z, rates, rounds, taus)."""
        cand_att, cand_acc = s @ att[0] + (1 - s) @ att[1], s @ acc[0] + (1 - s) @ acc[1]
        base_att, base_acc = tot_att - cand_att, tot_acc - cand_acc
        cand_tok, cand_rnd = s @ tok[0] + (1 - s) @ tok[1], s @ rnd[0] + (1 - s) @ rnd[1]
        base_tok, base_rnd = tok.sum() - cand_tok, rnd.sum() - cand_rnd
        with np.errstate(invalid="ignore", divide="ignore"):
            rb, rc = base_acc / base_att, cand_acc / cand_att
            z = (rc - rb) / np.sqrt(pooled * (1 - pooled) * (1 / base_att + 1 / cand_att))
            tb, tc = base_tok / base_rnd, cand_tok / cand_rnd
        z = np.where(np.isfinite(z), z, 0.0)
        shift = np.where(np.isfinite(tc - tb), tc - tb, 0.0) ** 2
        return (z ** 2).sum(1), shift, z, rb, rc, base_att, cand_att, tb, tc

    obs = stat(np.zeros((1, n)))
    chunks = [stat(c)[:2] for c in _chunks(swaps)]
    chi = np.concatenate([obs[0]] + [c[0] for c in chunks])  # entry 0: the observed files
    shift = np.concatenate([obs[1]] + [c[1] for c in chunks])
    p_chi, p_shift = _ranked_p(chi), _ranked_p(shift)
    smaller = np.minimum(p_chi, p_shift)
    p = float(np.count_nonzero(smaller <= smaller[0] * (1 + 1e-9)) / len(smaller))
    _, _, z, rb, rc, nb, nc, tb, tc = obs
    depth_ids = np.arange(1, depths + 1)[keep]
    j = int(np.argmax(np.abs(z[0])))
    return {
        "p": p, "p_by_depth": float(p_chi[0]), "p_tau": float(p_shift[0]), "statistic": float(chi[0]),
        "tau": {"baseline": float(tb[0]), "candidate": float(tc[0])},
        "depths": [{"depth": int(d), "baseline": float(rb[0, k]), "candidate": float(rc[0, k]),
                    "baseline_rounds": int(nb[0, k]), "candidate_rounds": int(nc[0, k]), "z": float(z[0, k])}
                   for k, d in enumerate(depth_ids)],
        "most_different": {"depth": int(depth_ids[j]), "baseline": float(rb[0, j]), "candidate": float(rc[0, j]),
                           "z": float(z[0, j])},
    }


def _token_form(outputs: list[tuple[list[int], list[int]]], rows: list[int], A: np.ndarray, cells: list,
                group: str | None) -> None:
    """Adds to A (in place) the chi-square form of per-position token counts over the pairs `rows`."""
    length = max((len(o) for i in rows for o in outputs[i]), default=0)
    for k in range(length):
        base = [outputs[i][0][k] if k < len(outputs[i][0]) else END for i in rows]
        cand = [outputs[i][1][k] if k < len(outputs[i][1]) else END for i in rows]
        diff = [j for j in range(len(rows)) if base[j] != cand[j]]
        if not diff:
            continue
        vocab = sorted({base[j] for j in diff} | {cand[j] for j in diff})
        col = {v: c for c, v in enumerate(vocab)}
        D = np.zeros((len(rows), len(vocab)))
        for j in diff:
            D[j, col[base[j]]] += 1
            D[j, col[cand[j]]] -= 1
        total = np.array([base.count(v) + cand.count(v) for v in vocab], dtype=np.float64)
        D /= np.sqrt(total)
        A[np.ix_(rows, rows)] += D @ D.T
        cells += [(group, k, v, base.count(v), cand.count(v)) for v in vocab]


def token_test(pairs: list[tuple[MethodRecord, MethodRecord]], swaps: np.ndarray) -> dict[str, Any] | None:
    """Permutation test of per-position token frequencies (see the module docstring); None without outputs.

    Counted over all prompts together, and again per prompt for prompts that appear several times (records of the
    same prompt tokens under other names, sampled with other seeds): there the counts follow one prompt's own
    distribution, so a difference is not averaged away over prompts whose distributions differ.

    The difference of the two files' counts of token v at position k is sum_i sign_i * d_ikv, with d_ikv in
    {-1, 0, 1} (prompt i's baseline minus candidate indicator) and sign_i = -1 where prompt i is swapped; the
    count of both files together does not change under swaps. So the statistic is a quadratic form in the signs,
    sign' A sign with A = sum over cells of d_k d_k' / count, evaluated for all swap patterns at once."""
    n = len(pairs)
    outputs = [([int(t) for t in b.output_ids], [int(t) for t in c.output_ids]) for b, c in pairs]
    length = max((len(o) for pair in outputs for o in pair), default=0)
    if length == 0:
        return None
    A = np.zeros((n, n))
    cells: list[tuple[str | None, int, int, int, int]] = []
    _token_form(outputs, list(range(n)), A, cells, None)
    groups: dict[str, list[int]] = {}
    for i, (b, _) in enumerate(pairs):
        groups.setdefault(b.prompt_sha256 or b.prompt_id, []).append(i)
    repeated = [(rows, pairs[rows[0]][0].prompt_id) for rows in groups.values() if len(rows) > 1]
    for rows, name in repeated:
        _token_form(outputs, rows, A, cells, name)
    out = {"p": 1.0, "statistic": 0.0, "positions": length, "repeated_prompts": len(repeated),
           "most_different": None}
    if not cells:
        return out
    permuted = np.concatenate([((sign @ A) * sign).sum(1) for sign in (1 - 2 * c for c in _chunks(swaps))])
    obs = float(np.ones(n) @ A @ np.ones(n))
    g, k, v, cb, cc = max(cells, key=lambda c: (c[3] - c[4]) ** 2 / (c[3] + c[4]))
    out.update(p=_p_value(obs, permuted), statistic=obs,
               most_different={"prompt": g, "position": k, "token": None if v == END else v, "baseline_count": cb,
                               "candidate_count": cc})
    return out


def sampled_tests(pairs: list[tuple[MethodRecord, MethodRecord]], *, speculative: bool, alpha: float,
                  seed: int) -> dict[str, Any]:
    """Both tests of one method's pairs, each at level `alpha` (the caller splits its overall level).

    Returns {"alpha": alpha, "prompts": n, "permutations": ..., "tests": {name: {...}}, "not_judged": reason or
    None, "failures": [sentences]}."""
    n = len(pairs)
    out: dict[str, Any] = {"alpha": alpha, "prompts": n, "permutations": 0, "tests": {}, "not_judged": None,
                           "failures": []}
    if n < min_prompts_for(alpha):
        out["not_judged"] = (f"{n} prompt(s) cannot show a difference at level {alpha:.2g} (the smallest possible "
                             f"p-value is 2 / 2^n); at least {min_prompts_for(alpha)} are needed")
        return out
    n_perm = permutations_for(alpha)
    out["permutations"] = n_perm
    swaps = _swaps(n, n_perm, seed)
    how = f"permutation test over {n} prompts"
    if speculative:
        t = acceptance_test(pairs, swaps)
        if t is not None:
            out["tests"]["acceptance_by_depth"] = t
            if t["p"] < alpha:
                m = t["most_different"]
                out["failures"].append(
                    f"sampled acceptance by depth differs from the baseline's ({how}: p = {t['p']:.2g} < "
                    f"{alpha:.2g}; most at depth {m['depth']}: {m['baseline']:.3f} vs {m['candidate']:.3f})")
    t = token_test(pairs, swaps)
    if t is not None:
        out["tests"]["token_frequencies"] = t
        if t["p"] < alpha:
            m = t["most_different"]
            tok = "the end of the output" if m["token"] is None else f"token {m['token']}"
            where = f"output position {m['position']}" + (f" of prompt {m['prompt']}" if m["prompt"] else "")
            out["failures"].append(
                f"sampled token frequencies differ from the baseline's ({how}: p = {t['p']:.2g} < {alpha:.2g}; "
                f"most at {where}: {tok} {m['baseline_count']} vs {m['candidate_count']} times)")
    return out
