#!/usr/bin/env python3
"""Client for the `xctx serve` Thrift service (coordinator/service/xctx.thrift), as a module and a CLI.

    with xctx_client.connect(port=9090, token=open("token").read().strip()) as c:
        job_id = c.submit(xctx_client.generate("The capital of France is", max_tokens=8))
        print(c.wait(job_id).text)

    xctx_client.py [--server H:P] [--token-file F] info|metrics|status ID|result ID|cancel ID|generate PROMPT [-n N]

The Python bindings are generated from the IDL on first use (`thrift --gen py`) into a cache
directory keyed by the IDL's contents, so the IDL stays the single source and nothing generated
is checked in. Needs the `thrift` compiler and the Python `thrift` package (Debian:
thrift-compiler, python3-thrift). One client is one connection: not for concurrent threads.
"""
import argparse
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

IDL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "xctx.thrift")

_rpc = None


def bindings():
    """The generated `xctx_rpc` package (with .Xctx and .ttypes), generating it when needed."""
    global _rpc
    if _rpc is not None:
        return _rpc
    if importlib.util.find_spec("thrift") is None:
        raise RuntimeError(f"the Python 'thrift' package is missing for {sys.executable} "
                           "(Debian: apt-get install python3-thrift; else pip install thrift)")
    with open(IDL, "rb") as f:
        key = hashlib.sha256(f.read()).hexdigest()[:16]
    cache = os.environ.get("XDG_CACHE_HOME")
    out = os.path.join(cache, "xctx", f"py-{key}") if cache else \
        os.path.join(tempfile.gettempdir(), f"xctx-py-{key}")
    if not os.path.isfile(os.path.join(out, "xctx_rpc", "Xctx.py")):
        _generate(out)
    sys.path.insert(0, out)
    _rpc = importlib.import_module("xctx_rpc")
    importlib.import_module("xctx_rpc.Xctx")
    importlib.import_module("xctx_rpc.ttypes")
    return _rpc


def _generate(out):
    """Runs the thrift compiler into a fresh directory and renames it into place, so that
    concurrent first uses never see a half-written package."""
    compiler = shutil.which("thrift")
    if compiler is None:
        raise RuntimeError("the 'thrift' compiler is not on PATH (Debian: apt-get install thrift-compiler)")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(out) + ".", dir=os.path.dirname(out))
    try:
        done = subprocess.run([compiler, "--gen", "py", "-out", tmp, IDL], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"thrift --gen py {IDL} failed:\n{done.stdout}{done.stderr}")
        try:
            os.rename(tmp, out)
        except OSError:
            if not os.path.isfile(os.path.join(out, "xctx_rpc", "Xctx.py")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def generate(prompt, max_tokens=128, chat=False, system="", temperature=0.0, top_p=1.0, seed=0, **sampling):
    """A GENERATE job (greedy unless temperature > 0). `sampling`: the GenerateJob's other
    sampler fields (top_k, min_p, repetition_penalty, repeat_last_n, frequency_penalty,
    presence_penalty, no_repeat_ngram; coordinator/service/xctx.thrift)."""
    t = bindings().ttypes
    return t.Job(kind=t.JobKind.GENERATE, generate=t.GenerateJob(
        prompt=prompt, chat=chat, system=system, max_tokens=max_tokens, temperature=temperature,
        top_p=top_p, seed=seed, **sampling))


def passkey(context=4096, trials=1, depths=(0.0, 0.5, 1.0), seed=1, filler="classic"):
    """A PASSKEY job: `trials` retrievals per depth in a `context`-token prompt."""
    t = bindings().ttypes
    return t.Job(kind=t.JobKind.PASSKEY, passkey=t.PasskeyJob(
        context=context, trials=trials, depths=list(depths), seed=seed, filler=filler))


def summarize(doc_id, text, instruction="", max_tokens=0):
    """A SUMMARIZE job over one document."""
    t = bindings().ttypes
    return t.Job(kind=t.JobKind.SUMMARIZE, summarize=t.SummarizeJob(document=t.Document(
        id=doc_id, text=text, instruction=instruction, max_tokens=max_tokens)))


def batch(jsonl, max_tokens=0):
    """A BATCH job over JSONL documents ({"id", "text", ...} per line)."""
    t = bindings().ttypes
    return t.Job(kind=t.JobKind.BATCH, batch=t.BatchJob(jsonl=jsonl, max_tokens=max_tokens))


class Client:
    """One connection to the service; every call sends the shared secret and raises
    ttypes.RequestError when the service refuses it."""

    def __init__(self, host, port, token, timeout_s):
        from thrift.protocol import TBinaryProtocol
        from thrift.transport import TSocket, TTransport
        rpc = bindings()
        sock = TSocket.TSocket(host, port)
        sock.setTimeout(timeout_s * 1000)
        self._transport = TTransport.TFramedTransport(sock)
        self._rpc = rpc.Xctx.Client(TBinaryProtocol.TBinaryProtocol(self._transport))
        self._token = token
        self._transport.open()

    def close(self):
        self._transport.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def submit(self, job):
        return self._rpc.submit(self._token, job)

    def status(self, job_id):
        return self._rpc.status(self._token, job_id)

    def result(self, job_id):
        return self._rpc.result(self._token, job_id)

    def cancel(self, job_id):
        return self._rpc.cancel(self._token, job_id)

    def info(self):
        return self._rpc.info(self._token)

    def metrics(self):
        return self._rpc.metrics(self._token)

    def wait(self, job_id, poll_s=0.2, timeout_s=None, on_status=None):
        """Polls status() until the job has ended (calling on_status with each status), then
        returns its result(); TimeoutError after timeout_s seconds."""
        ended = ended_phases()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            st = self.status(job_id)
            if on_status is not None:
                on_status(st)
            if st.phase in ended:
                return self.result(job_id)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {phase_name(st.phase)} after {timeout_s} s")
            time.sleep(poll_s)


def connect(host="127.0.0.1", port=9090, token="", timeout_s=30):
    """A connected Client (a context manager that closes the connection)."""
    return Client(host, port, token, timeout_s)


def ended_phases():
    p = bindings().ttypes.JobPhase
    return (p.DONE, p.FAILED, p.CANCELLED)


def phase_name(phase):
    return bindings().ttypes.JobPhase._VALUES_TO_NAMES.get(phase, str(phase))


def to_dict(struct):
    """A Thrift struct as plain data, enums by name (for printing)."""
    t = bindings().ttypes
    enums = {"kind": t.JobKind, "phase": t.JobPhase, "code": t.ErrorCode}
    out = {}
    for name, value in vars(struct).items():
        if name in enums:
            value = enums[name]._VALUES_TO_NAMES.get(value, value)
        elif hasattr(value, "thrift_spec"):
            value = to_dict(value)
        out[name] = value
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description="Talk to `xctx serve`.")
    ap.add_argument("--server", default="127.0.0.1:9090", help="HOST:PORT (default 127.0.0.1:9090)")
    ap.add_argument("--token-file", help="file holding the shared secret (default: no secret)")
    ap.add_argument("--timeout", type=float, default=30, help="socket timeout in seconds")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("info")
    sub.add_parser("metrics")
    for name in ("status", "result", "cancel"):
        sub.add_parser(name).add_argument("id", type=int)
    gen = sub.add_parser("generate", help="submit a GENERATE job, wait, print the text")
    gen.add_argument("prompt")
    gen.add_argument("-n", type=int, default=128, help="max output tokens")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    args = ap.parse_args(argv)

    host, _, port = args.server.rpartition(":")
    token = ""
    if args.token_file:
        with open(args.token_file) as f:
            token = f.read().strip()
    try:
        rpc = bindings()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from thrift.transport.TTransport import TTransportException
    try:
        with connect(host or "127.0.0.1", int(port), token, args.timeout) as c:
            if args.command in ("info", "metrics"):
                print(json.dumps(to_dict(getattr(c, args.command)()), indent=2))
            elif args.command == "cancel":
                print("cancelled" if c.cancel(args.id) else "already ended")
            elif args.command in ("status", "result"):
                print(json.dumps(to_dict(getattr(c, args.command)(args.id)), indent=2))
            else:
                job_id = c.submit(generate(args.prompt, max_tokens=args.n, chat=args.chat))
                res = c.wait(job_id, on_status=lambda st: print(
                    f"\rjob {job_id}: {phase_name(st.phase)} {st.tokens_done} tokens", end="", file=sys.stderr))
                print(file=sys.stderr)
                if res.phase != rpc.ttypes.JobPhase.DONE:
                    print(f"job {job_id} {phase_name(res.phase)}: {res.error}", file=sys.stderr)
                    return 1
                print(res.text)
    except rpc.ttypes.RequestError as e:
        print(f"error: {rpc.ttypes.ErrorCode._VALUES_TO_NAMES.get(e.code, e.code)}: {e.message}", file=sys.stderr)
        return 1
    except TTransportException as e:
        print(f"error: {args.server}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
