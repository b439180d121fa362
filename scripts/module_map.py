"""Print the module map of docs/layout.md: every module of specdec/, deployments/ and benchmarks/
with the first paragraph of its docstring, as a Markdown table (stdout).

    python scripts/module_map.py > /tmp/map.md   # then paste it under "Every module" in docs/layout.md
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("specdec", "deployments", "benchmarks")
LONGEST = 220  # characters of a docstring's first paragraph kept in the table


def first_paragraph(path: pathlib.Path) -> str:
    """The first paragraph of the module docstring of ``path``, on one line ('' when none)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    text = doc.strip().split("\n\n")[0].replace("\n", " ").strip().replace("|", "/")
    return text if len(text) <= LONGEST else text[: LONGEST - 3].rsplit(" ", 1)[0] + " ..."


def module_rows() -> list[str]:
    """One Markdown table row per module (``__init__.py`` files without a docstring left out)."""
    rows = []
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "__pycache__" in path.parts or path.name.endswith("_pb2.py") or path.name.endswith("_pb2_grpc.py"):
                continue
            text = first_paragraph(path)
            if not text and path.name == "__init__.py":
                continue
            rows.append(f"| `{path.relative_to(ROOT)}` | {text or '(no module docstring)'} |")
    return rows


if __name__ == "__main__":
    print("| module | what it holds (first paragraph of its docstring) |\n|---|---|")
    print("\n".join(module_rows()))
