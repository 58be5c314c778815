"""The scheduler-loop cProfile (sglang_ddtree.sglang.host_profile), with fake scheduler and batch objects."""

import pstats
import types

import pytest

from sglang_ddtree.sglang import host_profile


class Mode:
    def __init__(self, decode):
        self.decode = decode

    def is_decode(self):
        return self.decode


def batch(decode=True):
    return types.SimpleNamespace(forward_mode=Mode(decode))


def scheduler(algo="DDTREE", budget=64):
    return types.SimpleNamespace(server_args=types.SimpleNamespace(speculative_algorithm=algo,
                                                                  speculative_ddtree_budget=budget))


def busy_round_work(n):
    return sum(i * i for i in range(n))


def test_profiles_decode_batches_start_to_start_plus_count(tmp_path):
    clock = iter(float(t) for t in range(100)).__next__
    prof = host_profile.HostProfile(tmp_path, start=3, count=4, clock=clock)
    sched = scheduler()
    calls = []

    def run_batch(s, b, *args, **kwargs):
        calls.append((b, args, kwargs))
        return busy_round_work(2000)

    expected = busy_round_work(2000)
    for i in range(12):
        if i % 3 == 0:  # prefill batches do not count
            prof.around_run_batch(run_batch, sched, batch(decode=False))
        result = prof.around_run_batch(run_batch, sched, batch(), "pp", flag=1)
        assert result == expected  # the original's result, args passed through
        if prof.seen < 7:
            assert prof.written is None
    assert len(calls) == 16 and calls[-1][1] == ("pp",) and calls[-1][2] == {"flag": 1}
    assert prof.seen == 7  # stops counting once written
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and files[0].startswith("host_profile_ddtree_64_") and files[0].endswith(".pstats")
    stats = pstats.Stats(str(tmp_path / files[0]))
    work = [v for k, v in stats.stats.items() if k[2] == "busy_round_work"]
    # profiled from the 3rd decode batch's start to the 7th's: decode batches 3..6 and the 2 prefill batches
    # between them (the loop's whole thread, not only the decode calls)
    assert work and work[0][1] == 4 + 2
    text = (tmp_path / files[1]).read_text()
    assert "4 decode batches (from the 3-th)" in text and "busy_round_work" in text and "by cumulative" in text


def test_label_names_the_algorithm():
    assert host_profile._label(scheduler("DFLASH", None)) == "dflash"
    assert host_profile._label(scheduler(None, None)) == "plain"
    assert host_profile._label(scheduler("DDTREE", "auto")) == "ddtree_auto"


def test_rounds_env_and_install(monkeypatch, tmp_path):
    assert host_profile.parse_rounds(None) == (200, 400)
    assert host_profile.parse_rounds("5:10") == (5, 10)
    for bad in ("5", "a:b", "0:10", "5:0"):
        with pytest.raises(ValueError, match="START"):
            host_profile.parse_rounds(bad)

    registered = []
    registry = types.SimpleNamespace(register=lambda target, fn, kind: registered.append((target, kind)))
    kinds = types.SimpleNamespace(AROUND="around")
    monkeypatch.delenv(host_profile.ENV, raising=False)
    assert host_profile.install(registry, kinds) is None and registered == []
    monkeypatch.setenv(host_profile.ENV, str(tmp_path))
    monkeypatch.setenv(host_profile.ROUNDS_ENV, "2:3")
    prof = host_profile.install(registry, kinds)
    assert (prof.start, prof.count) == (2, 3) and registered == [(host_profile.TARGET, "around")]
