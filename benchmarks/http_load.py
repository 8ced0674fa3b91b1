#!/usr/bin/python3
"""Load on the HTTP front: N concurrent streaming clients against one `xctx serve --http-port`
(2 ranks by default) for a bounded time per level, over loopback.

Per level (1, 4, 16, 64 clients by default): requests/s answered, time to first token and time per
output token (p50 / p99, measured by the client from the stream's events), refusals by status,
and the invariant that every accepted request got exactly one complete answer (a first chunk, a
finish chunk, one `[DONE]`, usage equal to the tokens streamed). Each rank's RSS is sampled
through the run; the table reports it at the start and the end of each level and its growth over
the whole run.

    /usr/bin/python3 benchmarks/http_load.py [--levels 1,4,16,64] [--seconds 60] [--ranks 2]

Writes benchmarks/results/http_load.{csv,md} (--out to change). A client refused with 429 waits
0.2 s and tries again (what an SDK with retries does); those refusals are counted, not failures.
"""
import argparse
import csv
import datetime
import http.client
import json
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hostinfo import ROOT, cpu_identity, xctx_commit  # noqa: E402

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_NUM_THREADS": "1"}
PROMPTS = ["Write one sentence about the sea.", "Name three colours.", "What is a river?",
           "Describe a quiet morning.", "Why do birds sing?", "Tell me about bread."]


def session_pids(sid):
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[3]) == sid and fields[0] != "Z":
                    with open(f"/proc/{entry}/environ", "rb") as f:
                        env = f.read()
                    if b"OMPI_COMM_WORLD_RANK=" in env:
                        rank = int(env.split(b"OMPI_COMM_WORLD_RANK=")[1].split(b"\0")[0])
                        pids.append((rank, int(entry)))
            except (OSError, ValueError, IndexError):
                continue
    return sorted(pids)


def rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def percentile(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(p / 100 * (len(xs) - 1)))))
    return xs[k]


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.ttft, self.tpot, self.answered, self.broken, self.codes = [], [], 0, [], {}
        self.tokens = 0
        self.empty = 0

    def add(self, **kw):
        with self.lock:
            for k, v in kw.items():
                if k in ("ttft", "tpot"):
                    getattr(self, k).extend(v if isinstance(v, list) else [v])
                elif k == "code":
                    self.codes[v] = self.codes.get(v, 0) + 1
                elif k == "broken":
                    self.broken.append(v)
                elif k == "answered":
                    self.answered += v
                elif k == "tokens":
                    self.tokens += v
                elif k == "empty":
                    self.empty += v


def one_request(port, token, body, stats):
    """One streamed completion; checks the stream's shape. Returns the HTTP status."""
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    r = conn.getresponse()
    stats.add(code=r.status)
    if r.status != 200:
        r.read()
        conn.close()
        return r.status
    events, buf, times = [], b"", []
    while True:
        chunk = r.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            frame, buf = buf.split(b"\n\n", 1)
            if frame.startswith(b"data: "):
                events.append(frame[6:].decode())
                times.append(time.monotonic())
    conn.close()
    done = [i for i, e in enumerate(events) if e == "[DONE]"]
    problem = None
    if len(done) != 1 or done[0] != len(events) - 1:
        problem = f"{len(done)} [DONE] events"
    else:
        chunks = [json.loads(e) for e in events[:-1]]
        text_chunks = [(c, t) for c, t in zip(chunks, times) if c.get("choices") and c["choices"][0].get("text")]
        finish = [c for c in chunks if c.get("choices") and c["choices"][0].get("finish_reason")]
        usage = [c["usage"] for c in chunks if c.get("usage")]
        if len(finish) != 1:
            problem = f"{len(finish)} finish chunks"
        elif len(usage) != 1:
            problem = f"{len(usage)} usage chunks"
        elif not text_chunks and usage[0]["completion_tokens"] > 0:
            problem = f"no text for {usage[0]['completion_tokens']} tokens"
        elif len({c["id"] for c in chunks}) != 1:
            problem = "mixed ids"
        else:
            n = usage[0]["completion_tokens"]
            if not text_chunks:  # the model ended at once: an empty answer, complete
                stats.add(empty=1)
            else:
                stats.add(tokens=n, ttft=text_chunks[0][1] - t0)
            if n > 1 and text_chunks:
                stats.add(tpot=(text_chunks[-1][1] - text_chunks[0][1]) / (n - 1))
    if problem:
        stats.add(broken=problem)
    else:
        stats.add(answered=1)
    return 200


def run_level(port, token, clients, seconds, max_tokens, stats):
    stop_at = time.monotonic() + seconds

    def client(i):
        rng = random.Random(i)
        while time.monotonic() < stop_at:
            body = {"prompt": rng.choice(PROMPTS), "max_tokens": max_tokens, "temperature": 0.7,
                    "seed": rng.randrange(1 << 30), "stream": True, "stream_options": {"include_usage": True}}
            try:
                if one_request(port, token, body, stats) == 429:
                    time.sleep(0.2)
            except (OSError, http.client.HTTPException) as e:
                stats.add(broken=f"{type(e).__name__}: {e}")
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--xctx", default=os.path.join(ROOT, "build", "xctx"))
    ap.add_argument("--levels", default="1,4,16,64")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "http_load"))
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    commit = xctx_commit()  # at the start: the tree the binary was built from, not the one at the end

    tmp = tempfile.mkdtemp(prefix="xctx-http-load-")
    token = secrets.token_hex(16)
    with open(os.path.join(tmp, "token"), "w") as f:
        f.write(token)
    port_file = os.path.join(tmp, "http_port")
    serve = ["mpirun", "--oversubscribe", "-np", str(args.ranks), args.xctx, "serve", "--port", "0",
             "--http-port", "0", "--http-port-file", port_file, "--token-file", os.path.join(tmp, "token"),
             "--ctx", "2048", "--max-output-tokens", "64", "--max-queue", str(max(levels)),
             "--http-threads", str(2 * max(levels) + 8), "--log-dir", os.path.join(tmp, "logs")]
    proc = subprocess.Popen(serve, stdout=open(os.path.join(tmp, "serve.out"), "w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, **MPI_ENV), start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (os.path.exists(port_file) and open(port_file).read().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"xctx serve did not start; see {tmp}/serve.out")
            time.sleep(0.1)
        port = int(open(port_file).read())
        while True:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        ranks = session_pids(proc.pid)
        rss_samples = []  # (t, [rss per rank])
        sampling = [True]

        def sample():
            while sampling[0]:
                rss_samples.append((time.monotonic(), [rss_mib(p) for _, p in ranks]))
                time.sleep(2)
        sampler = threading.Thread(target=sample)
        sampler.start()
        rows = []
        for n in levels:
            stats = Stats()
            rss0 = [rss_mib(p) for _, p in ranks]
            t0 = time.monotonic()
            run_level(port, token, n, args.seconds, args.max_tokens, stats)
            wall = time.monotonic() - t0
            rss1 = [rss_mib(p) for _, p in ranks]
            row = {"clients": n, "seconds": round(wall, 1), "answered": stats.answered,
                   "empty": stats.empty, "requests_per_s": round(stats.answered / wall, 3),
                   "tokens_per_s": round(stats.tokens / wall, 1),
                   "ttft_p50_s": round(percentile(stats.ttft, 50), 3), "ttft_p99_s": round(percentile(stats.ttft, 99), 3),
                   "tpot_p50_ms": round(1000 * percentile(stats.tpot, 50), 1),
                   "tpot_p99_ms": round(1000 * percentile(stats.tpot, 99), 1),
                   "refused_429": stats.codes.get(429, 0),
                   "other_codes": ";".join(f"{k}:{v}" for k, v in sorted(stats.codes.items()) if k not in (200, 429)),
                   "broken": len(stats.broken), "broken_first": stats.broken[0] if stats.broken else "",
                   "rss_start_mib": "/".join(f"{x:.0f}" for x in rss0),
                   "rss_end_mib": "/".join(f"{x:.0f}" for x in rss1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        sampling[0] = False
        sampler.join()
    finally:
        pid = next((p for r, p in session_pids(proc.pid) if r == 0), None)
        if pid:
            os.kill(pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            for _, p in session_pids(proc.pid):
                os.kill(p, signal.SIGKILL)

    first = rss_samples[0][1] if rss_samples else []
    last = rss_samples[-1][1] if rss_samples else []
    peak = [max(s[1][i] for s in rss_samples) for i in range(len(first))] if rss_samples else []
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    cmd = "/usr/bin/python3 benchmarks/http_load.py " + " ".join(sys.argv[1:])
    with open(args.out + ".md", "w") as f:
        f.write("# HTTP front under load: concurrent streaming clients\n\n")
        f.write(f"Written by `{cmd}` on {datetime.date.today()}, xctx {commit}, {cpu_identity()}. "
                f"`xctx serve` on {args.ranks} ranks x 1 thread (fp16 cache, context 2048), the bundled SmolLM2; "
                f"each client streams `/v1/completions` with max_tokens {args.max_tokens}, temperature 0.7, "
                f"a seeded prompt from a fixed set of {len(PROMPTS)}, for {args.seconds:.0f} s per level; a 429 "
                "waits 0.2 s and tries again. Times are the client's: TTFT from sending the request to the first "
                "text event, time per output token from the first to the last text event over the tokens between. "
                "Answered counts complete streams (one finish chunk, one usage chunk equal to the tokens, one `[DONE]` "
                "last); empty = the model ended at once (0 tokens, a complete answer); broken = any other stream.\n\n")
        f.write("| clients | answered (empty) | req/s | tok/s | TTFT p50 s | TTFT p99 s | per token p50 ms | per token p99 ms "
                "| 429 | other statuses | broken answers | RSS/rank MiB start -> end |\n")
        f.write("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|\n")
        for r in rows:
            f.write(f"| {r['clients']} | {r['answered']} ({r['empty']}) | {r['requests_per_s']} | {r['tokens_per_s']} | "
                    f"{r['ttft_p50_s']} | {r['ttft_p99_s']} | {r['tpot_p50_ms']} | {r['tpot_p99_ms']} | "
                    f"{r['refused_429']} | {r['other_codes'] or '-'} | {r['broken']} | "
                    f"{r['rss_start_mib']} -> {r['rss_end_mib']} |\n")
        f.write(f"\nRSS per rank over the whole run ({len(rss_samples)} samples every 2 s): first "
                f"{'/'.join(f'{x:.0f}' for x in first)} MiB, last {'/'.join(f'{x:.0f}' for x in last)} MiB, "
                f"peak {'/'.join(f'{x:.0f}' for x in peak)} MiB.\n\n")
        f.write("One sequence runs at a time (the service's cache is one sequence-parallel cache): throughput "
                "is one stream's decode rate whatever the concurrency, and the extra clients wait in the queue, "
                "so TTFT grows with the queue. Batching several requests' decode steps over one cache is not "
                "built (docs/service.md).\n")
    print(f"wrote {args.out}.csv and .md")


if __name__ == "__main__":
    main()
