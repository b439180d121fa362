"""Regenerate the token frequency table of the vocabulary-subset draft (FR-Spec).

    python scripts/vocab_table.py                       # the shipped table, from the demo draft's tokenizer
    python scripts/vocab_table.py --tokenizer FOLDER --out table.json.gz

Corpus (offline, on every machine with CPython 3.11): the standard library of the Python that
runs this script (``sysconfig.get_paths()["stdlib"]``), files in sorted order:

- code: every ``*.py`` file outside ``site-packages`` and the test suites (``test/``,
  ``idle_test/``, ``tests/``) -- Python code, comments and docstrings (English prose);
- docs: ``pydoc_data/topics.py`` (the language reference, already among the ``.py`` files),
  ``idlelib/help.html`` with the tags stripped, and the ``*.txt`` / ``*.rst`` files outside the
  test suites (IDLE's README/NEWS, ``LICENSE.txt``, ``email/architecture.rst``);

and the Markdown this repository ships (``*.md`` outside ``.venv``/``.git``: README, docs,
k8s): prose with the Markdown a chat answer is written in (code fences, bold, lists), which the
standard library lacks.

Each file is tokenized alone without special tokens; the table ranks every id seen by count
(ties: lower id first) and stores the counts. It records the tokenizer's identity (vocabulary
size and the sha256 of its token-to-id map), and a table is refused for any other tokenizer.
The same Python version and tokenizer give the same bytes. Coverage (the share of tokens the top
N ids cover) is printed for the corpus and for held-out text: the long descriptions (mostly
Markdown READMEs) in the ``METADATA`` of the packages installed next to this Python's
``transformers``, with the ids the corpus never saw following in id order as
:func:`specdec.models.vocab_subset.subset_ids` takes them (for a BPE vocabulary a lower id is an
earlier merge, i.e. a more frequent pair in the tokenizer's own training text).
"""

from __future__ import annotations

import argparse
import html
import re
import sys
import sysconfig
from collections import Counter
from pathlib import Path

from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from specdec.models.vocab_subset import DEFAULT_TABLE, FrequencyTable  # noqa: E402

SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}


def corpus_files(stdlib: Path) -> list[Path]:
    files = []
    for p in sorted(stdlib.rglob("*")):
        rel = p.relative_to(stdlib)
        if not p.is_file() or SKIP_DIRS & set(rel.parts[:-1]):
            continue
        if p.suffix in (".py", ".txt", ".rst") or rel.as_posix() == "idlelib/help.html":
            files.append(p)
    return files


def repo_markdown() -> list[Path]:
    return sorted(p for p in REPO.rglob("*.md") if not {".venv", ".git", "node_modules"} & set(p.relative_to(REPO).parts))


def read_text(p: Path) -> str:
    text = p.read_text(encoding="utf-8", errors="replace")
    if p.suffix == ".html":
        text = re.sub(r"<script.*?</script>|<style.*?</style>", " ", text, flags=re.S)
        text = html.unescape(re.sub(r"<[^>]+>", "", text))
    return text


def count(tokenizer, texts) -> Counter:
    counts: Counter = Counter()
    for text in texts:
        counts.update(tokenizer(text, add_special_tokens=False)["input_ids"])
    return counts


def coverage(ranked: list[int], counts: Counter, n: int) -> float:
    top = set(ranked[:n])
    total = sum(counts.values())
    return sum(c for i, c in counts.items() if i in top) / total if total else 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the demo draft's, from the cache)")
    ap.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"], help="the corpus root")
    ap.add_argument("--out", default=str(REPO / "specdec" / "data" / DEFAULT_TABLE))
    ap.add_argument("--sizes", default="4096,8192,16384,32768,65536")
    a = ap.parse_args(argv)
    if a.tokenizer is None:
        from specdec.models.demo import ensure_demo_folder

        a.tokenizer = str(ensure_demo_folder("draft"))
    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    stdlib = Path(a.stdlib)
    files = corpus_files(stdlib) + repo_markdown()
    counts = count(tok, (read_text(p) for p in files))
    source = (f"CPython {sys.version.split()[0]} standard library (*.py outside site-packages and test suites, "
              f"*.txt/*.rst, idlelib/help.html without tags) and the repository's *.md; {len(files)} files; "
              "scripts/vocab_table.py")
    table = FrequencyTable.from_counts(tok, counts, source, python=sys.version.split()[0], files=len(files))
    table.save(a.out)
    seen = set(table.ranked_ids)
    order = table.ranked_ids + [i for i in range(len(tok)) if i not in seen]  # as subset_ids fills
    import transformers

    site = Path(transformers.__file__).resolve().parents[1]
    meta = sorted(site.glob("*.dist-info/METADATA"))
    held = count(tok, (p.read_text(errors="replace").partition("\n\n")[2] for p in meta))
    print(f"{len(files)} files, {sum(counts.values())} tokens, {len(table.ranked_ids)} distinct ids "
          f"of {len(tok)}; wrote {a.out} ({Path(a.out).stat().st_size} bytes)")
    print(f"| N | coverage, corpus | coverage, held-out ({len(meta)} installed packages' METADATA descriptions, "
          f"{sum(held.values())} tokens) |\n|---:|---:|---:|")
    for n in (int(s) for s in a.sizes.split(",")):
        print(f"| {n} | {table.coverage(n):.4f} | {coverage(order, held, n):.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
