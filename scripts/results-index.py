#!/usr/bin/env python3
"""Writes bench/results/README.md: one line per results folder — its NOTES.md title, and the files that cite it
(README.md, docs/*.md, code comments, scripts: every tracked file outside bench/results, and other folders' notes).
Run after adding or removing a folder:

    python3 scripts/results-index.py > bench/results/README.md
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def citations(name: str, docs: dict[str, str]) -> list[str]:
    """The files that name the folder in full, or by its part after the date and device: `…-<commit>-<what>`,
    `...-<commit>-<what>`, `-<commit>-<what>`, or for a folder without a `<what>` `…-<commit>` / `<gpus>x<device>-<commit>`.
    A name is matched whole: `…-8715c7e-internode-speed` does not cite `…-8715c7e-internode`."""
    pats = [re.escape(name)]
    m = re.match(r"^\d{4}-\d{2}-\d{2}-(\d+xnvidia-h\d+)-(.+)$", name)
    if m:
        device, rest = m.groups()
        if re.fullmatch(r"[0-9a-f]{7}-.+", rest):  # a commit and a tag: distinctive after any dash
            pats.append("-" + re.escape(rest))
        else:  # a bare commit, or a tag alone (`ll-trace`): only in the abbreviated forms
            pats.append(r"(?:…-|\.\.\.-|`-|" + re.escape(device) + "-)" + re.escape(rest))
    else:
        pats.append(r"(?:…|\.\.\.)-" + re.escape(re.sub(r"^\d{4}-\d{2}-\d{2}-", "", name)))
    rx = re.compile("(?:" + "|".join(pats) + r")(?![A-Za-z0-9_-])")
    return sorted(doc for doc, text in docs.items() if rx.search(text))


def sources() -> list[Path]:
    """Every tracked text file outside bench/results (docs, README, code comments, scripts); the folders' notes."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        tracked = [ROOT / f for f in listed.decode().split("\0") if f and not f.startswith("bench/results/")]
    except (OSError, subprocess.CalledProcessError):
        tracked = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("**/*.md"))]
    me = Path(__file__).resolve()  # its own examples cite nothing
    return [p for p in tracked if p.is_file() and p != me and "target" not in p.relative_to(ROOT).parts]


def main() -> None:
    docs = {str(p.relative_to(ROOT)): p.read_bytes().decode("utf-8", "replace") for p in sources()}
    for notes in sorted(RESULTS.glob("*/NOTES.md")):
        docs[str(notes.relative_to(ROOT))] = notes.read_text()
    print("# Results folders\n")
    print("Every GPU figure in the README and the docs comes from one of these folders: a device run's logs and JSON,")
    print("and a NOTES.md with the device, date, commit, command and what the run showed. Folders nothing cites")
    print("leave the tree (git history keeps them). Written by `python3 scripts/results-index.py`.\n")
    print("Runs no document cites were removed from the tree on 2026-11-28; `git log --diff-filter=D --stat -- bench/results`")
    print("finds them.\n")
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
