#!/usr/bin/env python3
"""Passkey retrieval per cache format, context length and key depth (KVQuant Table 3 shape),
under mpirun: CSV + Markdown + PNG heatmaps in benchmarks/results/.

    benchmarks/passkey_sweep.py --np 4 --formats fp16,kivi2,nuq3-1% --contexts 1K,2K,4K,8K \
        --depths 0,0.25,0.5,0.75,1 --trials 3 --seed 1000 --fillers classic,austen

Contexts beyond the model's trained 8K run with NTK RoPE scaling (--rope-scaling ntk,
factor = context / 8K rounded up). Keys and filler offsets come from --seed (trial t uses
seed + t), so a run with a fresh seed is a fresh draw; the README records which seeds were
used in development and which are fresh.
"""
import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINED = 8192
# "8K" means the longest prompt that still fits the trained context with the answer (as in
# the earlier 8000-token runs); longer contexts use NTK scaling.
FITS_8K = 8000


def parse_count(s):
    s = s.strip().upper()
    return int(float(s[:-1]) * 1024) if s.endswith("K") else int(s)


def run(args, fmt, ctx, filler):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        out = tmp.name
    cmd = [os.path.join(ROOT, "launch", "xctx-mpirun"), "-np", str(args.np), args.xctx, "passkey",
           "--context", str(ctx), "--trials", str(args.trials), "--depths", args.depths, "--seed", str(args.seed),
           "--filler", filler, "--cache", fmt, "--json", out]
    if fmt.startswith("nuq"):
        cmd += ["--calib", args.calib]
    if ctx > TRAINED:
        cmd += ["--rope-scaling", "ntk", "--rope-factor", str(math.ceil(ctx / TRAINED)), "--ctx", str(ctx + 1024)]
    # errors=replace: a broken format can make the model emit bytes that are not UTF-8
    p = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    if p.returncode != 0:
        print(f"  {fmt} {ctx} {filler}: FAILED: {(p.stderr.strip().splitlines() or ['?'])[-1]}", file=sys.stderr)
        return None
    with open(out) as f:
        j = json.load(f)
    os.unlink(out)
    s = j["summary"]
    print(f"  {fmt:9s} {ctx:6d} {filler:8s} {s['correct']}/{s['total']}  ({s['prefill_s_total']:.0f} s prefill)",
          file=sys.stderr)
    return j


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--xctx", default=os.path.join(ROOT, "build", "xctx"))
    ap.add_argument("--calib", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.calib"))
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--formats", default="fp16,kivi4,kivi2,nuq4-1%,nuq3-1%,nuq2-1%")
    ap.add_argument("--contexts", default="1K,2K,4K,8K")
    ap.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--fillers", default="classic,austen")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "passkey_sweep"))
    ap.add_argument("--from-csv", default="",
                    help="comma-separated CSVs of earlier runs: no runs, just the tables and heatmaps of their union")
    args = ap.parse_args()
    formats = args.formats.split(",")
    contexts = [FITS_8K if parse_count(c) == TRAINED else parse_count(c) for c in args.contexts.split(",")]
    fillers = args.fillers.split(",")
    rows = []
    if args.from_csv:
        for path in args.from_csv.split(","):
            with open(path) as f:
                for r in csv.DictReader(f):
                    rows.append({k: (v if k in ("filler", "format") else (float(v) if k == "depth" else int(v)))
                                 for k, v in r.items()})
        seen = lambda key: list(dict.fromkeys(r[key] for r in rows))
        formats, fillers, contexts = seen("format"), seen("filler"), sorted(set(seen("context")))
        fillers = [f for f in args.fillers.split(",") if f in fillers]
    for filler in ([] if args.from_csv else fillers):
        for fmt in formats:
            for ctx in contexts:
                j = run(args, fmt, ctx, filler)
                if j is None:
                    continue
                for d in j["summary"]["per_depth"]:
                    rows.append({"filler": filler, "format": fmt, "context": ctx, "depth": d["depth"],
                                 "correct": d["correct"], "trials": d["trials"], "seed": args.seed,
                                 "ranks": args.np})
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["filler", "format", "context", "depth", "correct", "trials", "seed", "ranks"],
                           extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)

    def acc(filler, fmt, ctx, depth=None):
        sel = [r for r in rows if r["filler"] == filler and r["format"] == fmt and r["context"] == ctx and
               (depth is None or r["depth"] == depth)]
        t = sum(r["trials"] for r in sel)
        return sum(r["correct"] for r in sel) / t if t else None

    lines = ["# Passkey retrieval per cache format (SmolLM2-135M-Instruct Q4_1)", "",
             (f"Union of the runs in {args.from_csv} (their commands: benchmarks/README.md)" if args.from_csv else
              f"Command: `benchmarks/passkey_sweep.py --np {args.np} --formats {args.formats} --contexts {args.contexts}"
              f" --depths {args.depths} --trials {args.trials} --seed {args.seed} --fillers {args.fillers}`"), "",
             "Accuracy over all depths and trials (trial t uses seed + t). Contexts above 8K use NTK RoPE scaling.", ""]
    for filler in fillers:
        lines += [f"## filler: {filler}", "", "| format | " + " | ".join(f"{round(c / 1024)}K" for c in contexts) + " |",
                  "|---|" + "---:|" * len(contexts)]
        for fmt in formats:
            cells = [fmt] + ["n/a" if acc(filler, fmt, c) is None else f"{acc(filler, fmt, c):.2f}" for c in contexts]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    depths = sorted({r["depth"] for r in rows})
    if not rows:
        print("no successful runs: no PNG", file=sys.stderr)
        return
    fig, axes = plt.subplots(len(fillers), len(formats), figsize=(2.4 * len(formats), 2.6 * len(fillers)),
                             squeeze=False)
    for i, filler in enumerate(fillers):
        for k, fmt in enumerate(formats):
            ax = axes[i][k]
            grid = [[acc(filler, fmt, c, d) if acc(filler, fmt, c, d) is not None else float("nan") for c in contexts]
                    for d in depths]
            ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
            ax.set_xticks(range(len(contexts)))
            ax.set_xticklabels([f"{round(c / 1024)}K" for c in contexts], fontsize=7)
            ax.set_yticks(range(len(depths)))
            ax.set_yticklabels([f"{d:g}" for d in depths], fontsize=7)
            ax.set_title(f"{fmt} ({filler})", fontsize=8)
            if k == 0:
                ax.set_ylabel("key depth", fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)
    print(f"wrote {args.out}.csv/.md/.png", file=sys.stderr)


if __name__ == "__main__":
    main()
