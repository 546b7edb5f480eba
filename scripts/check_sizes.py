#!/usr/bin/env python3
"""Checks the size of the headers under include/attn/ and of the functions in them.

Limits: a header (.hpp or .inl) of at most MAX_FILE_LINES lines, a function body of at most
MAX_FUNCTION_LINES lines (from the first line of its declaration to its closing brace).
The files and functions that were larger when the limits came in are listed in KNOWN with
their size then: they may shrink, not grow; one that reaches the limit must leave the list
(the check says so), so that the list only ever gets shorter. Prints the largest files and
functions. Exit status 1 on any breach. Run by ctest (source_sizes).

Functions are found by a brace scanner, not a compiler: comments, strings and preprocessor
lines are blanked, and a brace block at namespace or class scope whose declaration holds a
parenthesis is a function (a lambda at namespace scope too). A constructor whose member
initialiser list uses braces is measured from its last such brace, so it may read short.
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
INCLUDE = ROOT / "include" / "attn"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 150

# Larger than the limits when they came in (issue 30 splits them): path -> lines, and
# "path:function" -> lines. Lower an entry when its file or function shrinks.
KNOWN = {
}
KNOWN_FUNCTIONS = {
}


def blank(text):
    """The text with comments, string and character literals and preprocessor lines replaced
    by spaces (newlines kept, so that line numbers stay)."""
    out, i, n = [], 0, len(text)
    line_start = True
    while i < n:
        c = text[i]
        if line_start and c == "#":  # a preprocessor line, with its continuations
            j = i
            while j < n and (text[j] != "\n" or text[j - 1] == "\\"):
                j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
            continue
        if c == "\n":
            line_start = True
            out.append(c)
            i += 1
            continue
        if not c.isspace():
            line_start = False
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif c == "R" and text.startswith('R"', i) and not (i and (text[i - 1].isalnum() or text[i - 1] == "_")):
            delimiter = text[i + 2:text.index("(", i + 2)]
            j = text.index(")" + delimiter + '"', i) + len(delimiter) + 2
        elif c in "\"'" and not (c == "'" and i and text[i - 1].isalnum()):  # 1'000 digit marks
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            j += 1
        else:
            out.append(c)
            i += 1
            continue
        out.append(re.sub(r"[^\n]", " ", text[i:j]))
        i = j
    return "".join(out)


def functions(text):
    """[(name, first line, last line)] of the functions at namespace or class scope."""
    code = blank(text)
    found = []
    stack = []  # "scope" (namespace, class, extern), "function", or "other" (initialisers)
    header_start = 0
    for i, c in enumerate(code):
        if c in ";{}":
            if c == "{":
                header = code[header_start:i]
                if stack and stack[-1] != "scope":
                    kind = "inner"
                elif re.search(r"\b(namespace|extern)\b", header) or (
                        re.search(r"\b(class|struct|union|enum)\b", header) and "(" not in header):
                    kind = "scope"
                elif "(" in header:
                    kind = "function"
                    name = re.findall(r"(~?[A-Za-z_]\w*(?:::~?[A-Za-z_]\w*)*)\s*(?:<[^()]*>)?\s*\(",
                                      header)
                    start = header_start + len(header) - len(header.lstrip())
                    stack_entry = ("function", name[0] if name else "?",
                                   code.count("\n", 0, start) + 1)
                else:
                    kind = "other"
                stack.append(stack_entry if kind == "function" else kind)
            elif c == "}" and stack:
                top = stack.pop()
                if isinstance(top, tuple):
                    found.append((top[1], top[2], code.count("\n", 0, i) + 1))
            header_start = i + 1
    return found


def main():
    # --root DIR --limits FILE FUNCTION: another tree and limits, without KNOWN (the check's
    # own test, on tests/structure/).
    include, known, known_functions = INCLUDE, KNOWN, KNOWN_FUNCTIONS
    max_file, max_function = MAX_FILE_LINES, MAX_FUNCTION_LINES
    if "--root" in sys.argv:
        include = pathlib.Path(sys.argv[sys.argv.index("--root") + 1]) / "include" / "attn"
        known, known_functions = {}, {}
    if "--limits" in sys.argv:
        at = sys.argv.index("--limits")
        max_file, max_function = int(sys.argv[at + 1]), int(sys.argv[at + 2])
    problems, files, funcs = [], [], []
    for path in sorted(include.rglob("*")):
        if path.suffix not in (".hpp", ".inl"):
            continue
        rel = str(path.relative_to(include))
        text = path.read_text(encoding="utf-8")
        lines = text.count("\n")
        files.append((lines, rel))
        limit = known.get(rel, max_file)
        if lines > limit:
            problems.append(f"{rel}: {lines} lines, over {limit}" +
                            (" (its size when the limit came in)" if rel in known else ""))
        elif rel in known and lines <= max_file:
            problems.append(f"{rel}: {lines} lines, within the limit: remove it from KNOWN")
        elif rel in known and lines < known[rel]:
            print(f"note: {rel} shrank to {lines} lines: lower KNOWN to {lines}")
        for name, first, last in functions(text):
            length = last - first + 1
            key = f"{rel}:{name}"
            funcs.append((length, f"{key} (line {first})"))
            limit = known_functions.get(key, max_function)
            if length > limit:
                problems.append(f"{key} (line {first}): {length} lines, over {limit}")
            elif key in known_functions and length <= max_function:
                problems.append(f"{key}: {length} lines, within the limit: remove it from "
                                "KNOWN_FUNCTIONS")
    seen = {r for _, r in files} | {f.split(" (line")[0] for _, f in funcs}
    for key in list(known) + list(known_functions):
        if key not in seen:
            problems.append(f"{key}: listed as known but no longer exists: remove it")
    print("largest headers:", ", ".join(f"{r} {n}" for n, r in sorted(files, reverse=True)[:5]))
    print("largest functions:", ", ".join(f"{r} {n}" for n, r in sorted(funcs, reverse=True)[:5]))
    for p in problems:
        print(p)
    print(f"check_sizes: {len(files)} headers, {len(funcs)} functions, {len(problems)} problems "
          f"(limits {max_file} lines a header, {max_function} a function)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
