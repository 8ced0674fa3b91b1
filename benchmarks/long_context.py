#!/usr/bin/env python3
"""Long contexts over many ranks on this machine: passkey accuracy, prefill time, decode speed,
cache bytes per rank and peak RSS per rank against the memory plan, per context and cache format.
CSV + Markdown + PNG in benchmarks/results/.

    benchmarks/long_context.py --np 8 --contexts 32K,128K,512K,1M \\
        --formats fp16,nuq3-1%,kivi2,xquant-cl3,xquant2 --depths 0.5 --trials 1

Every run is `xctx passkey` under launch/xctx-mpirun with --json. Contexts past the model's
trained window use SelfExtend (--rope-scaling selfextend) with --window W and the smallest
power-of-two group whose reach covers the prompt (worker/llama_engine.h, rope_reach), or with
--attention retrieval the retrieval attention of docs/retrieval.md (write those rows to their own
--out, e.g. benchmarks/results/long_context_retrieval); the run header in the JSON records what ran. A format the node cannot hold is refused up front by the
fit check: the row says "refused" with the check's message. nuq formats need a calibration:
one is made with `xctx calibrate` when --calib does not exist.

Columns: prefill tok/s = prompt tokens / prefill seconds (mean over trials); decode tok/s =
decode steps / their seconds (the answer's tokens after the first); cache/rank = largest allocated shard cache; peak RSS/rank =
largest VmHWM; "over base" = peak RSS minus the rank's RSS after loading the model (weights and
code, which the plan leaves out) and minus the file-backed and shared-memory pages the rank first
touched during the run (code run for the first time, the MPI transport's segments: 2-3 MiB per
rank; column code_shm_rank_max; rows measured before passkey reported them include those pages),
compared with the plan's estimate (docs/sequence_parallel.md, "Memory").
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
TRAINED = 8192  # SmolLM2-135M's trained context
DEFAULT_FORMATS = "fp16,nuq3-1%,kivi2,xquant-cl3,xquant2"


def parse_count(s):
    s = s.strip().upper()
    for suffix, mult in (("K", 1024), ("M", 1024 * 1024)):
        if s.endswith(suffix):
            return int(float(s[:-1]) * mult)
    return int(s)


def label(n):
    if n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)}M"
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def cpu_description():
    return hostinfo.cpu_identity()  # model, family/model/stepping, cores, ISA


def loadavg():
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "?"


def self_extend_group(ctx, window):
    """The smallest power-of-two group whose reach covers ctx tokens (rope_reach's formula)."""
    g = 2
    while (TRAINED - 1 - (window - window // g) + 1) * g < ctx:
        g *= 2
    return g


def ensure_calib(args):
    if os.path.exists(args.calib):
        return
    print(f"making the nuq calibration {args.calib} (xctx calibrate)", file=sys.stderr)
    subprocess.run([args.xctx, "calibrate", "--text", "austen:emma", "--out", args.calib], check=True)


def run(args, fmt, ctx):
    # Room for the prompt within passkey's tolerance (1% of the context) and the answer.
    capacity = ctx + ctx // 100 + 1024
    # Each run's passkey JSON (per-trial answers, modes, shards) is kept beside the results.
    runs_dir = args.out + "_runs"
    os.makedirs(runs_dir, exist_ok=True)
    out = os.path.join(runs_dir, f"{label(ctx)}_{fmt.replace('%', 'pct')}.json")
    cmd = [os.path.join(ROOT, "launch", "xctx-mpirun"), "-np", str(args.np), args.xctx, "passkey",
           "--context", str(ctx), "--trials", str(args.trials), "--depths", args.depths, "--seed", str(args.seed),
           "--filler", args.filler, "--cache", fmt, "--json", out, "--prefill", args.prefill,
           "--ctx", str(capacity), "--block", str(args.block)]
    if args.anchor:
        cmd += ["--anchor", str(args.anchor)]
    if fmt.startswith("nuq"):
        cmd += ["--calib", args.calib]
    if args.attention == "retrieval":
        # Retrieval attention (docs/retrieval.md): sink + local window + top-k blocks, far keys at
        # distance --local; no RoPE flags. Full attention within the trained window.
        cmd += ["--attention", "retrieval" if ctx + 64 > TRAINED else "full", "--local", str(args.local),
                "--top-k", str(args.top_k), "--block-size", str(args.block_size), "--sink", str(args.sink),
                "--block-score", args.block_score, "--select-per", args.select_per]
    elif ctx + 64 > TRAINED:
        g = self_extend_group(capacity, args.window)
        cmd += ["--attention", "full", "--rope-scaling", "selfextend", "--group", str(g), "--window", str(args.window)]
    load_before = loadavg()
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=args.timeout)
    wall = time.time() - t0
    # 1-minute load average before and after: other work on the cores shows up here (8 ranks
    # alone give about 8 on this 2-core machine).
    row = {"context": ctx, "format": fmt, "ranks": args.np, "wall_s": round(wall, 1),
           "load": f"{load_before}->{loadavg()}"}
    if p.returncode != 0:
        lines = [x for x in p.stderr.strip().splitlines() if "error" in x.lower()] or p.stderr.strip().splitlines()
        msg = (lines or ["?"])[0]
        row["status"] = "refused" if "does not fit" in p.stderr or "cannot hold" in p.stderr else "failed"
        row["message"] = msg[:300]
        print(f"  {fmt:10s} {label(ctx):>5s}: {row['status']}: {msg[:160]}", file=sys.stderr)
        return row
    with open(out) as f:
        j = json.load(f)
    s, trials, shards = j["summary"], j["trials"], j.get("shards", [])
    prefill_s = sum(t["prefill_s"] for t in trials) / len(trials)
    prompt = sum(t["prompt_tokens"] for t in trials) / len(trials)
    dec_tok = sum(t.get("decode_steps", t["answer_tokens"]) for t in trials)  # steps run through the model
    dec_s = sum(t["decode_s"] for t in trials)
    row.update({
        # What ran (auto resolved per trial), then the header's description of it.
        "status": "ok", "rope": j.get("rope", ""),
        "prefill": "ran " + "/".join(sorted({t.get("prefill_mode", "?") for t in trials})) + "; " + j.get("prefill", ""),
        "correct": s["correct"], "total": s["total"], "accuracy": s["accuracy"],
        "ci95_lo": s["ci95"][0], "ci95_hi": s["ci95"][1],
        "prefill_s": round(prefill_s, 2), "prefill_tok_s": round(prompt / prefill_s, 1),
        "decode_tok_s": round(dec_tok / dec_s, 2) if dec_s > 0 else 0.0,
    })
    if shards:
        row["cache_bytes_rank_max"] = max(x["cache_allocated"] for x in shards)
        row["peak_rss_rank_max"] = max(x["peak_rss_bytes"] for x in shards)
        # Code pages first run during the sequence (file-backed) and the MPI transport's shared
        # memory are the program's, like the weights: they leave the comparison with the plan.
        # They never shrink, so their growth by the end was there at the peak too.
        def code_shm(x):
            b, n = x.get("base_rss_parts"), x.get("rss_parts")
            return max(0, n["file"] - b["file"] + n["shmem"] - b["shmem"]) if b and n else 0
        over = [x["peak_rss_bytes"] - x["base_rss_bytes"] - code_shm(x) for x in shards]
        row["code_shm_rank_max"] = max(code_shm(x) for x in shards)
        row["over_base_rank_max"] = max(over)
        row["planned_bytes"] = max(x["planned_bytes"] for x in shards)
        row["over_base_vs_plan"] = round(max(over) / row["planned_bytes"], 3) if row["planned_bytes"] else 0.0
    print(f"  {fmt:10s} {label(ctx):>5s}: {s['correct']}/{s['total']}, prefill {prefill_s:.0f} s "
          f"({row['prefill_tok_s']} tok/s), decode {row['decode_tok_s']} tok/s", file=sys.stderr)
    return row


def mib(x):
    return f"{x / 2**20:.0f} MiB" if x != "" and x is not None else ""


def write_outputs(rows, out, cpu, args):
    keys = ["context", "format", "ranks", "status", "correct", "total", "accuracy", "ci95_lo", "ci95_hi",
            "prefill_s", "prefill_tok_s", "decode_tok_s", "cache_bytes_rank_max", "peak_rss_rank_max",
            "over_base_rank_max", "code_shm_rank_max", "planned_bytes", "over_base_vs_plan", "rope", "prefill", "wall_s", "load", "message"]
    with open(out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)
    with open(out + ".md", "w") as f:
        f.write(f"# Long contexts: passkey over {args.np} ranks\n\n")
        f.write(f"This file was last written by `{' '.join(sys.argv)}` on {cpu}, {time.strftime('%Y-%m-%d')}; "
                f"build: {args.build_note}. Rows kept from earlier runs (--append) keep their own command, commit "
                f"and machine: the notes below name them. \"over base\" is each rank's peak RSS less its RSS after "
                f"loading the model and less the code and shared-memory pages it first touched during the run (rows "
                f"whose passkey JSON reports page kinds; older rows include those 2-3 MiB), against the memory plan.\n\n")
        f.write("| context | format | passkey | 95% interval | prefill s | prefill tok/s | decode tok/s | "
                "cache/rank | peak RSS/rank | over base / plan | prefill | rope | load |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            if r["status"] != "ok":
                f.write(f"| {label(r['context'])} | {r['format']} | {r['status']} | | | | | | | | | "
                        f"{r.get('message', '')[:120]} | {r.get('load', '')} |\n")
                continue
            f.write(f"| {label(r['context'])} | {r['format']} | {r['correct']}/{r['total']} | "
                    f"[{100 * r['ci95_lo']:.0f}%, {100 * r['ci95_hi']:.0f}%] | {r['prefill_s']} | {r['prefill_tok_s']} | "
                    f"{r['decode_tok_s']} | {mib(r.get('cache_bytes_rank_max'))} | {mib(r.get('peak_rss_rank_max'))} | "
                    f"{mib(r.get('over_base_rank_max'))} / {mib(r.get('planned_bytes'))} "
                    f"({r.get('over_base_vs_plan', '')}) | {r.get('prefill', '')} | {r['rope']} | {r.get('load', '')} |\n")
        # Hand-written notes on the rows (which command and commit made which, what they show)
        # live beside the results and are carried into every rewrite of the table.
        if os.path.exists(out + "_notes.md"):
            with open(out + "_notes.md") as notes:
                f.write("\n" + notes.read())
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install matplotlib): no PNG", file=sys.stderr)
        return
    ok = [r for r in rows if r["status"] == "ok"]
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.8))
    for fmt in sorted({r["format"] for r in ok}):
        rs = sorted((r for r in ok if r["format"] == fmt), key=lambda r: r["context"])
        x = [r["context"] for r in rs]
        ax[0].plot(x, [r["prefill_tok_s"] for r in rs], "o-", label=fmt)
        ax[1].plot(x, [r["decode_tok_s"] for r in rs], "o-", label=fmt)
        ax[2].plot(x, [r.get("cache_bytes_rank_max", 0) / 2**20 for r in rs], "o-", label=fmt)
    for a, t in zip(ax, ["prefill tokens/s", "decode tokens/s", "cache MiB per rank"]):
        a.set_xscale("log", base=2)
        a.set_xlabel("context tokens")
        a.set_title(t)
    ax[0].legend(fontsize=7)
    fig.suptitle(f"{args.np} ranks on 2 cores; rows from several runs and machines (the notes in {os.path.basename(out)}.md)",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--xctx", default=os.path.join(ROOT, "build", "xctx"))
    ap.add_argument("--calib", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.calib"))
    ap.add_argument("--np", type=int, default=8)
    ap.add_argument("--contexts", default="32K,128K,512K,1M")
    ap.add_argument("--formats", default=DEFAULT_FORMATS)
    ap.add_argument("--depths", default="0.5")
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--seed", type=int, default=4000)
    ap.add_argument("--filler", default="classic")
    ap.add_argument("--prefill", default="auto", help="exact | star | auto (the CLI's default)")
    ap.add_argument("--block", default="1K", help="star prefill: tokens per block (the anchor is one block unless --anchor)")
    ap.add_argument("--anchor", default="", help="star prefill: anchor tokens")
    ap.add_argument("--window", type=int, default=1024, help="SelfExtend neighbour window past the trained context")
    ap.add_argument("--attention", default="selfextend", choices=["selfextend", "retrieval"],
                    help="past the trained window: SelfExtend positions over full attention, or retrieval attention")
    ap.add_argument("--local", default="4K", help="retrieval: local window (and the far keys' distance)")
    ap.add_argument("--top-k", type=int, default=32, help="retrieval: blocks per query and layer")
    ap.add_argument("--block-size", default="256", help="retrieval: positions per block")
    ap.add_argument("--sink", default="256", help="retrieval: sink positions")
    ap.add_argument("--block-score", default="minmax", help="retrieval: minmax | mean")
    ap.add_argument("--select-per", default="layer", help="retrieval: layer | kv-head (one top-k per KV head)")
    ap.add_argument("--timeout", type=int, default=4 * 3600, help="seconds per run")
    ap.add_argument("--build-note", default="Release (-O3 -DNDEBUG), portable x86-64 with run-time AVX2/AVX-512 dispatch (launch/build)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "long_context"))
    ap.add_argument("--append", action="store_true", help="keep the rows of an existing CSV (other contexts/formats)")
    ap.add_argument("--replot", action="store_true",
                    help="run nothing: rewrite the Markdown (notes included) and the PNG from the existing CSV")
    args = ap.parse_args()
    formats = args.formats.split(",")
    contexts = [parse_count(c) for c in args.contexts.split(",")]
    if any(f.startswith("nuq") for f in formats) and not args.replot:
        ensure_calib(args)
    rows = []
    if (args.append or args.replot) and os.path.exists(args.out + ".csv"):
        with open(args.out + ".csv") as f:
            for r in csv.DictReader(f):
                r = {k: (v if v != "" else None) for k, v in r.items()}
                for k in ("context", "ranks", "correct", "total", "cache_bytes_rank_max", "peak_rss_rank_max",
                          "over_base_rank_max", "code_shm_rank_max", "planned_bytes"):
                    if r.get(k) is not None:
                        r[k] = int(float(r[k]))
                for k in ("accuracy", "ci95_lo", "ci95_hi", "prefill_s", "prefill_tok_s", "decode_tok_s",
                          "over_base_vs_plan", "wall_s"):
                    if r.get(k) is not None:
                        r[k] = float(r[k])
                r["message"] = r.get("message") or ""
                rows.append(r)
    cpu = cpu_description()
    # One row order whatever a run's --formats: context, then the default format order.
    order = DEFAULT_FORMATS.split(",") + [f for f in formats if f not in DEFAULT_FORMATS.split(",")]
    def sort_rows():
        rows.sort(key=lambda r: (r["context"], order.index(r["format"]) if r["format"] in order else len(order)))
    if args.replot:
        sort_rows()
        write_outputs(rows, args.out, cpu, args)
        return
    print(f"{cpu}; {args.np} ranks", file=sys.stderr)
    for ctx in contexts:
        for fmt in formats:
            rows = [r for r in rows if not (r["context"] == ctx and r["format"] == fmt)]
            rows.append(run(args, fmt, ctx))
            sort_rows()
            write_outputs(rows, args.out, cpu, args)  # after every run: a long sweep keeps what it measured


if __name__ == "__main__":
    main()
