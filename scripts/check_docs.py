#!/usr/bin/env python3
"""Checks that README.md and docs/*.md point at things that exist.

- every relative Markdown link [text](path#anchor) names an existing file, and an anchor
  that a heading of that file produces (GitHub's rule: lower case, spaces to '-', most
  punctuation dropped);
- every file path in backticks (`kernels/flash.hpp`, `tests/test_gemm.cpp`,
  `scripts/test.sh`, ...) names an existing file, looked up from the repository root, from
  include/attn/ and from the page's folder; a bare file name (`sdpa.json`) must be the name
  of some file of the repository;
- every name in backticks that looks like code (`attn::set_isa`, `KVCache::attend(q)`,
  `decode_max_queries`, `ATTN_OPENMP`, `AttentionOptions<T>`: a qualified name, or one with
  an underscore, parentheses or template arguments) is spelled somewhere in the sources
  (include/, tests/, examples/, bench/, fuzz/, scripts/, CMake files and presets), every part
  of a qualified name included.

Exit status 1 with one line per broken reference. Run by ctest (docs_references).
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"^[\w./-]+\.(hpp|inl|cpp|py|sh|md|json|txt|svg|in)$")
# attn::name, Class::member, name_with_underscore, name(...), Name<...>
NAME = re.compile(r"^((?:[A-Za-z_]\w*::)*[A-Za-z_]\w*)(\(.*\)|<.*>)?$")
SOURCE_SUFFIXES = {".hpp", ".inl", ".cpp", ".py", ".sh", ".txt", ".cmake", ".in", ".json"}


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


def source_words():
    words = set()
    for p in ROOT.rglob("*"):
        if not p.is_file() or {".git", "build"} & set(p.parts) or "reference" in p.parts:
            continue
        if p.suffix in SOURCE_SUFFIXES or p.name in ("run", "CMakeLists.txt"):
            text = p.read_text(encoding="utf-8", errors="replace")
            words.update(re.findall(r"[A-Za-z_]\w*", text))
            words.update(re.findall(r"(?<=-D)[A-Za-z_]\w*", text))  # -DNAME in flags
    return words


def looks_like_code(name, match):
    qualified, suffix = match.group(1), match.group(2)
    if re.match(r"^__\w+__$", qualified):  # a compiler's predefined macro
        return False
    return "::" in qualified or "_" in qualified or suffix is not None


# Headers of the dependencies, named as code includes them.
DEPENDENCY_HEADERS = ("catch2/", "Eigen/", "nlohmann/", "benchmark/", "unsupported/")


def check(page, problems, names, words):
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
        name = name.strip().rstrip(".,:;")
        match = NAME.match(name)
        if match and not PATH.match(name) and looks_like_code(name, match):
            missing = [part for part in match.group(1).split("::") if part not in words]
            if missing:
                problems.append(f"{page.relative_to(ROOT)}: `{name}` names {', '.join(missing)}, "
                                "which no source spells")
            continue
        if " " in name or not PATH.match(name) or name.startswith(
                ("results/", "build/") + DEPENDENCY_HEADERS):
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
    words = source_words()
    for page in pages:
        check(page, problems, names, words)
    for p in problems:
        print(p)
    print(f"check_docs: {len(pages)} pages, {len(problems)} broken references")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
