#!/usr/bin/env python3
"""Per-test times of one CTest run (launch/run-tests writes build/ctest-junit.xml): the total,
the time per label and per MPI rank count, and the slowest tests, as CSV and Markdown, with the
machine and commit. Where the suite's time goes, so it can be cut where it is spent.

    benchmarks/test_times.py [--junit build/ctest-junit.xml] [--wall-s S] [--out benchmarks/results/test_times]

--wall-s: the run's wall time, when known (CTest runs two tests at once, so it is below the sum).
"""
import argparse
import csv
import datetime
import os
import re
import sys
import xml.etree.ElementTree as ET

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hostinfo import ROOT, cpu_identity, xctx_commit  # noqa: E402


def group_of(name):
    if name.startswith(("mpi_", "cli_doctor_two", "cli_generate_two")) or re.search(r"_np\d+$", name):
        return "mpi"
    if name.startswith("service_"):
        return "service"
    if name.startswith(("cli_", "tests_", "cluster_")):
        return "cli"
    return name.split(".")[0].split("/")[-1] if "." in name else "other"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--junit", default=os.path.join(ROOT, "build", "ctest-junit.xml"))
    ap.add_argument("--wall-s", type=float, default=None)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--source", default=None, help="what run the report came from (default: its path)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "test_times"))
    a = ap.parse_args()
    root = ET.parse(a.junit).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    rows = []
    for tc in suite.iter("testcase"):
        status = "passed"
        if tc.find("failure") is not None or tc.get("status") == "fail":
            status = "failed"
        elif tc.find("skipped") is not None or tc.get("status") in ("notrun", "disabled"):
            status = "skipped"
        rows.append({"test": tc.get("name"), "seconds": float(tc.get("time") or 0), "status": status})
    rows.sort(key=lambda r: -r["seconds"])
    total = sum(r["seconds"] for r in rows)
    by_group = {}
    for r in rows:
        g = by_group.setdefault(group_of(r["test"]), [0, 0.0])
        g[0] += 1
        g[1] += r["seconds"]
    counts = {s: sum(r["status"] == s for r in rows) for s in ("passed", "failed", "skipped")}
    with open(a.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["test", "seconds", "status"])
        w.writeheader()
        w.writerows(rows)
    stamp = datetime.date.today().isoformat()
    with open(a.out + ".md", "w") as f:
        f.write("# Test suite times\n\n")
        source = a.source or f"{os.path.relpath(a.junit, ROOT)} (the CTest run of `launch/run-tests`)"
        f.write(f"Written by `benchmarks/test_times.py` from {source} on {cpu_identity()}, commit {xctx_commit()}, {stamp}. {len(rows)} tests: "
                f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped. Sum of test times "
                f"{total / 60:.1f} min" + (f"; wall time {a.wall_s / 60:.1f} min (CTest -j2)" if a.wall_s else "") +
                ". Every row in the CSV.\n\n")
        f.write("| group | tests | minutes | share |\n| --- | --- | --- | --- |\n")
        for g, (n, s) in sorted(by_group.items(), key=lambda kv: -kv[1][1]):
            f.write(f"| {g} | {n} | {s / 60:.1f} | {100 * s / total:.0f}% |\n")
        f.write(f"\nThe {a.top} slowest:\n\n| test | seconds | status |\n| --- | --- | --- |\n")
        for r in rows[:a.top]:
            f.write(f"| `{r['test']}` | {r['seconds']:.1f} | {r['status']} |\n")
    print(f"wrote {a.out}.md and .csv: {len(rows)} tests, {total / 60:.1f} min summed")


if __name__ == "__main__":
    main()
