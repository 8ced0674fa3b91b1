#!/usr/bin/env python3
"""Table of `passkey --needle-rank` runs that differ in --restart-skip (docs/retrieval.md).

For each trial: the answer, how many layers rank the key's block (minmax, heads summed) inside
the top 32, the ranks by layer, and how many of the probe's best-8 slots are star-block starts
(256-position blocks whose first position is a multiple of the star block).

  benchmarks/restart_skip_table.py --star-block 4096 --out F.md RUN.json...
"""
import argparse
import json
import re


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="passkey --json files written with --needle-rank")
    ap.add_argument("--star-block", type=int, default=4096, help="the runs' --block (star prefill)")
    ap.add_argument("--out", required=True, help="Markdown file to write")
    ap.add_argument("--host", required=True, help="the CPU the runs ran on (model, family/model/stepping, ISA)")
    a = ap.parse_args()
    rows = []
    for f in a.runs:
        d = json.load(open(f))
        m = re.search(r"first (\d+)", d["attention"])
        skip = int(m.group(1)) if m else 0
        summary_block = int(re.search(r"blocks of (\d+)", d["attention"]).group(1))
        per_star = a.star_block // summary_block
        for t in d["trials"]:
            nr = t.get("needle_rank", [])
            ranks = [l["minmax"] for l in nr]
            slots = [b for l in nr for b in l["top_minmax"]]
            rows.append((skip, t["depth"], t["ok"], t["answer"].strip()[:24],
                         sum(1 for r in ranks if 0 < r <= 32), len(ranks),
                         sum(1 for b in slots if b % per_star == 0), len(slots),
                         min(ranks) if ranks else 0, max(ranks) if ranks else 0))
    rows.sort()
    with open(a.out, "w") as o:
        o.write(f"Runs on {a.host}; one rank, 2 threads. Written by benchmarks/restart_skip_table.py.\n\n")
        o.write("| --restart-skip | depth | right | answer | layers with the key's block in the top 32 "
                "| best-8 slots at star-block starts | key block rank (min-max over layers) |\n")
        o.write("| --- | --- | --- | --- | --- | --- | --- |\n")
        for s, dep, ok, ans, n32, nl, st, ns, lo, hi in rows:
            o.write(f"| {s} | {dep} | {'yes' if ok else 'no'} | `{ans}` | {n32} / {nl} | {st} / {ns} | {lo}-{hi} |\n")


if __name__ == "__main__":
    main()
