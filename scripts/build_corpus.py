#!/usr/bin/env python
"""Build the tiny pair's corpus and tokenizer from the running interpreter's standard library (CPU, ~1-2 min).

    python scripts/build_corpus.py                      # -> .cache/corpus/ and models/tiny/tokenizer/

Steps: list the stdlib `*.py` files (sorted; site-packages excluded), split ~5% of them off as held-out by a
stable hash of the relative path, train a byte-level BPE tokenizer on the train split (vocab 4096, special
tokens <|endoftext|> = eos/bos/pad and <|mask|> for the drafter), save it as a Hugging Face tokenizer, and
tokenize both splits into uint16 arrays (files joined with <|endoftext|>). A manifest.json records the python
version, file counts, token counts and sha256 of every output file.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sglang_ddtree.tiny import (  # noqa: E402
    EOS_TOKEN, MASK_TOKEN, SPECIAL_TOKENS, is_heldout, sha256_file, stdlib_files, stdlib_root,
)

REPO_ROOT = Path(__file__).resolve().parents[1]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def read_sources(root: Path, rel_paths: list[str]) -> tuple[list[str], list[str], list[str]]:
    """Read files as UTF-8; files that are not valid UTF-8 (a few deliberate test fixtures) are skipped."""
    kept, texts, skipped = [], [], []
    for rel in rel_paths:
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
            continue
        if EOS_TOKEN in text or MASK_TOKEN in text:  # would be read as a special token
            skipped.append(rel)
            continue
        if text.strip():
            kept.append(rel)
            texts.append(text)
    return kept, texts, skipped


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),  # ids 0 and 1
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def save_hf_tokenizer(tok, out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer.json + tokenizer_config.json + special_tokens_map.json (AutoTokenizer / SGLang loadable)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    special = {"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "mask_token": MASK_TOKEN}
    added = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": True}
        for t in SPECIAL_TOKENS
    }
    config = {
        # PreTrainedTokenizerFast resolves to the tokenizers backend in transformers 4.x and 5.x alike.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        **special,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def tokenize(tok, texts: list[str], eos_id: int, label: str) -> np.ndarray:
    ids: list[int] = []
    t0 = time.time()
    step = 200
    for i in range(0, len(texts), step):
        for enc in tok.encode_batch(texts[i:i + step], add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(eos_id)
        print(f"  tokenized {label}: {min(i + step, len(texts))}/{len(texts)} files, {len(ids):,} tokens "
              f"({time.time() - t0:.1f}s)", flush=True)
    arr = np.asarray(ids, dtype=np.int64)
    if arr.max() >= 1 << 16:
        raise ValueError(f"token id {arr.max()} does not fit uint16; use a vocab below 65536.")
    return arr.astype(np.uint16)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO_ROOT / ".cache" / "corpus"), help="corpus directory (git-ignored)")
    ap.add_argument("--tokenizer-out", default=str(REPO_ROOT / "models" / "tiny" / "tokenizer"),
                    help="where the committed copy of the tokenizer goes ('' to skip)")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--model-max-length", type=int, default=4096)
    ap.add_argument("--max-files", type=int, default=0, help="use only the first N files (tests); 0 = all")
    ap.add_argument("--no-compress", action="store_true",
                    help="write plain .npy arrays instead of zlib-compressed .npz (the stdlib compresses ~3x)")
    args = ap.parse_args(argv)
    if not 258 < args.vocab_size < 65536:
        raise ValueError(f"--vocab-size must be in (258, 65536) (256 bytes + 2 specials, uint16 ids), got {args.vocab_size}.")

    t_start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = stdlib_root()
    rel_paths = stdlib_files(root)
    if args.max_files:
        rel_paths = rel_paths[: args.max_files]
    print(f"[corpus] stdlib {root}: {len(rel_paths)} .py files (python {platform.python_version()})", flush=True)

    kept, texts, skipped = read_sources(root, rel_paths)
    train_idx = [i for i, rel in enumerate(kept) if not is_heldout(rel)]
    held_idx = [i for i, rel in enumerate(kept) if is_heldout(rel)]
    if not train_idx or not held_idx:
        raise ValueError(f"need files in both splits, got {len(train_idx)} train and {len(held_idx)} held-out; "
                         "raise --max-files.")
    train_texts = [texts[i] for i in train_idx]
    held_texts = [texts[i] for i in held_idx]
    train_bytes = sum(len(t.encode()) for t in train_texts)
    held_bytes = sum(len(t.encode()) for t in held_texts)
    print(f"[corpus] kept {len(kept)} files ({len(skipped)} skipped: not UTF-8 or empty); "
          f"train {len(train_texts)} files / {train_bytes / 1e6:.1f} MB, held-out {len(held_texts)} files / "
          f"{held_bytes / 1e6:.1f} MB", flush=True)

    t0 = time.time()
    print(f"[corpus] training byte-level BPE, vocab {args.vocab_size} ...", flush=True)
    tok = train_tokenizer(train_texts, args.vocab_size)
    print(f"[corpus] tokenizer: {tok.get_vocab_size()} tokens ({time.time() - t0:.1f}s)", flush=True)
    eos_id, mask_id = tok.token_to_id(EOS_TOKEN), tok.token_to_id(MASK_TOKEN)
    assert (eos_id, mask_id) == (0, 1), (eos_id, mask_id)

    tok_dir = out / "tokenizer"
    save_hf_tokenizer(tok, tok_dir, args.model_max_length)
    if args.tokenizer_out:
        dst = Path(args.tokenizer_out)
        dst.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            shutil.copyfile(tok_dir / name, dst / name)
        print(f"[corpus] tokenizer written to {tok_dir} and {dst}", flush=True)

    train = tokenize(tok, train_texts, eos_id, "train")
    held = tokenize(tok, held_texts, eos_id, "held-out")
    token_files = {}
    for split, arr in (("train", train), ("heldout", held)):
        for stale in (f"{split}.npy", f"{split}.npz"):
            (out / stale).unlink(missing_ok=True)
        if args.no_compress:
            np.save(out / f"{split}.npy", arr)
            token_files[split] = f"{split}.npy"
        else:
            np.savez_compressed(out / f"{split}.npz", tokens=arr)
            token_files[split] = f"{split}.npz"
    (out / "files.json").write_text(json.dumps({"train": [kept[i] for i in train_idx],
                                                "heldout": [kept[i] for i in held_idx],
                                                "skipped": skipped}, indent=0) + "\n")

    files = [token_files["train"], token_files["heldout"], "files.json"] + [f"tokenizer/{n}" for n in TOKENIZER_FILES]
    manifest = {
        "python_version": platform.python_version(),
        "stdlib": str(root),
        "vocab_size": tok.get_vocab_size(),
        "eos_token_id": eos_id,
        "mask_token_id": mask_id,
        "files": {"train": len(train_texts), "heldout": len(held_texts), "skipped": len(skipped)},
        "bytes": {"train": train_bytes, "heldout": held_bytes},
        "tokens": {"train": int(train.size), "heldout": int(held.size)},
        "bytes_per_token": round(train_bytes / max(1, train.size - len(train_texts)), 3),
        "token_files": token_files,
        "sha256": {name: sha256_file(out / name) for name in files},
        "seconds": round(time.time() - t_start, 1),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    carried = sum((out / name).stat().st_size for name in files) + (out / "manifest.json").stat().st_size
    print(f"[corpus] train {train.size:,} tokens, held-out {held.size:,} tokens, "
          f"{manifest['bytes_per_token']} bytes/token; {carried / 2**20:.2f} MiB under {out} "
          f"({manifest['seconds']}s)", flush=True)
    return manifest


if __name__ == "__main__":
    main()
