#!/usr/bin/env python3
"""Perplexity of every cache format on the real model: the shape of XQuant Table 1/4 and
KVQuant Table 2, and XQuant Figure 1 (perplexity degradation against compression).

One command:
    benchmarks/ppl_sweep.py --calib models/SmolLM2-135M-Instruct.calib
runs `xctx ppl --json` for each format on each evaluation corpus and writes
benchmarks/results/ppl_sweep.{csv,md,png}.

Split (calibration and evaluation text never overlap): the nuq calibration is made on Jane
Austen's *Sense and Sensibility* (`xctx calibrate --text austen:sensesensibility`); perplexity
is measured on *Persuasion* (austen:persuasion) and on the Gospel of Luke (kjv:Luke).

KV size relative to fp16 comes from the bytes each format really stores
(`cache_bytes_per_token` in the JSON: long-context bytes per token including scales, zero
points, outliers and their indices), not from nominal bit widths.
"""
import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORMATS = ["fp16", "kivi4", "kivi3", "kivi2", "nuq4", "nuq3", "nuq2", "nuq4-1%", "nuq3-1%", "nuq2-1%",
           "xquant4", "xquant3", "xquant2", "xquant-cl4", "xquant-cl3", "xquant-cl2", "clkv"]
CORPORA = [("austen:persuasion", "Persuasion"), ("kjv:Luke", "KJV Luke")]


def run_one(args, fmt, text):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        out = tmp.name
    cmd = [args.xctx, "ppl", "--text", text, "--cache", fmt, "--window", str(args.window),
           "--max-windows", str(args.windows), "--json", out]
    if args.calib:
        cmd += ["--calib", args.calib]
    if args.np > 1:
        cmd = [os.path.join(ROOT, "launch", "xctx-mpirun"), "-np", str(args.np)] + cmd
    # errors=replace: a broken format can make the model emit bytes that are not UTF-8
    p = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    if p.returncode != 0:
        err = (p.stderr.strip().splitlines() or ["?"])[-1]
        print(f"  {fmt:11s} {text}: FAILED: {err}", file=sys.stderr)
        return None
    with open(out) as f:
        j = json.load(f)
    os.unlink(out)
    print(f"  {fmt:11s} {text:18s} ppl {j['ppl']:.4f}  ({j['seconds']:.0f} s)", file=sys.stderr)
    return j


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--xctx", default=os.path.join(ROOT, "build", "xctx"))
    ap.add_argument("--calib", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.calib"))
    ap.add_argument("--window", type=int, default=2048, help="perplexity context (tokens per window)")
    ap.add_argument("--windows", type=int, default=4, help="windows per corpus")
    ap.add_argument("--np", type=int, default=1, help="ranks (mpirun) per evaluation")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "ppl_sweep"))
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows of formats not run now from the existing CSV (same settings assumed)")
    args = ap.parse_args()
    formats = args.formats.split(",")
    kept = {}
    if args.merge and os.path.exists(args.out + ".csv"):
        with open(args.out + ".csv") as f:
            for r in csv.DictReader(f):
                if r["format"] not in formats:
                    kept[r["format"]] = {k: (float(v) if k != "format" and v != "" else v) for k, v in r.items()}
    rows = []
    for fmt in FORMATS + [f for f in formats if f not in FORMATS]:
        if fmt in kept:
            row = kept[fmt]
            row["fp16_bytes_per_token"] = row["bytes_per_token"] / row["kv_size_vs_fp16"]
            rows.append(row)
            continue
        if fmt not in formats:
            continue
        row = {"format": fmt}
        for text, label in CORPORA:
            j = run_one(args, fmt, text)
            if j is None:
                continue
            row["bytes_per_token"] = j["cache_bytes_per_token"]
            row["fp16_bytes_per_token"] = j["fp16_bytes_per_token"]
            row[f"ppl {label}"] = j["ppl"]
            row[f"targets {label}"] = j["targets"]
        rows.append(row)
    base = next((r for r in rows if r["format"] == "fp16"), None)
    for r in rows:
        if "bytes_per_token" in r:
            r["kv_size_vs_fp16"] = r["bytes_per_token"] / r["fp16_bytes_per_token"]
        for _, label in CORPORA:
            if base and f"ppl {label}" in r and f"ppl {label}" in base:
                r[f"dppl {label}"] = r[f"ppl {label}"] - base[f"ppl {label}"]

    cols = ["format", "kv_size_vs_fp16", "bytes_per_token"]
    for _, label in CORPORA:
        cols += [f"ppl {label}", f"dppl {label}", f"targets {label}"]
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)

    def fmt(v, spec):
        return format(v, spec) if isinstance(v, (int, float)) else "n/a"

    lines = ["# Perplexity per cache format (SmolLM2-135M-Instruct Q4_1)", "",
             f"Command: `benchmarks/ppl_sweep.py --window {args.window} --windows {args.windows} --np {args.np}`"
             f" (calibration: `{os.path.relpath(args.calib, ROOT) if args.calib else 'none'}`, made on"
             " austen:sensesensibility; evaluation never overlaps it).", "",
             "KV size = bytes per token actually stored (codes, scales, zero points, outliers + indices)"
             " / fp16 bytes per token. Every query attends to the compressed cache of its whole window"
             " (see coordinator/jobs/ppl.cpp for which tokens stay fp16).", "",
             "| format | KV size vs fp16 | compression | " + " | ".join(
                 f"PPL {l} | ΔPPL {l}" for _, l in CORPORA) + " |",
             "|---|---:|---:|" + "---:|---:|" * len(CORPORA)]
    for r in rows:
        size = r.get("kv_size_vs_fp16")
        cells = [r["format"], fmt(size, ".3f"), (fmt(1 / size, ".1f") + "x") if size else "n/a"]
        for _, l in CORPORA:
            cells += [fmt(r.get(f"ppl {l}"), ".3f"), fmt(r.get(f"dppl {l}"), "+.3f")]
        lines.append("| " + " | ".join(cells) + " |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, len(CORPORA), figsize=(6 * len(CORPORA), 4.5), squeeze=False)
    families = {"kivi": ("tab:blue", "o"), "nuq": ("tab:orange", "s"), "xquant-cl": ("tab:green", "^"),
                "xquant": ("tab:red", "D"), "clkv": ("tab:purple", "v"), "fp16": ("black", "*")}
    for ax, (_, label) in zip(axes[0], CORPORA):
        for r in rows:
            if f"dppl {label}" not in r or "kv_size_vs_fp16" not in r:
                continue
            fam = next(k for k in families if r["format"].startswith(k))
            color, marker = families[fam]
            x = 1.0 / r["kv_size_vs_fp16"]
            ax.scatter([x], [r[f"dppl {label}"]], color=color, marker=marker)
            ax.annotate(r["format"], (x, r[f"dppl {label}"]), textcoords="offset points", xytext=(4, 3), fontsize=7)
        ax.set_xlabel("compression vs fp16 (x, from stored bytes)")
        ax.set_ylabel("perplexity increase over fp16")
        ax.set_yscale("symlog", linthresh=0.1)
        ax.set_title(f"SmolLM2-135M, {label}, window {args.window}")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=120)
    print(f"wrote {args.out}.csv/.md/.png", file=sys.stderr)


if __name__ == "__main__":
    main()
