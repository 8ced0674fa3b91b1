#!/usr/bin/env python3
"""Sequence-parallel scaling at a fixed total context: prefill time, decode step time, cache
bytes per rank and bytes communicated per decoded token (measured against the formula), for
P = 1, 2, 4, 8 ranks under mpirun, all in one run.

    python3 benchmarks/sp_scaling.py [--context 4096] [--gen 32] [--ranks 1,2,4,8] [--prefill exact]

Writes benchmarks/results/sp_scaling_<prefill>.{csv,md,png}. On a 2-core machine more than two
ranks share cores (mpirun --oversubscribe, one OpenMP thread per rank when P >= 2), so time
cannot fall with P there; memory per rank falling as 1/P and the communication volume are what
this machine can show.
"""
import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "data"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--xctx", default=os.path.join(ROOT, "build", "xctx"))
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--ranks", default="1,2,4,8")
    ap.add_argument("--prefill", default="exact")
    ap.add_argument("--cache", default="fp16")
    args = ap.parse_args()

    import austen_text
    tmp = tempfile.mkdtemp(prefix="xctx-sp-")
    text_file = os.path.join(tmp, "austen.txt")
    open(text_file, "w").write("\n\n".join(austen_text.novels().values()))
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cores = os.cpu_count() or 2
    rows = []
    for p in [int(x) for x in args.ranks.split(",")]:
        threads = max(1, cores // p)
        env["OMP_NUM_THREADS"] = str(threads)
        cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(p), args.xctx, "bench", "--text", text_file,
               "--prompt-tokens", str(args.context), "--gen-tokens", str(args.gen), "--threads", str(threads),
               "--prefill", args.prefill, "--cache", args.cache]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        j = json.loads(out.strip().splitlines()[-1])
        per = j["per_rank"]
        layers, pb = j["n_layer"], j["partial_bytes_per_token_layer"]
        sent = sum(r["decode_gather_bytes_sent"] for r in per) / p / max(1, args.gen)
        recv = sum(r["decode_gather_bytes_recv"] for r in per) / p / max(1, args.gen)
        row = {
            "ranks": p, "threads_per_rank": threads, "context": args.context, "prefill": args.prefill,
            "prefill_s": round(j["prefill_s"], 3),
            "decode_ms_per_token": round(1000 * j["decode_s"] / max(1, args.gen), 2),
            "cache_bytes_max_rank": max(r["cache_allocated_bytes"] for r in per),
            "cache_bytes_total": sum(r["cache_allocated_bytes"] for r in per),
            "tokens_max_rank": max(r["tokens"] for r in per),
            "ring_bytes_per_rank": round(sum(r["ring_bytes_sent"] for r in per) / p),
            "decode_bytes_sent_per_token": round(sent),
            "decode_bytes_sent_formula": layers * pb if p > 1 else 0,
            "decode_bytes_recv_per_token": round(recv),
            "decode_bytes_recv_formula": p * layers * pb if p > 1 else 0,
            "peak_rss_mib_rank0": round(per[0]["peak_rss_bytes"] / 2**20, 1),
        }
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)

    out_dir = os.path.join(HERE, "results")
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"sp_scaling_{args.prefill}")
    with open(base + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    with open(base + ".md", "w") as f:
        f.write(f"# Sequence-parallel scaling, {args.context} tokens, {args.prefill} prefill, {args.cache} cache\n\n")
        f.write(f"Command: `python3 benchmarks/sp_scaling.py --context {args.context} --gen {args.gen} "
                f"--ranks {args.ranks} --prefill {args.prefill}` on {cores} cores (ranks > cores share them).\n\n")
        f.write("| ranks | prefill s | decode ms/token | cache/rank (max) | tokens/rank (max) | ring bytes/rank | "
                "decode bytes sent/token (formula) | received/token (formula) |\n|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r['ranks']} | {r['prefill_s']} | {r['decode_ms_per_token']} | "
                    f"{r['cache_bytes_max_rank'] / 2**20:.2f} MiB | {r['tokens_max_rank']} | "
                    f"{r['ring_bytes_per_rank'] / 2**20:.1f} MiB | {r['decode_bytes_sent_per_token']} "
                    f"({r['decode_bytes_sent_formula']}) | {r['decode_bytes_recv_per_token']} "
                    f"({r['decode_bytes_recv_formula']}) |\n")
        f.write("\nFormula: each rank contributes n_layer x n_head x (head_dim + 1) x 4 bytes of packed (o, lse) "
                "per decoded token and receives P times that (one all-gather per layer).\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        ps = [r["ranks"] for r in rows]
        ax[0].plot(ps, [r["cache_bytes_max_rank"] / 2**20 for r in rows], "o-", label="measured")
        ax[0].plot(ps, [rows[0]["cache_bytes_max_rank"] / 2**20 / p for p in ps], "--", label="1/P")
        ax[0].set_xlabel("ranks"); ax[0].set_ylabel("cache per rank (MiB)"); ax[0].legend(); ax[0].set_xscale("log", base=2)
        ax[1].plot(ps, [r["prefill_s"] for r in rows], "o-", label="prefill s")
        ax[1].plot(ps, [r["decode_ms_per_token"] / 1000 * args.gen for r in rows], "s-", label=f"decode s ({args.gen} tokens)")
        ax[1].set_xlabel("ranks"); ax[1].set_ylabel("seconds"); ax[1].legend(); ax[1].set_xscale("log", base=2)
        fig.suptitle(f"xctx sequence parallel, {args.context} tokens, {cores} cores")
        fig.tight_layout()
        fig.savefig(base + ".png", dpi=100)
    except ImportError:
        print("matplotlib missing: no PNG", file=sys.stderr)
    print(open(base + ".md").read())


if __name__ == "__main__":
    main()
