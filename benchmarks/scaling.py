#!/usr/bin/env python3
"""Scaling across node counts: hosts are network namespaces (launch/netns-cluster) joined over
TCP on one machine; ranks within a host use shared memory. For nodes x ranks-per-node and each
cache format, strong scaling (a fixed context) and weak scaling (context = per-rank tokens x
ranks): prefill and decode time, bytes each rank sends per decoded token and per prefill
(against the formulas), and the seconds spent inside the collectives against the whole.

    sudo python3 benchmarks/scaling.py [--nodes 1,2,4] [--ranks-per-node 1,2]
        [--formats fp16,nuq3-1%,xquant-cl3] [--strong-context 16K] [--weak-per-rank 2K]
        [--gen 16] [--rate 1gbit]

Writes benchmarks/results/scaling.{csv,md,png}. All hosts share this machine's cores, so time
does not fall with ranks here (on 2 cores it rises); what the table shows is communication
volume and share, memory per rank, and that every layout gives bitwise the same logits.
Needs root for the namespaces (1 node runs without them).
"""
import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CLUSTER = os.path.join(ROOT, "launch", "netns-cluster")
MPIRUN = os.path.join(ROOT, "launch", "xctx-mpirun")
sys.path.insert(0, os.path.join(ROOT, "tests", "data"))


def count(text):
    text = str(text)
    mult = {"K": 1024, "k": 1024, "M": 1 << 20, "m": 1 << 20}.get(text[-1], 1)
    return int(text[:-1] if mult > 1 else text) * mult


def cpu_line():
    name = platform.processor() or "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
        flags = next(l for l in open("/proc/cpuinfo") if l.startswith("flags")).split()
        isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "amx_tile") if f in flags]
    except (OSError, StopIteration):
        isa = []
    return f"{name}, {os.cpu_count()} cores, ISA {' '.join(isa) or 'baseline'}"


def run_bench(args, nodes, rpn, fmt, context, text_file, hostfile):
    p = nodes * rpn
    cmd = [MPIRUN, "-np", str(p)]
    if hostfile:
        cmd += ["--hostfile", hostfile]
    cmd += [args.xctx, "bench", "--text", text_file, "--prompt-tokens", str(context), "--gen-tokens", str(args.gen),
            "--cache", fmt, "--prefill", "exact"]
    if fmt.startswith("nuq"):
        cmd += ["--calib", args.calib]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("OMP_NUM_THREADS", None)  # xctx-mpirun divides the cores among all ranks
    t0 = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if res.returncode != 0:
        raise SystemExit(f"scaling: {' '.join(cmd)} failed ({res.returncode}):\n{res.stderr[-2000:]}")
    j = json.loads(res.stdout.strip().splitlines()[-1])
    per = j["per_rank"]
    layers = j["n_layer"]
    gen = max(1, args.gen)
    exact_pb, olse_pb = j["partial_bytes_per_token_layer"], j["o_lse_bytes_per_token_layer"]
    used = [r["cache_used_bytes"] for r in per]
    # Ring: rank r sends its own shard, then each block it received, P-1 in all; summed over the
    # ranks that is (P-1) x all shards' exported bytes (here: their used bytes).
    ring_formula = (p - 1) * sum(used) / p if p > 1 else 0
    row = {
        "scaling": None, "format": fmt, "nodes": nodes, "ranks_per_node": rpn, "ranks": p, "context": context,
        "prefill_s": round(j["prefill_s"], 3),
        "decode_ms_per_token": round(1000 * j["decode_s"] / gen, 2),
        "prefill_comm_s": round(max(r["prefill_ring_s"] for r in per), 3),
        "decode_comm_ms_per_token": round(1000 * max(r["decode_gather_s"] for r in per) / gen, 3),
        "ring_bytes_per_rank": round(sum(r["ring_bytes_sent"] for r in per) / p),
        "ring_bytes_formula": round(ring_formula),
        "decode_bytes_sent_per_token": round(sum(r["decode_gather_bytes_sent"] for r in per) / p / gen),
        "decode_bytes_formula": layers * exact_pb if p > 1 else 0,
        "o_lse_bytes_per_token": layers * olse_pb if p > 1 else 0,
        "cache_bytes_max_rank": max(r["cache_allocated_bytes"] for r in per),
        "peak_rss_mib_max_rank": round(max(r["peak_rss_bytes"] for r in per) / 2**20, 1),
        "logits_fnv1a": j["logits_fnv1a"],
        "wall_s": round(time.time() - t0, 1),
    }
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--xctx", default=os.path.join(ROOT, "build", "xctx"))
    ap.add_argument("--calib", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.calib"))
    ap.add_argument("--nodes", default="1,2,4")
    ap.add_argument("--ranks-per-node", default="1,2")
    ap.add_argument("--formats", default="fp16,nuq3-1%,xquant-cl3")
    ap.add_argument("--strong-context", default="16K")
    ap.add_argument("--weak-per-rank", default="2K")
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--rate", default="", help="shape every host link (tc tbf), e.g. 1gbit")
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "scaling"))
    args = ap.parse_args()
    node_counts = [int(x) for x in args.nodes.split(",")]
    rpns = [int(x) for x in args.ranks_per_node.split(",")]
    formats = args.formats.split(",")
    strong, weak = count(args.strong_context), count(args.weak_per_rank)
    if max(node_counts) > 1 and os.geteuid() != 0:
        raise SystemExit("scaling: more than one node needs root (network namespaces); run with sudo or --nodes 1")

    import austen_text
    tmp = tempfile.mkdtemp(prefix="xctx-scaling-")
    text_file = os.path.join(tmp, "austen.txt")
    open(text_file, "w").write("\n\n".join(austen_text.novels().values()))
    os.environ["XCTX_NETNS_DIR"] = os.path.join(tmp, "netns")
    rows = []
    started = time.strftime("%Y-%m-%d %H:%M")
    try:
        for nodes in node_counts:
            hostfile = None
            for rpn in rpns:
                if nodes > 1:
                    up = [CLUSTER, "up", str(nodes), "--slots", str(rpn)] + (["--rate", args.rate] if args.rate else [])
                    subprocess.run(up, check=True, stdout=subprocess.DEVNULL)
                    hostfile = subprocess.run([CLUSTER, "hostfile"], check=True, capture_output=True,
                                              text=True).stdout.strip()
                for fmt in formats:
                    for kind, context in (("strong", strong), ("weak", weak * nodes * rpn)):
                        row = run_bench(args, nodes, rpn, fmt, context, text_file, hostfile)
                        row["scaling"] = kind
                        rows.append(row)
                        print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        subprocess.run([CLUSTER, "down"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    # Bitwise: within one format and context, every layout must give the same logits.
    ref = {}
    for r in rows:
        ref.setdefault((r["format"], r["context"]), r["logits_fnv1a"])
        r["logits_match"] = r["logits_fnv1a"] == ref[(r["format"], r["context"])]

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    with open(args.out + ".md", "w") as f:
        f.write("# Scaling across node counts (hosts as network namespaces, TCP between them)\n\n")
        f.write(f"Command: `python3 benchmarks/scaling.py --nodes {args.nodes} --ranks-per-node {args.ranks_per_node} "
                f"--formats {args.formats} --strong-context {args.strong_context} --weak-per-rank "
                f"{args.weak_per_rank} --gen {args.gen}{' --rate ' + args.rate if args.rate else ''}`  \n")
        f.write(f"Date: {started}; commit {commit}; {cpu_line()}; exact ring prefill; every host shares these "
                "cores (threads per rank = cores / all ranks).\n\n")
        f.write("*comm* = seconds inside the collectives on the slowest rank (transfer plus waiting for the "
                "others). *ring B/rank* = prefill bytes each rank sent (formula: (P-1)/P x all shards' bytes). "
                "*merge B/token* = decode bytes each rank sent per token (formula: n_layer x the exact "
                "accumulator's bytes; a plain (o, lse) merge would send the last column). *same logits* = the "
                "run's logits digest equals the first layout's at that format and context.\n\n")
        for kind in ("strong", "weak"):
            f.write(f"## {kind} scaling\n\n")
            f.write("| format | nodes x ranks | context | prefill s | prefill comm s | decode ms/token | decode comm "
                    "ms/token | ring B/rank (formula) | merge B/token (formula) | (o, lse) B/token | cache/rank MiB "
                    "| peak RSS MiB | same logits |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
            for r in rows:
                if r["scaling"] != kind:
                    continue
                f.write(f"| {r['format']} | {r['nodes']} x {r['ranks_per_node']} | {r['context']} | {r['prefill_s']} | "
                        f"{r['prefill_comm_s']} | {r['decode_ms_per_token']} | {r['decode_comm_ms_per_token']} | "
                        f"{r['ring_bytes_per_rank']} ({r['ring_bytes_formula']}) | {r['decode_bytes_sent_per_token']} "
                        f"({r['decode_bytes_formula']}) | {r['o_lse_bytes_per_token']} | "
                        f"{r['cache_bytes_max_rank'] / 2**20:.1f} | {r['peak_rss_mib_max_rank']} | "
                        f"{'yes' if r['logits_match'] else 'NO'} |\n")
            f.write("\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, kind in zip(axes, ("strong", "weak")):
            for fmt in formats:
                sel = [r for r in rows if r["scaling"] == kind and r["format"] == fmt]
                xs = [f"{r['nodes']}x{r['ranks_per_node']}" for r in sel]
                ax.plot(xs, [r["decode_ms_per_token"] for r in sel], "o-", label=f"{fmt} decode")
                ax.plot(xs, [r["decode_comm_ms_per_token"] for r in sel], "x--", label=f"{fmt} of it in merge")
            ax.set_title(f"{kind} scaling"); ax.set_xlabel("nodes x ranks per node"); ax.set_ylabel("ms per token")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=100)
    except ImportError:
        print("matplotlib missing: no PNG", file=sys.stderr)
    print(open(args.out + ".md").read())
    if not all(r["logits_match"] for r in rows):
        raise SystemExit("scaling: logits differ between layouts (see the table)")


if __name__ == "__main__":
    main()
