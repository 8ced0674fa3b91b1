#!/usr/bin/env python3
"""This host's limits, the denominators of every speed figure: streaming read bandwidth, the
fp32 FMA peak and the int8 dot-product peak, on one thread and on all, measured by
`xctx doctor --probe` (kernels/cpu/simd/roofline.h) several times; the best of the runs is the
limit, the spread says how steady the machine was. Written per host (the CPU's family, model and
stepping in the file name), so results from Zen 4, Zen 5 and Ice Lake sit side by side.

    benchmarks/roofline.py [--xctx build/xctx] [--runs 3] [--out-dir benchmarks/results]

Writes roofline_<family>-<model>-<stepping>.{json,md}. Other scripts read the JSON of the host
they run on (load_limits below) to report each figure as a fraction of its limit.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hostinfo import ROOT, cpu_identity, xctx_commit  # noqa: E402

FIELDS = [("read_gbs_1", "read, 1 thread", "GB/s"), ("read_gbs_all", "read, all threads", "GB/s"),
          ("fma_gflops_1", "fp32 FMA, 1 thread", "GFLOP/s"), ("fma_gflops_all", "fp32 FMA, all threads", "GFLOP/s"),
          ("int8_gops_1", "int8 dot, 1 thread", "GOP/s"), ("int8_gops_all", "int8 dot, all threads", "GOP/s")]


def host_key():
    fields = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            if not line.strip():
                break
            k, _, v = line.partition(":")
            fields[k.strip()] = v.strip()
    return f"{fields.get('cpu family', 'x')}-{fields.get('model', 'x')}-{fields.get('stepping', 'x')}"


def load_limits(results_dir=os.path.join(ROOT, "benchmarks", "results")):
    """The committed limits of the host this runs on, or None when it was never measured."""
    path = os.path.join(results_dir, f"roofline_{host_key()}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)["limits"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--xctx", default=os.path.join(ROOT, "build", "xctx"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    a = ap.parse_args()
    if a.runs < 1:
        sys.exit("roofline.py: --runs must be >= 1")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.runs):
            path = os.path.join(tmp, f"doctor{i}.json")
            subprocess.run([a.xctx, "doctor", "--probe", "--json", path], check=True, stdout=subprocess.DEVNULL)
            with open(path) as f:
                runs.append(json.load(f)["roofline"])
            print(f"run {i + 1}/{a.runs}: " + ", ".join(f"{k} {runs[-1][k]:.1f}" for k, _, _ in FIELDS), flush=True)
    limits = {k: max(r[k] for r in runs) for k, _, _ in FIELDS}
    limits.update({k: runs[0][k] for k in ("threads", "read_bytes", "read_isa", "fma_isa", "int8_isa")})
    out = {"host": cpu_identity(), "commit": xctx_commit(), "date": datetime.date.today().isoformat(),
           "runs": runs, "limits": limits}
    base = os.path.join(a.out_dir, f"roofline_{host_key()}")
    with open(base + ".json", "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    lines = [f"# This host's limits ({host_key()})", "",
             f"Written by `benchmarks/roofline.py` (`xctx doctor --probe`, {a.runs} runs, best kept) on "
             f"{out['host']}, commit {out['commit']}, {out['date']}. {limits['threads']} threads; the read "
             f"buffer is {limits['read_bytes'] >> 20} MiB ({limits['read_isa']} loads); FMA by {limits['fma_isa']}, "
             f"int8 dot products by {limits['int8_isa']}.", "",
             "| limit | best | runs (min - max) | unit |", "| --- | --- | --- | --- |"]
    for k, name, unit in FIELDS:
        vals = [r[k] for r in runs]
        lines.append(f"| {name} | {limits[k]:.1f} | {min(vals):.1f} - {max(vals):.1f} | {unit} |")
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {base}.json and .md")


if __name__ == "__main__":
    main()
