#!/usr/bin/python3
"""End-to-end tests of `xctx serve` through the Python client: one service on 2 MPI ranks for
the whole module, every refusal the IDL names, job progress, cancellation, failures at run time,
and a closing check that the service still serves and counted what it refused.

    /usr/bin/python3 tests/service/test_service.py --xctx build/xctx --model models/SmolLM2-135M-Instruct.Q4_1.gguf

(or XCTX_BIN / XCTX_TEST_MODEL; other arguments go to unittest, e.g. -k cancel). Tests run in the
order they are written. The service starts with the first test that needs it and is stopped
after the last with SIGTERM to rank 0, which must shut every rank down with exit code 0.
"""
import argparse
import inspect
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "coordinator", "service", "python"))
import xctx_client  # noqa: E402

T = xctx_client.bindings().ttypes
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_NUM_THREADS": "1"}
RANKS = 2
MAX_OUTPUT = 64
MAX_REQUEST = 65536
MAX_QUEUE = 2
MAX_CONTEXT = 2048
JOB_TIMEOUT_S = 180
PARIS = "The capital of France is"
SENTENCES = [
    "The lighthouse keeper counted the ships that passed the rocky point each night.",
    "Bees return to the hive and dance to show the others where the flowers are.",
    "The old railway bridge was rebuilt in stone after the spring flood of 1887.",
    "A good bread dough needs flour, water, salt, yeast and a long, slow rise.",
    "The orchestra tuned to the oboe before the conductor raised her baton.",
    "Glaciers carve wide valleys as they creep downhill over thousands of years.",
    "The chess club meets on Thursdays in the back room of the public library.",
    "Copper turns green over time because it reacts with air and moisture.",
]

OPTIONS = argparse.Namespace(xctx=None, model=None)


def parse_args(argv):
    """--xctx and --model (or XCTX_BIN / XCTX_TEST_MODEL); the rest is for unittest."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--xctx", default=os.environ.get("XCTX_BIN", os.path.join(ROOT, "build", "xctx")))
    ap.add_argument("--model", default=os.environ.get(
        "XCTX_TEST_MODEL", os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")))
    args, rest = ap.parse_known_args(argv)
    OPTIONS.xctx, OPTIONS.model = os.path.abspath(args.xctx), os.path.abspath(args.model)
    return rest


def mpirun(*xctx_args):
    return ["mpirun", "--oversubscribe", "-np", str(RANKS), OPTIONS.xctx, *xctx_args]


def session_pids(sid):
    """Processes of session `sid`: mpirun puts each rank in its own process group, so killing
    mpirun's group would leave the ranks running; the session holds them all."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                pids.append(int(entry))
    return pids


def kill_session(proc):
    """SIGKILLs mpirun (started with start_new_session) and every rank it launched."""
    for pid in session_pids(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def rank0_pid(proc):
    """The pid of rank 0 among mpirun's children (from OMPI_COMM_WORLD_RANK in its environment)."""
    for pid in session_pids(proc.pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if b"OMPI_COMM_WORLD_RANK=0" in env:
            return pid
    return None


def tail(path, n=40):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def port_in_file(proc, path, logs):
    """The port a service wrote to `path` (None until it has); fails with logs() once proc exited."""
    if proc.poll() is not None:
        raise AssertionError(f"{proc.args[0]} exited with {proc.returncode}:\n{logs()}")
    try:
        with open(path) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


def wait_until(predicate, timeout_s, what, poll_s=0.1):
    """Polls predicate() until it returns a true value, which is returned; fails after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)


class Service:
    """`mpirun -np 2 xctx serve` with small limits, in its own session, logs in a temp dir."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="xctx-service-")
        self.token = secrets.token_hex(16)
        with open(os.path.join(self.dir, "token"), "w") as f:
            f.write(self.token + "\n")  # the service trims whitespace
        self.out_path = os.path.join(self.dir, "serve.out")
        port_file = os.path.join(self.dir, "port")
        cmd = mpirun("serve", "--model", OPTIONS.model, "--port", "0", "--port-file", port_file,
                     "--token-file", os.path.join(self.dir, "token"), "--ctx", str(MAX_CONTEXT),
                     "--max-context", str(MAX_CONTEXT), "--max-output-tokens", str(MAX_OUTPUT),
                     "--max-request-bytes", str(MAX_REQUEST), "--max-queue", str(MAX_QUEUE),
                     "--log-dir", os.path.join(self.dir, "logs"))
        with open(self.out_path, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=self.dir,
                                         env=dict(os.environ, **MPI_ENV), start_new_session=True)

        try:
            self.port = wait_until(lambda: port_in_file(self.proc, port_file, self.logs), 120, f"the port file {port_file}", poll_s=0.2)
        except BaseException:
            kill_session(self.proc)
            raise

    def connect(self, token=None):
        return xctx_client.connect(port=self.port, token=self.token if token is None else token, timeout_s=60)

    def logs(self):
        text = f"--- {self.out_path}\n{tail(self.out_path)}"
        logs = os.path.join(self.dir, "logs")
        for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
            text += f"--- {name}\n{tail(os.path.join(logs, name))}"
        return text

    def stop(self):
        """SIGTERM to rank 0 (mpirun itself answers SIGTERM by aborting the job with exit code 1,
        so only a shutdown the service drives can end in 0); SIGKILL to all after 30 s."""
        pid = rank0_pid(self.proc)
        os.kill(pid if pid is not None else self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            kill_session(self.proc)
            return None


SERVICE = None
SERVICE_ERROR = None
REJECTED = 0        # calls answered with a RequestError
SUBMITTED = 0       # jobs accepted
ENDED = {}          # job id -> the phase it was seen ending in


def service():
    """The module's one service, started on first use (so the IDL test runs without it)."""
    global SERVICE, SERVICE_ERROR
    if SERVICE_ERROR is not None:
        raise AssertionError(f"the service did not start: {SERVICE_ERROR}")
    if SERVICE is None:
        if not os.access(OPTIONS.xctx, os.X_OK):
            SERVICE_ERROR = f"no xctx binary at {OPTIONS.xctx}"
            raise AssertionError(SERVICE_ERROR)
        try:
            SERVICE = Service()
        except BaseException as e:
            SERVICE_ERROR = str(e).splitlines()[0]
            raise
    return SERVICE


def tearDownModule():
    if SERVICE is None:
        return
    rc = SERVICE.stop()
    if rc != 0:
        raise AssertionError(f"xctx serve exited with {rc} after SIGTERM (want 0); files kept in "
                             f"{SERVICE.dir}\n{SERVICE.logs()}")
    shutil.rmtree(SERVICE.dir, ignore_errors=True)


class IdlTest(unittest.TestCase):
    def test_job_round_trip(self):
        """A Job survives TBinaryProtocol both ways (the bindings match the IDL)."""
        from thrift.protocol import TBinaryProtocol
        from thrift.transport import TTransport
        jobs = [xctx_client.generate(PARIS, max_tokens=8, chat=True, system="Be brief.", temperature=0.7,
                                     top_p=0.9, seed=-5),
                xctx_client.passkey(context=1024, trials=2, depths=[0.25, 1.0]),
                xctx_client.summarize("doc-1", "Some text.", instruction="One line.", max_tokens=12),
                xctx_client.batch('{"id": "a", "text": "x"}\n', max_tokens=7)]
        for job in jobs:
            out = TTransport.TMemoryBuffer()
            job.write(TBinaryProtocol.TBinaryProtocol(out))
            back = T.Job()
            back.read(TBinaryProtocol.TBinaryProtocol(TTransport.TMemoryBuffer(out.getvalue())))
            self.assertEqual(back, job)
        self.assertEqual(T.GenerateJob().max_tokens, 128)
        self.assertEqual(T.PasskeyJob().depths, [0.0, 0.5, 1.0])


class ServiceTest(unittest.TestCase):
    """Base: a connection to the module's service and helpers that keep the counts the closing
    test compares with metrics()."""

    @classmethod
    def setUpClass(cls):
        cls.svc = service()
        cls.c = cls.svc.connect()

    @classmethod
    def tearDownClass(cls):
        cls.c.close()

    def submit(self, job):
        global SUBMITTED
        job_id = self.c.submit(job)
        SUBMITTED += 1
        self.addCleanup(self.end_job, job_id)
        return job_id

    def end_job(self, job_id):
        """Cleanup: the job has ended (cancelled if need be), so later tests find an idle queue."""
        self.c.cancel(job_id)
        self.wait(job_id)

    def wait(self, job_id, timeout_s=JOB_TIMEOUT_S, on_status=None):
        res = self.c.wait(job_id, poll_s=0.05, timeout_s=timeout_s, on_status=on_status)
        ENDED.setdefault(job_id, res.phase)
        return res

    def run_job(self, job, timeout_s=JOB_TIMEOUT_S, on_status=None):
        return self.wait(self.submit(job), timeout_s, on_status)

    def assertDone(self, res):
        self.assertEqual(xctx_client.phase_name(res.phase), "DONE", res.error)

    def assertRefused(self, code, call, *args, contains=()):
        """call(*args) raises RequestError `code` whose message holds every word of `contains`."""
        global REJECTED
        try:
            value = call(*args)
        except T.RequestError as e:
            REJECTED += 1
            name = T.ErrorCode._VALUES_TO_NAMES
            self.assertEqual(name.get(e.code, e.code), name[code], e.message)
            for word in contains:
                self.assertIn(word, e.message)
            return e
        if call == self.c.submit:
            self.addCleanup(self.end_job, value)
        self.fail(f"expected RequestError {T.ErrorCode._VALUES_TO_NAMES[code]}, got {value!r}")

    def assertMonotonic(self, statuses):
        """tokens_done and items_done never go back between polls."""
        for field in ("tokens_done", "items_done"):
            values = [getattr(s, field) for s in statuses]
            self.assertEqual(values, sorted(values), f"{field} went backwards: {values}")

    def assertEndCounts(self, st, res):
        """An ended job's status counts the tokens its result reports (IDL: tokens_done is prompt
        tokens read + tokens generated; tokens_total an upper bound)."""
        self.assertEqual(st.tokens_done, res.prompt_tokens + res.generated_tokens)
        self.assertLessEqual(st.tokens_done, st.tokens_total)

    def blocker(self, trials=4):
        """A job that keeps the service busy for a few seconds: passkey trials at 1K context."""
        return xctx_client.passkey(context=1024, trials=trials, depths=[0.5])

    def status_until(self, job_id, phases, timeout_s=60):
        """Polls status() until the job is in one of `phases`; fails if it ends first."""
        want = {getattr(T.JobPhase, p) for p in phases}

        def reached():
            st = self.c.status(job_id)
            if st.phase not in want and st.phase in xctx_client.ended_phases():
                self.fail(f"job {job_id} ended {xctx_client.phase_name(st.phase)} before {phases}: {st.error}")
            return st if st.phase in want else None
        return wait_until(reached, timeout_s, f"job {job_id} to reach {'/'.join(phases)}", poll_s=0.05)


class InfoTest(ServiceTest):
    def test_info(self):
        info = self.c.info()
        self.assertEqual(info.ranks, RANKS)
        self.assertEqual(info.cache, "fp16")
        self.assertIn("fp16", info.cache_formats)
        self.assertTrue(info.auth_required)
        self.assertEqual(info.max_output_tokens, MAX_OUTPUT)
        self.assertEqual(info.max_request_bytes, MAX_REQUEST)
        self.assertEqual(info.max_queue, MAX_QUEUE)
        self.assertEqual(info.max_context_tokens, MAX_CONTEXT)
        self.assertGreater(info.cache_bytes_per_rank, 0)
        self.assertIn(info.prefill, ("exact", "star", "auto"))
        self.assertTrue(info.model)
        self.assertTrue(info.backend)


class JobTest(ServiceTest):
    def test_generate_paris(self):
        res = self.run_job(xctx_client.generate(PARIS, max_tokens=8))
        self.assertDone(res)
        self.assertIn("Paris", res.text)
        self.assertGreater(res.prompt_tokens, 0)
        self.assertTrue(1 <= res.generated_tokens <= 8, res.generated_tokens)
        self.assertGreaterEqual(res.prefill_s, 0)
        self.assertGreaterEqual(res.decode_s, 0)

    def test_generate_with_penalties(self):
        # Greedy loops on this prompt; the repeat penalty and the 3-gram ban leave the loop.
        prompt = "The sea was calm and the sea was"
        plain = self.run_job(xctx_client.generate(prompt, max_tokens=24))
        self.assertDone(plain)
        self.assertIn("the sea was calm.", plain.text)
        res = self.run_job(xctx_client.generate(prompt, max_tokens=24, repetition_penalty=1.2, no_repeat_ngram=3))
        self.assertDone(res)
        self.assertNotIn("the sea was calm.", res.text)
        self.assertRefused(T.ErrorCode.BAD_REQUEST, self.c.submit,
                           xctx_client.generate(prompt, max_tokens=4, no_repeat_ngram=1), contains=["--no-repeat-ngram"])

    def test_status_progress(self):
        """tokens_done only grows, through PREFILL and DECODE, and ends at prompt + generated."""
        seen = []
        job = xctx_client.generate("Once upon a time, in a small village by the sea,", max_tokens=MAX_OUTPUT)
        res = self.run_job(job, on_status=seen.append)
        self.assertDone(res)
        self.assertGreater(res.generated_tokens, 8, "the prompt should not end at once")
        self.assertIn(T.JobPhase.DECODE, [s.phase for s in seen])
        self.assertMonotonic(seen)
        st = self.c.status(res.id)
        self.assertEqual(st.kind, T.JobKind.GENERATE)
        self.assertEqual(st.phase, T.JobPhase.DONE)
        self.assertEndCounts(st, res)
        self.assertGreater(st.tokens_per_s, 0)
        self.assertGreater(st.elapsed_s, 0)
        self.assertEqual(st.queue_position, 0)
        self.assertEqual(st.error, "")

    def test_summarize_one(self):
        res = self.run_job(xctx_client.summarize("s1", " ".join(SENTENCES[:4]), max_tokens=16))
        self.assertDone(res)
        self.assertTrue(res.text.strip())
        self.assertTrue(1 <= res.generated_tokens <= 16, res.generated_tokens)

    def test_passkey(self):
        res = self.run_job(xctx_client.passkey(context=1024, trials=2, depths=[0.5]))
        self.assertDone(res)
        self.assertIn("summary", json.loads(res.json))
        st = self.c.status(res.id)
        self.assertEqual((st.items_done, st.items_total), (2, 2))
        self.assertEndCounts(st, res)

    def test_batch(self):
        docs = [{"id": "first", "text": " ".join(SENTENCES[0:3])},
                {"id": "second", "text": " ".join(SENTENCES[3:6])}]
        job_id = self.submit(xctx_client.batch("".join(json.dumps(d) + "\n" for d in docs), max_tokens=16))
        self.assertEqual(self.c.status(job_id).items_total, 2)
        seen = []
        res = self.wait(job_id, on_status=seen.append)
        self.assertDone(res)
        self.assertIn(T.JobPhase.DECODE, [s.phase for s in seen], "summaries are generated in DECODE")
        self.assertMonotonic(seen)
        lines = [json.loads(line) for line in res.text.splitlines() if line.strip()]
        self.assertEqual([d["id"] for d in lines], ["first", "second"])
        for line in lines:
            self.assertNotIn("error", line)
            self.assertTrue(line["summary"].strip())
            self.assertGreater(line["prompt_tokens"], 0)
            self.assertTrue(1 <= line["generated_tokens"] <= 16, line)
            for key in ("prefill_s", "decode_s"):
                self.assertGreaterEqual(line[key], 0)
            self.assertEqual(line["cache"], "fp16")
            self.assertEqual(line["ranks"], RANKS)
        st = self.c.status(job_id)
        self.assertEqual(st.items_done, 2)
        self.assertEndCounts(st, res)

    def test_fails_at_run_time(self):
        """A prompt over max-context tokens passes submit (bytes are within limits) and fails
        when it is tokenized; the service goes on."""
        prompt = "The quick brown fox jumps over the lazy dog. " * 250  # ~2500 tokens, ~11 KB
        res = self.run_job(xctx_client.generate(prompt, max_tokens=8))
        self.assertEqual(xctx_client.phase_name(res.phase), "FAILED")
        self.assertIn("tokens", res.error)
        st = self.c.status(res.id)
        self.assertEqual(st.phase, T.JobPhase.FAILED)
        self.assertIn("tokens", st.error)


class RefusalTest(ServiceTest):
    def test_bad_token(self):
        for token in ("wrong", ""):
            with self.svc.connect(token=token) as bad:
                self.assertRefused(T.ErrorCode.UNAUTHORIZED, bad.info)
                self.assertRefused(T.ErrorCode.UNAUTHORIZED, bad.submit, xctx_client.generate(PARIS, max_tokens=4))
                self.assertRefused(T.ErrorCode.UNAUTHORIZED, bad.metrics)

    def test_oversized_request(self):
        job = xctx_client.generate("x " * (MAX_REQUEST // 2 + 1000), max_tokens=4)
        self.assertRefused(T.ErrorCode.TOO_LARGE, self.c.submit, job, contains=["bytes"])

    def test_max_tokens(self):
        self.assertRefused(T.ErrorCode.TOO_LARGE, self.c.submit,
                           xctx_client.generate(PARIS, max_tokens=MAX_OUTPUT + 1), contains=["max_tokens"])
        self.assertRefused(T.ErrorCode.BAD_REQUEST, self.c.submit,
                           xctx_client.generate(PARIS, max_tokens=0), contains=["max_tokens"])

    def test_kind_without_struct(self):
        self.assertRefused(T.ErrorCode.BAD_REQUEST, self.c.submit, T.Job(kind=T.JobKind.GENERATE),
                           contains=["generate"])
        wrong = xctx_client.generate(PARIS, max_tokens=4)
        wrong.kind = T.JobKind.BATCH
        self.assertRefused(T.ErrorCode.BAD_REQUEST, self.c.submit, wrong, contains=["batch"])

    def test_malformed_batch(self):
        jsonl = '{"id": "a", "text": "One sentence."}\n{"id": "b", "text": \n'
        self.assertRefused(T.ErrorCode.BAD_REQUEST, self.c.submit, xctx_client.batch(jsonl), contains=["line 2"])

    def test_batch_with_path(self):
        jsonl = '{"id": "a", "text": "One sentence."}\n{"id": "b", "path": "/etc/hostname"}\n'
        self.assertRefused(T.ErrorCode.BAD_REQUEST, self.c.submit, xctx_client.batch(jsonl), contains=["path"])

    def test_unknown_id(self):
        for call in (self.c.status, self.c.result, self.c.cancel):
            self.assertRefused(T.ErrorCode.NOT_FOUND, call, 10**12)

    def test_result_not_finished(self):
        job_id = self.submit(self.blocker(trials=2))
        self.assertRefused(T.ErrorCode.NOT_FINISHED, self.c.result, job_id)


class CancelTest(ServiceTest):
    def test_queue_full(self):
        """One job runs, --max-queue wait, the next is QUEUE_FULL (at most one submit earlier
        when the first has not started yet); cancelling newest first empties the queue."""
        global REJECTED
        ids = []
        for _ in range(MAX_QUEUE + 2):
            try:
                ids.append(self.submit(self.blocker()))
            except T.RequestError as e:
                REJECTED += 1
                self.assertEqual(e.code, T.ErrorCode.QUEUE_FULL, e.message)
                break
        else:
            self.fail(f"{len(ids)} jobs accepted with --max-queue {MAX_QUEUE}")
        self.assertGreaterEqual(len(ids), MAX_QUEUE)
        for job_id in reversed(ids):
            cancelled = self.c.cancel(job_id)
            res = self.wait(job_id)
            self.assertEqual(xctx_client.phase_name(res.phase), "CANCELLED" if cancelled else "DONE")
        self.assertEqual(self.c.metrics().queued, 0)

    def test_cancel_queued(self):
        running = self.submit(self.blocker())
        queued = self.submit(xctx_client.generate(PARIS, max_tokens=8))
        st = self.c.status(queued)
        self.assertEqual(st.phase, T.JobPhase.QUEUED)
        self.assertGreaterEqual(st.queue_position, 1)
        self.assertEqual(st.elapsed_s, 0)
        self.assertTrue(self.c.cancel(queued))
        self.assertEqual(self.c.status(queued).phase, T.JobPhase.CANCELLED)
        self.assertEqual(self.wait(queued).phase, T.JobPhase.CANCELLED)
        self.assertFalse(self.c.cancel(queued))
        self.assertTrue(self.c.cancel(running))

    def test_cancel_running(self):
        job_id = self.submit(self.blocker(trials=4))
        self.status_until(job_id, ["PREFILL", "DECODE"])
        self.assertTrue(self.c.cancel(job_id))
        res = self.wait(job_id, timeout_s=60)
        self.assertEqual(xctx_client.phase_name(res.phase), "CANCELLED")
        st = self.c.status(job_id)
        self.assertEqual(st.items_total, 4)
        self.assertLess(st.items_done, st.items_total)
        self.assertFalse(self.c.cancel(job_id))


class StillServingTest(ServiceTest):
    def test_still_serving(self):
        """After every refusal and failure above, a job still runs and metrics() add up."""
        res = self.run_job(xctx_client.generate(PARIS, max_tokens=8))
        self.assertDone(res)
        self.assertIn("Paris", res.text)
        m = self.c.metrics()
        phases = list(ENDED.values())
        self.assertGreaterEqual(m.rejected, REJECTED)
        self.assertGreaterEqual(m.submitted, SUBMITTED)
        self.assertGreaterEqual(m.completed, phases.count(T.JobPhase.DONE))
        self.assertGreaterEqual(m.failed, phases.count(T.JobPhase.FAILED))
        self.assertGreaterEqual(m.cancelled, phases.count(T.JobPhase.CANCELLED))
        self.assertEqual(m.queued, 0)
        self.assertGreater(m.uptime_s, 0)
        self.assertGreater(m.prompt_tokens, 0)
        self.assertGreater(m.generated_tokens, 0)
        self.assertGreater(m.busy_s, 0)


def load_tests(loader, tests, pattern):
    """Classes and methods in the order they are written (the closing test must run last)."""
    module = sys.modules[__name__]
    classes = [c for c in vars(module).values()
               if isinstance(c, type) and issubclass(c, unittest.TestCase) and c.__module__ == __name__]
    suite = unittest.TestSuite()
    for cls in sorted(classes, key=lambda c: inspect.getsourcelines(c)[1]):
        names = sorted(loader.getTestCaseNames(cls), key=lambda n: getattr(cls, n).__code__.co_firstlineno)
        suite.addTests(cls(n) for n in names)
    return suite


def run(argv):
    """unittest with the module's order and a closing `N passed, M failed` line; the exit code."""
    rest = parse_args(argv[1:])
    result = unittest.main(module="__main__", argv=[argv[0], *rest], exit=False, verbosity=2).result
    failed = len(result.failures) + len(result.errors) + len(result.unexpectedSuccesses)
    not_passed = [t for t, _ in result.failures + result.errors + result.skipped + result.expectedFailures]
    passed = result.testsRun - sum(isinstance(t, unittest.TestCase) for t in not_passed)
    skipped = f", {len(result.skipped)} skipped" if result.skipped else ""
    print(f"{passed} passed, {failed} failed{skipped}")
    return 1 if failed or not result.testsRun else 0


if __name__ == "__main__":
    sys.exit(run(sys.argv))
