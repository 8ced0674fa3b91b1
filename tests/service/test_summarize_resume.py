#!/usr/bin/python3
"""End-to-end tests of the batch command `xctx summarize` on 2 MPI ranks: killed (SIGKILL to
mpirun and every rank) part-way and resumed with --resume, every document ends up in the output
exactly once, the lines written before the kill are kept, and every summary (greedy) equals the
one an uninterrupted run writes; malformed input and duplicate ids
are refused up front, naming the line or the id.

    /usr/bin/python3 tests/service/test_summarize_resume.py --xctx build/xctx --model models/SmolLM2-135M-Instruct.Q4_1.gguf

(or XCTX_BIN / XCTX_TEST_MODEL; other arguments go to unittest).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_service import (MPI_ENV, OPTIONS, RANKS, SENTENCES, kill_session, mpirun, run,  # noqa: E402
                          tail, wait_until)

MAX_TOKENS = 24
RUN_TIMEOUT_S = 300


def documents():
    """d1..d6, three distinct sentences each, and one that names a file (an error line)."""
    n = len(SENTENCES)
    docs = [{"id": f"d{i}", "text": " ".join(SENTENCES[(i + k) % n] for k in (0, 3, 5))} for i in range(1, 7)]
    docs.insert(3, {"id": "bad", "path": "does/not/exist.txt"})
    return docs


def complete_lines(path):
    """The newline-terminated lines of `path` (a killed writer may leave half a line)."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return []
    return text[:text.rfind("\n") + 1].splitlines(keepends=True)


class SummarizeTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="xctx-summarize-")
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
        self.docs_path = os.path.join(self.dir, "docs.jsonl")
        self.out_path = os.path.join(self.dir, "out.jsonl")
        self.log_path = os.path.join(self.dir, "summarize.log")

    def write_docs(self, lines):
        with open(self.docs_path, "w") as f:
            f.writelines(line + "\n" for line in lines)

    def start(self, *extra, out=None):
        """`mpirun -np 2 xctx summarize` in its own session, output appended to the log."""
        cmd = mpirun("summarize", "--model", OPTIONS.model, "--in", self.docs_path, "--out", out or self.out_path,
                     "--max-tokens", str(MAX_TOKENS), *extra)
        with open(self.log_path, "a") as log:
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.dir,
                                    env=dict(os.environ, **MPI_ENV), start_new_session=True)

    def finish(self, proc):
        """The exit code of a run, killed (and failed) after RUN_TIMEOUT_S."""
        try:
            return proc.wait(RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            kill_session(proc)
            self.fail(f"xctx summarize still running after {RUN_TIMEOUT_S} s:\n{tail(self.log_path)}")

    def test_kill_and_resume(self):
        docs = documents()
        self.write_docs(json.dumps(d) for d in docs)
        proc = self.start()

        def two_lines():
            if proc.poll() is not None:
                self.fail(f"xctx summarize exited with {proc.returncode} before writing 2 lines:\n"
                          f"{tail(self.log_path)}")
            return len(complete_lines(self.out_path)) >= 2
        wait_until(two_lines, RUN_TIMEOUT_S, f"2 lines in {self.out_path}", poll_s=0.02)
        kill_session(proc)
        before = complete_lines(self.out_path)
        self.assertLess(len(before), len(docs), "every document was done before the kill")

        rc = self.finish(self.start("--resume"))
        self.assertEqual(rc, 0, tail(self.log_path))
        lines = complete_lines(self.out_path)
        with open(self.out_path) as f:
            self.assertEqual(f.read(), "".join(lines), "the output ends in half a line")
        self.assertEqual(lines[:len(before)], before, "--resume changed the lines written before the kill")
        out = [json.loads(line) for line in lines]
        ids = [o["id"] for o in out]
        self.assertEqual(sorted(ids), sorted(d["id"] for d in docs), "each document exactly once")
        for o in out:
            if o["id"] == "bad":
                self.assertTrue(o.get("error"), o)
                continue
            self.assertNotIn("error", o)
            self.assertTrue(o["summary"].strip(), o)
            self.assertGreater(o["prompt_tokens"], 0, o)
            self.assertTrue(1 <= o["generated_tokens"] <= MAX_TOKENS, o)
            self.assertGreaterEqual(o["prefill_s"], 0, o)
            self.assertGreaterEqual(o["decode_s"], 0, o)
            self.assertEqual(o["cache"], "fp16", o)
            self.assertEqual(o["ranks"], RANKS, o)

        # The same documents in one uninterrupted run: a resumed document is summarized from
        # scratch, so with greedy decoding its summary is the uninterrupted run's, token for token.
        whole_path = os.path.join(self.dir, "whole.jsonl")
        self.assertEqual(self.finish(self.start(out=whole_path)), 0, tail(self.log_path))
        whole = {o["id"]: o for o in map(json.loads, complete_lines(whole_path))}
        self.assertEqual(sorted(whole), sorted(ids))
        for i, o in enumerate(out):
            w = whole[o["id"]]
            when = "written before the kill" if i < len(before) else "resumed"
            for field in ("summary", "generated_tokens", "prompt_tokens", "error"):
                self.assertEqual(o.get(field), w.get(field), f"{o['id']} ({when}): {field} differs from the uninterrupted run")

    def assertRefused(self, lines, *words):
        """summarize over `lines` exits non-zero and its output names every one of `words`."""
        self.write_docs(lines)
        rc = self.finish(self.start())
        log = tail(self.log_path, 200)
        self.assertNotEqual(rc, 0, log)
        for word in words:
            self.assertIn(word, log)

    def test_malformed_line(self):
        self.assertRefused(['{"id": "a", "text": "One."}', '{"id": "b", "text": "Two."}', "this is not json",
                            '{"id": "c", "text": "Three."}'], "line 3")

    def test_duplicate_id(self):
        self.assertRefused(['{"id": "twin", "text": "One."}', '{"id": "other", "text": "Two."}',
                            '{"id": "twin", "text": "Three."}'], "twin")


if __name__ == "__main__":
    sys.exit(run(sys.argv))
