#!/usr/bin/env python3
"""Retrieval attention's two selection scopes side by side (docs/retrieval.md): one top-k per
query and layer with the heads' scores summed (InfLLM, `--select-per layer`) against one top-k per
KV head (Quest's per-head selection at GQA's granularity, `--select-per kv-head`), on the same
haystacks, seeds and depths.

    benchmarks/selection_scope.py --contexts 32K --fillers classic,austen --depths 0.25,0.5,0.75 --trials 2

Every run is `xctx passkey --attention retrieval --trials 1 --json` (one rank unless --np; the
selection is rank-count invariant, test mpi_retrieval_*). The two scopes of one (context, filler,
depth, seed) run back to back, in alternating order from one trial to the next, so load and
thermal drift fall on both alike. Per scope: passkey with a Wilson interval, the paired outcome
(both right, only one, neither), decode tok/s and the units of 256 positions each merged token
attends (summed over layers: what the step reads beside the weights). CSV + Markdown in
benchmarks/results/.
"""
import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hostinfo  # noqa: E402
from needle_rank import label, parse_count  # noqa: E402  (the same count syntax as its sibling)

SCOPES = ("layer", "kv-head")


def wilson(k, n, z=1.96):
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def run_one(args, ctx, filler, depth, seed, scope):
    runs_dir = args.out + "_runs"
    os.makedirs(runs_dir, exist_ok=True)
    out = os.path.join(runs_dir, f"{label(ctx)}_{filler}_{args.cache.replace('%', 'pct')}_d{depth}_s{seed}_{scope}.json")
    cmd = [args.xctx, "passkey", "--context", str(ctx), "--trials", "1", "--depths", str(depth), "--seed", str(seed),
           "--filler", filler, "--cache", args.cache, "--attention", "retrieval", "--select-per", scope,
           "--top-k", str(args.top_k), "--local", args.local, "--block-size", args.block_size, "--sink", args.sink,
           "--json", out]
    if args.cache.startswith("nuq"):
        cmd += ["--calib", args.calib]
    if args.np > 1:
        cmd = [os.path.join(ROOT, "launch", "xctx-mpirun"), "-np", str(args.np)] + cmd
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=args.timeout)
    if p.returncode != 0:
        print(p.stderr[-2000:], file=sys.stderr)
        raise SystemExit(f"selection_scope: {' '.join(cmd)} failed")
    with open(out) as f:
        res = json.load(f)
    t = res["trials"][0]
    merged = max(1, sum(s.get("merged_tokens", 0) for s in res["shards"][:1]))
    units = sum(s.get("units_attended", 0) for s in res["shards"])
    row = {"context": ctx, "filler": filler, "cache": args.cache, "depth": depth, "seed": seed, "scope": scope,
           "top_k": args.top_k, "ok": int(t["ok"]), "answer": t["answer"].strip(), "key": t["key"],
           "prefill_s": round(t["prefill_s"], 2),
           "decode_tok_s": round(t["decode_steps"] / t["decode_s"], 2) if t["decode_s"] > 0 else 0,
           "units_per_token": round(units / merged, 1), "wall_s": round(time.time() - t0, 1),
           "load": os.getloadavg()[0]}
    print(f"  {label(ctx)} {filler} d{depth} s{seed} {scope:7s}: {'ok ' if row['ok'] else 'WRONG'} "
          f"{row['answer']!r} ({row['wall_s']:.0f} s)", file=sys.stderr)
    return row


def write(rows, args):
    fields = ["context", "filler", "cache", "depth", "seed", "scope", "top_k", "ok", "answer", "key", "prefill_s",
              "decode_tok_s", "units_per_token", "wall_s", "load"]
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    md = ["# Retrieval: one selection per layer vs one per KV head", "",
          f"Host: {hostinfo.cpu_identity()}; xctx {hostinfo.xctx_commit()}; {args.np} rank(s).",
          f"Cache {args.cache}; top-{args.top_k} blocks of {args.block_size}, sink {args.sink}, local {args.local}; "
          f"depths {args.depths}; seeds {args.seed}..{args.seed + args.trials - 1}. Written by "
          f"`{' '.join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))}` "
          f"on {time.strftime('%Y-%m-%d')}.", "",
          "Both scopes ran on the same haystacks back to back (order alternating by trial). Decode tok/s and "
          "the load column are this machine's under whatever else ran; units per token: units of 256 positions "
          "a merged token attends, summed over the 30 layers.", "",
          "| context | filler | scope | passkey | 95% Wilson | decode tok/s (median) | units per token (median) |",
          "|---|---|---|---|---|---|---|"]
    groups = sorted({(r["context"], r["filler"]) for r in rows})
    for ctx, filler in groups:
        for scope in SCOPES:
            rs = [r for r in rows if r["context"] == ctx and r["filler"] == filler and r["scope"] == scope]
            if not rs:
                continue
            k, n = sum(r["ok"] for r in rs), len(rs)
            lo, hi = wilson(k, n)
            med = lambda xs: sorted(xs)[len(xs) // 2]
            md.append(f"| {label(ctx)} | {filler} | {scope} | {k}/{n} | [{100 * lo:.0f}%, {100 * hi:.0f}%] | "
                      f"{med([r['decode_tok_s'] for r in rs])} | {med([r['units_per_token'] for r in rs])} |")
    md += ["", "Paired outcomes (same haystack and question):", "",
           "| context | filler | both right | only per layer | only per KV head | neither |", "|---|---|---|---|---|---|"]
    for ctx, filler in groups:
        pairs = {}
        for r in rows:
            if r["context"] == ctx and r["filler"] == filler:
                pairs.setdefault((r["depth"], r["seed"]), {})[r["scope"]] = r["ok"]
        full = [p for p in pairs.values() if len(p) == 2]
        c = lambda a, b: sum(1 for p in full if p["layer"] == a and p["kv-head"] == b)
        md.append(f"| {label(ctx)} | {filler} | {c(1, 1)} | {c(1, 0)} | {c(0, 1)} | {c(0, 0)} |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(md) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--xctx", default=os.path.join(ROOT, "build", "xctx"))
    ap.add_argument("--calib", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.calib"))
    ap.add_argument("--np", type=int, default=1)
    ap.add_argument("--contexts", default="32K")
    ap.add_argument("--fillers", default="classic,austen")
    ap.add_argument("--depths", default="0.25,0.5,0.75")
    ap.add_argument("--trials", type=int, default=2, help="seeds per depth")
    ap.add_argument("--seed", type=int, default=6000)
    ap.add_argument("--cache", default="fp16")
    ap.add_argument("--top-k", type=int, default=32)
    ap.add_argument("--local", default="4K")
    ap.add_argument("--block-size", default="256")
    ap.add_argument("--sink", default="256")
    ap.add_argument("--timeout", type=int, default=4 * 3600)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "selection_scope"))
    args = ap.parse_args()
    rows = []
    for ctx in [parse_count(c) for c in args.contexts.split(",")]:
        for filler in args.fillers.split(","):
            for t in range(args.trials):
                for depth in [float(d) for d in args.depths.split(",")]:
                    order = SCOPES if t % 2 == 0 else tuple(reversed(SCOPES))
                    for scope in order:
                        rows.append(run_one(args, ctx, filler, depth, args.seed + t, scope))
                        write(rows, args)  # after every run: a long sweep keeps what it measured


if __name__ == "__main__":
    main()
