#!/usr/bin/env python3
"""Writes bench/results/README.md: one line per results folder — its NOTES.md title, and the docs that cite it
(README.md, docs/*.md, other folders' notes). Run after adding or removing a folder:

    python3 scripts/results-index.py > bench/results/README.md
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def citations(name: str, docs: dict[str, str]) -> list[str]:
    """The docs that name the folder in full, or by its part after the date and device (`…-<commit>-<what>`)."""
    undated = re.sub(r"^\d{4}-\d{2}-\d{2}-", "", name)
    short = re.sub(r"^\d+xnvidia-h[0-9]+-", "", undated)
    return sorted(doc for doc, text in docs.items() if name in text or f"…-{undated}" in text or f"…-{short}" in text)


def main() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("**/*.md"))]
    docs = {str(p.relative_to(ROOT)): p.read_text() for p in pages if "target" not in p.parts}
    for notes in sorted(RESULTS.glob("*/NOTES.md")):
        docs[str(notes.relative_to(ROOT))] = notes.read_text()
    print("# Results folders\n")
    print("Every GPU figure in the README and the docs comes from one of these folders: a device run's logs and JSON,")
    print("and a NOTES.md with the device, date, commit, command and what the run showed. Folders nothing cites")
    print("leave the tree (git history keeps them). Written by `python3 scripts/results-index.py`.\n")
    print("| folder | what it holds | cited by |")
    print("|---|---|---|")
    for folder in sorted(p for p in RESULTS.iterdir() if p.is_dir()):
        notes = folder / "NOTES.md"
        title = notes.read_text().splitlines()[0].lstrip("# ").strip() if notes.exists() else "(no NOTES.md: " + \
            ", ".join(sorted(f.name for f in folder.iterdir())[:4]) + ")"
        own = f"bench/results/{folder.name}/NOTES.md"
        cited = [d for d in citations(folder.name, docs) if d != own]
        print(f"| `{folder.name}` | {title.replace('|', '/')} | {', '.join(cited) or '–'} |")


if __name__ == "__main__":
    main()
