"""Committed text stays inside the repository: code cites docs/algorithms.md by anchor (every cited anchor
exists), and committed reports print paths relative to the repo or the data dir, never machine paths."""

from __future__ import annotations

import re
from pathlib import Path

from taps_ray.relpaths import REPO as PACKAGE_REPO, shown_path

REPO = Path(__file__).resolve().parents[1]
ALGORITHMS = REPO / "docs" / "algorithms.md"
SCANNED = ("taps_ray", "tests", "benchmarks", "jobs")
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".sh", ".json"}
# Written in pieces so that this file does not match its own patterns.
OUTSIDE = re.compile("|".join([
    "ALGORITHMS" + r"\.md",  # the external algorithms spec this repository used to cite
    r"\.\./" + "shared",  # the folder next to the repository
    r"\bshared/[\w.-]+\." + "md",  # a document in that folder
    "\u00a7",  # a section number of the external spec
]))
CITATION = re.compile(r"docs/algorithms\.md#([\w-]+)")
REQUIRED = ("draft-tree", "batched-tree-verification", "acceptance", "training-losses", "taps-combinations",
            "draft-vocabulary", "acceptance-length", "what-the-reports-count")


def scanned_files() -> list[Path]:
    return [p for top in SCANNED for p in sorted((REPO / top).rglob("*"))
            if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts]


def github_anchors(markdown: str) -> set[str]:
    """Heading anchors as GitHub renders them: lower case, punctuation dropped, spaces to hyphens, -1 for repeats."""
    anchors: set[str] = set()
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        match = None if in_code else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        unique, n = slug, 0
        while unique in anchors:
            n += 1
            unique = f"{slug}-{n}"
        anchors.add(unique)
    return anchors


def test_github_anchor_slugs():
    assert github_anchors("# Algorithms\n## Batched tree verification\n### Greedy (T = 0)\n## Notes\n## Notes\n") == {
        "algorithms", "batched-tree-verification", "greedy-t--0", "notes", "notes-1"}
    assert github_anchors("```\n# not a heading\n```\n## Real\n") == {"real"}


def test_no_citation_of_files_outside_the_repository():
    offenders = [f"{path.relative_to(REPO)}:{i}: {line.strip()}"
                 for path in scanned_files()
                 for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
                 if OUTSIDE.search(line)]
    assert not offenders, "cite docs/algorithms.md#<anchor> instead:\n" + "\n".join(offenders)


def test_every_cited_anchor_exists():
    anchors = github_anchors(ALGORITHMS.read_text(encoding="utf-8"))
    assert set(REQUIRED) <= anchors, sorted(set(REQUIRED) - anchors)
    cited: dict[str, list[str]] = {}
    for path in [*scanned_files(), *sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]:
        for anchor in CITATION.findall(path.read_text(encoding="utf-8", errors="replace")):
            cited.setdefault(anchor, []).append(str(path.relative_to(REPO)))
    assert len(cited) >= 10  # the engine, training, data and report modules all cite it
    missing = {anchor: files for anchor, files in cited.items() if anchor not in anchors}
    assert not missing, f"anchors cited but not headings of docs/algorithms.md: {missing}"
    internal = set(re.findall(r"\]\(#([\w-]+)\)", ALGORITHMS.read_text(encoding="utf-8")))
    assert internal <= anchors, sorted(internal - anchors)


MACHINE_PATH = re.compile(r"(?<![\w.$])/(?:work|root|home|tmp|Users)/|site-packages|dist-packages")


def test_shown_path_is_relative_to_the_data_dir_or_the_repo(tmp_path):
    data = tmp_path / "data"
    assert PACKAGE_REPO == REPO
    assert shown_path(data / "svamp" / "question.jsonl", data) == "$TAPS_DATA_DIR/svamp/question.jsonl"
    assert shown_path(REPO / "runs" / "cpu" / "results") == "runs/cpu/results"
    assert shown_path(REPO / "runs" / "cpu" / "results", data) == "runs/cpu/results"
    assert shown_path("reports/results") == "reports/results"
    assert shown_path(tmp_path / "work" / "results") == "…/work/results"


def test_committed_reports_carry_no_machine_paths():
    files = [p for p in sorted((REPO / "reports").rglob("*")) if p.suffix in (".md", ".json")]
    assert files
    offenders = [f"{p.relative_to(REPO)}:{i}: {line.strip()[:160]}"
                 for p in files for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
                 if MACHINE_PATH.search(line)]
    assert not offenders, "\n".join(offenders)
