#!/usr/bin/env python3
"""Checks that README.md and docs/*.md point at things that exist.

- every relative Markdown link [text](path#anchor) names an existing file, and an anchor
  that a heading of that file produces (GitHub's rule: lower case, spaces to '-', most
  punctuation dropped);
- every file path in backticks (`kernels/flash.hpp`, `tests/test_gemm.cpp`,
  `scripts/test.sh`, ...) names an existing file, looked up from the repository root, from
  include/attn/ and from the page's folder; a bare file name (`sdpa.json`) must be the name
  of some file of the repository.

Exit status 1 with one line per broken reference. Run by ctest (docs_references).
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\s]+)`")
PATH = re.compile(r"^[\w./-]+\.(hpp|inl|cpp|py|sh|md|json|txt|svg|in)$")


def anchors(path):
    found = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            title = re.sub(r"[^\w\- ]", "", title)
            found.add(title.replace(" ", "-"))
    return found


def repository_names():
    skip = {".git", "build"}
    return {p.name for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.parts)}


def check(page, problems, names):
    text = page.read_text(encoding="utf-8")
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            problems.append(f"{page.relative_to(ROOT)}: link to missing {target}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{page.relative_to(ROOT)}: no heading for #{anchor} in {path or page.name}")
    for name in CODE.findall(text):
        name = name.rstrip(".,:;")
        if not PATH.match(name) or name.startswith(("results/", "build/")):
            continue
        candidates = [ROOT / name, ROOT / "include" / "attn" / name, ROOT / "include" / name,
                      page.parent / name]
        if "/" not in name and name in names:
            continue
        if not any(c.exists() for c in candidates):
            problems.append(f"{page.relative_to(ROOT)}: `{name}` does not exist")


def main():
    pages = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    problems = []
    names = repository_names()
    for page in pages:
        check(page, problems, names)
    for p in problems:
        print(p)
    print(f"check_docs: {len(pages)} pages, {len(problems)} broken references")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
