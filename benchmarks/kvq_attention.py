#!/usr/bin/env python3
"""Decode-attention throughput of the quantized KV caches against fp16 and the memory ceiling.

    python3 benchmarks/kvq_attention.py [--quick] [--binary build/benchmarks/bench_kvq_attention]

Runs bench_kvq_attention (one SmolLM2-geometry layer of synthetic keys/values per format and
shard length, one decode query, CPU backend, all threads and 1 thread): the decode step (the
fused one-query kernel for the quantized formats), the same query through the tiled kernel,
and the memory ceilings; derives bandwidths and ratios, and writes
benchmarks/results/kvq_attention.{csv,md,png}. --quick measures 8K and 64K tokens only (the full
run adds 512K). Everything compared is measured in the same run.
"""
import argparse
import csv
import datetime
import io
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hostinfo  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

MiB = 1 << 20


def uptime():
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return open("/proc/loadavg").read().strip()


def cpu_flags():
    """The SIMD extensions the kernels choose between, as /proc/cpuinfo lists them."""
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            return ", ".join(f for f in ("avx2", "avx512f", "avx512vbmi", "avx512_vnni", "avx_vnni", "amx_tile")
                             if f in have) or "none of avx2/avx512/vnni/amx"
    return "unknown"


def token_label(n):
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def derive(rows):
    """Adds the bandwidths and ratios to the raw rows (all against the same run's numbers)."""
    fp16 = {(r["tokens"], r["threads"]): r["attend_ms"] for r in rows if r["format"] == "fp16"}
    for r in rows:
        s = r["attend_ms"] / 1e3
        r["bytes_per_token"] = r["bytes_used"] / r["tokens"]
        r["compression_vs_fp16"] = r["fp16_bytes"] / r["bytes_used"]
        r["GBps"] = r["bytes_used"] / s / 1e9
        r["effective_GBps"] = r["fp16_bytes"] / s / 1e9
        r["time_vs_fp16"] = r["attend_ms"] / fp16[(r["tokens"], r["threads"])]
        r["frac_memcpy_ceiling"] = r["GBps"] / r["memcpy_read_GBps"]
        r["frac_read_ceiling"] = r["GBps"] / r["read_GBps"]
        # What the call would take if it only had to stream its bytes at the read ceiling.
        r["read_floor_ms"] = r["bytes_used"] / (r["read_GBps"] * 1e9) * 1e3
        r["fused_speedup"] = r["tiled_ms"] / r["attend_ms"]
        r["decode_GBps"] = None if r["decode_ms"] is None else r["bytes_used"] / (r["decode_ms"] / 1e3) / 1e9
    return rows


def parse(out):
    meta, lines = [], []
    for line in out.splitlines():
        (meta if line.startswith("#") else lines).append(line)
    rows = []
    for r in csv.DictReader(io.StringIO("\n".join(lines))):
        row = {}
        for k, v in r.items():
            if k == "format":
                row[k] = v
            elif v == "":
                row[k] = None
            elif k in ("tokens", "threads", "bytes_used", "fp16_bytes", "key_outliers", "rounds"):
                row[k] = int(v)
            else:
                row[k] = float(v)
        rows.append(row)
    return meta, rows


def fmt(x, spec):
    return "–" if x is None else format(x, spec)


def build_flags(binary):
    """The build type and flags of the binary's CMake tree (build/benchmarks/X -> build/CMakeCache.txt)."""
    cache = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(binary))), "CMakeCache.txt")
    vals = {}
    try:
        with open(cache) as f:
            for line in f:
                key, _, val = line.strip().partition("=")
                vals[key.split(":")[0]] = val
    except OSError:
        return "unknown (no CMakeCache.txt beside the binary)"
    btype = vals.get("CMAKE_BUILD_TYPE", "?")
    flags = " ".join(x for x in (vals.get("CMAKE_CXX_FLAGS", ""), vals.get(f"CMAKE_CXX_FLAGS_{btype.upper()}", "")) if x)
    native = "-march=native" if vals.get("XCTX_NATIVE", "OFF").upper() in ("ON", "1", "TRUE") else \
        "portable x86-64 with run-time AVX2/AVX-512 dispatch"
    return f"{btype} ({flags or 'no extra flags'}), {native}"


def write_markdown(path, rows, meta, info):
    out = []
    w = out.append
    w("# Decode attention over quantized KV caches (CPU)\n")
    w(f"Command: `{info['command']}`  ")
    w(f"Date: {info['date']}; commit {info['commit']}; {info['cpu']}; "
      f"isa {info['isa']}, fused decode kernel {info['fused_isa']}; CPU flags: {info['cpu_flags']}.  ")
    w(f"Build: {info['build']}.  ")
    w(f"Load before: `{info['uptime_before']}`  ")
    w(f"Load after: `{info['uptime_after']}`  ")
    w(f"Run time: {info['seconds']:.0f} s. Involuntary context switches per (length, threads) block "
      f"(other work on the 2 cores shows up here): {info['switches']}.\n")
    w("**Setup.** One layer of SmolLM2-135M geometry (9 heads, 3 kv heads, head_dim 64, RoPE base 1e5, "
      "n_rot 64) filled with seeded synthetic keys/values: pre-RoPE keys with 4 large-magnitude outlier "
      "channels per kv head (|mean| 4–8) and Student-t(4) tails on every 8th channel, Gaussian values. "
      "The nuq formats use a calibration fitted on a separate 16K-token sample of the same distribution "
      "(per-channel min/max, or 0.5%/99.5% quantiles for -1%; k-means datatypes, unweighted). One decode "
      "query at the position after the last key, `kv_cache::attend` on the CPU backend. Each timed call "
      "starts with cold caches (a 128 MiB buffer is read first, 4x the LLC), as in a real model where the "
      "other layers evict this one between decode steps. Median of the rounds after a warm-up round; "
      "formats are timed round-robin so load changes hit all of them alike." +
      (f" **SelfExtend G {info['selfextend']}, window 1024:** keys farther than 1024 positions from the "
       "query attend at floor(pos / G), as in the runs past the model's trained context; the quantized "
       "formats' fused kernel then turns the query once per shared rotation instead of rotating each key, "
       "while fp16 (post-RoPE keys) re-rotates every far key through the tiled path, so the *vs fp16* "
       "column compares two different code paths here." if info["selfextend"] > 1 else "") + "\n")
    w("**What is counted.** *bytes* = `bytes_used()` of the one-layer cache: packed K/V codes, "
      "fp16 scales/zeros, per-layer tables (nuq LUTs, key channel scale/zero, -1% thresholds), sparse "
      "outliers (values + indices + per-token offsets), the fp16 attention-sink row (nuq), and int32 "
      "positions (4 B/token, which the kernels only touch at tile boundaries). No kivi residual window "
      "(lengths are multiples of the 128-token group). *GB/s* = bytes / time. *effective GB/s* = the fp16 "
      "cache's bytes for the same tokens / time, i.e. how fast the format delivers attention in fp16 terms. "
      "*vs fp16* = time / fp16 time (below 1 = faster). Ceilings, measured per block in the same run: "
      "*memcpy* = 512 MiB copied per thread-split memcpy, reported as bytes copied / time (GB/s read); "
      "*read* = a read-only stream of the same buffer. *% memcpy*, *% read* = GB/s / ceiling.\n")
    w("**The two kernels.** *decode step* = `attend_path::attend_decode`, what a generated token pays: "
      "for the quantized formats the fused one-query kernel (kernels/cpu/kvq/kvq_fused_avx2.cpp, or its 16-lane "
      "variant kvq_fused_avx512.cpp on CPUs with AVX-512 VBMI, as named above: codes unpacked, "
      "looked up and scaled in registers, RoPE as one query rotation per 256-position unit plus a static "
      "per-offset key rotation, value scales folded into the probabilities, outliers as dense-and-sparse "
      "corrections). *tiled* = the same query through the tiled kernel the prefill path uses (each unit "
      "decoded to f32 with outliers patched and keys rotated, then the f32 attention core). *decode* and "
      "*math* are the tiled kernel's two halves timed alone: codes to f32 tiles (no RoPE) with cold caches, "
      "and the attention core on f32 tiles already in cache (format-independent). *read floor* = bytes / "
      "read ceiling, the time a purely bandwidth-bound kernel would need.\n")
    key = sorted({(r["threads"], r["tokens"]) for r in rows}, key=lambda t: (-t[0], t[1]))
    for threads, tokens in key:
        sel = [r for r in rows if r["threads"] == threads and r["tokens"] == tokens]
        c = sel[0]
        w(f"\n## {token_label(tokens)} tokens, {threads} thread{'s' if threads > 1 else ''}\n")
        w(f"Ceilings: memcpy {c['memcpy_read_GBps']:.1f} GB/s read, read stream {c['read_GBps']:.1f} GB/s; "
          f"math (f32 tiles in cache) {c['math_ms']:.3f} ms.\n")
        w("| format | B/token | MiB | decode step ms | GB/s | % memcpy | % read | effective GB/s | vs fp16 | "
          "read floor ms | tiled ms | tiled / fused | decode ms | K err | V err |")
        w("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in sel:
            w(f"| {r['format']} | {r['bytes_per_token']:.1f} | {r['bytes_used'] / MiB:.2f} | {r['attend_ms']:.3f} | "
              f"{r['GBps']:.1f} | {100 * r['frac_memcpy_ceiling']:.0f}% | {100 * r['frac_read_ceiling']:.0f}% | "
              f"{r['effective_GBps']:.1f} | {r['time_vs_fp16']:.2f} | {r['read_floor_ms']:.3f} | "
              f"{r['tiled_ms']:.3f} | {r['fused_speedup']:.2f} | {fmt(r['decode_ms'], '.3f')} | "
              f"{r['k_rel_err']:.3f} | {r['v_rel_err']:.3f} |")
    w("\n*K err, V err*: RMS reconstruction error of the decoded pre-RoPE keys / values of the first 8K "
      "tokens over their RMS deviation from the channel mean (a sanity check that data and calibration "
      "fit; synthetic data, not a quality result).\n")
    w("\n![kvq attention](kvq_attention.png)\n")
    open(path, "w").write("\n".join(out) + "\n")


def plot(path, rows):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    threads = sorted({r["threads"] for r in rows}, reverse=True)
    tokens = sorted({r["tokens"] for r in rows})
    fig, axes = plt.subplots(len(threads), len(tokens), figsize=(5.2 * len(tokens), 4.2 * len(threads)),
                             squeeze=False)
    for i, th in enumerate(threads):
        for j, n in enumerate(tokens):
            ax = axes[i][j]
            sel = [r for r in rows if r["threads"] == th and r["tokens"] == n]
            names = [r["format"] for r in sel]
            x = range(len(sel))
            xs = list(x)
            ax.bar([i - 0.2 for i in xs], [r["tiled_ms"] for r in sel], width=0.4, color="tab:orange",
                   label="tiled kernel (decode to f32, then attend)")
            ax.bar([i + 0.2 for i in xs], [r["attend_ms"] for r in sel], width=0.4, color="tab:blue",
                   label="decode step (fused for quantized formats)")
            ax.scatter(xs, [r["read_floor_ms"] for r in sel], marker="v", color="red", zorder=3,
                       label="read floor (bytes / read ceiling)")
            ax.axhline(sel[0]["attend_ms"], color="tab:gray", ls="--", lw=1)
            ax.set_xticks(list(x))
            ax.set_xticklabels(names, rotation=60, ha="right", fontsize=8)
            ax.set_title(f"{token_label(n)} tokens, {th} thread{'s' if th > 1 else ''}")
            ax.set_ylabel("ms per decode attend (one layer)")
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    fig.suptitle("Decode attention per format: fused vs tiled kernel, fp16 (dashed) and the read-bandwidth floor")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", default=os.path.join(ROOT, "build", "benchmarks", "bench_kvq_attention"))
    ap.add_argument("--quick", action="store_true", help="8K and 64K tokens only")
    ap.add_argument("--threads", help="comma list passed to the binary (default: all, then 1)")
    ap.add_argument("--rounds", type=int, help="timed rounds per block (default: by length)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "kvq_attention"), help="path prefix")
    ap.add_argument("--selfextend", type=int, default=1,
                    help="SelfExtend group G (window 1024): keys past the window attend at floor(pos / G), as "
                         "the long runs past the trained context do (1: off)")
    ap.add_argument("--no-avx512", action="store_true",
                    help="keep the fused kernel on AVX2 (XCTX_NO_AVX512=1) on a CPU that has AVX-512")
    args = ap.parse_args()
    env = dict(os.environ)
    if args.no_avx512:
        env["XCTX_NO_AVX512"] = "1"

    cmd = [args.binary] + (["--quick"] if args.quick else [])
    if args.threads:
        cmd += ["--threads", args.threads]
    if args.rounds:
        cmd += ["--rounds", str(args.rounds)]
    if args.selfextend > 1:
        cmd += ["--selfextend", str(args.selfextend)]
    before = uptime()
    t0 = datetime.datetime.now()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    sys.stderr.write(res.stderr)
    if res.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed with exit code {res.returncode}")
    seconds = (datetime.datetime.now() - t0).total_seconds()
    after = uptime()
    meta, rows = parse(res.stdout)
    derive(rows)
    head = dict(x.split("=", 1) for x in meta[0][1:].split() if "=" in x) if meta else {}
    switches = ", ".join(
        f"{token_label(int(kv['tokens']))}/{kv['threads']}t: {kv['involuntary_switches']}"
        for kv in (dict(x.split("=", 1) for x in m[1:].split() if "=" in x) for m in meta if m.startswith("# block")))
    try:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        # A binary built from uncommitted sources is not the commit's: say so.
        if subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                          capture_output=True, text=True).stdout.strip():
            commit += " + uncommitted changes"
    except OSError:
        commit = "?"
    info = {
        "command": "python3 benchmarks/kvq_attention.py" + "".join(f" {a}" for a in sys.argv[1:]),
        "date": t0.strftime("%Y-%m-%d %H:%M"), "commit": commit or "?", "cpu": hostinfo.cpu_identity(),
        "cores": os.cpu_count(), "isa": head.get("isa", "?"), "fused_isa": head.get("fused_isa", "?"),
        "cpu_flags": cpu_flags(), "build": build_flags(args.binary),
        "uptime_before": before, "uptime_after": after,
        "seconds": seconds, "switches": switches, "selfextend": args.selfextend,
    }

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    cols = ["format", "tokens", "threads", "bytes_used", "bytes_per_token", "fp16_bytes", "compression_vs_fp16",
            "key_outliers", "attend_ms", "attend_min_ms", "GBps", "effective_GBps", "time_vs_fp16",
            "memcpy_read_GBps", "read_GBps", "frac_memcpy_ceiling", "frac_read_ceiling", "read_floor_ms",
            "tiled_ms", "fused_speedup", "decode_ms", "decode_GBps", "math_ms", "k_rel_err", "v_rel_err", "rounds"]
    with open(args.out + ".csv", "w", newline="") as f:
        wr = csv.writer(f)
        wr.writerow(cols)
        for r in rows:
            wr.writerow(["" if r[c] is None else (f"{r[c]:.6g}" if isinstance(r[c], float) else r[c]) for c in cols])
    write_markdown(args.out + ".md", rows, meta, info)
    plot(args.out + ".png", rows)
    print(f"wrote {args.out}.csv, .md, .png ({len(rows)} rows, {seconds:.0f} s)")


if __name__ == "__main__":
    main()
