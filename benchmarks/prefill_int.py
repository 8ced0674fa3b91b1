#!/usr/bin/env python3
"""The integer prefill GEMM (--prefill-act q8: 8-bit activation blocks, VPDPBUSD on AVX-512 VNNI,
AMX tiles where the CPU and kernel grant them) against the f32 GEMM that prefill runs by default,
in one run on this host:

1. bench_matmul at n_tok = 512 on SmolLM2-135M's five matrix shapes, 1 and 2 threads, every
   variant (on AMX hosts also q8 with AMX off) with Google Benchmark's random interleaving over
   --reps repetitions (median);
2. `xctx bench` prefill tok/s at 512 / 2K / 8K tokens of Emma, the variants adjacent run by run;
3. perplexity of Persuasion (held out: no tuning used it) over --ppl-tokens tokens in 2K windows
   under both settings (the same windows and targets, so the difference is paired).
Each speed is also given as a fraction of this host's limits (benchmarks/roofline.py; the f32 GEMM
against the fp32 FMA peak, the integer one against the int8 dot peak).

    benchmarks/prefill_int.py [--reps 3] [--ppl-tokens 32K] [--out benchmarks/results/prefill_int]

Writes <out>.csv and <out>.md.
"""
import argparse
import csv
import datetime
import json
import os
import re
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hostinfo import ROOT, cpu_identity, xctx_commit  # noqa: E402
import roofline  # noqa: E402

SHAPES = ["wq_wo Q4_1 576x576", "wk_wv Q4_1 192x576", "gate_up Q4_1 1536x576", "down Q4_1 576x1536",
          "output Q8_0 49152x576"]
# bench_matmul's prefill_split_rows, prefill_q8 (AMX tiles where granted) and prefill_q8_vnni (the
# same with AMX off; listed on AMX hosts only).
VARIANTS = {3: "f32", 12: "q8", 13: "q8-vnni"}
PROMPTS = ["512", "2K", "8K"]


def run(cmd, env=None):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"prefill_int.py: {' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return r.stdout


def gemm_rows(bench, reps):
    out = run([bench, "--benchmark_filter=BM_matmul/shape:./n_tok:512/threads:./variant:(3|12|13)/",
               f"--benchmark_repetitions={reps}", "--benchmark_enable_random_interleaving=true",
               "--benchmark_format=json"])
    times = {}
    for b in json.loads(out)["benchmarks"]:
        if b.get("run_type") != "iteration":
            continue
        m = re.match(r"BM_matmul/shape:(\d)/n_tok:512/threads:(\d)/variant:(\d+)/", b["name"])
        shape, threads, v = int(m.group(1)), int(m.group(2)), int(m.group(3))
        times.setdefault((shape, threads, VARIANTS[v]), []).append(b["real_time"] * 1e-6)  # us -> s
    rows = []
    for (shape, threads, act), ts in sorted(times.items()):
        dims = SHAPES[shape].split()[2].split("x")
        flops = 2.0 * int(dims[0]) * int(dims[1]) * 512
        t = statistics.median(ts)
        rows.append({"part": "gemm", "what": SHAPES[shape], "threads": threads, "act": act, "seconds": t,
                     "rate": flops / t / 1e9, "unit": "GFLOP/s", "runs": len(ts)})
    return rows


def prefill_rows(xctx, reps, amx):
    got = {}
    variants = ["f32", "q8"] + (["q8-vnni"] if amx else [])
    for _ in range(reps):
        for n in PROMPTS:
            for var in variants:  # adjacent: the same machine state for all
                act = var.split("-")[0]
                env = dict(os.environ, XCTX_NO_AMX="1") if var == "q8-vnni" else None
                j = json.loads(run([xctx, "bench", "--text", "austen:emma", "--prompt-tokens", n, "--gen-tokens", "0",
                                    "--prefill-act", act], env))
                if j["prefill_activations"] != act:
                    sys.exit(f"prefill_int.py: asked for {act}, the run says {j['prefill_activations']}")
                got.setdefault((n, var), []).append(j["prefill_tok_s"])
    return [{"part": "prefill", "what": f"{n} tokens", "threads": 2, "act": act, "seconds": 0.0,
             "rate": statistics.median(v), "unit": "tok/s", "runs": len(v)} for (n, act), v in got.items()]


def ppl_rows(xctx, tokens):
    rows = []
    for act in VARIANTS.values():
        out = run([xctx, "ppl", "--text", "austen:persuasion", "--window", "2048", "--max-tokens", tokens,
                   "--prefill-act", act])
        m = re.search(r"ppl ([0-9.]+)\s+\(.*?(\d+) targets", out)
        rows.append({"part": "ppl", "what": f"persuasion {m.group(2)} targets", "threads": 2, "act": act,
                     "seconds": 0.0, "rate": float(m.group(1)), "unit": "ppl", "runs": 1})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--xctx", default=os.path.join(ROOT, "build", "xctx"))
    ap.add_argument("--bench-matmul", default=os.path.join(ROOT, "build", "benchmarks", "bench_matmul"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ppl-tokens", default="32K")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "prefill_int"))
    a = ap.parse_args()
    doctor = run([a.xctx, "doctor"])
    if "AVX-512" not in doctor:
        sys.exit("prefill_int.py: this CPU has no AVX-512 VNNI; --prefill-act q8 would run the f32 path")
    amx = "AMX" in doctor
    rows = gemm_rows(a.bench_matmul, a.reps) + prefill_rows(a.xctx, a.reps, amx) + ppl_rows(a.xctx, a.ppl_tokens)
    limits = roofline.load_limits()
    for r in rows:
        r["of_limit"] = ""
        if limits and r["part"] == "gemm":
            peak = limits["fma_gflops_1" if r["threads"] == 1 else "fma_gflops_all"] if r["act"] == "f32" else \
                limits["int8_gops_1" if r["threads"] == 1 else "int8_gops_all"]
            r["of_limit"] = f"{r['rate'] / peak:.2f}"
    with open(a.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    by = {(r["part"], r["what"], r["threads"], r["act"]): r for r in rows}
    with open(a.out + ".md", "w") as f:
        f.write(f"# Integer prefill GEMM (--prefill-act q8) vs the f32 GEMM\n\n"
                f"{datetime.date.today()}, xctx {xctx_commit()}, {cpu_identity()}; written by "
                f"`benchmarks/prefill_int.py --reps {a.reps} --ppl-tokens {a.ppl_tokens}`.\n\n")
        q8_name = "q8 (AMX)" if amx else "q8 (VNNI)"
        f.write("## GEMMs at n_tok = 512 (bench_matmul, median of the interleaved repetitions)\n\n"
                f"| matrix | threads | f32 GFLOP/s | of fp32 FMA peak | {q8_name} GOP/s | of int8 dot peak | vs f32 |"
                + (" q8 (VNNI, AMX off) GOP/s | of int8 dot peak | AMX / VNNI |" if amx else "") + "\n"
                + "|---" * (7 + (3 if amx else 0)) + "|\n")
        for shape in SHAPES:
            for threads in (1, 2):
                f32, q8 = by.get(("gemm", shape, threads, "f32")), by.get(("gemm", shape, threads, "q8"))
                vn = by.get(("gemm", shape, threads, "q8-vnni"))
                if f32 and q8:
                    f.write(f"| {shape} | {threads} | {f32['rate']:.0f} | {f32['of_limit'] or '-'} | {q8['rate']:.0f} | "
                            f"{q8['of_limit'] or '-'} | {f32['seconds'] / q8['seconds']:.2f} |")
                    if amx and vn:
                        f.write(f" {vn['rate']:.0f} | {vn['of_limit'] or '-'} | {vn['seconds'] / q8['seconds']:.2f} |")
                    f.write("\n")
        if not limits:
            f.write("\nNo committed limits for this host (run benchmarks/roofline.py first): no fractions.\n")
        f.write("\n## Whole prefill (`xctx bench --text austen:emma --gen-tokens 0`, 1 rank, 2 threads, fp16 cache; "
                f"median, the variants adjacent)\n\n| prompt | f32 tok/s | {q8_name} tok/s | vs f32 |"
                + (" q8 (VNNI, XCTX_NO_AMX=1) tok/s | vs f32 |" if amx else "") + "\n" + "|---" * (4 + (2 if amx else 0))
                + "|\n")
        for n in PROMPTS:
            f32, q8 = by[("prefill", f"{n} tokens", 2, "f32")], by[("prefill", f"{n} tokens", 2, "q8")]
            f.write(f"| {n} | {f32['rate']:.0f} | {q8['rate']:.0f} | {q8['rate'] / f32['rate']:.2f} |")
            if amx:
                vn = by[("prefill", f"{n} tokens", 2, "q8-vnni")]
                f.write(f" {vn['rate']:.0f} | {vn['rate'] / f32['rate']:.2f} |")
            f.write("\n")
        p = [r for r in rows if r["part"] == "ppl"]
        f.write(f"\n## Perplexity (`xctx ppl --text austen:persuasion --window 2048 --max-tokens {a.ppl_tokens}`)\n\n"
                "| prefill activations | ppl |\n|---|---|\n")
        for r in p:
            f.write(f"| {r['act']} ({r['what']}) | {r['rate']:.4f} |\n")
        f.write(f"\nq8 / f32 perplexity: {p[1]['rate'] / p[0]['rate']:.4f}. The VNNI and AMX kernels give the scalar "
                "reference's bits (tests/kernels/test_matmul_prefill_int.cpp), so q8's perplexity is the same with "
                "either.\n")
    print(open(a.out + ".md").read())


if __name__ == "__main__":
    main()
