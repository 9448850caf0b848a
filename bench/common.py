"""Helpers shared by the benchmarks."""
from __future__ import annotations

import re
import sys
from pathlib import Path

BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADER = "# Benchmarks\n\nFigures from `python -m bench.<name>`; each section is rewritten by its own benchmark.\n"


def command_line(module: str, argv: list[str] | None) -> str:
    """How to run this benchmark again, as docs/benchmarks.md quotes it: `python -m bench.<module> ARGS`."""
    return " ".join(["python -m", module, *(sys.argv[1:] if argv is None else argv)])


def write_section(title: str, text: str, path: Path = BENCHMARKS_MD) -> None:
    """Replace (or append) the `## <title>` section of docs/benchmarks.md, leaving the others alone."""
    document = path.read_text() if path.exists() else HEADER
    section = f"## {title}\n\n{text.strip()}\n"
    pattern = re.compile(rf"^## {re.escape(title)}[ \t]*\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    if pattern.search(document):
        document = pattern.sub(lambda _: section + "\n", document, count=1).rstrip("\n") + "\n"
    else:
        document = document.rstrip("\n") + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(document)
