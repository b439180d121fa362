"""The README and the docs it links name only paths that exist.

README.md, docs/*.md and docs/history/*.md name files and folders of this repository in backticks
(`specdec/models/formats.py`, `docs/bench/batching/served-s8/`) and in Markdown links. A path
counts when it starts with a top-level folder of the repository; a `::test` or `:function`
suffix is dropped, and placeholders (`<role>`, `TAG`, `*`) are skipped. The session-9 restructure
found one such path dead for sessions (`docs/bench/batching.md`, a folder by then).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = ("specdec/", "deployments/", "docs/", "tests/", "scripts/", "k8s/", "benchmarks/", "protos/", ".ci/")
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
        *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "history").glob("*.md"))]
PLACEHOLDER = re.compile(r"[<>*{}\[\]]|\bTAG\b|\bFORMAT\b|\.\.\.|\bN\b")


def named_paths(text: str) -> set[str]:
    """Repository paths named in backticks or Markdown links of ``text``, suffixes dropped."""
    found = set()
    for token in re.findall(r"`([^`\n]+)`", text) + re.findall(r"\]\(([^)\s#]+)", text):
        for word in token.split():
            word = word.strip(".,;()'\"")
            if not word.startswith(TOP) or PLACEHOLDER.search(word):
                continue
            found.add(re.split(r"::|:(?=[A-Za-z_])", word)[0])
    return found


def test_the_readme_and_docs_name_only_paths_that_exist():
    assert named_paths("see `docs/bench/x.md::t`, [y](k8s/README.md) and `specdec/a.py:f`") == {
        "docs/bench/x.md", "k8s/README.md", "specdec/a.py"}
    missing = [(doc, path) for doc in DOCS for path in sorted(named_paths((ROOT / doc).read_text()))
               if not (ROOT / path).exists()]
    assert missing == []


def test_the_readme_keeps_the_two_set_up_commands():
    """The brief fixes the set-up at two commands; CI (.ci/run) calls the second."""
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/demo.sh" in readme and "bash scripts/test.sh" in readme
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
