#!/usr/bin/env python3
"""Every #include of a product source follows docs/architecture.md: the part it lives in may
include the part the header belongs to (the "Allowed arrows" table), or the (file, part) pair
is a listed known crossing; a listed crossing that no longer occurs fails too, so the list only
shrinks.

    check_include_arrows.py SOURCE_DIR [--plant FILE=HEADER]

--plant adds `#include "HEADER"` to FILE as read (nothing is written): the test that the check
refuses a forbidden arrow.
"""
import os
import re
import sys

SOURCE_PARTS = ["common", "model", "kernels", "cache", "comm", "registry", "worker", "coordinator"]
SUFFIXES = (".h", ".cpp", ".cu", ".cuh")


def part_of(path, parts):
    """The longest part (e.g. kernels/cpu before kernels) that holds path."""
    best = None
    for p in parts:
        if path == p or path.startswith(p + "/"):
            if best is None or len(p) > len(best):
                best = p
    return best


def read_tables(doc):
    allowed, known = {}, set()
    section = None
    for line in doc.splitlines():
        if line.startswith("## "):
            section = "allowed" if "Allowed arrows" in line else "known" if "Known crossings" in line else None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not line.startswith("| `"):
            continue
        name = cells[0].strip("`")
        targets = [t.strip().strip("`") for t in cells[1].split(",")]
        if section == "allowed":
            allowed[name] = set(targets)
        elif section == "known":
            known.update((name, t) for t in targets)
    return allowed, known


def main():
    root = sys.argv[1]
    plant = None
    if len(sys.argv) == 4 and sys.argv[2] == "--plant":
        plant = tuple(sys.argv[3].split("=", 1))
    with open(os.path.join(root, "docs", "architecture.md"), encoding="utf-8") as f:
        allowed, known = read_tables(f.read())
    parts = list(allowed)
    if not {"common", "coordinator"} <= set(parts):
        sys.exit("check_include_arrows: docs/architecture.md has no arrows table")
    bad, seen_known, n_includes = [], set(), 0
    for top in SOURCE_PARTS:
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for name in sorted(files):
                if not name.endswith(SUFFIXES):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                with open(os.path.join(root, rel), encoding="utf-8") as f:
                    text = f.read()
                if plant and plant[0] == rel:
                    text += f'\n#include "{plant[1]}"\n'
                src = part_of(rel, parts)
                for header in re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, re.M):
                    dst = part_of(header, parts)
                    if dst is None:
                        continue  # generated (xctx_types.h) or a system-style path
                    n_includes += 1
                    if dst in allowed.get(src, set()):
                        continue
                    if (rel, dst) in known:
                        seen_known.add((rel, dst))
                        continue
                    bad.append(f"{rel} ({src}) includes {header} ({dst}): not an arrow of docs/architecture.md")
    for rel, dst in sorted(known - seen_known):
        bad.append(f"the known crossing {rel} -> {dst} no longer occurs: remove it from docs/architecture.md")
    for b in bad:
        print("check_include_arrows:", b)
    if bad:
        sys.exit(1)
    print(f"check_include_arrows: {n_includes} includes of the parts' headers follow the table "
          f"({len(known)} known crossings)")


if __name__ == "__main__":
    main()
