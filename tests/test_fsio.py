"""The atomic writers and folder publishing: a reader sees the old content or the new, never a half or a temp."""

from __future__ import annotations

import pandas as pd
import pytest

from taps_ray.fsio import (
    OutputRefused,
    atomic_dir,
    atomic_path,
    atomic_write_json,
    atomic_write_parquet,
    atomic_write_text,
    check_new_output,
)


def test_atomic_writes_replace_and_leave_no_temporaries(tmp_path):
    path = tmp_path / "sub" / "a.json"
    atomic_write_json(path, {"x": 1})
    atomic_write_json(path, {"x": 2}, indent=None, newline=True)
    assert path.read_text() == '{"x": 2}\n'
    frame = pd.DataFrame({"a": [1, 2]})
    atomic_write_parquet(tmp_path / "f.parquet", frame)
    assert pd.read_parquet(tmp_path / "f.parquet").equals(frame)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a.json", "f.parquet", "sub"]


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "a.txt"
    atomic_write_text(path, "old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]


def test_atomic_dir_publishes_replaces_or_yields(tmp_path):
    final = tmp_path / "head"
    with atomic_dir(final) as staging:
        (staging / "w").write_text("1")
    with atomic_dir(final) as staging:  # replace=True swaps the folder as a whole
        (staging / "v").write_text("2")
    assert [p.name for p in final.iterdir()] == ["v"]
    with atomic_dir(final, replace=False) as staging:  # replace=False: the folder already there wins
        (staging / "u").write_text("3")
    assert [p.name for p in final.iterdir()] == ["v"]
    with pytest.raises(RuntimeError), atomic_dir(tmp_path / "other") as staging:
        (staging / "x").write_text("half")
        raise RuntimeError("killed")
    assert [p.name for p in tmp_path.iterdir()] == ["head"]
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["head", "v"]


def test_a_folder_replaces_a_file_and_leaves_nothing_aside(tmp_path):
    """`taps export --force` over a regular file: the folder takes its place, the swapped-out file is removed."""
    final = tmp_path / "out"
    final.write_text("old")
    with atomic_dir(final) as staging:
        (staging / "config.json").write_text("{}")
    assert final.is_dir() and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_new_output_is_refused_where_something_is(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputRefused, match="already there; choose a new path, or add --force"):
        check_new_output(tmp_path / "taken", force=False)
    assert check_new_output(tmp_path / "taken", force=True) == tmp_path / "taken"
    with pytest.raises(OutputRefused, match="is a file, not a folder"):
        check_new_output(tmp_path / "file" / "deeper" / "out", force=False)
    assert check_new_output(tmp_path / "new" / "out", force=False) == tmp_path / "new" / "out"
