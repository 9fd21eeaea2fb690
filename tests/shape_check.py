#!/usr/bin/env python3
"""Pith's shape rules, checked on every C++/CUDA source in the checkout (tracked, or
untracked and not ignored):

  * no non-test source file over 800 lines (tests: *_test.cc, *_testing.h, *_fuzz.cc,
    tests/);
  * no function over 100 lines, counted from the first line of its signature to its
    closing brace (test bodies included: a test that long is a test of too much).

Sources are clang-formatted (Google base), so a brace-depth scan that skips comments,
strings and preprocessor lines finds every function body: a block whose header (the text
since the last ';', '{' or '}') has a parameter list, at a depth not already inside a
function. Lambdas and local classes count toward the function that holds them.

Usage: shape_check.py REPO_ROOT   (exit 1 and one line per violation when any is found)
"""
import os
import re
import subprocess
import sys

MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 100
SOURCE_SUFFIXES = (".cc", ".h", ".cu", ".cuh")


def is_test(path):
    base = os.path.basename(path)
    return (path.startswith("tests/") or base.endswith("_test.cc") or
            base.endswith("_testing.h") or base.endswith("_fuzz.cc"))


def strip_code(text):
    """Returns text with comments, string/char literals and preprocessor lines blanked
    (newlines kept, so line numbers survive)."""
    out = []
    i, n = 0, len(text)
    at_line_start = True
    while i < n:
        c = text[i]
        if at_line_start and c in " \t":
            out.append(c)
            i += 1
            continue
        if at_line_start and c == "#":
            # A preprocessor line, with its backslash continuations.
            while i < n and text[i] != "\n":
                if text[i] == "\\" and i + 1 < n and text[i + 1] == "\n":
                    out.append("\n")
                    i += 2
                    continue
                i += 1
            continue
        at_line_start = False
        if c == "\n":
            at_line_start = True
            out.append(c)
            i += 1
        elif text.startswith("//", i):
            while i < n and text[i] != "\n":
                i += 1
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            out.append("\n" * text.count("\n", i, end))
            i = end
        elif c == "R" and text.startswith('R"', i) and (i == 0 or not text[i - 1].isalnum()):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            if not m:
                out.append(c)
                i += 1
                continue
            close = ")" + m.group(1) + '"'
            end = text.find(close, i + m.end())
            end = n if end < 0 else end + len(close)
            out.append('""' + "\n" * text.count("\n", i, end))
            i = end
        elif c in "\"'":
            if c == "'" and i > 0 and (text[i - 1].isalnum()) and i + 1 < n and text[i + 1].isalnum():
                i += 1  # a digit separator (1'000'000)
                continue
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(c + c)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


NON_FUNCTION = re.compile(r"^\s*(namespace\b|extern\b|class\b|struct\b|union\b|enum\b)")


def functions(code):
    """Yields (first_line, last_line, header) of every outermost function body."""
    stack = []  # entries: (kind, start_line, header)
    header_start = 0
    line = 1
    for i, c in enumerate(code):
        if c == "\n":
            line += 1
        elif c in ";":
            header_start = i + 1
        elif c == "{":
            header = code[header_start:i]
            inside_function = any(kind == "func" for kind, _, _ in stack)
            if inside_function:
                kind = "inner"
            elif NON_FUNCTION.match(header) or "(" not in header or re.search(r"=\s*$", header):
                kind = "scope"
            else:
                kind = "func"
            stripped = header.lstrip()
            start = line - header.count("\n") + (len(header) - len(stripped) and
                                                 header[:len(header) - len(stripped)].count("\n"))
            stack.append((kind, start, header.strip()))
            header_start = i + 1
        elif c == "}":
            if stack:
                kind, start, header = stack.pop()
                if kind == "func":
                    yield start, line, header
            header_start = i + 1


def main():
    root = sys.argv[1]
    files = subprocess.run(["git", "-C", root, "ls-files", "-co", "--exclude-standard"],
                           check=True, capture_output=True, text=True).stdout.split()
    problems = []
    checked = 0
    for path in sorted(files):
        if not path.endswith(SOURCE_SUFFIXES) or not os.path.exists(os.path.join(root, path)):
            continue
        checked += 1
        with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
            text = f.read()
        lines = text.count("\n")
        if not is_test(path) and lines > MAX_FILE_LINES:
            problems.append(f"{path}: {lines} lines (at most {MAX_FILE_LINES})")
        for first, last, header in functions(strip_code(text)):
            length = last - first + 1
            if length > MAX_FUNCTION_LINES:
                name = " ".join(header.split())[:70]
                problems.append(f"{path}:{first}: function of {length} lines "
                                f"(at most {MAX_FUNCTION_LINES}): {name}")
    for p in problems:
        print(p)
    if problems:
        print(f"shape_check: {len(problems)} problems in {checked} sources")
        return 1
    print(f"shape_check: {checked} sources: files <= {MAX_FILE_LINES} lines (tests excepted), "
          f"functions <= {MAX_FUNCTION_LINES} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
