#!/usr/bin/env python3
"""Checks that the headers of include/attn/ keep to the layer table of docs/design.md.

The table (the section "Layers") gives each header a floor; a header may include headers of
its own floor or of lower floors, never of a higher one. An include is an `#include
"attn/..."` line or an `ATTN_ISA_SOURCE` definition (the per-instruction-set sources that
kernels/simd/foreach_isa.hpp includes). A table cell holds paths relative to include/attn/
in backticks, or globs (`kernels/*.hpp`); an exact path wins over a glob.

Fails (exit status 1, one line per problem) on an include that points up a floor, a header
the table does not place (or places twice), and a table entry that matches no header.
`--graph` also prints each header's floor and what it includes. Run by ctest (include_layers).
"""
import pathlib
import re
import sys

# --root DIR: another tree (the check's own test, on tests/structure/).
ROOT = (pathlib.Path(sys.argv[sys.argv.index("--root") + 1]) if "--root" in sys.argv else
        pathlib.Path(__file__).resolve().parent.parent)
INCLUDE = ROOT / "include" / "attn"
DESIGN = ROOT / "docs" / "design.md"
EDGE = re.compile(r'^\s*(?:#\s*include|#\s*define\s+ATTN_ISA_SOURCE)\s+"attn/([^"]+)"', re.M)


def glob_match(header, pattern):
    """Glob match in which `*` and `?` stay within one folder (`kernels/*.hpp` is not
    `kernels/simd/avx2.hpp`)."""
    regex = "".join("[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c)
                    for c in pattern)
    return re.fullmatch(regex, header) is not None


def read_table():
    """[(floor number, floor name, [patterns])] from the "Layers" section of docs/design.md."""
    text = DESIGN.read_text(encoding="utf-8")
    section = re.search(r"^## Layers\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    if not section:
        sys.exit("check_layers: docs/design.md has no '## Layers' section")
    floors = []
    for line in section.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].isdigit():
            floors.append((int(cells[0]), cells[1], re.findall(r"`([^`]+)`", cells[2])))
    if not floors:
        sys.exit("check_layers: the 'Layers' section of docs/design.md has no table rows")
    return floors


def place(headers, floors):
    """{header: floor} and the problems found while placing."""
    problems, placed, used = [], {}, set()
    for header in headers:
        exact = [(f, p) for f, _, ps in floors for p in ps if p == header]
        globbed = [(f, p) for f, _, ps in floors for p in ps
                   if any(c in p for c in "*?") and glob_match(header, p)]
        matches = exact or globbed
        if not matches:
            problems.append(f"{header}: not in the layer table of docs/design.md")
        elif len(matches) > 1:
            problems.append(f"{header}: placed more than once ({', '.join(p for _, p in matches)})")
        else:
            placed[header] = matches[0][0]
            used.add(matches[0][1])
    for _, name, patterns in floors:
        for p in patterns:
            if not any(glob_match(h, p) for h in headers):
                problems.append(f"docs/design.md: `{p}` (floor {name}) matches no header")
    return placed, problems


def main():
    headers = sorted(str(p.relative_to(INCLUDE)) for p in INCLUDE.rglob("*")
                     if p.suffix in (".hpp", ".inl"))
    floors = read_table()
    names = {f: name for f, name, _ in floors}
    placed, problems = place(headers, floors)
    graph = {h: EDGE.findall((INCLUDE / h).read_text(encoding="utf-8")) for h in headers}
    for header, targets in graph.items():
        for target in targets:
            if target not in placed:
                if target not in graph:
                    problems.append(f"{header} includes attn/{target}, which does not exist")
                continue
            if header in placed and placed[target] > placed[header]:
                problems.append(
                    f"{header} (floor {placed[header]}, {names[placed[header]]}) includes "
                    f"{target} (floor {placed[target]}, {names[placed[target]]}): an include "
                    "that points up the layer table")
    if "--graph" in sys.argv:
        for f, name, _ in floors:
            print(f"floor {f}: {name}")
            for h in headers:
                if placed.get(h) == f:
                    print(f"  {h} -> {' '.join(graph[h]) or '-'}")
    for p in problems:
        print(p)
    edges = sum(len(t) for t in graph.values())
    print(f"check_layers: {len(headers)} headers on {len(floors)} floors, {edges} includes, "
          f"{len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
