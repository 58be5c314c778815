"""A cProfile of a scheduler process's decode loop, for any speculative algorithm (DFLASH as well as DDTREE).

Why: on a small target the round is host-bound (tiny pair at batch 4: the GPU busy 0.6-0.8 ms of a
3.9-5.9 ms profiled step), and a DDTREE round cost the host ~2 ms more than a DFLASH round under torch's profiler: 81 more CUDA runtime calls and ~93 more torch ops a step,
which do not account for all of it. torch's profiler names ops, not our Python; cProfile names the functions.

SGLANG_DDTREE_HOST_PROFILE=DIR turns it on in every scheduler process the plugin loads into (the DDTREE plugin is
loaded by every SGLang server of this environment, so a DFLASH server is profiled the same way). From the START-th
decode batch to the (START + COUNT)-th (SGLANG_DDTREE_HOST_PROFILE_ROUNDS="START:COUNT", default "200:400"),
everything on the scheduler thread is profiled: the batches' launches, result processing and the scheduling between
them. Written once COUNT batches are in: DIR/host_profile_<algorithm>[_<budget>]_<pid>.pstats and a .txt with the
top functions by own time and by cumulative time (totals over the COUNT batches) and the wall time per batch.
"""

from __future__ import annotations

import cProfile
import io
import logging
import os
import pstats
import time
from pathlib import Path

from sglang_ddtree import config
from sglang_ddtree.sglang import engine

logger = logging.getLogger(__name__)

ENV = "SGLANG_DDTREE_HOST_PROFILE"
ROUNDS_ENV = "SGLANG_DDTREE_HOST_PROFILE_ROUNDS"
TARGET = engine.hook_target("Scheduler.run_batch")


def parse_rounds(text: str | None) -> tuple[int, int]:
    """"START:COUNT" -> (START, COUNT); START >= 1, COUNT >= 1."""
    if not text:
        return 200, 400
    try:
        start, count = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"{ROUNDS_ENV} must be START:COUNT (two integers), got {text!r}") from None
    if start < 1 or count < 1:
        raise ValueError(f"{ROUNDS_ENV}: START and COUNT must be >= 1, got {text!r}")
    return start, count


def _is_decode(batch) -> bool:
    mode = getattr(batch, "forward_mode", None)
    return bool(mode is not None and getattr(mode, "is_decode", None) and mode.is_decode())


def _label(scheduler) -> str:
    args = getattr(scheduler, "server_args", None)
    algo = str(getattr(args, "speculative_algorithm", None) or "plain").lower()
    budget = getattr(args, "speculative_ddtree_budget", None)
    return algo + (f"_{budget}" if budget is not None and algo == "ddtree" else "")


class HostProfile:
    def __init__(self, out_dir: str | Path, start: int, count: int, clock=time.perf_counter):
        self.out_dir = Path(out_dir)
        self.start, self.count = start, count
        self.clock = clock
        self.seen = 0
        self.profiler: cProfile.Profile | None = None
        self.t_enabled = 0.0
        self.written: Path | None = None

    def around_run_batch(self, original, scheduler, batch, *args, **kwargs):
        if self.written is None and _is_decode(batch):
            self.seen += 1
            if self.seen == self.start:
                self.profiler = cProfile.Profile()
                self.t_enabled = self.clock()
                self.profiler.enable()
            elif self.seen == self.start + self.count and self.profiler is not None:
                self.profiler.disable()
                try:
                    self._write(scheduler, self.clock() - self.t_enabled)
                except Exception:  # a debugging aid must never take the server down
                    logger.exception("DDTREE host profile: could not write to %s", self.out_dir)
                self.profiler = None
        return original(scheduler, batch, *args, **kwargs)

    def _write(self, scheduler, seconds: float) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stem = self.out_dir / f"host_profile_{_label(scheduler)}_{os.getpid()}"
        self.profiler.dump_stats(str(stem) + ".pstats")
        text = io.StringIO()
        text.write(f"{_label(scheduler)}: {self.count} decode batches (from the {self.start}-th), "
                   f"{1e3 * seconds / self.count:.3f} ms of wall time per batch while profiled\n"
                   f"(times below are totals over the {self.count} batches; divide by {self.count} for one)\n\n")
        for key in ("tottime", "cumulative"):
            text.write(f"---- by {key}\n")
            stats = pstats.Stats(self.profiler, stream=text)
            stats.sort_stats(key).print_stats(40)
        Path(str(stem) + ".txt").write_text(text.getvalue())
        self.written = Path(str(stem) + ".pstats")
        logger.warning("DDTREE host profile: %d decode batches written to %s", self.count, self.written)


def install(hook_registry, hook_type) -> HostProfile | None:
    """Registers the run_batch hook when SGLANG_DDTREE_HOST_PROFILE is set (called from plugin.register)."""
    out = config.get(ENV)
    if not out:
        return None
    start, count = parse_rounds(config.get(ROUNDS_ENV))
    profile = HostProfile(out, start, count)
    hook_registry.register(TARGET, profile.around_run_batch, hook_type.AROUND)
    return profile
