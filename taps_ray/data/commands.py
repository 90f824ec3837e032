"""`taps data list` and `taps data show`: what data is available, from where, and what it looks like."""

from __future__ import annotations

import os
import sys
import textwrap

from taps_ray.data.sources import Conversation, DataUnavailable, Question, list_datasets, load_examples, resolve

_MAX_CHARS = 400


def _clip(text: str, limit: int = _MAX_CHARS) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit].rstrip() + f" … [{len(text) - limit} more chars]"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def cmd_list(data_dir: str | os.PathLike | None = None) -> int:
    """Print every data set with its role, source and row count; 2 when any set is unavailable."""
    try:
        rows = list_datasets(data_dir)
    except DataUnavailable as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    table = [
        [r.name, r.role, str(r.rows) if r.rows is not None else "-", r.source + (f" [{', '.join(r.notes)}]" if r.notes else "")]
        for r in rows
    ]
    print(_table(["name", "role", "rows", "source"], table))
    missing = [r for r in rows if not r.available]
    for r in missing:
        print(f"error: {r.error}", file=sys.stderr)
    return 2 if missing else 0


def _format_example(example: Question | Conversation) -> str:
    indent = lambda text: textwrap.indent(_clip(text), "    ")  # noqa: E731
    if isinstance(example, Question):
        parts = [f"[{example.question_id}] category={example.category}"]
        for i, turn in enumerate(example.turns, 1):
            parts.append(f"  turn {i}:\n{indent(turn)}")
        for i, ref in enumerate(example.reference or [], 1):
            parts.append(f"  reference {i}:\n{indent(ref)}")
        return "\n".join(parts)
    parts = [f"[{example.id}] {len(example.messages)} messages"]
    for message in example.messages:
        parts.append(f"  {message['role']}:\n{indent(message['content'])}")
    return "\n".join(parts)


def cmd_show(name: str, n: int = 3, data_dir: str | os.PathLike | None = None) -> int:
    """Print the source of `name` and its first `n` examples; 2 when it is unavailable."""
    try:
        source = resolve(name, data_dir)
        examples = load_examples(name, data_dir, limit=max(n, 0))
    except DataUnavailable as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"{source.name} ({source.role}) from {source.source_label}")
    for example in examples:
        print()
        print(_format_example(example))
    return 0
