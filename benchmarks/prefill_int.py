#!/usr/bin/env python3
"""The integer prefill GEMMs (--prefill-act q16 / q8: 16- / 8-bit activation blocks, VPDPBUSD on
AVX-512 VNNI, AMX tiles where the CPU and kernel grant them) against the f32 GEMM that prefill runs
by default, in one run on this host:

1. bench_matmul at n_tok = 512 on SmolLM2-135M's five matrix shapes, 1 and 2 threads, every
   variant (on AMX hosts also q16 and q8 with AMX off) with Google Benchmark's random interleaving over
   --reps repetitions (median);
2. `xctx bench` prefill tok/s at 512 / 2K / 8K tokens of Emma, the variants adjacent run by run;
3. perplexity of held-out novels (--ppl-texts; no tuning used them: Persuasion, Northanger Abbey)
   over --ppl-tokens tokens each in 2K windows under f32, q16 and q8 (the same windows and
   targets: the differences are paired, with their standard error across windows).
Each speed is also given as a fraction of this host's limits (benchmarks/roofline.py; the f32 GEMM
against the fp32 FMA peak, the integer ones against the int8 dot peak).

    benchmarks/prefill_int.py [--reps 3] [--ppl-tokens 32K] [--ppl-texts austen:persuasion,austen:northangerabbey]
                              [--out benchmarks/results/prefill_int_<family>-<model>-<stepping>]

Writes <out>.csv and <out>.md (per host by default).
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
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hostinfo import ROOT, cpu_identity, xctx_commit  # noqa: E402
import roofline  # noqa: E402

SHAPES = ["wq_wo Q4_1 576x576", "wk_wv Q4_1 192x576", "gate_up Q4_1 1536x576", "down Q4_1 576x1536",
          "output Q8_0 49152x576"]
# bench_matmul's variants: prefill_split_rows (the f32 GEMM), prefill_q8 / prefill_q16 (AMX tiles
# where granted) and, on AMX hosts, prefill_q8_vnni / prefill_q16_vnni (the same with AMX off).
VARIANTS = {3: "f32", 12: "q8", 13: "q8-vnni", 14: "q16", 15: "q16-vnni"}
ORDER = ["f32", "q16", "q8", "q16-vnni", "q8-vnni"]
PROMPTS = ["512", "2K", "8K"]


def run(cmd, env=None):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"prefill_int.py: {' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return r.stdout


def gemm_rows(bench, reps):
    out = run([bench, "--benchmark_filter=BM_matmul/shape:./n_tok:512/threads:./variant:(3|12|13|14|15)/",
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


def variants_here(amx):
    return ["f32", "q16", "q8"] + (["q16-vnni", "q8-vnni"] if amx else [])


def prefill_rows(xctx, reps, amx):
    got = {}
    for _ in range(reps):
        for n in PROMPTS:
            for var in variants_here(amx):  # adjacent: the same machine state for all
                act = var.split("-")[0]
                env = dict(os.environ, XCTX_NO_AMX="1") if var.endswith("-vnni") else None
                j = json.loads(run([xctx, "bench", "--text", "austen:emma", "--prompt-tokens", n, "--gen-tokens", "0",
                                    "--prefill-act", act], env))
                if j["prefill_activations"] != act:
                    sys.exit(f"prefill_int.py: asked for {act}, the run says {j['prefill_activations']}")
                got.setdefault((n, var), []).append(j["prefill_tok_s"])
    return [{"part": "prefill", "what": f"{n} tokens", "threads": 2, "act": act, "seconds": 0.0,
             "rate": statistics.median(v), "unit": "tok/s", "runs": len(v)} for (n, act), v in got.items()]


def ppl_rows(xctx, tokens, texts, tmp):
    """Per text and setting the perplexity and each window's mean NLL (the same windows and targets
    for all settings of a text)."""
    rows = []
    for text in texts:
        for act in ["f32", "q16", "q8"]:
            path = os.path.join(tmp, f"ppl_{act}.json")
            run([xctx, "ppl", "--text", text, "--window", "2048", "--max-tokens", tokens, "--prefill-act", act,
                 "--json", path])
            with open(path) as f:
                j = json.load(f)
            rows.append({"part": "ppl", "what": text, "threads": 2, "act": act, "seconds": 0.0, "rate": j["ppl"],
                         "unit": "ppl", "runs": 1, "targets": j["targets"], "window_nll": j["window_nll_mean"]})
    return rows


def paired(base, other):
    """Mean and standard error over windows of other - base (nats per target)."""
    d = [o - b for b, o in zip(base, other)]
    mean = statistics.fmean(d)
    se = statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else float("nan")
    return mean, se


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--xctx", default=os.path.join(ROOT, "build", "xctx"))
    ap.add_argument("--bench-matmul", default=os.path.join(ROOT, "build", "benchmarks", "bench_matmul"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ppl-tokens", default="32K")
    ap.add_argument("--ppl-texts", default="austen:persuasion,austen:northangerabbey")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", f"prefill_int_{roofline.host_key()}"))
    a = ap.parse_args()
    texts = [t for t in a.ppl_texts.split(",") if t]
    doctor = run([a.xctx, "doctor"])
    if "AVX-512" not in doctor:
        sys.exit("prefill_int.py: this CPU has no AVX-512 VNNI; --prefill-act q8 would run the f32 path")
    amx = "AMX" in doctor
    with tempfile.TemporaryDirectory() as tmp:
        rows = (gemm_rows(a.bench_matmul, a.reps) + prefill_rows(a.xctx, a.reps, amx)
                + ppl_rows(a.xctx, a.ppl_tokens, texts, tmp))
    limits = roofline.load_limits()
    for r in rows:
        r["of_limit"] = ""
        if limits and r["part"] == "gemm":
            one = r["threads"] == 1
            peak = limits["fma_gflops_1" if one else "fma_gflops_all"] if r["act"] == "f32" else \
                limits["int8_gops_1" if one else "int8_gops_all"]
            r["of_limit"] = f"{r['rate'] / peak:.2f}"
    with open(a.out + ".csv", "w", newline="") as f:
        fields = ["part", "what", "threads", "act", "seconds", "rate", "unit", "runs", "targets", "of_limit"]
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    by = {(r["part"], r["what"], r["threads"], r["act"]): r for r in rows}
    names = {"f32": "f32", "q16": "q16 (AMX)" if amx else "q16 (VNNI)", "q8": "q8 (AMX)" if amx else "q8 (VNNI)",
             "q16-vnni": "q16 (VNNI, AMX off)", "q8-vnni": "q8 (VNNI, AMX off)"}
    with open(a.out + ".md", "w") as f:
        f.write(f"# Integer prefill GEMMs (--prefill-act q16 / q8) vs the f32 GEMM\n\n"
                f"{datetime.date.today()}, xctx {xctx_commit()}, {cpu_identity()}; written by "
                f"`benchmarks/prefill_int.py --reps {a.reps} --ppl-tokens {a.ppl_tokens} --ppl-texts {a.ppl_texts}`.\n\n")
        f.write("## GEMMs at n_tok = 512 (bench_matmul, median of the randomly interleaved repetitions)\n\n"
                "Rates count the product's useful work (2 n_rows n_cols n_tok); f32 against the fp32 FMA peak, the "
                "integer variants against the int8 dot-product peak (q16 issues twice q8's integer products).\n\n"
                "| matrix | threads | variant | GFLOP/s or GOP/s | of its peak | vs f32 |\n|---|---|---|---|---|---|\n")
        for shape in SHAPES:
            for threads in (1, 2):
                f32 = by.get(("gemm", shape, threads, "f32"))
                for var in ORDER:
                    r = by.get(("gemm", shape, threads, var))
                    if r and f32:
                        f.write(f"| {shape} | {threads} | {names[var]} | {r['rate']:.0f} | {r['of_limit'] or '-'} | "
                                f"{f32['seconds'] / r['seconds']:.2f} |\n")
        if not limits:
            f.write("\nNo committed limits for this host (run benchmarks/roofline.py first): no fractions.\n")
        f.write("\n## Whole prefill (`xctx bench --text austen:emma --gen-tokens 0`, 1 rank, 2 threads, fp16 cache; "
                "median, the variants adjacent run by run)\n\n| prompt | variant | tok/s | vs f32 |\n|---|---|---|---|\n")
        for n in PROMPTS:
            f32 = by[("prefill", f"{n} tokens", 2, "f32")]
            for var in variants_here(amx):
                r = by[("prefill", f"{n} tokens", 2, var)]
                f.write(f"| {n} | {names[var]} | {r['rate']:.0f} | {r['rate'] / f32['rate']:.2f} |\n")
        f.write(f"\n## Perplexity (`xctx ppl --text T --window 2048 --max-tokens {a.ppl_tokens}`)\n\n"
                "The same windows and targets under each setting, so the comparison is paired: the change of each "
                "window's mean NLL against f32, averaged over the windows, with its standard error across them.\n\n"
                "| text | prefill activations | ppl | vs f32 | mean ΔNLL per target (nats) | its standard error |\n"
                "|---|---|---|---|---|---|\n")
        for text in texts:
            p = {r["act"]: r for r in rows if r["part"] == "ppl" and r["what"] == text}
            for act in ["f32", "q16", "q8"]:
                r = p[act]
                if act == "f32":
                    f.write(f"| {text} ({r['targets']} targets) | f32 | {r['rate']:.4f} | 1 | - | - |\n")
                    continue
                mean, se = paired(p["f32"]["window_nll"], r["window_nll"])
                f.write(f"| {text} | {act} | {r['rate']:.4f} | {r['rate'] / p['f32']['rate']:.5f} | {mean:+.5f} | "
                        f"{se:.5f} |\n")
        f.write("\nThe VNNI and AMX kernels give the scalar reference's bits "
                "(tests/kernels/test_matmul_prefill_int.cpp), so each setting's perplexity is the same with either.\n")
    print(open(a.out + ".md").read())


if __name__ == "__main__":
    main()
