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
        isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile") if f in flags]
    except (OSError, StopIteration):
        isa = []
    return f"{name}, {os.cpu_count()} cores, ISA {' '.join(isa) or 'baseline'}"


def run_bench(args, nodes, rpn, fmt, context, text_file, hostfile, threads=0):
    p = nodes * rpn
    cmd = [MPIRUN, "-np", str(p)]
    if hostfile:
        cmd += ["--hostfile", hostfile]
    cmd += [args.xctx, "bench", "--text", text_file, "--prompt-tokens", str(context), "--gen-tokens", str(args.gen),
            "--cache", fmt, "--prefill", "exact"]
    if fmt.startswith("nuq"):
        cmd += ["--calib", args.calib]
    if threads:
        cmd += ["--threads", str(threads)]
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
    # Ring: rank r sends its own shard's blocks, then each block it received, P-1 shards in all
    # (every shard but the next rank's); on average (P-1)/P x all shards' exported bytes.
    # Older binaries report no exported bytes: their used bytes stand in (within a few %).
    shard = [r.get("prefill_exported_bytes", r["cache_used_bytes"]) for r in per]
    ring_formula = (p - 1) * sum(shard) / p if p > 1 else 0
    row = {
        "scaling": None, "format": fmt, "nodes": nodes, "ranks_per_node": rpn, "ranks": p, "threads": j["threads"],
        "context": context,
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
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"),
                    help="the model xctx runs (for xctx plan's projections)")
    ap.add_argument("--from-csv", default="", help="skip the runs: recompute projections and tables from this CSV")
    args = ap.parse_args()
    node_counts = [int(x) for x in args.nodes.split(",")]
    rpns = [int(x) for x in args.ranks_per_node.split(",")]
    formats = args.formats.split(",")
    strong, weak = count(args.strong_context), count(args.weak_per_rank)
    if args.from_csv:
        return report(args, read_rows(args.from_csv), formats, started=None)
    if max(node_counts) > 1 and os.geteuid() != 0:
        raise SystemExit("scaling: more than one node needs root (network namespaces); run with sudo or --nodes 1")

    if any(f.startswith("nuq") for f in formats) and not os.path.exists(args.calib):
        print(f"making the nuq calibration {args.calib} (xctx calibrate)", file=sys.stderr)
        subprocess.run([args.xctx, "calibrate", "--text", "austen:emma", "--out", args.calib], check=True)
    import austen_text
    tmp = tempfile.mkdtemp(prefix="xctx-scaling-")
    text_file = os.path.join(tmp, "austen.txt")
    open(text_file, "w").write("\n\n".join(austen_text.novels().values()))
    os.environ["XCTX_NETNS_DIR"] = os.path.join(tmp, "netns")
    rows = []
    started = time.strftime("%Y-%m-%d %H:%M")
    # One node, the first format: as many ranks as cores at a context no scaling run uses (the
    # price of a collective), and each rank count above the cores that the grid runs, at the
    # strong context (what taking turns costs, by ranks per core).
    cores = os.cpu_count() or 1
    turns = sorted({n * r for n in node_counts for r in rpns if n * r > cores})
    for p, context in [(cores, weak)] + [(p, strong) for p in turns]:
        if p > 1:
            row = run_bench(args, 1, p, formats[0], context, text_file, None)
            row["scaling"] = "calibration"
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    try:
        if max(node_counts) > 1:  # across hosts: 2 x 1 rank at the weak context, 2 x C at twice it
            rows += calibrate_across_hosts(args, formats[0], weak, text_file, cores)
        for nodes in node_counts:
            hostfile = None
            for rpn in rpns:
                if nodes > 1:
                    up = [CLUSTER, "up", str(nodes), "--slots", str(rpn)] + (["--rate", args.rate] if args.rate else [])
                    subprocess.run(up, check=True, stdout=subprocess.DEVNULL)
                    hostfile = subprocess.run([CLUSTER, "hostfile"], check=True, capture_output=True,
                                              text=True).stdout.strip()
                for fmt in formats:
                    runs = [("strong", strong, 0), ("weak", weak * nodes * rpn, 0)]
                    if nodes * rpn == 1:  # the CPU profile's single-thread costs
                        runs += [("calibration", weak, 1), ("calibration", strong, 1)]
                    for kind, context, threads in runs:
                        row = run_bench(args, nodes, rpn, fmt, context, text_file, hostfile, threads)
                        row["scaling"] = kind
                        rows.append(row)
                        print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        subprocess.run([CLUSTER, "down"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    report(args, rows, formats, started)


def calibrate_across_hosts(args, fmt, weak, text_file, cores):
    """Two hosts, at contexts no grid run of those layouts uses: one rank each (a collective's
    price across hosts), then `cores` ranks each (what taking turns adds to each collective)."""
    out = []
    for rpn, context in ((1, weak), (cores, 2 * weak)):
        subprocess.run([CLUSTER, "up", "2", "--slots", str(rpn)] + (["--rate", args.rate] if args.rate else []),
                       check=True, stdout=subprocess.DEVNULL)
        hostfile = subprocess.run([CLUSTER, "hostfile"], check=True, capture_output=True, text=True).stdout.strip()
        row = run_bench(args, 2, rpn, fmt, context, text_file, hostfile)
        row["scaling"] = "calibration"
        out.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return out


def turns_at(prof, ranks_per_core):
    """xctx plan's interpolation of the taking-turns factors (cpu_profile::turns_at)."""
    if ranks_per_core <= 1 or not prof.get("oversubscribed"):
        return 1.0, 1.0
    pts = sorted((float(k), v["decode_factor"], v["prefill_factor"]) for k, v in prof["oversubscribed"].items())
    lo, hi = (1.0, 1.0, 1.0), pts[0]
    for p in pts[1:]:
        if hi[0] >= ranks_per_core:
            break
        lo, hi = hi, p
    w = (ranks_per_core - lo[0]) / (hi[0] - lo[0])
    return max(1.0, lo[1] + w * (hi[1] - lo[1])), max(1.0, lo[2] + w * (hi[2] - lo[2]))


def read_rows(path):
    rows = []
    for r in csv.DictReader(open(path)):
        for k, v in r.items():
            if k in ("scaling", "format", "logits_fnv1a"):
                continue
            if v in ("True", "False"):
                r[k] = v == "True"
            elif v != "":
                r[k] = float(v) if any(c in v for c in ".e") else int(v)
        rows.append(r)
    return rows


def fit_cpu_profile(args, rows, formats, path):
    """Costs per format and thread count from the 1-rank runs (at 1 thread and on all cores, two
    contexts each): decode = fixed + n·a and prefill = lin·n + att·n², as core-seconds (wall x
    the rank's threads). Written for `xctx plan --cpu-profile`; the layouts of 2+ ranks are then
    projected from it, not fitted."""
    cores = os.cpu_count() or 1
    mem = next(int(l.split()[1]) * 1024 for l in open("/proc/meminfo") if l.startswith("MemTotal"))
    prof = {"machine": cpu_line(), "cores": cores, "memory_bytes": mem, "formats": {},
            "calibrated_on": "benchmarks/scaling.py: 1 rank at 1 thread and on all cores at its strong and weak "
                             "contexts; 1 node at P = cores (weak context) and at each P > cores of the grid (strong context); "
                             "2 nodes at 1 rank each (weak context) and at cores ranks each (twice the weak context)"}
    for fmt in formats:
        prof["formats"][fmt] = {}
        for threads in sorted({r["threads"] for r in rows if r["format"] == fmt and r["ranks"] == 1}):
            one = sorted((r for r in rows if r["format"] == fmt and r["ranks"] == 1 and r["threads"] == threads),
                         key=lambda r: r["context"])
            one = [r for i, r in enumerate(one) if i == 0 or r["context"] != one[i - 1]["context"]]
            if len(one) < 2:
                raise SystemExit(f"scaling: {fmt} needs 1-rank runs at two contexts to calibrate the CPU profile")
            (n1, r1), (n2, r2) = (one[0]["context"], one[0]), (one[-1]["context"], one[-1])
            d1, d2 = r1["decode_ms_per_token"] / 1e3, r2["decode_ms_per_token"] / 1e3
            a = max(0.0, (d2 - d1) / (n2 - n1))
            fixed = max(0.0, d1 - a * n1)
            p1, p2 = r1["prefill_s"], r2["prefill_s"]
            det = n1 * n2 * n2 - n2 * n1 * n1
            att = max(0.0, (n1 * p2 - n2 * p1) / det)
            lin = max(0.0, (p1 - att * n1 * n1) / n1)
            prof["formats"][fmt][str(threads)] = {
                "decode_fixed_core_s": fixed * threads, "decode_core_s_per_token": a * threads,
                "prefill_core_s_per_token": lin * threads, "prefill_core_s_per_token2": att * threads}
    info = subprocess.run([args.xctx, "info", args.model], check=True, capture_output=True, text=True).stdout
    for line in info.splitlines():
        if line.startswith("layers"):
            prof["n_layer"] = int(line.split()[1])
        if line.startswith("width"):
            prof["n_embd"] = int(line.split()[1])
    # A collective's price: what P = C single-thread ranks took beyond their conserved work, per
    # merge (n_layer per decode step). Taking turns: P > C ranks' time over their conserved work
    # and collectives, decode step and prefill.
    def conserved(r):
        c = prof["formats"][r["format"]]["1"]
        n = r["context"]
        return ((r["ranks"] * c["decode_fixed_core_s"] + n * c["decode_core_s_per_token"]) / cores,
                (n * c["prefill_core_s_per_token"] + n * n * c["prefill_core_s_per_token2"]) / cores)
    layers = prof["n_layer"]
    calib = [r for r in rows if r["scaling"] == "calibration" and r["ranks"] > 1 and r["nodes"] == 1]
    prof["collective_s"] = 0.0
    for r in calib:
        if r["ranks"] <= cores:
            prof["collective_s"] = max(0.0, (r["decode_ms_per_token"] / 1e3 - conserved(r)[0]) / layers)
    prof["oversubscribed"] = {}
    for r in calib:
        if r["ranks"] > cores:  # keyed by ranks per core; xctx plan interpolates between them
            decode, prefill = conserved(r)
            t = prof["collective_s"]
            prof["oversubscribed"][f"{r['ranks'] / cores:g}"] = {
                "decode_factor": max(1.0, (r["decode_ms_per_token"] / 1e3 - layers * t) / decode),
                "prefill_factor": max(1.0, (r["prefill_s"] - layers * (r["ranks"] - 1) * t) / prefill)}
    # Across hosts: a collective's price from one rank per host (P <= C), then what each adds
    # per rank per core past the first from C ranks per host.
    across = [r for r in rows if r["scaling"] == "calibration" and r["nodes"] > 1]
    for r in sorted(across, key=lambda r: r["ranks"]):
        decode = conserved(r)[0] * turns_at(prof, r["ranks"] / cores)[0]
        per = (r["decode_ms_per_token"] / 1e3 - decode) / layers
        a = prof.setdefault("across_hosts", {"collective_s": 0.0, "turns_collective_s": 0.0})
        if r["ranks"] <= cores:
            a["collective_s"] = max(0.0, per)
        else:
            a["turns_collective_s"] = max(0.0, (per - a["collective_s"]) / (r["ranks"] / cores - 1))
    json.dump(prof, open(path, "w"), indent=1)
    return prof


def project(args, rows, formats, profile_path):
    """xctx plan's projection of every run, from the profile (plan runs the default threads per
    rank: the single-thread calibration runs have none)."""
    cores = os.cpu_count() or 1
    for r in rows:
        if r["threads"] != max(1, cores // r["ranks"]):
            for k in ("plan_decode_ms", "plan_prefill_s", "decode_plan_over_measured", "prefill_plan_over_measured"):
                r[k] = ""
            continue
        out = subprocess.run([args.xctx, "plan", "--model", args.model, "--cpu-profile", profile_path, "--gpus",
                              str(r["ranks"]), "--hosts", str(r["nodes"]), "--context", str(r["context"]), "--formats", r["format"], "--json"],
                             check=True, capture_output=True, text=True).stdout
        f = json.loads(out)["formats"][0]
        r["plan_decode_ms"] = round(1000 * f["decode_s"], 2)
        r["plan_prefill_s"] = round(f["prefill_ring_s"], 3)
        r["decode_plan_over_measured"] = round(r["plan_decode_ms"] / r["decode_ms_per_token"], 3)
        r["prefill_plan_over_measured"] = round(r["plan_prefill_s"] / r["prefill_s"], 3)


def plan_cell(r, key, part):
    if r[key] == "":
        return "(1 thread: fit)"
    return f"{r[key]} ({r[part + '_plan_over_measured']})"


def report(args, rows, formats, started):
    started = started or "(from " + os.path.basename(args.from_csv) + ")"
    profile_path = args.out + "_cpu_profile.json"
    fit_cpu_profile(args, rows, formats, profile_path)
    project(args, rows, formats, profile_path)

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
                "run's logits digest equals the first layout's at that format and context. *plan* = `xctx plan "
                "--cpu-profile` for that layout, from costs fitted to the calibration runs only (last table) "
                f"([{os.path.basename(profile_path)}]({os.path.basename(profile_path)})); the ratio is plan / measured.\n\n")
        multi = [r for r in rows if r["ranks"] > 1 and r["scaling"] != "calibration"]
        if multi:
            worst_d = max(multi, key=lambda r: abs(r["decode_plan_over_measured"] - 1))
            worst_p = max(multi, key=lambda r: abs(r["prefill_plan_over_measured"] - 1))
            within_d = sum(abs(r["decode_plan_over_measured"] - 1) <= 0.25 for r in multi)
            within_p = sum(abs(r["prefill_plan_over_measured"] - 1) <= 0.25 for r in multi)
            f.write(f"**Plan against measurement** (the {len(multi)} runs on 2+ ranks, none used in the fit): decode "
                    f"step within 25% in {within_d} of {len(multi)}, prefill in {within_p} of {len(multi)}; the worst "
                    f"decode ratio {worst_d['decode_plan_over_measured']} ({worst_d['format']}, {worst_d['nodes']} x "
                    f"{worst_d['ranks_per_node']}, {worst_d['context']} tokens), the worst prefill ratio "
                    f"{worst_p['prefill_plan_over_measured']} ({worst_p['format']}, {worst_p['nodes']} x "
                    f"{worst_p['ranks_per_node']}, {worst_p['context']} tokens).\n\n")
        titles = {"strong": "strong scaling", "weak": "weak scaling",
                  "calibration": "calibration runs (the profile: one rank on one thread; one collective's price "
                                 "from as many ranks as cores; what taking turns costs from each rank count above them; the same across 2 hosts)"}
        for kind in ("strong", "weak", "calibration"):
            f.write(f"## {titles[kind]}\n\n")
            f.write("| format | nodes x ranks | context | prefill s | prefill comm s | decode ms/token | decode comm "
                    "ms/token | ring B/rank (formula) | merge B/token (formula) | (o, lse) B/token | cache/rank MiB "
                    "| peak RSS MiB | same logits | plan decode ms (/ measured) | plan prefill s (/ measured) |\n"
                    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
            for r in rows:
                if r["scaling"] != kind:
                    continue
                f.write(f"| {r['format']} | {r['nodes']} x {r['ranks_per_node']} | {r['context']} | {r['prefill_s']} | "
                        f"{r['prefill_comm_s']} | {r['decode_ms_per_token']} | {r['decode_comm_ms_per_token']} | "
                        f"{r['ring_bytes_per_rank']} ({r['ring_bytes_formula']}) | {r['decode_bytes_sent_per_token']} "
                        f"({r['decode_bytes_formula']}) | {r['o_lse_bytes_per_token']} | "
                        f"{r['cache_bytes_max_rank'] / 2**20:.1f} | {r['peak_rss_mib_max_rank']} | "
                        f"{'yes' if r['logits_match'] else 'NO'} | {plan_cell(r, 'plan_decode_ms', 'decode')} | "
                        f"{plan_cell(r, 'plan_prefill_s', 'prefill')} |\n")
            f.write("\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
        for ax, kind in zip(axes, ("strong", "weak")):
            for i, fmt in enumerate(formats):
                sel = [r for r in rows if r["scaling"] == kind and r["format"] == fmt]
                xs = [f"{r['nodes']}x{r['ranks_per_node']}" for r in sel]
                color = f"C{i}"
                ax.plot(xs, [r["decode_ms_per_token"] for r in sel], "o-", color=color, label=f"{fmt} decode")
                ax.plot(xs, [r["plan_decode_ms"] for r in sel], ":", color=color, label=f"{fmt} plan")
                ax.plot(xs, [r["decode_comm_ms_per_token"] for r in sel], "x--", color=color,
                        label=f"{fmt} of it in merge")
            ax.set_yscale("log")
            ax.set_title(f"{kind} scaling: decode step"); ax.set_xlabel("nodes x ranks per node")
            ax.set_ylabel("ms per token")
            ax.legend(fontsize=6)
        ax = axes[2]
        multi = [r for r in rows if r["ranks"] > 1 and r["scaling"] != "calibration"]
        for i, fmt in enumerate(formats):
            sel = [r for r in multi if r["format"] == fmt]
            ax.plot([r["ranks"] for r in sel], [r["decode_plan_over_measured"] for r in sel], "o", color=f"C{i}",
                    label=f"{fmt} decode")
            ax.plot([r["ranks"] for r in sel], [r["prefill_plan_over_measured"] for r in sel], "s", color=f"C{i}",
                    mfc="none", label=f"{fmt} prefill")
        ax.axhspan(0.75, 1.25, color="0.9", zorder=0)
        ax.axhline(1, color="0.5", lw=0.8)
        ax.set_title("xctx plan --cpu-profile / measured (band: 25%)"); ax.set_xlabel("ranks")
        ax.set_ylabel("plan / measured")
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=100)
    except ImportError:
        print("matplotlib missing: no PNG (Debian's python3-matplotlib: run with /usr/bin/python3)", file=sys.stderr)
    print(open(args.out + ".md").read())
    if not all(r["logits_match"] for r in rows):
        raise SystemExit("scaling: logits differ between layouts (see the table)")


if __name__ == "__main__":
    main()
