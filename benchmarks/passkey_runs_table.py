#!/usr/bin/env python3
"""One Markdown table of `xctx passkey --json` runs that differ in their settings: per trial the
run's cache and attention line (what differs), the depth, where the key sat, the answer and
whether it holds the key. For A/B probes of single trials (docs/retrieval.md); the grids with
intervals are long_context.py's.

  benchmarks/passkey_runs_table.py --out F.md --host "CPU ..." --command "..." RUN.json...

--host: the machine the runs ran on (benchmarks/hostinfo.py's cpu_identity() when left out, so
run it where the runs ran).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hostinfo  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="passkey --json files")
    ap.add_argument("--out", required=True, help="Markdown file to write")
    ap.add_argument("--host", default=None, help="the CPU the runs ran on (default: this machine's)")
    ap.add_argument("--command", default="", help="the passkey command the runs share, for the header")
    a = ap.parse_args()
    host = a.host or hostinfo.cpu_identity()
    lines = [f"Runs on {host}; table written by benchmarks/passkey_runs_table.py from the JSON files named in "
             f"the first column.", ""]
    if a.command:
        lines += [f"Shared command: `{a.command}`", ""]
    lines += ["| run | context | cache | attention | depth | key at token | answer | right | prefill s |",
              "| --- | ---: | --- | --- | ---: | ---: | --- | --- | ---: |"]
    n_ok = n = 0
    for f in a.runs:
        d = json.load(open(f))
        for t in d["trials"]:
            answer = t["answer"].strip().replace("|", "\\|")
            if len(answer) > 48:
                answer = answer[:45] + "..."
            lines.append(f"| {os.path.basename(f)} | {d['context']} | {d['cache']} | {d['attention']} | "
                         f"{t['depth']:.2f} | {t['key_token']} | `{answer}` | {'yes' if t['ok'] else 'no'} | "
                         f"{t['prefill_s']:.0f} |")
            n += 1
            n_ok += bool(t["ok"])
    lines += ["", f"{n_ok} of {n} trials right."]
    with open(a.out, "w") as out:
        out.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
