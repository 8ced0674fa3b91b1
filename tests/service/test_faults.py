#!/usr/bin/python3
"""A rank killed with SIGKILL mid-job under the supervisor (launch/xctx-serve) loses no accepted
job: the service on 2 ranks with --journal takes three jobs (one long, running; two queued), rank
1 is killed, mpirun ends every rank, the supervisor starts the service again on the same journal,
and then: the interrupted job is FAILED with a clear error on both surfaces (Thrift status and
HTTP /v1/jobs; policy --on-interrupt fail), the two queued jobs run to DONE, each exactly once
(the journal holds one start and one end for each), new ids continue after the old ones, and a
SIGTERM to the supervisor ends everything with exit code 0.

    /usr/bin/python3 tests/service/test_faults.py --xctx build/xctx --model models/SmolLM2-135M-Instruct.Q4_1.gguf
"""
import json
import os
import secrets
import signal
import struct
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import test_service as ts  # noqa: E402
import xctx_client  # noqa: E402

T = xctx_client.bindings().ttypes
LONG = " ".join(["The river ran past the mill and the mill wheel turned all day."] * 60)


def rank_pids(sid):
    """{rank: pid} of the ranks in session sid."""
    out = {}
    for pid in ts.session_pids(sid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        for kv in env:
            if kv.startswith(b"OMPI_COMM_WORLD_RANK="):
                out[int(kv.split(b"=")[1])] = pid
    return out


def journal_records(path):
    """[(type, id)] of a job journal (coordinator/service/job_journal.h's format)."""
    recs = []
    with open(path, "rb") as f:
        data = f.read()
    at = 0
    while at + 21 <= len(data):
        assert data[at:at + 4] == b"XJR1", f"bad record at {at}"
        typ = data[at + 4]
        job_id, n = struct.unpack_from("<qI", data, at + 5)
        recs.append((typ, job_id))
        at += 17 + n + 4
    assert at == len(data), "a torn tail after a clean stop"
    return recs


class FaultTests(unittest.TestCase):
    def test_a_killed_rank_loses_no_accepted_job(self):
        d = tempfile.mkdtemp(prefix="xctx-faults-")
        token = secrets.token_hex(16)
        with open(os.path.join(d, "token"), "w") as f:
            f.write(token)
        port_file, http_file = os.path.join(d, "port"), os.path.join(d, "http_port")
        journal = os.path.join(d, "journal")
        cmd = [os.path.join(ts.ROOT, "launch", "xctx-serve"), "--backoff", "1", "--max-restarts", "3",
               "-np", "2", ts.OPTIONS.xctx, "serve", "--model", ts.OPTIONS.model, "--journal", journal,
               "--on-interrupt", "fail", "--port", "0", "--port-file", port_file, "--http-port", "0",
               "--http-port-file", http_file, "--token-file", os.path.join(d, "token"), "--ctx", "2048",
               "--max-output-tokens", "64", "--threads", "1", "--log-dir", os.path.join(d, "logs")]
        out_path = os.path.join(d, "supervisor.out")
        with open(out_path, "w") as out:
            sup = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=d,
                                   env=dict(os.environ, **ts.MPI_ENV), start_new_session=True)

        def logs():
            return f"--- {out_path}\n{ts.tail(out_path, 60)}"

        def read_port(path):
            return ts.port_in_file(sup, path, logs)

        try:
            port = ts.wait_until(lambda: read_port(port_file), 120, "the Thrift port")
            os.remove(port_file)
            os.remove(http_file)
            with xctx_client.connect(port=port, token=token, timeout_s=60) as c:
                long_id = c.submit(xctx_client.generate(LONG, max_tokens=64))
                a = c.submit(xctx_client.generate("The capital of France is", max_tokens=8))
                b = c.submit(xctx_client.generate("Once upon a time", max_tokens=8))
                ts.wait_until(lambda: c.status(long_id).phase in (T.JobPhase.PREFILL, T.JobPhase.DECODE) and
                              c.status(long_id).tokens_done > 0, 60, "the long job to run")
                self.assertEqual(c.status(a).phase, T.JobPhase.QUEUED)
            ranks = rank_pids(sup.pid)
            self.assertEqual(sorted(ranks), [0, 1], ranks)
            os.kill(ranks[1], signal.SIGKILL)

            # The supervisor starts a new service on the same journal.
            port = ts.wait_until(lambda: read_port(port_file), 180, "the restarted service's Thrift port")
            http_port = ts.wait_until(lambda: read_port(http_file), 60, "the restarted service's HTTP port")
            self.assertNotEqual(rank_pids(sup.pid).get(1), ranks[1])
            with xctx_client.connect(port=port, token=token, timeout_s=60) as c:
                st = c.status(long_id)
                self.assertEqual(st.phase, T.JobPhase.FAILED)
                self.assertIn("interrupted", st.error)
                for job in (a, b):
                    r = c.wait(job, timeout_s=180)
                    self.assertEqual(r.phase, T.JobPhase.DONE, r.error)
                    self.assertTrue(r.text)
                new = c.submit(xctx_client.generate("Hello", max_tokens=2))
                self.assertEqual(new, b + 1)
                self.assertEqual(c.wait(new, timeout_s=120).phase, T.JobPhase.DONE)
            req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/jobs/{long_id}",
                                         headers={"Authorization": f"Bearer {token}"})
            body = json.loads(urllib.request.urlopen(req, timeout=30).read())
            self.assertEqual(body["phase"], "FAILED")
            self.assertIn("interrupted", body["error"])

            os.kill(sup.pid, signal.SIGTERM)
            self.assertEqual(sup.wait(60), 0, logs())
            with open(out_path) as f:
                self.assertIn("restart 1/3", f.read())
            recs = journal_records(os.path.join(journal, "jobs.journal"))
            for job in (a, b, new):
                self.assertEqual(recs.count((2, job)), 1, f"job {job} started {recs.count((2, job))} times")
                self.assertEqual(recs.count((3, job)), 1)
            self.assertEqual(recs.count((2, long_id)), 1)
            self.assertEqual(recs.count((3, long_id)), 1)
        finally:
            if sup.poll() is None:
                ts.kill_session(sup)
            if sys.exc_info()[0] is not None:
                print(logs(), file=sys.stderr)


if __name__ == "__main__":
    rest = ts.parse_args(sys.argv[1:])
    result = unittest.main(argv=[sys.argv[0], *rest], exit=False, verbosity=2).result
    sys.exit(0 if result.wasSuccessful() and result.testsRun > 0 else 1)
