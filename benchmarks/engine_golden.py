#!/usr/bin/env python3
"""The engine's distance from exact arithmetic and from llama.cpp on the golden prompts, per host:
runs tests/worker/test_engine_golden.cpp (the test that holds these distances to their
tolerances) and keeps the lines it prints, under a header naming the CPU (family/model/stepping,
ISA: the prefill's activations depend on it) and the commit. docs/engine.md quotes the file.

    benchmarks/engine_golden.py [--test-worker build/tests/test_worker] [--out-dir benchmarks/results]

Writes engine_golden_<family>-<model>-<stepping>.txt; exits non-zero when the test fails.
"""
import argparse
import datetime
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hostinfo import ROOT, cpu_identity, xctx_commit  # noqa: E402
from roofline import host_key  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--test-worker", default=os.path.join(ROOT, "build", "tests", "test_worker"))
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    a = ap.parse_args()
    if not os.access(a.test_worker, os.X_OK):
        sys.exit(f"engine_golden.py: no test binary at {a.test_worker} (launch/build builds it)")
    r = subprocess.run([a.test_worker, "--gtest_filter=caches/engine_golden.*"], capture_output=True, text=True)
    lines = [l for l in r.stdout.splitlines() if l.startswith("[golden")]
    if r.returncode != 0 or not lines:
        sys.stderr.write(r.stdout[-4000:] + r.stderr[-2000:])
        sys.exit(f"engine_golden.py: the golden test failed (exit {r.returncode})")
    path = os.path.join(a.out_dir, f"engine_golden_{host_key()}.txt")
    with open(path, "w") as f:
        f.write(f"# caches/engine_golden.* on {cpu_identity()}\n")
        f.write(f"# {datetime.date.today()}, xctx {xctx_commit()}; written by benchmarks/engine_golden.py\n")
        f.write("\n".join(lines) + "\n")
    print(f"engine_golden.py: {len(lines)} lines -> {path}")


if __name__ == "__main__":
    main()
