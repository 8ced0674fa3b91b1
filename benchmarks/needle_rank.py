#!/usr/bin/env python3
"""Where does the passkey's block rank among all blocks, per layer and KV head, under each
scoring rule of retrieval attention (docs/retrieval.md)? The measurement the choice of the rule,
the block size and top-k rests on (issue 53, part 2).

    benchmarks/needle_rank.py --contexts 32K,128K --fillers classic,austen --depths 0.25,0.5,0.75 --trials 2

Each run is `xctx passkey --attention retrieval --needle-rank --json` on one rank (the ranks of
blocks do not depend on the sharding: the selection is rank-count invariant, test
mpi_retrieval_*). For the last question token (the one that predicts the answer's first digit)
and each layer it records the needle block's rank among the candidate blocks (every block not
wholly inside the sink or the local window) under Quest's bound (minmax), the mean key (mean)
and InfLLM's representative tokens (repr: the 4 keys of each block with the highest mean logit
from the queries after them in their star block, worker/representative_tokens.h; measured by the
probe, not a rule the selector runs), for the layer's heads summed (what the selector uses) and
for each KV head's query heads alone. CSV (one row per trial, layer and rule) and Markdown in
benchmarks/results/.
"""
import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time

import hostinfo

ROOT = hostinfo.ROOT


def parse_count(s):
    s = s.strip().upper()
    mult = {"K": 1024, "M": 1024 * 1024}.get(s[-1:], 1)
    return int(s[:-1] if mult > 1 else s) * mult


def label(n):
    return f"{n // (1024 * 1024)}M" if n % (1024 * 1024) == 0 else f"{n // 1024}K"


def run(args, ctx, filler):
    runs_dir = args.out + "_runs"
    os.makedirs(runs_dir, exist_ok=True)
    out = os.path.join(runs_dir, f"{label(ctx)}_{filler}_{args.cache.replace('%', 'pct')}.json")
    cmd = [args.xctx, "passkey", "--context", str(ctx), "--trials", str(args.trials), "--depths", args.depths,
           "--seed", str(args.seed), "--filler", filler, "--cache", args.cache, "--attention", "retrieval",
           "--local", args.local, "--block-size", args.block_size, "--sink", args.sink, "--top-k", str(args.top_k),
           "--needle-rank", "--json", out]
    if args.cache.startswith("nuq"):
        cmd += ["--calib", args.calib]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=args.timeout)
    if p.returncode != 0:
        print(p.stderr[-2000:], file=sys.stderr)
        raise SystemExit(f"needle_rank: {' '.join(cmd)} failed")
    print(f"  {label(ctx):>5s} {filler}: {time.time() - t0:.0f} s", file=sys.stderr)
    with open(out) as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--xctx", default=os.path.join(ROOT, "build", "xctx"))
    ap.add_argument("--calib", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.calib"))
    ap.add_argument("--contexts", default="32K,128K")
    ap.add_argument("--fillers", default="classic,austen")
    ap.add_argument("--depths", default="0.25,0.5,0.75")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--seed", type=int, default=5000)
    ap.add_argument("--cache", default="fp16")
    ap.add_argument("--local", default="4K")
    ap.add_argument("--block-size", default="256")
    ap.add_argument("--sink", default="256")
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--timeout", type=int, default=4 * 3600)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "needle_rank"))
    args = ap.parse_args()

    rows = []
    for ctx in [parse_count(c) for c in args.contexts.split(",")]:
        for filler in args.fillers.split(","):
            res = run(args, ctx, filler)
            for t in res["trials"]:
                for L in t.get("needle_rank", []):
                    for rule in ("minmax", "mean", "repr"):
                        if rule not in L:  # repr: only after a star prefill
                            continue
                        kv = L[rule + "_kv"]
                        rows.append({"context": ctx, "filler": filler, "depth": t["depth"], "seed": t["seed"],
                                     "key_token": t["key_token"], "ok": int(t["ok"]), "layer": L["layer"],
                                     "rule": rule, "candidates": L["candidates"], "rank": L[rule],
                                     "best_kv_rank": min(kv) if kv else 0, "kv_ranks": "/".join(map(str, kv))})
    fields = ["context", "filler", "depth", "seed", "key_token", "ok", "layer", "rule", "candidates", "rank",
              "best_kv_rank", "kv_ranks"]
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)

    ks = (1, 4, 8, 16, 32)
    md = ["# Needle block rank under retrieval attention's scoring rules", "",
          f"Host: {hostinfo.cpu_identity()}; xctx {hostinfo.xctx_commit()}; one rank.",
          f"Cache {args.cache}; blocks of {args.block_size}, sink {args.sink}, local {args.local}; depths {args.depths}, "
          f"{args.trials} trial(s) each, seed {args.seed}. Written by benchmarks/needle_rank.py from "
          f"{os.path.basename(args.out)}.csv.", "",
          "Rank 1 = the key's block scores best among the candidates (blocks outside the sink and the local "
          "window); 0 = it lies in the sink or the local window. \"layer\": the layer's query heads summed (what "
          "the selector uses); \"best KV head\": the best of the per-KV-head ranks. Cells: the share of "
          "(trial, layer) pairs whose rank is <= k; median rank over them.", "",
          "| context | filler | rule | ranking | trials | candidates | median rank | " +
          " | ".join(f"<= {k}" for k in ks) + " | passkey ok |",
          "|---|---|---|---|---|---|---|" + "---|" * len(ks) + "---|"]
    groups = {}
    for r in rows:
        groups.setdefault((r["context"], r["filler"], r["rule"]), []).append(r)
    for (ctx, filler, rule), rs in sorted(groups.items()):
        trials = {(r["depth"], r["seed"]) for r in rs}
        ok = sum({(r["depth"], r["seed"]): r["ok"] for r in rs}.values())
        for col, name in (("rank", "layer"), ("best_kv_rank", "best KV head")):
            ranks = [r[col] for r in rs if r[col] > 0]
            if not ranks:
                continue
            share = [f"{sum(1 for x in ranks if x <= k) / len(ranks):.0%}" for k in ks]
            md.append(f"| {label(ctx)} | {filler} | {rule} | {name} | {len(trials)} | {rs[0]['candidates']} | "
                      f"{statistics.median(ranks):.0f} | " + " | ".join(share) + f" | {ok}/{len(trials)} |")
    # Per layer: where the key's block stands, median over trials, for the choice of layers and k.
    md += ["", "Median rank per layer (heads summed), per context, filler and rule:", "",
           "| context | filler | rule | " + " | ".join(f"L{l}" for l in range(30)) + " |",
           "|---|---|---|" + "---|" * 30]
    for (ctx, filler, rule), rs in sorted(groups.items()):
        by_layer = {}
        for r in rs:
            by_layer.setdefault(r["layer"], []).append(r["rank"])
        md.append(f"| {label(ctx)} | {filler} | {rule} | " +
                  " | ".join(f"{statistics.median(by_layer[l]):.0f}" if l in by_layer else "" for l in range(30)) + " |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
