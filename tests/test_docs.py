"""Docs stay inside the repository: code cites docs/algorithms.md by anchor, and every cited anchor exists."""

from __future__ import annotations

import re
from pathlib import Path

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
