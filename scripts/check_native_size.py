#!/usr/bin/env python3
"""The size rules of the C++ the patch series adds to llama.cpp: no function longer than 80 lines,
no class or struct with more than 20 data members, no patch adding more than 400 lines.

    python scripts/check_native_size.py [--all]

Reads native/llama/ (the cache's own sources, whole files) and patches/series (in each patch, the
functions and classes whose first line the patch adds, as the patched file has them in that
hunk), prints the three figures (the longest function, the class with the most data members,
the patch adding the most lines) and, with --all, every function and class; exits 1 when a rule
is broken. tests/test_patches.py holds the same limits.

A function's length is its lines from the first line of its declarator (return type and name;
comments before it not counted) to its closing brace, both included. Data members are the
non-static declarations of a class body that are not functions, types or aliases (`int a, b;`
counts two). The parser is a rough brace matcher for our own files: comments, strings and
preprocessor lines are blanked first."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from moecache.util import OneLineParser

REPO = Path(__file__).resolve().parent.parent
MAX_FUNCTION_LINES = 80
MAX_DATA_MEMBERS = 20
MAX_PATCH_ADDED = 400


@dataclass
class Definition:
    kind: str      # "function" or "class"
    name: str
    where: str     # file (and patch) it is in
    line: int      # its first line there
    size: int      # lines (a function) or data members (a class)


def blank(text: str) -> str:
    """comments, string and character literals and preprocessor lines replaced by spaces, lines kept"""
    out = []
    i, n = 0, len(text)
    at_line_start = True
    while i < n:
        c = text[i]
        if at_line_start and c == "#" or (at_line_start and c in " \t" and text[i:].lstrip(" \t").startswith("#")):
            j = text.find("\n", i)
            j = n if j < 0 else j
            while j > i and text[j - 1] == "\\" and j < n:  # a continued directive
                j = text.find("\n", j + 1)
                j = n if j < 0 else j
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
            continue
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
            continue
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
            continue
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(c + " " * (min(j, n) - i - 1) + (c if j < n else ""))
            i = j + 1
            at_line_start = False
            continue
        out.append(c)
        at_line_start = c == "\n" or (at_line_start and c in " \t")
        i += 1
    return "".join(out)


def _no_templates(s: str) -> str:
    prev = None
    while prev != s:
        prev, s = s, re.sub(r"<[^<>;{}]*>", "", s)
    return s


def _top_level(s: str) -> str:
    """s without what stands inside parentheses, brackets or braces"""
    out, depth = [], 0
    for c in s:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0:
            out.append(c)
    return "".join(out)


ACCESS = re.compile(r"^\s*((public|private|protected)\s*:\s*)+")


def _classify(header: str) -> tuple[str, str]:
    h = ACCESS.sub("", header).strip()
    h = re.sub(r"^template\s*<.*?>\s*", "", h, flags=re.S)
    if re.match(r"(namespace\b|extern\s*\")", h):
        return "scope", ""
    plain = _no_templates(h)
    if re.match(r"(typedef\s+)?(struct|class|union)\b", plain) and "(" not in plain:
        m = re.match(r"(?:typedef\s+)?(?:struct|class|union)\s+([\w:]+)", plain)
        return "class", m.group(1) if m else "(anonymous)"
    if re.match(r"(typedef\s+)?enum\b", plain):
        return "block", ""
    top = _top_level(plain)
    if "=" in top.replace("==", "").replace("operator=", "") or "(" not in plain:
        return "block", ""  # an initializer
    m = re.search(r"([~\w:]+(?:operator\s*\S+)?)\s*\(", plain)
    return "function", m.group(1) if m else "?"


def _data_members(statement: str) -> int:
    s = ACCESS.sub("", statement).strip()
    if not s or re.match(r"(using|typedef|friend|static_assert|static|template|enum|struct|class|union)\b", s):
        return 0
    s = _no_templates(s)
    top = _top_level(re.sub(r"\{[^{}]*\}", "", s))
    if "(" in s.split("=")[0].split("{")[0]:
        return 0  # a function declaration
    return top.count(",") + 1


def definitions(text: str, where: str, first_line: int = 1, only_first: bool = False) -> list[Definition]:
    """the functions and classes of C++ text, at namespace or class scope"""
    src = blank(text)
    found: list[Definition] = []
    stack: list[list] = []  # [kind, name, line, members]
    stmt = 0
    line = first_line
    for i, c in enumerate(src):
        if c == "\n":
            line += 1
            continue
        scope = stack[-1][0] if stack else "scope"
        if c == "{":
            if scope in ("scope", "class"):
                header = src[stmt:i]
                kind, name = _classify(header)
                first = stmt + len(header) - len(header.lstrip())  # the declarator's first character
                start = line - src[first:i].count("\n")
                stack.append([kind, name, start, 0, stmt])
            else:
                stack.append(["body", "", line, 0, stmt])
            stmt = i + 1
        elif c == "}":
            if not stack:
                continue  # unbalanced: a hunk that starts inside a block
            kind, name, start, members, stmt_at = stack.pop()
            if kind == "function":
                found.append(Definition("function", name, where, start, line - start + 1))
            elif kind == "class":
                found.append(Definition("class", name, where, start, members))
            if kind in ("function", "class", "scope"):
                stmt = i + 1
            elif kind == "block" and stack and stack[-1][0] in ("scope", "class"):
                stmt = stmt_at  # a brace initializer: the statement goes on to its ';'
            if only_first and found and not stack:
                return found
        elif c == ";" and scope in ("scope", "class"):
            if scope == "class":
                stack[-1][3] += _data_members(src[stmt:i])
            stmt = i + 1
    return found


def native_definitions(native: Path = REPO / "native" / "llama") -> list[Definition]:
    out = []
    for path in sorted(native.glob("*")):
        if path.suffix in (".h", ".cpp"):
            out += definitions(path.read_text(), f"native/llama/{path.name}")
    return out


def series(patches: Path = REPO / "patches") -> list[Path]:
    return [patches / line.strip() for line in (patches / "series").read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def added_lines(patch: Path) -> int:
    return sum(1 for line in patch.read_text().splitlines() if line.startswith("+") and not line.startswith("+++"))


DEFINITION_START = re.compile(r"^(?:[A-Za-z_].*\(|\s*(?:struct|class)\s+\w+[^;()]*\{\s*$|[A-Za-z_][\w:<>,\s*&]*\s(?:struct|class)\b)")
NOT_A_START = re.compile(r"^\s*(#|//|/\*|\*|}|return\b|if\b|for\b|while\b|switch\b|case\b|else\b|do\b)")


def patch_definitions(patch: Path) -> list[Definition]:
    """the functions and classes whose first line the patch adds, measured in their hunk's new text"""
    out: list[Definition] = []
    target = ""
    hunk: list[tuple[bool, str]] = []
    start_line = 0

    def flush():
        for k, (added, text) in enumerate(hunk):
            if added and DEFINITION_START.match(text) and not NOT_A_START.match(text):
                rest = "\n".join(t for _, t in hunk[k:]) + "\n"
                where = f"{patch.name}: {target}"
                out.extend(definitions(rest, where, start_line + k, only_first=True)[:1])
        hunk.clear()

    for line in patch.read_text().splitlines():
        if line.startswith("+++ "):
            flush()
            target = line[4:].removeprefix("b/")
        elif line.startswith("@@"):
            flush()
            start_line = int(re.match(r"@@ -\d+(?:,\d+)? \+(\d+)", line).group(1))
        elif line.startswith("diff --git") or line.startswith("--- ") or line.startswith("index "):
            flush()
        elif line.startswith("+"):
            hunk.append((True, line[1:]))
        elif line.startswith(" ") or line == "":
            hunk.append((False, line[1:]))
    flush()
    # a definition found from one added line may be found again from a later one inside it
    seen, unique = set(), []
    for d in out:
        if (d.where, d.line) not in seen:
            seen.add((d.where, d.line))
            unique.append(d)
    return unique


def figures() -> dict:
    defs = native_definitions() + [d for p in series() for d in patch_definitions(p)]
    functions = [d for d in defs if d.kind == "function"]
    classes = [d for d in defs if d.kind == "class"]
    patches = [(added_lines(p), p.name) for p in series()]
    return {
        "functions": functions,
        "classes": classes,
        "longest_function": max(functions, key=lambda d: d.size),
        "largest_class": max(classes, key=lambda d: d.size),
        "largest_patch": max(patches),
        "patches": patches,
    }


def main(argv=None) -> int:
    p = OneLineParser(prog="check_native_size.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--all", action="store_true", help="also print every function and class, and each patch's lines")
    return p.run(report, argv)


def report(args) -> int:
    f = figures()
    if args.all:
        for d in sorted(f["functions"] + f["classes"], key=lambda d: (d.kind, -d.size)):
            print(f"{d.kind:8} {d.size:4}  {d.name}  ({d.where}:{d.line})")
        for n, name in f["patches"]:
            print(f"patch    {n:4}  {name}")
    fn, cl, (n_added, patch) = f["longest_function"], f["largest_class"], f["largest_patch"]
    print(f"longest function: {fn.name}, {fn.size} lines ({fn.where}:{fn.line}; limit {MAX_FUNCTION_LINES})")
    print(f"largest class: {cl.name}, {cl.size} data members ({cl.where}:{cl.line}; limit {MAX_DATA_MEMBERS})")
    print(f"largest patch: {patch}, {n_added} lines added (limit {MAX_PATCH_ADDED})")
    return 0 if fn.size <= MAX_FUNCTION_LINES and cl.size <= MAX_DATA_MEMBERS and n_added <= MAX_PATCH_ADDED else 1


if __name__ == "__main__":
    sys.exit(main())
