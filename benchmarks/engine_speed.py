#!/usr/bin/env python3
"""Whole-engine speed on this machine: prefill tokens/s at 512, 2K and 8K tokens and decode
tokens/s at 1K and 8K context, with peak RSS, for xctx and (when llama-cpp-python is installed)
llama.cpp on the same GGUF, the same token ids and the same thread count, in the same run.

    python3 benchmarks/engine_speed.py [--xctx build/xctx] [--model models/...gguf] [--threads 2] [--repeat 3]

Writes benchmarks/results/engine_speed.{csv,md}. Each configuration runs in a fresh process
(so peak RSS is per configuration); the best of --repeat runs is reported, with the spread.
"""
import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "data"))

# (label, prompt tokens, decode steps, what is measured)
CONFIGS = [
    ("prefill 512", 512, 0, "prefill"),
    ("prefill 2K", 2048, 0, "prefill"),
    ("prefill 8K", 8192, 0, "prefill"),
    ("decode @1K", 1024 - 64, 64, "decode"),
    ("decode @8K", 8192 - 64, 64, "decode"),
]

LLAMA_RUNNER = r"""
import json, resource, sys, time
import numpy as np
import llama_cpp
from llama_cpp import Llama
model, ids_file, n_gen, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
ids = json.load(open(ids_file))
llm = Llama(model_path=model, n_ctx=len(ids) + n_gen + 8, n_batch=512, n_ubatch=512, n_threads=threads,
            n_threads_batch=threads, verbose=False)
n_vocab = llm.n_vocab()
def last_logits():  # the last evaluated token's logits, straight from the context
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
t0 = time.perf_counter(); llm.eval(ids); t1 = time.perf_counter()
for _ in range(n_gen):
    llm.eval([int(np.argmax(last_logits()))])
t2 = time.perf_counter()
with open("/proc/self/status") as f:
    hwm = [int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM")][0]
print(json.dumps({"engine": "llama.cpp", "prompt_tokens": len(ids), "gen_tokens": n_gen, "prefill_s": t1 - t0,
                  "prefill_tok_s": len(ids) / (t1 - t0), "decode_s": t2 - t1,
                  "decode_tok_s": n_gen / (t2 - t1) if n_gen else 0.0, "peak_rss_bytes": hwm}))
"""


def have_llama_cpp():
    try:
        import llama_cpp  # noqa: F401
        return True
    except ImportError:
        return False


def run_json(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--xctx", default=os.path.join(ROOT, "build", "xctx"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated config labels to run")
    ap.add_argument("--merge", nargs="*", default=[],
                    help="instead of measuring, write the results from the JSON rows in these logs")
    args = ap.parse_args()
    if args.merge:
        rows = [json.loads(l) for f in args.merge for l in open(f) if l.startswith('{"config"')]
        order = [c[0] for c in CONFIGS]
        rows.sort(key=lambda r: order.index(r["config"]))
        write_results(rows, args.threads, args.repeat, "llama_tok_s" in rows[0])
        return

    import austen_text
    text = "\n\n".join(austen_text.novels().values())
    tmp = tempfile.mkdtemp(prefix="xctx-bench-")
    text_file = os.path.join(tmp, "austen.txt")
    open(text_file, "w").write(text)

    llama = have_llama_cpp()
    if not llama:
        print("llama-cpp-python not installed: measuring xctx only", file=sys.stderr)
    rows = []
    for label, n_prompt, n_gen, kind in CONFIGS:
        if args.only and label not in args.only.split(","):
            continue
        xs = [run_json([args.xctx, "bench", "--model", args.model, "--text", text_file, "--prompt-tokens",
                        str(n_prompt), "--gen-tokens", str(n_gen), "--threads", str(args.threads)])
              for _ in range(args.repeat)]
        row = {"config": label, "kind": kind, "prompt_tokens": n_prompt, "gen_tokens": n_gen}
        key = "prefill_tok_s" if kind == "prefill" else "decode_tok_s"
        row["xctx_tok_s"] = max(x[key] for x in xs)
        row["xctx_tok_s_min"] = min(x[key] for x in xs)
        row["xctx_peak_rss_mib"] = max(x["peak_rss_bytes"] for x in xs) / 2**20
        if llama:
            # Same ids as xctx: the xctx tokenizer is golden-tested against llama.cpp's.
            from llama_cpp import Llama
            tok = Llama(model_path=args.model, vocab_only=True, verbose=False)
            ids = tok.tokenize(text.encode(), add_bos=True)
            ids = (ids * (1 + n_prompt // len(ids)))[:n_prompt]
            ids_file = os.path.join(tmp, "ids.json")
            json.dump(ids, open(ids_file, "w"))
            ls = [run_json([sys.executable, "-c", LLAMA_RUNNER, args.model, ids_file, str(n_gen), str(args.threads)])
                  for _ in range(args.repeat)]
            row["llama_tok_s"] = max(x[key] for x in ls)
            row["llama_tok_s_min"] = min(x[key] for x in ls)
            row["llama_peak_rss_mib"] = max(x["peak_rss_bytes"] for x in ls) / 2**20
            row["xctx_over_llama"] = row["xctx_tok_s"] / row["llama_tok_s"]
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)

    write_results(rows, args.threads, args.repeat, llama)


def write_results(rows, threads, repeat, llama):
    out_dir = os.path.join(HERE, "results")
    os.makedirs(out_dir, exist_ok=True)
    fields = list(rows[0].keys())
    with open(os.path.join(out_dir, "engine_speed.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    cpu = platform.processor() or "cpu"
    try:
        cpu = [l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")][0]
    except (OSError, IndexError):
        pass
    with open(os.path.join(out_dir, "engine_speed.md"), "w") as f:
        f.write(f"# Engine speed: SmolLM2-135M-Instruct Q4_1, {threads} threads, {cpu}\n\n")
        f.write("Command: `python3 benchmarks/engine_speed.py --threads %d --repeat %d`; best of %d runs "
                "(slowest in parentheses), each in a fresh process; fp16 cache for both engines.\n\n"
                % (threads, repeat, repeat))
        if llama:
            f.write("| config | xctx tok/s | llama.cpp tok/s | xctx / llama.cpp | xctx peak RSS | llama.cpp peak RSS |\n")
            f.write("|---|---|---|---|---|---|\n")
            for r in rows:
                f.write(f"| {r['config']} | {r['xctx_tok_s']:.1f} ({r['xctx_tok_s_min']:.1f}) | "
                        f"{r['llama_tok_s']:.1f} ({r['llama_tok_s_min']:.1f}) | {r['xctx_over_llama']:.2f} | "
                        f"{r['xctx_peak_rss_mib']:.0f} MiB | {r['llama_peak_rss_mib']:.0f} MiB |\n")
        else:
            f.write("| config | xctx tok/s | xctx peak RSS |\n|---|---|---|\n")
            for r in rows:
                f.write(f"| {r['config']} | {r['xctx_tok_s']:.1f} ({r['xctx_tok_s_min']:.1f}) | "
                        f"{r['xctx_peak_rss_mib']:.0f} MiB |\n")
    print(open(os.path.join(out_dir, "engine_speed.md")).read())


if __name__ == "__main__":
    main()
