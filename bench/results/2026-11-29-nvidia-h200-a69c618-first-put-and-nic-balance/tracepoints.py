"""Condenses `moelink trace:` lines: per launch, the chosen points as min/median/max."""
import re, sys
want = sys.argv[2].split(",")
keep = int(sys.argv[3]) if len(sys.argv) > 3 else 4
pt = re.compile(r"(\w+) \+?(-?[\d.]+)/\+?(-?[\d.]+)/\+?(-?[\d.]+) \((\d+)\)")
seen = {}
for line in open(sys.argv[1], errors="replace"):
    m = re.match(r"moelink trace: rank (\d+) (.+?) \((\S+)\): span ([\d.]+) us;(.*)", line)
    if not m or "notify" in m.group(2):
        continue
    rank, op, span, rest = m.group(1), m.group(2), m.group(4), m.group(5)
    pts = {p[0]: p[1:] for p in pt.findall(rest)}
    s = f"r{rank} {op:16s} span {span:>7s}: " + "; ".join(f"{w} {'/'.join(pts[w][:3])}" for w in want if w in pts)
    seen.setdefault((rank, op), []).append(s)
for k in sorted(seen):
    for s in seen[k][-keep:]:
        print(s)
