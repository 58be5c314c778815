"""Importing a release's SGLang sources on a CPU machine without its GPU and serving packages (tests only).

`import_sglang(src)` puts an unpacked release (tests/test_sglang_plugin.sglang_source) first on sys.path and
imports it; a third-party module that the SGLang sources import and this machine lacks becomes a stub whose
attributes are placeholder classes (only for imports made from SGLang's own files, so torch's and transformers'
optional probes still see what is really installed). A few SGLang modules that would pull whole model registries
or parser stacks are replaced by the names the server arguments need from them. Meant for a fresh interpreter
(a subprocess): it leaves its modules in sys.modules.
"""

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types


class _Placeholder(type):
    def __getitem__(cls, key):
        return cls

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})

    def __call__(cls, *args, **kwargs):
        return _Placeholder("instance", (), {})

    def __iter__(cls):
        return iter(())

    def __len__(cls):
        return 0


class StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _Placeholder(name, (), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, src: str):
        self.src = src
        self.stubbed = []

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("sglang", "sglang_ddtree", "msgspec"):
            return None
        parent = sys.modules.get(name.rpartition(".")[0])
        if not isinstance(parent, StubModule):
            for finder in sys.meta_path:
                if finder is self:
                    continue
                try:
                    if finder.find_spec(name, path, target) is not None:
                        return None
                except Exception:  # noqa: BLE001 - a finder that cannot answer does not have it
                    pass
            frame = sys._getframe(1)
            while frame is not None and "importlib" in frame.f_code.co_filename:
                frame = frame.f_back
            if frame is None or not frame.f_code.co_filename.startswith(self.src):
                return None
        self.stubbed.append(name)
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        return StubModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def _module(name, **names):
    module = types.ModuleType(name)
    module.__dict__.update(names)
    sys.modules[name] = module
    return module


def import_sglang(src, extra_paths=()):
    """Import the SGLang release unpacked at `src` (its parent directory holds `sglang/`) with stubs; -> sglang."""
    src = os.path.abspath(src)
    sys.path[:0] = [src, *[os.path.abspath(p) for p in extra_paths]]
    import torch  # noqa: F401 - the real ones first: their optional probes must not meet stubs
    import transformers
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer, PretrainedConfig  # noqa: F401

    sys.meta_path.append(_StubFinder(src))
    import sglang
    import sglang.srt

    # packages whose __init__ imports every model config (and registers image processors with transformers):
    # their submodules load one by one instead
    configs = StubModule("sglang.srt.configs")
    configs.__path__ = [os.path.join(src, "sglang", "srt", "configs")]
    sys.modules.setdefault("sglang.srt.configs", configs)

    class FunctionCallParser:
        ToolCallParserEnum = {}

    class ReasoningParser:
        DetectorMap = {}

    for name, attrs in {
        "sglang.srt.function_call.function_call_parser": {"FunctionCallParser": FunctionCallParser},
        "sglang.srt.parser.reasoning_parser": {"ReasoningParser": ReasoningParser},
        "sglang.srt.utils.hf_transformers_utils": {"check_gguf_file": lambda *a, **k: False,
                                                  "get_config": _no_config},
    }.items():
        _module(name, **attrs)
    return sglang


# model path -> the config get_config answers for it (a test registers its stand-in checkpoints here)
CONFIGS = {}


def _no_config(path, *args, **kwargs):
    if path in CONFIGS:
        return CONFIGS[path]
    raise OSError(f"no model config at {path} on this machine")
