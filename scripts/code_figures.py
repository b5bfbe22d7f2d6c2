#!/usr/bin/env python3
"""The figures of docs/architecture.md, measured from the tree: the largest functions, the
public methods of the classes that tend to grow, and include arrows that run back up the
layers. `--check` exits 1 when an include breaks the layer table (a ctest runs it)."""

import argparse
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = ("engine", "runner", "storage")
SUFFIXES = {".cpp", ".hpp", ".cu", ".h", ".cuh"}

# What each folder of engine/ may include besides itself, lowest layer first (docs/architecture.md).
# An entry is a folder, or one header of a folder (then nothing else of that folder).
LAYERS = {
    "common": [],
    "recipe": ["common"],
    "tokenizer": ["common"],
    "dist": ["common", "recipe"],
    "hooks": ["common", "recipe"],
    "model": ["common", "recipe/kinds.hpp", "recipe/model_spec.hpp"],
    "data": ["common", "recipe", "tokenizer", "model"],
    "parallel": ["common", "recipe", "dist", "model"],
    "checkpoint": ["common", "recipe", "data", "dist", "model", "parallel"],
    "plan": ["common", "recipe", "data", "dist", "parallel/pipeline_schedule.hpp"],
    "protocol": ["common", "recipe", "plan"],
    "train": ["common", "recipe", "data", "dist", "model", "parallel", "checkpoint", "hooks", "plan", "protocol"],
    "probe": ["common", "recipe", "data", "dist", "model", "parallel", "plan", "train"],
    "sweep": ["common", "recipe", "plan"],
}

INCLUDE = re.compile(r'^\s*#\s*include\s+"engine/([a-z_]+)/([A-Za-z0-9_./]+)"', re.M)


def source_files():
    for top in SOURCES:
        for p in sorted((ROOT / top).rglob("*")):
            if p.suffix in SUFFIXES and p.is_file():
                yield p


def arrows_up():
    """(file, included) pairs that the layer table does not allow."""
    found = []
    for p in (ROOT / "engine").rglob("*"):
        if p.suffix not in SUFFIXES or len(p.relative_to(ROOT / "engine").parts) < 2:
            continue
        folder = p.relative_to(ROOT / "engine").parts[0]
        allowed = LAYERS.get(folder)
        for target, header in INCLUDE.findall(p.read_text(errors="replace")):
            if target == folder:
                continue
            ok = allowed is not None and (target in allowed or f"{target}/{header}" in allowed)
            if not ok:
                found.append((str(p.relative_to(ROOT)), f"engine/{target}/{header}"))
    return sorted(found)


def strip_code(text):
    """Comments and string/char literals blanked (newlines kept), so braces can be counted."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
            i = j
        elif text.startswith('R"', i):
            m = re.match(r'R"([^(]*)\(', text[i:])
            end = text.find(")" + (m.group(1) if m else "") + '"', i)
            j = n if end < 0 else end + len(m.group(1) if m else "") + 2
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(c + " " * max(0, j - i - 1) + c)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


CONTROL = re.compile(r"^\s*(if|for|while|switch|catch|else|do|return|try)\b")
SCOPE = re.compile(r"\b(namespace|class|struct|union|enum)\b")


def functions(path):
    """(name, first line, lines) of every function or method body at namespace or class scope."""
    text = strip_code(path.read_text(errors="replace"))
    text = re.sub(r"^\s*#(?:.*\\\n)*.*$", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.M)  # preprocessor lines
    stack, found, head_start = [], [], 0
    for i, c in enumerate(text):
        if c in ";":
            head_start = i + 1
        elif c == "{":
            head = text[head_start:i]
            outer = stack[-1][0] if stack else "namespace"
            kind = "other"
            flat = " ".join(head.split())
            if outer in ("namespace", "class"):
                before_paren = flat.split("(")[0]
                if SCOPE.search(before_paren) and "(" not in flat.split("{")[0][: len(before_paren)]:
                    kind = "namespace" if "namespace" in before_paren else "class"
                elif ")" in flat and not CONTROL.match(flat) and "=" not in before_paren and "[" not in before_paren:
                    kind = "function"
            name = ""
            if kind == "function":
                m = re.search(r"([~A-Za-z_][A-Za-z0-9_:~<>]*(?:operator\S*)?)\s*\(", flat)
                name = m.group(1) if m else "?"
            stack.append((kind, text.count("\n", 0, i) + 1, name))
            head_start = i + 1
        elif c == "}":
            if stack:
                kind, line, name = stack.pop()
                if kind == "function":
                    found.append((name, line, text.count("\n", 0, i) + 1 - line + 1))
            head_start = i + 1
    return found


def class_methods(name):
    """Public and private member functions declared in class `name`'s body (headers and sources)."""
    pattern = re.compile(r"\b(class|struct)\s+" + re.escape(name) + r"\b(?!::)[^;{]*\{")
    for p in sorted(source_files(), key=lambda p: p.suffix != ".hpp"):
        text = strip_code(p.read_text(errors="replace"))
        m = pattern.search(text)
        if not m:
            continue
        access = "public" if m.group(1) == "struct" else "private"
        counts = {"public": 0, "private": 0}
        depth, i, stmt = 1, m.end(), ""
        while i < len(text) and depth > 0:
            c = text[i]
            if c == "{":
                if depth == 1 and "(" in stmt and not re.match(r"\s*(struct|class|enum|union)\b", stmt):
                    counts[access] += 1
                depth += 1
                stmt = ""
            elif c == "}":
                depth -= 1
                stmt = ""
            elif depth == 1:
                stmt += c
                label = re.match(r"\s*(public|private|protected)\s*:$", stmt)
                if label:
                    access = "public" if label.group(1) == "public" else "private"
                    stmt = ""
                elif c == ";":
                    s = " ".join(stmt.split())
                    if "(" in s and not re.match(r"(using|friend|typedef|static_assert)\b", s) and "= default" not in s and "= delete" not in s:
                        if not re.match(r"[^(]*=", s):  # a data member initialised by a call
                            counts[access] += 1
                    stmt = ""
            i += 1
        return str(p.relative_to(ROOT)), counts
    return None, None


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="only check the layer table; exit 1 on an arrow back up")
    ap.add_argument("--top", type=int, default=12, help="how many of the largest functions to list")
    ap.add_argument("--classes", default="Trainer,ZeroDataParallel,FlatUnits,MasterShards,GradientSync,OffloadPipeline,Planner", help="classes whose methods to count")
    args = ap.parse_args()

    ups = arrows_up()
    if args.check:
        for f, inc in ups:
            print(f"{f}: includes {inc}, which the layer table in scripts/code_figures.py does not allow "
                  f"(move the shared part down a layer, or pass it in)", file=sys.stderr)
        return 1 if ups else 0

    rows = []
    for p in source_files():
        for name, line, lines in functions(p):
            rows.append((lines, f"{p.relative_to(ROOT)}:{line}", name))
    rows.sort(reverse=True)
    print("## Largest functions (lines)")
    for lines, where, name in rows[: args.top]:
        print(f"{lines:5d}  {name}  ({where})")
    print("\n## Member functions (public / private)")
    for cls in args.classes.split(","):
        where, counts = class_methods(cls)
        if counts:
            print(f"{cls}: {counts['public']} / {counts['private']}  ({where})")
        else:
            print(f"{cls}: gone")
    print(f"\n## Include arrows back up: {len(ups)}")
    for f, inc in ups:
        print(f"  {f} -> {inc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
