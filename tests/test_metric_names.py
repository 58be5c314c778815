"""The DDTREE series are named once (sglang_ddtree/metric_names.py): the server registers exactly those, and every
name a reader reads (the benchmark harness's scraper, the dashboard's queries) is one the server exports. CPU only:
the server's series (sglang/prometheus.py) in a private prometheus_client registry, fed as DDTreeStats feeds them."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from sglang_ddtree import metric_names as mn
from sglang_ddtree.stages import HOST_STAGES, SERVER_STAGES

prometheus_client = pytest.importorskip("prometheus_client")

REPO = Path(__file__).resolve().parents[1]
DEPTH = 3
# one batch round of 4 request-rounds: accepted draft tokens 0, 2, 2, 3
ROUND = {"by_accepted": [1, 0, 2, 1], "branches": 2, "nodes": 30, "expected": 9.5, "requests": 4}


def _vector(rnd: dict) -> list[float]:
    layout = mn.SummaryLayout(DEPTH)
    vec = [0.0] * layout.width
    vec[layout.by_accepted] = [float(c) for c in rnd["by_accepted"]]
    for field in mn.SUMMARY_FIELDS:
        vec[layout.index(field)] = float(rnd[field])
    return vec


def _server(budget: str, rounds: int = 5, auto: bool = False):
    """A server's registry after `rounds` batch rounds of ROUND; `auto`: with every `auto`-only series (candidates,
    calibration errors and table, the A/B arms) used."""
    from sglang_ddtree.sglang.prometheus import PrometheusSeries

    registry = prometheus_client.CollectorRegistry()
    series = PrometheusSeries(DEPTH, budget, registry=registry)
    for _ in range(rounds):
        series.observe(_vector(ROUND), 1, [{**{s: 0.5 for s in SERVER_STAGES}, "host": 2.0}])
    series.host_stages({s: 0.25 * rounds for s in HOST_STAGES}, rounds)
    if auto:
        for k in range(rounds):
            series.auto_round("chain" if k % 2 else "32", 4 if k < 3 else 8)
        series.flush_auto_rounds()
        series.calibration_errors(3.0, 2.0, 4.0, gated_abs=2.5)
        series.calibration_table([{"depth": 1, "path_class": 0, "rank_class": 1, "ratio": 0.8, "observations": 7.0}])
        for arm in ("auto", "fixed"):
            series.ab(arm, {field: 1.0 for field in mn.AB_FIELDS}, {s: 0.001 for s in HOST_STAGES})
    return registry


def _exposition(registry) -> str:
    return prometheus_client.generate_latest(registry).decode()


def _exported(registry) -> dict[str, set[str]]:
    """{sample name: its label names} of every sample the registry exposes."""
    out: dict[str, set[str]] = {}
    for family in registry.collect():
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def test_the_server_registers_exactly_the_defined_series():
    registry = _server("auto", auto=True)
    families = {family.name: family.type for family in registry.collect()}
    # prometheus_client names a counter's family without its `_total`
    defined = {m.name.removesuffix("_total") if m.kind == mn.COUNTER else m.name: m.kind for m in mn.ALL}
    assert families == defined
    exported = _exported(registry)
    for metric in mn.ALL:
        for sample in metric.samples:
            assert sample in exported, sample
            assert exported[sample] - {"le"} == set(metric.label_names), (sample, exported[sample])
    assert len({m.name for m in mn.ALL}) == len(mn.ALL)


def test_a_fixed_budget_server_exports_no_auto_only_series():
    exported = _exported(_server("8"))
    auto_only = [mn.AUTO_TAU_SCORED, mn.AUTO_TAU_ABS_ERROR, mn.CALIBRATION_RATIO, mn.CALIBRATION_OBSERVATIONS,
                 *mn.AB.values(), mn.AB_HOST_STAGE_SECONDS]
    assert not [m.name for m in auto_only if m.name in exported]
    assert mn.ROUNDS.name in exported and mn.EXPECTED_TOKENS.name in exported


def test_every_name_the_harness_reads_is_exported_and_read_right(monkeypatch):
    """ddtree_bench.prom's readers on a scrape difference of the server's own exposition: every sample name they
    look up exists there, and the numbers come back (the drafter's expected tokens and the nodes per request-round
    included: a reader of a renamed series would get None or 0)."""
    from ddtree_bench import prom

    asked: set[str] = set()
    select = prom._select

    def recording(delta, names, **labels):
        asked.update(names)
        return select(delta, names, **labels)

    monkeypatch.setattr(prom, "_select", recording)
    rounds = 5
    registry = _server("auto", rounds=rounds, auto=True)
    empty = prom.parse(_exposition(_server("auto", rounds=0)))
    delta = prom.diff(prom.parse(_exposition(registry)), empty)
    summary = prom.ddtree_summary(delta, "auto")
    candidates = prom.auto_rounds(delta)
    by_batch = prom.auto_rounds_by_batch(delta)
    calibration = prom.auto_calibration(delta)
    arms = prom.ab_arms(delta)
    exported = _exported(registry)
    assert asked and not asked - set(exported), sorted(asked - set(exported))

    request_rounds = rounds * ROUND["requests"]
    assert summary["request_rounds"] == request_rounds and summary["batch_rounds"] == rounds
    committed = sum((a + 1) * c for a, c in enumerate(ROUND["by_accepted"]))
    assert summary["tau"] == pytest.approx(committed / ROUND["requests"])
    assert summary["expected_accept_length"] == pytest.approx(ROUND["expected"] / ROUND["requests"])
    assert summary["tree_nodes_mean"] == pytest.approx(ROUND["nodes"] / ROUND["requests"])
    assert summary["branch_accept_rate"] == pytest.approx(ROUND["branches"] / (committed - ROUND["requests"]))
    assert summary["accept_rate_by_depth"] == pytest.approx([3 / 4, 3 / 4, 1 / 4])
    assert summary["stage_ms"] == pytest.approx({s: 0.5 for s in SERVER_STAGES})
    assert summary["host_ms"] == pytest.approx(2.0)
    assert summary["host_stage_ms"] == pytest.approx({s: 0.25 for s in HOST_STAGES})
    assert candidates == {"32": 3, "chain": 2}
    assert by_batch == {"4": {"32": 2, "chain": 1}, "8": {"32": 1, "chain": 1}} and list(by_batch) == ["4", "8"]
    assert calibration == pytest.approx({"scored_request_rounds": 4, "tau_mae_raw": 0.75, "tau_mae_calibrated": 0.5,
                                         "tau_mae_gated": 0.625})
    assert arms["auto"]["rounds"] == 1 and arms["fixed"]["tokens"] == 1 and arms["ratio"] == pytest.approx(1.0)
    assert arms["auto"]["host_stage_ms"] == pytest.approx({s: 1.0 for s in HOST_STAGES})


_SERIES = re.compile(r"sglang:[A-Za-z0-9_:]+")


def test_every_name_the_dashboard_queries_is_exported():
    """Every series in a panel query (and the budget variable's) of the generated dashboard and of the committed
    JSON is one the server exports, or one of SGLang's own spec gauges that the dashboard reads."""
    from sglang_ddtree.dashboard import BUDGET_VARIABLE_QUERY, DASHBOARD_PATH, build_dashboard, panel_targets

    exported = set(_exported(_server("auto", auto=True)))
    sglang_own = {mn.SGLANG_SPEC_ACCEPT_LENGTH, mn.SGLANG_SPEC_ACCEPT_RATE}
    for dash in (build_dashboard(), json.loads(DASHBOARD_PATH.read_text())):
        exprs = [expr for _, _, expr, _ in panel_targets(dash)]
        exprs += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
        assert BUDGET_VARIABLE_QUERY in exprs
        read = {name for expr in exprs for name in _SERIES.findall(expr)}
        ours = {name for name in read if name.startswith(mn.PREFIX)}
        assert len(ours) >= 10 and not ours - exported, sorted(ours - exported)
        assert read - ours <= sglang_own, sorted(read - ours - sglang_own)


# a whole series name (not a family pattern such as `sglang:ddtree_ab_*`), or one built from a literal prefix
_NAME_LITERAL = re.compile(r"sglang:(ddtree_[a-z0-9_]+|spec_[a-z0-9_]+)(?![a-z0-9_*])")


def _string_literals(path: Path):
    """(line, text) of the string constants of a module that are not docstrings (f-strings' literal parts too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


def test_no_module_but_metric_names_spells_a_series_name_out():
    """The package, the harness, the benchmarks and the scripts take every series name from metric_names (docstrings
    and comments may name series; tests write their own scrapes)."""
    files = [p for folder in ("sglang_ddtree", "ddtree_bench", "benchmarks", "scripts")
             for p in sorted((REPO / folder).rglob("*.py")) if p != REPO / "sglang_ddtree" / "metric_names.py"]
    assert len(files) > 50
    found = [f"{p.relative_to(REPO)}:{line}: {m.group(0)}" for p in files for line, text in _string_literals(p)
             for m in _NAME_LITERAL.finditer(text)]
    assert not found, "series names outside sglang_ddtree/metric_names.py:\n" + "\n".join(found)


def test_the_static_check_sees_a_literal_name(tmp_path):
    """The literal scan above finds a plain name and one built from a literal prefix, not a family pattern or a
    docstring."""
    module = tmp_path / "m.py"
    module.write_text('"""Reads sglang:ddtree_rounds_total."""\n'
                      'A = "sglang:ddtree_rounds_total"\n'
                      'B = f"sglang:ddtree_ab_{field}_total"\n'
                      'C = "one counter per arm (sglang:ddtree_ab_* per arm)"\n')
    found = [(line, m.group(0)) for line, text in _string_literals(module) for m in _NAME_LITERAL.finditer(text)]
    assert found == [(2, "sglang:ddtree_rounds_total"), (3, "sglang:ddtree_ab_")]


def test_the_docs_name_only_series_the_server_exports():
    """docs/ and the README spell names out for users: each is a family or a sample the server exports."""
    exported = set(_exported(_server("auto", auto=True))) | {m.name for m in mn.ALL}
    texts = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    named = {(p.relative_to(REPO).as_posix(), m.group(0)) for p in texts
             for m in _NAME_LITERAL.finditer(p.read_text()) if m.group(0).startswith(mn.PREFIX)}
    assert len(named) >= 10
    assert not {name for _, name in named} - exported, sorted(n for n in named if n[1] not in exported)
