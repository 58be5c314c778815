"""sglang_ddtree/config.py: every environment variable the package reads is in the registry, none is read at import,
and a bad value fails when it is read, naming the variable."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_ddtree import config

ROOT = Path(__file__).resolve().parents[1]
# read by the `auto` policy itself (sglang/auto.py), not through the registry
AUTO_OWN = re.compile(r"SGLANG_DDTREE_(AUTO_[A-Z0-9_]*|CALIBRATION_PRIOR_MASS)$")


def names_in(path: Path) -> set[str]:
    return set(re.findall(r"SGLANG_DDTREE_[A-Z0-9_]+", path.read_text()))


def test_every_variable_the_package_names_is_registered():
    named = set()
    for path in (ROOT / "sglang_ddtree").rglob("*.py"):
        if "bench" in path.relative_to(ROOT / "sglang_ddtree").parts or path.name == "config.py":
            continue  # the benchmark harness's own variables; the registry itself
        named |= names_in(path)
    unregistered = {n for n in named if not AUTO_OWN.match(n)} - set(config.VARIABLES)
    assert not unregistered, unregistered
    assert all(n in named for n in config.VARIABLES), "a registered variable nothing reads"
    for row in config.describe():
        assert row["meaning"] and row["name"].startswith("SGLANG_DDTREE_")


def test_values_are_read_when_asked_and_checked(monkeypatch):
    monkeypatch.delenv("SGLANG_DDTREE_TREE_CONV", raising=False)
    assert config.get("SGLANG_DDTREE_TREE_CONV") == "auto"
    monkeypatch.setenv("SGLANG_DDTREE_TREE_CONV", "ddtree")
    assert config.get("SGLANG_DDTREE_TREE_CONV") == "ddtree"
    monkeypatch.setenv("SGLANG_DDTREE_TREE_CONV", "theirs")
    with pytest.raises(ValueError, match="SGLANG_DDTREE_TREE_CONV"):
        config.get("SGLANG_DDTREE_TREE_CONV")
    monkeypatch.setenv("SGLANG_DDTREE_TORCH_PATH", "1")
    assert config.get("SGLANG_DDTREE_TORCH_PATH") is True
    monkeypatch.setenv("SGLANG_DDTREE_TORCH_PATH", "yes")
    with pytest.raises(ValueError, match="SGLANG_DDTREE_TORCH_PATH"):
        config.get("SGLANG_DDTREE_TORCH_PATH")


def test_importing_the_package_reads_no_variable():
    """Bad values everywhere: importing every module that needs no SGLang still succeeds."""
    env = {name: "not-a-valid-value" for name in config.VARIABLES}
    modules = ["sglang_ddtree.kernels", "sglang_ddtree.tree_conv", "sglang_ddtree.tiny", "sglang_ddtree.datasets",
               "sglang_ddtree.sglang.ops", "sglang_ddtree.sglang.stats", "sglang_ddtree.sglang.plugin",
               "sglang_ddtree.sglang.modes", "sglang_ddtree.sglang.auto_round"]
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\nprint('ok')"
    import os

    out = subprocess.run([sys.executable, "-c", code, *modules], env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
