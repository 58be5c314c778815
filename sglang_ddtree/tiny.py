"""The committed tiny target/drafter pair: where it lives, how to load it, and how its corpus is split.

Layout of `tiny_dir()` (default `models/tiny` under the working directory, override with env
`SGLANG_DDTREE_TINY_DIR`):
    tokenizer/           byte-level BPE tokenizer (written by scripts/build_corpus.py)
    target/              transformers Qwen3ForCausalLM (config.json, model.safetensors, tokenizer files)
    drafter/             DFlash drafter (config.json in the z-lab format, model.safetensors)
    training_log.json    what scripts/train_tiny_pair.py did (losses, held-out ppl, acceptance, file hashes)

The corpus is the Python standard library of the interpreter that builds it; the held-out split is decided
by a stable hash of each file's relative path, so any interpreter can tell which files the models never saw.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import torch

from sglang_ddtree import config



def tiny_dir() -> Path:
    """The tiny pair's directory: SGLANG_DDTREE_TINY_DIR, else models/tiny under the working directory (a
    checkout's root). Read when asked: the installed package reads no file next to its own source."""
    return Path(config.get("SGLANG_DDTREE_TINY_DIR") or Path.cwd() / "models" / "tiny")


EOS_TOKEN = "<|endoftext|>"  # also bos and pad
MASK_TOKEN = "<|mask|>"      # the DFlash drafter's mask token; never appears in the corpus
SPECIAL_TOKENS = (EOS_TOKEN, MASK_TOKEN)  # ids 0 and 1, in this order

HELDOUT_PER_MILLE = 50  # ~5% of files are held out
# Third-party packages installed next to the standard library are not part of the corpus.
_EXCLUDED_TOP_DIRS = ("site-packages", "dist-packages", "__pycache__")

_MISSING_HINT = "run scripts/build_corpus.py and then scripts/train_tiny_pair.py to create it"


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[str]:
    """Relative POSIX paths of every `*.py` file of the standard library, sorted (deterministic)."""
    root = stdlib_root() if root is None else Path(root)
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if rel.parts[0] in _EXCLUDED_TOP_DIRS or "__pycache__" in rel.parts:
            continue
        if path.is_file():
            out.append(rel.as_posix())
    return sorted(out)


def is_heldout(rel_path: str) -> bool:
    """Stable split: a file is held out iff the hash of its relative path falls in the first 5%."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < HELDOUT_PER_MILLE


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def heldout_sample(tokenizer, n_files: int = 4, max_tokens: int = 512, skip_tokens: int = 256) -> list[dict]:
    """A small held-out slice read from the RUNNING interpreter's stdlib (nothing is shipped in the repo):
    the first `n_files` held-out top-level modules (sorted), `max_tokens` tokens each, starting after the first
    `skip_tokens` (mostly the module docstring) when the file is long enough.
    Returns [{"path", "sha256", "ids"}]; "sha256" is of the file, so runs on other Python versions can tell
    whether they measured the same text."""
    root = stdlib_root()
    picked = []
    for rel in stdlib_files(root):
        if "/" in rel or rel.startswith("_") or not is_heldout(rel):
            continue
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        if len(ids) < max_tokens:
            continue
        start = skip_tokens if len(ids) >= skip_tokens + max_tokens else 0
        picked.append({"path": rel, "sha256": sha256_file(root / rel), "ids": ids[start:start + max_tokens]})
        if len(picked) == n_files:
            break
    return picked


@torch.no_grad()
def sample_perplexity(model, sample: list[dict]) -> dict:
    """Per-file and pooled next-token perplexity of a causal LM on `heldout_sample` output."""
    import math

    per_file, total, count = {}, 0.0, 0
    device = next(model.parameters()).device
    for item in sample:
        x = torch.tensor([item["ids"]], device=device)
        logits = model(input_ids=x, use_cache=False).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()
        per_file[item["path"]] = math.exp(nll / (x.shape[1] - 1))
        total, count = total + nll, count + x.shape[1] - 1
    return {"ppl": math.exp(total / max(1, count)), "tokens": count, "per_file": per_file}


def load_corpus_tokens(corpus_dir: str | Path, split: str):
    """uint16 token array of a corpus split ("train" or "heldout") written by scripts/build_corpus.py."""
    import numpy as np

    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}.")
    corpus_dir = Path(corpus_dir)
    if (corpus_dir / f"{split}.npz").is_file():
        with np.load(corpus_dir / f"{split}.npz") as data:
            return data["tokens"]
    if (corpus_dir / f"{split}.npy").is_file():
        return np.load(corpus_dir / f"{split}.npy")
    raise FileNotFoundError(f"No {split}.npz or {split}.npy under {corpus_dir}; run scripts/build_corpus.py.")


def _resolve(path, sub: str) -> Path:
    base = Path(path) if path is not None else tiny_dir() / sub
    return base


def _require(path: Path, what: str, needed: tuple[str, ...]) -> None:
    missing = [name for name in needed if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"The tiny {what} is missing {', '.join(missing)} under {path}; {_MISSING_HINT}."
        )


def load_tokenizer(path=None):
    """The tiny pair's tokenizer (a transformers fast tokenizer). Default: `tiny_dir()/tokenizer`."""
    from transformers import AutoTokenizer

    path = _resolve(path, "tokenizer")
    _require(path, "tokenizer", ("tokenizer.json", "tokenizer_config.json"))
    return AutoTokenizer.from_pretrained(str(path))


def load_target(path=None, device="cpu", dtype=torch.float32):
    """The tiny target as a transformers `Qwen3ForCausalLM`, in eval mode."""
    from transformers import AutoModelForCausalLM

    path = _resolve(path, "target")
    _require(path, "target", ("config.json", "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.to(device).eval()


def load_drafter(path=None, device="cpu", dtype=torch.float32):
    """The tiny DFlash drafter (`sglang_ddtree.drafter.DFlashDrafter`), in eval mode."""
    from sglang_ddtree.drafter import DFlashDrafter

    path = _resolve(path, "drafter")
    _require(path, "drafter", ("config.json", "model.safetensors"))
    return DFlashDrafter.from_pretrained(path, device=device, dtype=dtype).eval()
