#!/usr/bin/env python3
"""Compares the SASS of two builds, function by function: the check that a kernel refactor changed no
instruction, before any GPU time is spent.

Each build is a folder of `<variant>.sass` files as `compile_all` writes them with `MOELINK_SASS_DIR` (and
`MOELINK_CUOBJDUMP`) set. A function is identified by its name and the bracketed part of its variant's
name (`ll[h7168,k8,fp8]` and `ll_dispatch[h7168,k8,fp8]` are both `[h7168,k8,fp8]`), so that a family
split into several files compares against the file it came from. Every instruction line, encoding
included, must be equal; runs of whitespace count as one space (cuobjdump pads the encoding column to the
longest instruction of the whole file, so a function's padding depends on the other functions beside it).

    MOELINK_SASS_DIR=/tmp/sass-before cargo test --release -p moelink-kernels --test compile_all   # on the old tree
    MOELINK_SASS_DIR=/tmp/sass-after  cargo test --release -p moelink-kernels --test compile_all   # on the new tree
    scripts/compare-sass.py /tmp/sass-before /tmp/sass-after
    scripts/compare-sass.py /tmp/sass-before /tmp/sass-after --rename ll_dispatch=<new symbol> ...

`--rename OLD=NEW` compares function OLD of the first build with function NEW of the second (kernels whose
symbol changed); `--demangled` matches names after `c++filt` (a symbol and its demangled form are the same
function). Exit status 0 when every function of both builds has an identical twin, 1 otherwise.
"""

import argparse
import re
import subprocess
import sys
from pathlib import Path


def functions(folder: Path) -> dict:
    """{(function, variant key): SASS lines} over every .sass file of the folder."""
    out = {}
    for path in sorted(folder.glob("*.sass")):
        key = re.sub(r"^[^\[]*", "", path.stem)
        name, body = None, []
        for line in path.read_text().splitlines():
            m = re.match(r"\s*Function : (\S+)", line)
            if m:
                if name is not None:
                    out[(name, key)] = body
                name, body = m.group(1), []
            elif name is not None:
                body.append(" ".join(line.split()))
        if name is not None:
            out[(name, key)] = body
    return out


def demangle(names):
    names = sorted(set(names))
    if not names:
        return {}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout.splitlines()
    return dict(zip(names, out))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--rename", action="append", default=[], metavar="OLD=NEW", help="function OLD (before) is NEW (after)")
    ap.add_argument("--demangled", action="store_true", help="match function names after c++filt")
    args = ap.parse_args()

    before, after = functions(args.before), functions(args.after)
    if not before or not after:
        print(f"no SASS found ({len(before)} functions in {args.before}, {len(after)} in {args.after})")
        return 1
    renames = dict(r.split("=", 1) for r in args.rename)
    if args.demangled:
        d = demangle([n for n, _ in before] + [n for n, _ in after])
        before = {(d[n], k): b for (n, k), b in before.items()}
        after = {(d[n], k): b for (n, k), b in after.items()}
    before = {(renames.get(n, n), k): b for (n, k), b in before.items()}

    differ, only_before, only_after = [], sorted(set(before) - set(after)), sorted(set(after) - set(before))
    for fk in sorted(set(before) & set(after)):
        if before[fk] != after[fk]:
            first = next((i for i, (x, y) in enumerate(zip(before[fk], after[fk])) if x != y), min(len(before[fk]), len(after[fk])))
            differ.append((fk, first))
    same = len(set(before) & set(after)) - len(differ)
    for (name, key), line in differ:
        print(f"DIFFERS  {name} {key}: first difference at SASS line {line + 1}")
    for name, key in only_before:
        print(f"ONLY IN {args.before}: {name} {key}")
    for name, key in only_after:
        print(f"ONLY IN {args.after}: {name} {key}")
    lines = sum(len(b) for b in after.values())
    print(f"{same} functions identical ({lines} SASS lines in {args.after}), {len(differ)} differ, "
          f"{len(only_before)} only before, {len(only_after)} only after")
    return 0 if not differ and not only_before and not only_after else 1


if __name__ == "__main__":
    sys.exit(main())
