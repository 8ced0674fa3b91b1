#!/usr/bin/env python3
"""Every environment variable the product sources read is in the one table (common/env_vars.cpp),
the table's every entry is documented (docs/env_vars.md) and printed by `xctx doctor` with its
value in force; a variable set here shows up as set.

    check_env_table.py SOURCE_DIR XCTX_BINARY
"""
import os
import re
import subprocess
import sys

PARTS = ["common", "model", "kernels", "cache", "comm", "registry", "worker", "coordinator"]
EXEMPT = {"HOME"}  # only as the fallback of XDG_CACHE_HOME, which the table names


def main():
    root, xctx = sys.argv[1], sys.argv[2]
    read = {}
    for part in PARTS:
        for dirpath, _, files in os.walk(os.path.join(root, part)):
            for name in files:
                if not name.endswith((".cpp", ".h", ".cu", ".cuh")):
                    continue
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8") as f:
                    for var in re.findall(r'getenv\("([A-Z0-9_]+)"\)', f.read()):
                        read.setdefault(var, os.path.relpath(path, root))
    if len(read) < 10:
        sys.exit(f"check_env_table: found only {len(read)} getenv calls under {root}: wrong source dir?")
    with open(os.path.join(root, "common", "env_vars.cpp"), encoding="utf-8") as f:
        table = re.findall(r'^\s*\{"([A-Z0-9_]+)",', f.read(), re.M)
    with open(os.path.join(root, "docs", "env_vars.md"), encoding="utf-8") as f:
        doc = f.read()
    bad = [f"{v} (read in {where}) is not in common/env_vars.cpp" for v, where in sorted(read.items())
           if v not in table and v not in EXEMPT]
    bad += [f"{v} is in the table but nothing reads it" for v in table if v not in read]
    bad += [f"{v} is not documented in docs/env_vars.md" for v in table if f"`{v}`" not in doc]
    env = dict(os.environ, XCTX_KVQ_KEY_LANES="1")
    out = subprocess.run([xctx, "doctor"], capture_output=True, text=True, env=env, timeout=120)
    if out.returncode != 0:
        bad.append(f"xctx doctor failed ({out.returncode}): {out.stderr[-500:]}")
    lines = {m.group(1): m.group(2) for m in re.finditer(r"^  ([A-Z0-9_]+) +(.*)$", out.stdout, re.M)}
    bad += [f"xctx doctor does not print {v}" for v in table if v not in lines]
    if not lines.get("XCTX_KVQ_KEY_LANES", "").startswith("= 1"):
        bad.append(f"xctx doctor does not show XCTX_KVQ_KEY_LANES as set: {lines.get('XCTX_KVQ_KEY_LANES')!r}")
    for b in bad:
        print("check_env_table:", b)
    if bad:
        sys.exit(1)
    print(f"check_env_table: {len(table)} variables, every read one in the table, documented and printed")


if __name__ == "__main__":
    main()
