#!/usr/bin/env python3
"""Whole-engine speed on this machine: prefill tokens/s at 512, 2K, 8K and 32K tokens and decode
tokens/s at 1K, 8K and 32K context, with peak RSS, for xctx (fp16 and quantized caches) and
llama.cpp (fp16 KV with flash attention off and on, q8_0 and q4_0 KV) on the same GGUF, the
same token ids and the same thread count, in the same run.

    benchmarks/install-llama-native            # once: llama.cpp built from source for this CPU
    python3 benchmarks/engine_speed.py [--threads 2] [--repeat 2] [--only 'prefill 8K,decode @8K']
        [--xctx-caches fp16,kivi4,nuq3-1%] [--llama-kv f16,f16+fa,q8_0+fa,q4_0+fa]
        [--prefill-from-decode]    # 'prefill N' from the prefill of the 'decode @N' run

llama.cpp runs in the interpreter of build-llama-native/venv (made by install-llama-native)
when it exists, else in --llama-python (any interpreter with llama-cpp-python), else not at all.
Writes benchmarks/results/engine_speed.{csv,md}; the Markdown names the llama.cpp version, how
it was built and its system-info line. Each (configuration, engine) runs in a fresh process (so
peak RSS is its own); the best of --repeat runs is reported, with the slowest in parentheses; the repeats of all
engines of a configuration are interleaved (A B C, A B C), never all of one engine first.
Contexts past the model's trained 8K use linear RoPE scaling in both engines (speed does not
depend on it; both engines refuse or degrade without it).
"""
import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hostinfo  # noqa: E402
import roofline  # noqa: E402
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "data"))
NATIVE = os.path.join(ROOT, "build-llama-native")
TRAINED_CTX = 8192  # SmolLM2-135M

# (label, prompt tokens, decode steps, what is measured)
CONFIGS = [
    ("prefill 512", 512, 0, "prefill"),
    ("prefill 2K", 2048, 0, "prefill"),
    ("prefill 8K", 8192, 0, "prefill"),
    ("prefill 32K", 32768, 0, "prefill"),
    ("decode @1K", 1024 - 64, 64, "decode"),
    ("decode @8K", 8192 - 64, 64, "decode"),
    ("decode @32K", 32768 - 64, 64, "decode"),
]

# llama.cpp KV variants: name -> (type_k = type_v as a GGML type id, flash attention). llama.cpp
# quantizes V only with flash attention on, so the quantized variants run with it.
LLAMA_KV = {"f16": (1, False), "f16+fa": (1, True), "q8_0+fa": (8, True), "q4_0+fa": (2, True)}

LLAMA_TOKENIZE = r"""
import json, sys
from llama_cpp import Llama
model, text_file, out = sys.argv[1], sys.argv[2], sys.argv[3]
tok = Llama(model_path=model, vocab_only=True, verbose=False)
json.dump(tok.tokenize(open(text_file, "rb").read(), add_bos=True), open(out, "w"))
"""

LLAMA_RUNNER = r"""
import json, sys, time
import numpy as np
import llama_cpp
from llama_cpp import Llama
o = json.loads(sys.argv[1])
ids = json.load(open(o["ids_file"]))[:o["n_prompt"]]
n_gen = o["n_gen"]
extra = {}
if not o["repack"]:
    # Weights in the file's own layout: no extra buffer types (the repacked / AMX copies). Llama()
    # has no argument for it, so the default model parameters it starts from are changed.
    default_params = llama_cpp.llama_cpp.llama_model_default_params
    def no_extra_bufts():
        p = default_params()
        p.use_extra_bufts = False
        return p
    llama_cpp.llama_cpp.llama_model_default_params = no_extra_bufts
if o["rope_factor"] > 1:
    extra = dict(rope_scaling_type=llama_cpp.LLAMA_ROPE_SCALING_TYPE_LINEAR, rope_freq_scale=1.0 / o["rope_factor"])
llm = Llama(model_path=o["model"], n_ctx=len(ids) + n_gen + 8, n_batch=512, n_ubatch=512, n_threads=o["threads"],
            n_threads_batch=o["threads"], flash_attn=o["flash_attn"], type_k=o["type_kv"], type_v=o["type_kv"],
            verbose=False, **extra)
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


def can_import_llama(python):
    if not python or not os.access(python, os.X_OK):
        return False
    return subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0


def llama_build_info(python):
    """What llama.cpp is measured: the native build's record, else what the interpreter reports."""
    info_file = os.path.join(NATIVE, "info.json")
    # abspath, not realpath: a venv's python is a link to the interpreter it was made from.
    if os.path.abspath(python).startswith(os.path.abspath(NATIVE) + os.sep) and os.path.exists(info_file):
        return json.load(open(info_file))
    out = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__); "
                          "print(llama_cpp.llama_print_system_info().decode().strip())"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    return {"llama_cpp_python": out[0], "cmake_args": "prebuilt wheel (not built here)", "system_info": out[1]}


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            return set(next(l.split(":", 1)[1].split() for l in f if l.startswith("flags")))
    except (OSError, StopIteration):
        return set()


def source_commit():
    """HEAD of this checkout, marked when tracked files differ from it (the binary may too)."""
    git = lambda *a: subprocess.run(["git", "-C", ROOT, *a], capture_output=True, text=True).stdout.strip()
    try:
        commit = git("rev-parse", "--short", "HEAD") or "?"
        return commit + (" + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except OSError:
        return "?"


def xctx_build_type():
    try:
        with open(os.path.join(ROOT, "build", "CMakeCache.txt")) as f:
            return next((l.split("=", 1)[1].strip() for l in f if l.startswith("CMAKE_BUILD_TYPE:")), "?")
    except OSError:
        return "?"


def run_json(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"engine_speed: {' '.join(cmd[:3])} ... failed ({p.returncode}):\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def rope_factor(n_ctx):
    return max(1, math.ceil(n_ctx / TRAINED_CTX))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--xctx", default=os.path.join(ROOT, "build", "xctx"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--calib", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.calib"),
                    help="calibration file for xctx's nuq caches")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated config labels to run")
    ap.add_argument("--xctx-caches", default="fp16,kivi4,nuq3-1%")
    ap.add_argument("--llama-kv", default=",".join(LLAMA_KV), help="llama.cpp KV variants: " + ", ".join(LLAMA_KV))
    ap.add_argument("--llama-python", default="",
                    help="interpreter with llama-cpp-python (default: build-llama-native's, else this one)")
    ap.add_argument("--out", default="engine_speed", help="results file stem in benchmarks/results")
    ap.add_argument("--prefill-from-decode", action="store_true",
                    help="also report each decode run's prefill (64 tokens short of the prefill row's "
                         "prompt) as that length's prefill row, instead of a second long prefill")
    ap.add_argument("--llama-repack", choices=("auto", "on", "off"), default="auto",
                    help="llama.cpp's repacked weight copies (extra buffer types); auto: off on CPUs with AMX, "
                         "where llama-cpp-python 0.3.36's AMX path crashes on Q4_1 weights (SIGSEGV, 2026-11-29)")
    ap.add_argument("--merge", nargs="*", default=[],
                    help="instead of measuring, write the results from the JSON rows in these logs")
    args = ap.parse_args()
    args.repack = args.llama_repack == "on" or (args.llama_repack == "auto" and "amx_tile" not in cpu_flags())
    caches = [c for c in args.xctx_caches.split(",") if c]
    kvs = [k for k in args.llama_kv.split(",") if k]
    for k in kvs:
        if k not in LLAMA_KV:
            sys.exit(f"engine_speed: unknown llama.cpp KV variant '{k}' (known: {', '.join(LLAMA_KV)})")

    python = args.llama_python or os.path.join(NATIVE, "venv", "bin", "python")
    if not can_import_llama(python):
        python = sys.executable if not args.llama_python and can_import_llama(sys.executable) else ""
    if not python and kvs:
        print("no llama-cpp-python (run benchmarks/install-llama-native): measuring xctx only", file=sys.stderr)
    info = llama_build_info(python) if python and kvs else None

    if args.merge:
        rows = [json.loads(l) for f in args.merge for l in open(f) if l.startswith('{"config"')]
        write_results(rows, args, info)
        return

    import austen_text
    text = "\n\n".join(austen_text.novels().values())
    tmp = tempfile.mkdtemp(prefix="xctx-bench-")
    text_file = os.path.join(tmp, "austen.txt")
    open(text_file, "w").write(text)
    ids_file = os.path.join(tmp, "ids.json")
    if info:
        # Same ids as xctx: the xctx tokenizer is golden-tested against llama.cpp's.
        subprocess.run([python, "-c", LLAMA_TOKENIZE, args.model, text_file, ids_file], check=True)
        n_ids = len(json.load(open(ids_file)))
        if n_ids < max(c[1] for c in CONFIGS):
            sys.exit(f"engine_speed: the text has {n_ids} tokens, fewer than the longest prompt")

    rows = []
    for label, n_prompt, n_gen, kind in CONFIGS:
        if args.only and label not in args.only.split(","):
            continue
        key = "prefill_tok_s" if kind == "prefill" else "decode_tok_s"
        n_ctx = n_prompt + n_gen
        f = rope_factor(n_ctx)
        engines = [("xctx", c) for c in caches] + ([("llama.cpp", k) for k in kvs] if info else [])
        # Every engine's command first; then the repeats interleaved (A B C, A B C, ...) so a change
        # in the machine's load or clock falls on all of them alike, not on whichever ran last.
        cmds = []
        for engine, variant in engines:
            if engine == "xctx":
                # --prefill exact: auto picks star (block-local attention) from 32K tokens, which is
                # not the computation llama.cpp does.
                cmd = [args.xctx, "bench", "--model", args.model, "--text", text_file, "--prompt-tokens", str(n_prompt),
                       "--gen-tokens", str(n_gen), "--threads", str(args.threads), "--cache", variant,
                       "--ctx", str(n_ctx + 8), "--prefill", "exact"]
                if variant.startswith("nuq"):
                    cmd += ["--calib", args.calib]
                if f > 1:
                    cmd += ["--rope-scaling", "linear", "--rope-factor", str(f)]
            else:
                type_kv, fa = LLAMA_KV[variant]
                opts = {"model": args.model, "ids_file": ids_file, "n_prompt": n_prompt, "n_gen": n_gen,
                        "threads": args.threads, "type_kv": type_kv, "flash_attn": fa, "rope_factor": f,
                        "repack": args.repack}
                cmd = [python, "-c", LLAMA_RUNNER, json.dumps(opts)]
            cmds.append(cmd)
        all_runs = [[] for _ in engines]
        for _ in range(args.repeat):
            for i, cmd in enumerate(cmds):
                all_runs[i].append(run_json(cmd))
        for (engine, variant), runs in zip(engines, all_runs):
            row = {"config": label, "kind": kind, "prompt_tokens": n_prompt, "gen_tokens": n_gen, "engine": engine,
                   "variant": variant, "tok_s": max(x[key] for x in runs), "tok_s_min": min(x[key] for x in runs),
                   "peak_rss_mib": max(x["peak_rss_bytes"] for x in runs) / 2**20}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            # The decode run prefilled n_prompt tokens first: at 32K that prefill is the expensive
            # part (an hour for llama.cpp's q4_0 KV on 2 cores), so it need not run twice.
            twin = next((c[0] for c in CONFIGS if c[3] == "prefill" and c[1] == n_ctx), None)
            if args.prefill_from_decode and kind == "decode" and twin:
                prow = dict(row, config=twin, kind="prefill", gen_tokens=0, from_decode_run=True,
                            tok_s=max(x["prefill_tok_s"] for x in runs),
                            tok_s_min=min(x["prefill_tok_s"] for x in runs))
                rows.append(prow)
                print(json.dumps(prow), file=sys.stderr, flush=True)
    write_results(rows, args, info)


def write_results(rows, args, info):
    out_dir = os.path.join(HERE, "results")
    os.makedirs(out_dir, exist_ok=True)
    order = [c[0] for c in CONFIGS]
    rows.sort(key=lambda r: order.index(r["config"]))
    with open(os.path.join(out_dir, args.out + ".csv"), "w", newline="") as f:
        fields = list(dict.fromkeys(k for r in rows for k in r))  # a row may carry from_decode_run
        w = csv.DictWriter(f, fieldnames=fields, restval="")
        w.writeheader()
        w.writerows(rows)
    cpu, flags = hostinfo.cpu_identity(), set()  # model, family/model/stepping, cores, ISA
    try:
        lines = open("/proc/cpuinfo").read().splitlines()
        flags = set(next(l.split(":", 1)[1].split() for l in lines if l.startswith("flags")))
    except (OSError, StopIteration):
        pass
    isa = ", ".join(f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_vbmi", "avx_vnni", "amx_tile")
                    if f in flags) or "unknown"
    md = os.path.join(out_dir, args.out + ".md")
    with open(md, "w") as f:
        f.write(f"# Engine speed: SmolLM2-135M-Instruct Q4_1, {args.threads} threads, {cpu}\n\n")
        only = f" --only '{args.only}'" if args.only else ""
        f.write("Command: `python3 benchmarks/engine_speed.py --threads %d --repeat %d%s`; best of %d runs "
                "(slowest in parentheses), each in a fresh process. `vs xctx fp16`: this engine's tok/s "
                "over xctx's with its fp16 cache in the same configuration.\n\n"
                % (args.threads, args.repeat, only, args.repeat))
        f.write(f"CPU: {cpu}, {os.cpu_count()} cores; ISA extensions: {isa} (xctx picks its kernels at run time).\n\n")
        f.write(f"xctx: commit {source_commit()}, build {xctx_build_type()}.\n\n")
        if info:
            f.write(f"llama.cpp: llama-cpp-python {info['llama_cpp_python']} (ggml {info.get('ggml', '?')}), "
                    f"{info['cmake_args']}; {info.get('compiler', '')}\n\n")
            f.write(f"llama.cpp system info: `{info['system_info']}`; weight repacking (extra buffer types) "
                    f"{'on' if args.repack else 'off'} (`--llama-repack {args.llama_repack}`)\n\n")
        f.write("| config | engine | cache | tok/s | vs xctx fp16 | peak RSS |\n|---|---|---|---|---|---|\n")
        for r in rows:
            base = next((b["tok_s"] for b in rows if b["config"] == r["config"] and b["engine"] == "xctx"
                         and b["variant"] == "fp16"), None)
            ratio = f"{r['tok_s'] / base:.2f}" if base else "-"
            mark = " †" if r.get("from_decode_run") else ""
            f.write(f"| {r['config']}{mark} | {r['engine']} | {r['variant']} | {r['tok_s']:.1f} ({r['tok_s_min']:.1f}) | "
                    f"{ratio} | {r['peak_rss_mib']:.0f} MiB |\n")
        limits = roofline.load_limits()
        if limits:
            # Against this host's limits (benchmarks/roofline.py): a decode token streams every weight
            # byte once (the GGUF's size, embeddings included), so read bandwidth caps tok/s; a prompt
            # token costs 2 flops per weight at best, so the fp32 FMA peak caps prefill tok/s.
            weight_bytes = os.path.getsize(args.model)
            n_params = 134.5e6  # SmolLM2-135M, tied embeddings counted once
            decode_cap = limits["read_gbs_all"] * 1e9 / weight_bytes
            prefill_cap = limits["fma_gflops_all"] * 1e9 / (2 * n_params)
            f.write(f"\nAgainst this host's limits (benchmarks/results/roofline_{roofline.host_key()}.md): decode "
                    f"{limits['read_gbs_all']:.1f} GB/s / {weight_bytes / 1e6:.0f} MB of weights = {decode_cap:.0f} "
                    f"tok/s; prefill {limits['fma_gflops_all']:.0f} GFLOP/s fp32 / (2 x {n_params / 1e6:.1f}M "
                    f"weights) = {prefill_cap:.0f} tok/s (attention not counted).\n\n"
                    "| config | engine | cache | tok/s | of the limit |\n|---|---|---|---|---|\n")
            for r in rows:
                kind = next(c[3] for c in CONFIGS if c[0] == r["config"])
                cap = decode_cap if kind == "decode" else prefill_cap
                f.write(f"| {r['config']} | {r['engine']} | {r['variant']} | {r['tok_s']:.1f} | {r['tok_s'] / cap:.0%} |\n")
        else:
            f.write("\nNo committed limits for this host (run benchmarks/roofline.py first): no fractions.\n")
        if any(r.get("from_decode_run") for r in rows):
            f.write("\n† the prefill of the decode run of the same length: its prompt is 64 tokens shorter "
                    "(`--prefill-from-decode`).\n")
        # Per configuration: xctx's fp16 cache against llama.cpp's fastest KV setting of the run.
        summary = []
        for label in order:
            mine = next((r for r in rows if r["config"] == label and r["engine"] == "xctx" and r["variant"] == "fp16"),
                        None)
            theirs = [r for r in rows if r["config"] == label and r["engine"] == "llama.cpp"]
            if mine and theirs:
                best = max(theirs, key=lambda r: r["tok_s"])
                summary.append(f"| {label} | {mine['tok_s']:.1f} | {best['tok_s']:.1f} ({best['variant']}) | "
                               f"{mine['tok_s'] / best['tok_s']:.2f} |\n")
        if summary:
            f.write("\nxctx (fp16 cache) against llama.cpp's faster setting in the same run:\n\n"
                    "| config | xctx tok/s | llama.cpp best tok/s | xctx / best |\n|---|---|---|---|\n")
            f.writelines(summary)
    print(open(md).read())


if __name__ == "__main__":
    main()
