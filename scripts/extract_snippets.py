#!/usr/bin/env python3
"""The C++ snippets of README.md and docs/*.md as translation units that ctest compiles and runs.

Every ```cpp block of a page becomes one function of that page's translation unit (one unit
per page, each snippet in its own namespace); the unit's main runs them in page order and
fails on the first exception. #line directives point every compiler message at the page's
own lines. Conventions (docs/testing.md, "Docs snippets"):

- A block is a function body: it is placed in `void run()` after the declarations of
  tests/docs/snippet_preamble.hpp (attn/attn.hpp, <iostream>, ...). Its #include lines are
  moved to the top of the unit.
- A block with `int main(` is a whole program: it stays at namespace scope, its main is
  renamed and must return 0.
- Variables a snippet uses without showing them come from a hidden setup, an HTML comment
  right before the block (and before its marker, if any):
      <!-- snippet setup:
      attn::Tensor<float, 4> q = attn_docs::random_tensor<float>(1, 2, 16, 8);
      -->
  The setup is code of the same function body, run before the snippet.
- One marker, also right before the block, changes what is done with it:
      <!-- snippet: compile-only (reason) -->   compiled, not run
      <!-- snippet: skip (reason) -->           neither (keep these rare)
  The reason is required.

  extract_snippets.py --output FILE.cpp PAGE.md   write the unit of one page
  extract_snippets.py --list PAGE.md...           print the pages that have snippets
  extract_snippets.py --summary PAGE.md...        count snippets run, compiled, skipped

ctest: docs_snippets/<page> runs each page's unit; docs_snippets_catches runs this script and
the compiler on tests/structure/docs/snippets.md, whose planted errors must be reported.
"""
import argparse
import pathlib
import re
import sys

FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
MARKER = re.compile(r"^<!--\s*snippet:\s*([\w-]+)\s*(?:\((.*)\))?\s*-->\s*$")
SETUP_OPEN = re.compile(r"^<!--\s*snippet setup:\s*$")
INCLUDE = re.compile(r"^\s*#\s*include\s*[<\"]")
MAIN = re.compile(r"\bint\s+main\s*\(")
KINDS = {"compile-only", "skip"}


class SnippetError(Exception):
    pass


class Snippet:
    def __init__(self, page, line, code, setup, setup_line, kind, reason):
        self.page, self.line, self.code = page, line, code
        self.setup, self.setup_line = setup, setup_line
        self.kind, self.reason = kind, reason

    @property
    def name(self):
        return f"snippet_{self.line}"


def snippets(path, display):
    """The ```cpp blocks of a page with their setup and marker."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group(2), m.group(3)
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        if j == len(lines):
            raise SnippetError(f"{display}:{i + 1}: unterminated code block")
        if lang in ("cpp", "c++"):
            kind, reason, setup, setup_line = "run", "", [], 0
            k = i - 1
            marker = MARKER.match(lines[k]) if k >= 0 else None
            if marker:
                kind, reason = marker.group(1), (marker.group(2) or "").strip()
                if kind not in KINDS:
                    raise SnippetError(f"{display}:{k + 1}: unknown snippet marker '{kind}' "
                                       f"(known: {', '.join(sorted(KINDS))})")
                if not reason:
                    raise SnippetError(f"{display}:{k + 1}: 'snippet: {kind}' needs a reason "
                                       "in parentheses")
                k -= 1
            elif k >= 0 and "snippet" in lines[k] and lines[k].startswith("<!--"):
                raise SnippetError(f"{display}:{k + 1}: not a snippet marker: {lines[k]}")
            if k >= 0 and lines[k].strip() == "-->":
                start = k - 1
                while start >= 0 and not SETUP_OPEN.match(lines[start]):
                    if lines[start].startswith("<!--") or lines[start].startswith("```"):
                        raise SnippetError(f"{display}:{k + 1}: '-->' before a code block "
                                           "closes no '<!-- snippet setup:'")
                    start -= 1
                if start < 0:
                    raise SnippetError(f"{display}:{k + 1}: '-->' before a code block closes "
                                       "no '<!-- snippet setup:'")
                setup, setup_line = lines[start + 1:k], start + 2
            found.append(Snippet(display, i + 2, lines[i + 1:j], setup, setup_line, kind,
                                 reason))
        i = j + 1
    return found


def translation_unit(page_snippets, display, preamble="snippet_preamble.hpp"):
    includes, bodies, calls = [], [], []
    for s in page_snippets:
        if s.kind == "skip":
            continue
        code = []
        for n, text in enumerate(s.code):
            if INCLUDE.match(text):
                if text.strip() not in includes:
                    includes.append(text.strip())
                code.append("")  # keeps the line numbers
            else:
                code.append(text)
        program = any(MAIN.search(t) for t in code)
        out = [f"// {display}:{s.line - 1}", f"namespace {s.name} {{"]
        if program:
            if s.setup:
                raise SnippetError(f"{display}:{s.line - 1}: a whole program takes no setup")
            out.append(f'#line {s.line} "{display}"')
            out += [MAIN.sub("int snippet_main(", t) for t in code]
            out.append("#line 1 \"snippet_glue\"")
            out.append("void run() { attn_docs::expect_zero(attn_docs::call_main(&snippet_main)); }")
        else:
            out.append("[[maybe_unused]] void run() {")
            if s.setup:
                out.append(f'#line {s.setup_line} "{display}"')
                out += s.setup
            out.append(f'#line {s.line} "{display}"')
            out += code
            out.append("#line 1 \"snippet_glue\"")
            out.append("}")
        out.append(f"}}  // namespace {s.name}")
        bodies.append("\n".join(out))
        calls.append(f'      {{"{display}:{s.line - 1}", {"true" if s.kind == "run" else "false"}, '
                     f"&{s.name}::run}},")
    unit = [f"// Generated by scripts/extract_snippets.py from {display}: edit the page, not this.",
            f'#include "{preamble}"']
    unit += includes
    unit.append("")
    unit += bodies
    unit += ["", "int main() {", "  return attn_docs::run_snippets({"] + calls + ["  });", "}", ""]
    return "\n".join(unit)


def display_name(path, root):
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return path.as_posix()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pages", nargs="+", type=pathlib.Path)
    ap.add_argument("--preamble", default="snippet_preamble.hpp",
                    help="the header every unit includes first (default: tests/docs/%(default)s)")
    ap.add_argument("--root", type=pathlib.Path,
                    default=pathlib.Path(__file__).resolve().parent.parent,
                    help="page names in messages are relative to it (default: the repository)")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--output", type=pathlib.Path, help="write the unit of the one page given")
    mode.add_argument("--list", action="store_true")
    mode.add_argument("--summary", action="store_true")
    args = ap.parse_args()
    try:
        if args.output:
            if len(args.pages) != 1:
                ap.error("--output takes one page")
            display = display_name(args.pages[0], args.root)
            unit = translation_unit(snippets(args.pages[0], display), display, args.preamble)
            if not args.output.exists() or args.output.read_text(encoding="utf-8") != unit:
                args.output.parent.mkdir(parents=True, exist_ok=True)
                args.output.write_text(unit, encoding="utf-8")
            return 0
        totals = {"run": 0, "compile-only": 0, "skip": 0}
        for page in args.pages:
            display = display_name(page, args.root)
            found = snippets(page, display)
            if args.list:
                if found:
                    print(display)
                continue
            for s in found:
                totals[s.kind] += 1
                if s.kind != "run":
                    print(f"{display}:{s.line - 1}: {s.kind} ({s.reason})")
        if args.summary:
            print(f"{sum(totals.values())} snippets: {totals['run']} compiled and run, "
                  f"{totals['compile-only']} compiled only, {totals['skip']} skipped")
        return 0
    except SnippetError as e:
        print(e, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
