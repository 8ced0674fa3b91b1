#!/usr/bin/env python3
"""Every numeric option and every choice of every xctx subcommand refuses bad values where it is parsed.

Usage: check_numeric_options.py XCTX MODEL

The options come from each subcommand's --help, so a numeric option added later is covered
without editing this file: every INT/UINT/FLOAT option, every TEXT option that takes a
count (NUMERIC_TEXT below), and every choice (a TEXT option whose help lists "a, b or c", the
one_of check of coordinator/cli/options.h). Each gets the bad values of its kind; each run must end quickly with
a clear error -- a non-zero exit that is not a signal's, whose output names the flag. A run that
is still going after the time limit took the bad value as good (a job started).
"""
import atexit
import os
import re
import shutil
import subprocess
import sys
import tempfile

XCTX, MODEL = sys.argv[1], sys.argv[2]
TMP = tempfile.mkdtemp(prefix="xctx-numeric-")
atexit.register(shutil.rmtree, TMP, ignore_errors=True)
DOC = os.path.join(TMP, "docs.jsonl")
with open(DOC, "w") as f:
    f.write('{"id": "a", "text": "A short document about the sea."}\n')

# Arguments that make each subcommand otherwise valid (and quick to fail on the one bad value).
BASE = {
    "generate": ["--model", MODEL, "--prompt", "hi", "-n", "1"],
    "plan": [],
    "info": [MODEL],
    "bench": ["--model", MODEL, "--text", "austen:emma"],
    "passkey": ["--model", MODEL],
    "ppl": ["--model", MODEL, "--text", "austen:emma"],
    "calibrate": ["--model", MODEL, "--text", "austen:emma", "--out", "{out}"],
    "summarize": ["--model", MODEL, "--in", DOC, "--out", "{out}"],
    "serve": ["--model", MODEL, "--port", "0"],
    "submit": ["--server", "127.0.0.1:1", "--prompt", "hi"],
    "result": ["--server", "127.0.0.1:1", "1"],
}
# TEXT options that hold a count with an optional K/M/G suffix, or a list of numbers.
NUMERIC_TEXT = {"--ctx", "--window", "--se-window", "--block", "--anchor", "--star-from", "--sink", "--local",
                "--block-size", "--context", "--prompt-tokens", "--stride", "--max-tokens", "--chunk-tokens",
                "--max-request-bytes", "--max-context", "--depths"}
BAD = {
    "INT": ["abc", "-1", "99999999999999999999"],
    "UINT": ["abc", "-1"],
    "FLOAT": ["abc", "-1", "nan"],
    "TEXT": ["abc", "-1", "99999999999999999999", "9000000000T"],
    "CHOICE": ["not-a-choice", ""],
}
# Options whose range holds negatives (OpenAI's penalties, [-2, 2]): bad values past the range.
BAD_FOR = {opt: ["abc", "-3", "nan"] for opt in ("--frequency-penalty", "--presence-penalty")}
OPTION = re.compile(r"^\s+(?:-[a-zA-Z],)?(--[a-z][a-z0-9-]*)(?:,--[a-z0-9-]+)? (INT|UINT|FLOAT|TEXT)\b(:[^=\[]* or [^=\[]*)?")


def options_of(sub):
    out = subprocess.run([XCTX, sub, "--help"], capture_output=True, text=True, timeout=30).stdout
    opts = []
    for line in out.splitlines():
        m = OPTION.match(line)
        if m and m.group(2) == "TEXT" and m.group(3):
            opts.append((m.group(1), "CHOICE"))
        elif m and (m.group(2) != "TEXT" or m.group(1) in NUMERIC_TEXT):
            opts.append((m.group(1), m.group(2)))
    return opts


def main():
    failures, runs = [], 0
    for sub, base in BASE.items():
        opts = options_of(sub)
        if not opts:
            failures.append(f"{sub}: no numeric options found in --help (parser changed?)")
        for opt, kind in opts:
            for bad in BAD_FOR.get(opt, BAD[kind]):
                runs += 1
                out_file = os.path.join(TMP, f"out{runs}")  # a run that wrongly succeeds cannot mask the next
                cmd = [XCTX, sub, *[a.replace("{out}", out_file) for a in base], opt, bad]
                try:
                    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                                       env={**os.environ, "OMP_NUM_THREADS": "1"})
                except subprocess.TimeoutExpired:
                    failures.append(f"{' '.join(cmd[1:])}: still running after 60 s (the bad value was accepted)")
                    continue
                out = p.stdout + p.stderr
                if p.returncode == 0:
                    failures.append(f"{' '.join(cmd[1:])}: exit 0 (accepted)")
                elif p.returncode < 0 or p.returncode >= 128:
                    failures.append(f"{' '.join(cmd[1:])}: died with exit {p.returncode} (a crash, not an error)")
                elif opt not in out:
                    first = next((l for l in out.splitlines() if l.strip()), "")
                    failures.append(f"{' '.join(cmd[1:])}: exit {p.returncode}, but the message does not name {opt}: {first[:160]}")
    print(f"{runs} bad values over {len(BASE)} subcommands")
    for f in failures:
        print("FAIL:", f)
    print("PASS" if not failures else f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
