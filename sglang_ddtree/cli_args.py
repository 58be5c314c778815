"""Argument checks shared by the `sglang-ddtree` subcommands: every input error is one line on stderr and exit 2,
found before any model loads.

- `CliParser`: an ArgumentParser whose errors are one line (`prog: error: message (see prog --help)`), not the
  usage block followed by the message; subparsers inherit it.
- argparse `type=` checks: `positive_int`, `nonnegative_int`, `nonnegative_float`, `probability`, `budget_list`,
  `device_name`.
- output paths: `check_output_file` / `check_output_dir` try the write (a probe file in the nearest existing folder)
  without leaving anything behind; `made_dirs` creates an output folder and removes what it created when the run
  fails, so a failed run leaves no empty folders.
- `Interrupted`: what a command stopped by Ctrl-C kept; `cli.main` prints it in one line and exits 130.
- `set_cpu_threads`: torch's CPU threads for a run (--threads, else OMP_NUM_THREADS, else 1 for the tiny pair).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile
from pathlib import Path


class CliParser(argparse.ArgumentParser):
    """argparse with one-line errors (exit status 2)."""

    def error(self, message: str):  # noqa: D102 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message.rstrip('.')} (see {self.prog} --help).\n")


def fail(message: str) -> int:
    """Print `error: message` on stderr; the exit status of a bad input."""
    print(f"error: {message}", file=sys.stderr)
    return 2


class Interrupted(Exception):
    """A command stopped by Ctrl-C, with what it kept (one sentence); `cli.main` prints it and exits 130."""


def _whole_number(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _whole_number(text, 1)


def nonnegative_int(text: str) -> int:
    return _whole_number(text, 0)


def _number(text: str, expected: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def nonnegative_float(text: str) -> float:
    value = _number(text, "a number >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value:g}")
    return value


def probability(text: str) -> float:
    """argparse type for --top-p: a number in (0, 1]."""
    value = _number(text, "a number in (0, 1]")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {value:g}")
    return value


def parse_budgets(text: str, what: str = "--budgets") -> list[int]:
    """'16,64,256' -> [16, 64, 256]: whole numbers in 1..tree.MAX_BUDGET, no empty or repeated entries."""
    from sglang_ddtree.tree import MAX_BUDGET

    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise ValueError(f"{what} must be comma-separated whole numbers with no empty entries, got {text!r}.")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated whole numbers, got {text!r}.") from None
    bad = [v for v in values if not 1 <= v <= MAX_BUDGET]
    if bad:
        raise ValueError(f"{what} must each be in 1..{MAX_BUDGET} (draft nodes per tree), got {bad[0]}.")
    if len(set(values)) != len(values):
        raise ValueError(f"{what} lists a budget twice: {text!r}.")
    return values


def budget_list(text: str) -> list[int]:
    """argparse type for --budgets."""
    try:
        return parse_budgets(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--budgets ").rstrip(".")) from None


def device_name(text: str) -> str:
    """argparse type for --device: cpu, cuda or cuda:N, and CUDA only when torch sees a GPU."""
    name = text.strip().lower()
    if name == "cpu":
        return name
    if name != "cuda" and not (name.startswith("cuda:") and name[5:].isdigit()):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    import torch

    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r} was asked for but torch sees no CUDA GPU here; use --device cpu")
    if ":" in name and int(name[5:]) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r} does not exist: torch sees {torch.cuda.device_count()} GPU(s)")
    return name


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists():
        if p.parent == p:
            break
        p = p.parent
    return p


def _probe_folder(folder: Path, what: str, target: Path) -> None:
    """Raise ValueError unless a file can be created (and is removed again) in `folder`."""
    if not folder.is_dir():
        raise ValueError(f"{what} {str(target)!r} cannot be created: {str(folder)!r} is a file, not a folder.")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".sglang-ddtree-probe-"):
            pass
    except OSError as e:
        raise ValueError(f"{what} {str(target)!r} is not writable: cannot create a file in {str(folder)!r} "
                         f"({e.strerror or type(e).__name__}).") from None


def check_output_file(path: str | os.PathLike, what: str = "--out") -> None:
    """A file that will be written: not an existing folder, and its folder (or the nearest existing one above it)
    writable. Creates nothing."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{what} {str(p)!r} is a folder; give a file name.")
    if p.exists():
        try:
            with open(p, "a", encoding="utf-8"):
                pass
        except OSError as e:
            raise ValueError(f"{what} {str(p)!r} is not writable ({e.strerror or type(e).__name__}).") from None
        return
    _probe_folder(_nearest_existing(p.parent.absolute()), what, p)


def check_output_dir(path: str | os.PathLike, what: str = "--out") -> None:
    """A folder that will be written into: not an existing file, and writable (or creatable). Creates nothing."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{what} {str(p)!r} is an existing file, not a folder.")
    _probe_folder(_nearest_existing(p.absolute()), what, p)


@contextlib.contextmanager
def made_dirs(path: str | os.PathLike):
    """Create folder `path` (and missing parents) for a run's outputs. If the body raises, or sets
    `state["failed"] = True` on the yielded dict, the folders this call created are removed again when empty: a
    failed run leaves no empty output folders behind."""
    p = Path(path).absolute()
    created = []
    q = p
    while not q.exists():
        created.append(q)
        q = q.parent
    p.mkdir(parents=True, exist_ok=True)
    state = {"failed": False}
    try:
        yield state
    except BaseException:
        state["failed"] = True
        raise
    finally:
        if state["failed"]:
            for d in created:  # deepest first
                with contextlib.suppress(OSError):
                    d.rmdir()


def set_cpu_threads(threads: int | None, device: str, tiny: bool, environ=None) -> str | None:
    """Set torch's intra-op CPU threads for a run on `device`; returns how many and why, for the run's first line
    (None on a GPU unless `threads` was asked for: there the CPU threads hardly matter).

    `threads` (--threads) wins. Else an OMP_NUM_THREADS the user set is kept (torch already follows it). Else the
    tiny pair runs on 1 thread: its matrix products are too small to gain from more, and torch's threads wait on
    each other at every op, which stalls whenever another process holds one of the cores. Other models keep
    torch's default (one thread per core)."""
    import torch

    env = os.environ if environ is None else environ
    if threads is not None:
        torch.set_num_threads(threads)
        why = "--threads"
    elif torch.device(device).type != "cpu":
        return None
    elif env.get("OMP_NUM_THREADS", "").strip():
        why = f"OMP_NUM_THREADS={env['OMP_NUM_THREADS'].strip()}"
    elif tiny:
        torch.set_num_threads(1)
        why = "the tiny pair's default; --threads N for more"
    else:
        why = "torch's default; --threads N to change"
    n = torch.get_num_threads()
    return f"{n} CPU thread{'s' if n != 1 else ''} ({why})"
