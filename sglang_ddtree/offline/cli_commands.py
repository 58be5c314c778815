"""Subcommands `offline`, `compare` and `import-reference` of the sglang-ddtree CLI (wired in sglang_ddtree/cli.py).

Each `add_*_parser(sub)` registers its subparser with `func` set to the matching `cmd_*(args) -> int`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import platform
import sys

from sglang_ddtree.cli_args import (Interrupted, check_output_file, device_name, fail, nonnegative_float,
                                   nonnegative_int, positive_int, probability)


# ----------------------------------------------------------------------------------------------------------
# offline


def add_offline_parser(sub) -> None:
    p = sub.add_parser("offline", help="run the offline reference decoders over a prompt set into a baseline file")
    src = p.add_argument_group("models (local folders only; nothing is downloaded)")
    src.add_argument("--tiny", action="store_true", help="use the committed tiny pair (models/tiny)")
    src.add_argument("--target", help="target model folder (transformers causal LM)")
    src.add_argument("--drafter", help="DFlash drafter folder (needed for dflash / ddtree)")
    src.add_argument("--tokenizer", help="tokenizer folder (default: the target folder, or the tiny tokenizer)")
    p.add_argument("--dataset", default="humaneval", help="humaneval, gsm8k, math500, mbpp, mt-bench, alpaca, jsonl, ...")
    p.add_argument("--dataset-path", help="local .jsonl/.json/.parquet file (required except for humaneval; "
                                             ".parquet needs the parquet extra)")
    p.add_argument("--prompt-field", help="override the dataset's text field")
    p.add_argument("--id-field", help="override the dataset's id field")
    p.add_argument("--limit", type=positive_int, help="first N prompts (file order)")
    p.add_argument("--prompt-style", choices=("ours", "zlab"), default="ours",
                   help="zlab: z-lab's DFlash benchmark wording, chat template as text then encode, and its "
                        "--max-samples shuffle (sglang_ddtree/zlab.py), to compare with a z-lab summary")
    p.add_argument("--max-samples", type=positive_int, help="zlab prompt style: z-lab's --max-samples (seeded shuffle, first N)")
    p.add_argument("--shuffle-seed", type=int, default=42,
                   help="zlab prompt style: the shuffle's seed (42: z-lab's MLX backend; 0: its transformers backend)")
    p.add_argument("--chat", choices=("auto", "yes", "no"), default="auto",
                   help="wrap prompts in the tokenizer's chat template (auto: when it has one)")
    p.add_argument("--methods", default="plain,dflash,ddtree",
                   help="comma list of plain, dflash, ddtree, ddtree_tb<B>, ddtree_auto (adaptive budget per round)")
    p.add_argument("--budgets", default="16,32,64,128,256,512,1024",
                   help="DDTree budgets for method 'ddtree', comma separated, each in 1..1024")
    p.add_argument("--max-new-tokens", type=positive_int, default=256)
    p.add_argument("--temperature", type=nonnegative_float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=nonnegative_int, default=0, help="sample from the k likeliest tokens (0 = all)")
    p.add_argument("--top-p", type=probability, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens tokens")
    p.add_argument("--device", type=device_name, default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch CPU threads (default: OMP_NUM_THREADS when set, else 1 for --tiny, whose matrices are "
                        "too small to gain from more, else torch's)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="target attention (custom tree masks)")
    p.add_argument("--record-trees", action="store_true", help="dump every round's tree (tokens, parents, scores)")
    p.add_argument("--commit", default="gather", choices=("gather", "rerun"), help="how accepted KV is committed")
    p.add_argument("--hybrid-verify", choices=("oracle", "tree"), default=None,
                   help="verify path for hybrid targets (recurrent + attention layers, e.g. Qwen3-Next): 'tree' = "
                        "depth-by-depth batched forwards from the parents' states, 'oracle' = node by node on cache "
                        "copies (slow); required for such targets")
    auto = p.add_argument_group("ddtree_auto (adaptive budget per round, docs/adaptive-budget.md)")
    auto.add_argument("--auto-candidates", default="chain,16,32,64,128,256",
                      help="candidate budgets; 'chain' (the drafter's top-1 chain, DFLASH) is always included")
    auto.add_argument("--auto-batch-size", type=positive_int, default=1,
                      help="batch size whose predicted round times (committed H200 sweep, 8B-shaped) drive the choice")
    auto.add_argument("--calibrate", action="store_true",
                      help="learn the node-score correction table online and use calibrated scores to choose")
    auto.add_argument("--auto-max-gain", type=nonnegative_float, default=2.0,
                      help="drop budgets whose round costs more than this x the chain's at the batch size "
                           "(0 = keep all)")
    auto.add_argument("--auto-no-overhead", action="store_true",
                      help="predict round times without the decision's own cost (bigger tree build, top-K)")
    auto.add_argument("--auto-sweep", default=None, help="sweep JSONL for the cost model (default: the committed one)")
    auto.add_argument("--auto-tau-prior", default=None,
                      help="prior acceptance curve (baseline .jsonl, adaptive_eval JSON or {'chain': tau, '16': tau}): "
                           "keep the chain + budgets within --auto-window of the best projected rate at the batch size "
                           "(replaces --auto-max-gain)")
    auto.add_argument("--auto-window", type=nonnegative_float, default=0.05, help="tolerance of the candidate window")
    p.add_argument("--out", required=True, help="baseline JSONL (appended to / resumed when it has records)")
    p.add_argument("--no-resume", action="store_true", help="overwrite --out instead of resuming it")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_offline)


def _dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _eos_ids(tokenizer, target) -> list[int]:
    ids = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(target, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is not None:
        ids.update(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return sorted(ids)


def run_device(args) -> str:
    """--device, else cuda when torch sees a GPU, else cpu."""
    import torch

    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def model_paths(args) -> tuple[str, str | None, str]:
    """(target, drafter or None, tokenizer) folders of --tiny / --target / --drafter / --tokenizer, each checked to be
    an existing folder (ValueError otherwise). Loads nothing."""
    if args.tiny:
        from sglang_ddtree import tiny

        target_path = args.target or str(tiny.tiny_dir() / "target")
        drafter_path = args.drafter or str(tiny.tiny_dir() / "drafter")
        tok_path = args.tokenizer or str(tiny.tiny_dir() / "tokenizer")
    else:
        if not args.target:
            raise ValueError("pass --target FOLDER (or --tiny for the committed tiny pair).")
        target_path, drafter_path, tok_path = args.target, args.drafter, args.tokenizer or args.target
    for what, path in (("target", target_path), ("tokenizer", tok_path), ("drafter", drafter_path)):
        if path is None or os.path.isdir(path):
            continue
        if os.path.exists(path):
            raise ValueError(f"{what} {path!r} is a file, not a folder: give the {what}'s folder (only local "
                             "folders are supported).")
        if args.tiny and not getattr(args, what):
            raise ValueError(f"the tiny pair's {what} folder {path!r} does not exist: run from the repository's "
                             "root (it holds models/tiny) or set SGLANG_DDTREE_TINY_DIR.")
        raise ValueError(f"{what} folder {path!r} does not exist (only local folders are supported).")
    return target_path, drafter_path, tok_path


def _load_models(args):
    """(target, drafter or None, tokenizer, header model info)."""
    from sglang_ddtree.baseline import fingerprint_dir

    device = run_device(args)
    dtype = _dtype(args.dtype)
    target_path, drafter_path, tok_path = model_paths(args)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tok_path, local_files_only=True)
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype, attn_implementation=args.attn,
                                                  local_files_only=True).to(device).eval()
    drafter = None
    if drafter_path is not None:
        from sglang_ddtree.drafter import DFlashDrafter

        drafter = DFlashDrafter.from_pretrained(drafter_path, device=device, dtype=dtype).eval()
    info = {
        "target": {"path": os.path.abspath(target_path), "fingerprint": fingerprint_dir(target_path)},
        "drafter": None if drafter_path is None else {"path": os.path.abspath(drafter_path),
                                                      "fingerprint": fingerprint_dir(drafter_path)},
        "tokenizer": os.path.abspath(tok_path),
        "device": str(device),
        "block_size": None if drafter is None else int(drafter.config.block_size),
    }
    return target, drafter, tokenizer, info


def _hybrid_settings(args, target, speculative_methods) -> dict:
    """RunSettings fields for --hybrid-verify; refuses a hybrid target without it (speculative methods only)."""
    from sglang_ddtree.offline.runner import RunSettings
    from sglang_ddtree.offline.target import is_hybrid

    if args.hybrid_verify is None:
        if speculative_methods and is_hybrid(target):
            raise ValueError(
                f"the target ({type(target).__name__}) has recurrent layers, which the attention-mask tree verify "
                f"cannot handle: pass --hybrid-verify tree (or oracle)."
            )
        return {}
    if "hybrid_verify" not in {f.name for f in dataclasses.fields(RunSettings)}:
        raise ValueError("--hybrid-verify is not forwarded by this version of offline/runner.py (RunSettings has no "
                         "hybrid_verify field); use speculative_decode(hybrid_verify=...) from Python.")
    return {"hybrid_verify": args.hybrid_verify}


def _versions() -> dict[str, str]:
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}


def _complete_records(path: str) -> int | None:
    """How many complete records the baseline file at `path` holds (None: no file, or not a readable baseline)."""
    from sglang_ddtree.baseline import read_baseline

    if not os.path.exists(path):
        return None
    try:
        return len(read_baseline(path, allow_partial_last_line=True).records)
    except ValueError:
        return None


def cmd_offline(args) -> int:
    from sglang_ddtree.baseline import BaselineHeader, BaselineWriter
    from sglang_ddtree.datasets import encode_prompt, load_prompts
    from sglang_ddtree.offline.drafts import DFlashDraftSource
    from sglang_ddtree.cli_args import parse_budgets, set_cpu_threads
    from sglang_ddtree.offline.runner import AutoSettings, PromptInput, RunSettings, expand_methods, run_offline

    try:
        budgets = parse_budgets(args.budgets) if args.budgets else []
        methods = expand_methods(args.methods.split(","), budgets)
        check_output_file(args.out)
        if args.prompt_style == "zlab":
            from sglang_ddtree.zlab import zlab_prompts

            prompts = zlab_prompts(args.dataset, args.dataset_path, max_samples=args.max_samples,
                                   shuffle_seed=args.shuffle_seed)[: args.limit]
        else:
            prompts = load_prompts(args.dataset, args.dataset_path, limit=args.limit, text_field=args.prompt_field,
                                   id_field=args.id_field)
        _, drafter_path, _ = model_paths(args)
        needs_drafter = [m for m in methods if m != "plain"]
        if needs_drafter and drafter_path is None:
            raise ValueError(f"methods {needs_drafter} need a drafter: pass --drafter FOLDER (or --tiny).")
        threads = set_cpu_threads(args.threads, run_device(args), tiny=args.tiny)
        if threads:
            print(f"offline: {run_device(args)}, {threads}", flush=True)
        target, drafter, tokenizer, info = _load_models(args)
        hybrid_settings = _hybrid_settings(args, target, needs_drafter)
        auto_settings = None
        if "ddtree_auto" in methods:
            from sglang_ddtree.adaptive import parse_candidates

            parse_candidates(args.auto_candidates)
            auto_settings = AutoSettings(candidates=args.auto_candidates, batch_size=args.auto_batch_size,
                                         calibrate=args.calibrate, max_gain=args.auto_max_gain or None,
                                         decision_overhead=not args.auto_no_overhead, sweep=args.auto_sweep,
                                         tau_prior=args.auto_tau_prior, window=args.auto_window)
            if args.auto_tau_prior:
                from sglang_ddtree.round_cost import load_tau_prior

                load_tau_prior(args.auto_tau_prior)
    except (ValueError, FileNotFoundError) as e:
        return fail(str(e))
    chat = {"auto": None, "yes": True, "no": False}[args.chat]
    if args.prompt_style == "zlab":
        from sglang_ddtree.zlab import zlab_encode

        inputs = [PromptInput(p.id, p.index, zlab_encode(tokenizer, p)) for p in prompts]
    else:
        inputs = [PromptInput(p.id, p.index, encode_prompt(tokenizer, p, chat=chat)) for p in prompts]
    settings = RunSettings(
        methods=methods, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, eos_token_ids=[] if args.ignore_eos else _eos_ids(tokenizer, target),
        record_trees=args.record_trees, commit=args.commit, auto=auto_settings, **hybrid_settings,
    )
    header = BaselineHeader(
        source="offline", target=info["target"], drafter=info["drafter"], tokenizer=info["tokenizer"],
        dtype=args.dtype, device=info["device"], attn_implementation=args.attn, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed, max_new_tokens=args.max_new_tokens,
        block_size=info["block_size"], dataset=args.dataset, versions=_versions(),
        extra={"methods": methods, "limit": args.limit, "chat": args.chat, "commit": args.commit,
               **({"prompt_style": "zlab", "max_samples": args.max_samples, "shuffle_seed": args.shuffle_seed}
                  if args.prompt_style == "zlab" else {}),
               "eos_token_ids": settings.eos_token_ids, "record_trees": args.record_trees, **hybrid_settings,
               **({"auto": dataclasses.asdict(auto_settings)} if auto_settings else {})},
    )
    draft = DFlashDraftSource(drafter, target) if drafter is not None else None
    had = _complete_records(args.out)
    try:
        # a file with a header and no record (a run stopped before its first record) holds nothing to resume
        writer = BaselineWriter(args.out, header, resume=not args.no_resume and had != 0)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        with writer:
            taus = run_offline(target, draft, inputs, settings, writer, progress=not args.no_progress)
    except BaseException as e:
        kept = _complete_records(args.out)
        if kept == 0:  # only the header this run wrote: a rerun with other settings must not find it in the way
            with contextlib.suppress(OSError):
                os.remove(args.out)
        if not isinstance(e, KeyboardInterrupt):
            raise
        if kept is None:
            raise Interrupted(f"{args.out} is left as it is (it does not read back as a baseline file).") from None
        if not kept:
            raise Interrupted("no record was complete, so no output file was kept.") from None
        new = kept if args.no_resume else kept - (had or 0)
        again = "the same command without --no-resume" if args.no_resume else "the same command"
        raise Interrupted(f"{args.out} keeps {kept} complete record(s), {new} of them from this run; {again} "
                          "resumes it.") from None
    for m, t in taus.items():
        if t["rounds"]:
            print(f"{m:<14} tau {t['tau']:.3f} over {t['rounds']} new rounds")
    print(f"wrote {args.out}")
    return 0


# ----------------------------------------------------------------------------------------------------------
# compare


def add_compare_parser(sub) -> None:
    p = sub.add_parser("compare", help="compare a candidate baseline file against a reference one")
    p.add_argument("baseline", help="reference: baseline JSONL, or the DDTree paper's .pt output (imported)")
    p.add_argument("candidate", help="candidate: baseline JSONL, or a .pt reference output")
    p.add_argument("--method", action="append", dest="methods",
                   help="method to compare (repeatable or comma list); default: all methods in both files")
    p.add_argument("--min-match-rate", type=float, default=None, help="fail below this exact-match rate")
    p.add_argument("--max-tau-drop", type=float, default=None,
                   help="tolerated tau drop: a speculative method fails when the 95%% interval of tau(candidate) - "
                        "tau(baseline) lies entirely below -this (default 0 for greedy runs; at T > 0 the acceptance "
                        "test judges tau unless this is given; 'inf' turns the check off)")
    p.add_argument("--sampled-alpha", type=float, default=0.01,
                   help="T > 0: false-alarm rate of the tests of acceptance per depth and token frequencies, over "
                        "the whole comparison (default 0.01; 0 turns them off)")
    p.add_argument("--rule", choices=("auto", "exact", "float32-tie", "margin"), default="auto",
                   help="what counts as noise (auto: exact when both files are exact decoders in the same dtype, "
                        "every difference a bug; float32-tie when one side is float32 and the other not; else "
                        "margin); the report says which rule was used")
    p.add_argument("--noise-margin", type=float, default=0.25,
                   help="tie threshold of the float32-tie and margin rules: top-2 log-prob gap (nats) below which a "
                        "first divergence is a tie (default 0.25)")
    p.add_argument("--exact-tol", type=float, default=1e-3,
                   help="exact rule: largest difference of a recorded top-2 gap or tree score that is not a bug")
    p.add_argument("--score-tol", type=float, default=0.05, help="tolerance on tree scores (log-prob)")
    p.add_argument("--no-trees", action="store_true", help="skip tree comparison")
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples for the tau CI")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    p.add_argument("--trust-pickle", action="store_true", help="load .pt reference files with weights_only=False")
    p.add_argument("--json", dest="json_out", help="write the full report as JSON here")
    p.set_defaults(func=cmd_compare)


def input_file(path: str, what: str) -> str:
    """`path` when it names a file; a folder is refused in one sentence (reading it would raise mid-parse)."""
    if os.path.isdir(path):
        raise ValueError(f"{what} {path!r} is a folder; pass a file.")
    return path


def _unreadable(e: OSError) -> int:
    return fail(f"could not read {e.filename!r} ({e.strerror or type(e).__name__}).")


def load_any(path: str, trust_pickle: bool = False, what: str = "input"):
    """A baseline JSONL, or the paper's torch.save output (imported on the fly)."""
    from sglang_ddtree.baseline import read_baseline
    from sglang_ddtree.reference_import import import_reference

    input_file(path, what)
    if path.endswith((".pt", ".pth", ".bin")):
        return import_reference(path, trust_pickle=trust_pickle)
    try:
        return read_baseline(path)
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path!r} is not a text file (a baseline file is UTF-8 JSON lines).") from None


def cmd_compare(args) -> int:
    """Exit 0: pass; 1: the candidate fails a check; 2: bad input."""
    from sglang_ddtree.compare import Thresholds, compare
    from sglang_ddtree.compare_report import format_report

    try:
        if args.json_out:
            check_output_file(args.json_out, "--json")
        base = load_any(args.baseline, args.trust_pickle, "baseline")
        cand = load_any(args.candidate, args.trust_pickle, "candidate")
        methods = None
        if args.methods:
            methods = [m.strip() for arg in args.methods for m in arg.split(",") if m.strip()]
        th = Thresholds(min_match_rate=args.min_match_rate, max_tau_drop=args.max_tau_drop,
                        noise_margin=args.noise_margin, score_tol=args.score_tol, check_trees=not args.no_trees,
                        rule=args.rule, exact_tol=args.exact_tol, sampled_alpha=args.sampled_alpha)
        report = compare(base, cand, methods=methods, thresholds=th, n_boot=args.bootstrap, seed=args.seed)
    except ValueError as e:
        return fail(str(e))
    except OSError as e:
        return _unreadable(e)
    print(format_report(report))
    if args.json_out:
        try:
            os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
            with open(args.json_out, "w", encoding="utf-8") as f:
                json.dump(_finite(report), f, indent=1, allow_nan=False, default=str)
        except OSError as e:
            return fail(f"could not write --json {args.json_out!r} ({e.strerror or type(e).__name__}).")
    return 0 if report["passed"] else 1


def _finite(x):
    """NaN / inf -> None, recursively (strict JSON has no such numbers)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


# ----------------------------------------------------------------------------------------------------------
# import-reference


def add_import_parser(sub) -> None:
    p = sub.add_parser("import-reference", help="convert the DDTree paper's benchmark .pt output to a baseline file")
    p.add_argument("reference", help="torch.save file with 'responses', 'block_size', 'args'")
    p.add_argument("--out", required=True, help="baseline JSONL to write")
    p.add_argument("--dataset", help="dataset name to record (default: the reference args)")
    p.add_argument("--prompt-ids-from", help="take prompt ids from this dataset (same order and count as the file)")
    p.add_argument("--dataset-path", help="local file for --prompt-ids-from")
    p.add_argument("--trust-pickle", action="store_true", help="load with weights_only=False (files you made)")
    p.add_argument("--dtype", help="dtype the reference ran in (the file does not record it; default: unknown)")
    p.add_argument("--device", help="device the reference ran on (cpu, cuda; default: unknown)")
    p.set_defaults(func=cmd_import)


def cmd_import(args) -> int:
    from sglang_ddtree.baseline import write_baseline
    from sglang_ddtree.reference_import import import_reference

    try:
        check_output_file(args.out)
        ids = None
        if args.prompt_ids_from:
            from sglang_ddtree.datasets import load_prompts

            ids = [p.id for p in load_prompts(args.prompt_ids_from, args.dataset_path)]
        b = import_reference(args.reference, trust_pickle=args.trust_pickle, prompt_ids=ids,
                             dataset=args.dataset or args.prompt_ids_from, dtype=args.dtype, device=args.device)
    except ValueError as e:
        return fail(str(e))
    write_baseline(args.out, b.header, b.records)
    print(f"imported {len(b.records)} records ({', '.join(b.methods)}) into {args.out}")
    extra = b.header.extra.get("reference_extra_final_rounds", 0)
    if extra:
        print(f"{extra} record(s) end with the reference's extra final round (run after an exactly full output); "
              "it is kept in extra.reference_extra_final_round and not counted in tau")
    if b.header.dtype is None:
        print("dtype unknown (the reference file does not record it): pass --dtype to record what you ran")
    return 0


# ----------------------------------------------------------------------------------------------------------
# compare-zlab


def add_zlab_parser(sub) -> None:
    p = sub.add_parser("compare-zlab", help="compare our tau and acceptance histogram with a z-lab DFlash summary")
    p.add_argument("summary", help="z-lab benchmark's printed summary (text) or its JSON form")
    p.add_argument("ours", help="our baseline JSONL on the same prompts (offline --prompt-style zlab, or from-server)")
    p.add_argument("--method", default="dflash", help="our method to compare (default dflash: z-lab's chain)")
    p.add_argument("--dataset", help="dataset the summary is for (the printed text does not say)")
    p.add_argument("--samples", type=int, help="prompts the summary averaged over (the printed text does not say)")
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples for the intervals")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    p.add_argument("--json", dest="json_out", help="write the report as JSON here")
    p.set_defaults(func=cmd_compare_zlab)


def cmd_compare_zlab(args) -> int:
    """Exit 0: consistent; 1: not consistent; 2: bad input."""
    from sglang_ddtree.zlab import compare_with_zlab, format_zlab_report, read_zlab_summary

    try:
        try:
            summary = read_zlab_summary(input_file(args.summary, "summary"), dataset=args.dataset,
                                        samples=args.samples)
        except UnicodeDecodeError:
            raise ValueError(f"summary {args.summary!r} is not a text file (z-lab's printed summary or its JSON "
                             f"form).") from None
        ours = load_any(args.ours, what="baseline")
        records = [r for r in ours.records if r.method == args.method]
        if not records:
            raise ValueError(f"{args.ours} has no record of method {args.method!r}; it has {ours.methods}.")
        if summary.dataset and ours.header.dataset and summary.dataset != ours.header.dataset:
            raise ValueError(f"the summary is for dataset {summary.dataset!r} but {args.ours} for "
                             f"{ours.header.dataset!r}.")
        rep = compare_with_zlab(summary, records, n_boot=args.bootstrap, seed=args.seed)
    except ValueError as e:
        return fail(str(e))
    except OSError as e:
        return _unreadable(e)
    print(format_zlab_report(rep))
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(_finite(rep), f, indent=1, allow_nan=False)
    return 0 if rep["consistent"] else 1
