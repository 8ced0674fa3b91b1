#!/usr/bin/env python3
"""Batch summarization demo: `xctx summarize` on real books, once per cache format, with
throughput and a simple, honest quality signal.

One command (all three steps, the quick set; measured cost model on the 2-core development
machine: fp16 ~3 min, nuq3-1% ~4 min, xquant-cl3 ~28 min, so ~35 min in all; with
--formats fp16,nuq3-1% about 8 min):
    /usr/bin/python3 benchmarks/summarize_demo.py
writes benchmarks/results/summarize_demo.{csv,md,png}. (Debian's /usr/bin/python3 has
python3-matplotlib; without matplotlib the PNG is skipped.) xquant-cl3 dominates: it rebuilds K
from its cross-layer latents at every decode step, so a token costs ~0.31 s at 1.2K tokens of
context (fp16: 0.024 s, 13x) and ~2.7 s at 7.6K (`xctx bench`, 2 ranks); its prefill takes
~1.5-2x fp16's.

Steps (positional; default: all three):
  write   builds the documents as JSONL under benchmarks/results/tmp/summarize_demo/<set>/:
          chapters of Jane Austen's novels (Debian's r-cran-janeaustenr, read with
          tests/data/austen_text.py), whole books of the King James Bible (Debian's bible-kjv,
          through its `bible` reader), and documents longer than the model's 8K context, which
          the command summarizes by map-reduce. Short documents go inline ("text"), long ones as
          files ("path", relative to the JSONL).
            quick (default): 6 short chapters (0.8K-1.3K words) of Pride and Prejudice, Northanger
                   Abbey and Emma, the books of Ruth, Jonah and Philemon, and Persuasion chapters
                   1-3 joined (7.4K words, ~9.5K tokens: the map-reduce path, 2 chunks).
            --full: every chapter of the six novels (269), ten KJV books (Ruth ... Judges, six of
                   them over 8K tokens) and the six whole novels (77K-160K words each, by
                   map-reduce). Hours: ~4 h for fp16, ~4.5 h for nuq3-1%, well over a day for
                   xquant-cl3 (the write step prints the estimate); use --formats fp16,nuq3-1%.
          --ids A,B / --limit N take a subset (working folder "check", report kept there).
  run     for each --formats entry runs
              launch/xctx-mpirun -np RANKS build/xctx summarize --in docs.jsonl --out S.jsonl --cache FMT
          timing the whole run (the nuq formats get --calib; without --calib the script makes one
          with `xctx calibrate --text austen:sensesensibility --samples 8 --seq-len 2048`).
  report  reads the summaries and writes the CSV (one row per document and format), the Markdown
          report and the PNG.

Quality signal (simple on purpose): each source has a hand-made list of its characters' names
(NAMES below, one entry per name word with its aliases, e.g. Elizabeth = Elizabeth|Lizzy|Eliza;
names of the deity -- God, LORD, Lord, Jesus, Christ -- are left out). For each document the
names are counted in the source text (case-sensitive whole words, plural/possessive allowed);
a summary "names the top-1" when it contains the most frequent one, and "names a top-3" when it
contains any of the three most frequent. Degenerate: empty, or a phrase repeated (an 8-word
sequence twice, or a 4-word sequence 4 times, or under 30% distinct words in 30+ words).
"""
import argparse
import collections
import csv
import datetime
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "data"))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
TMP = os.path.join(RESULTS, "tmp", "summarize_demo")
FORMATS = ["fp16", "nuq3-1%", "xquant-cl3"]
CALIB_CMD = ["calibrate", "--text", "austen:sensesensibility", "--samples", "8", "--seq-len", "2048"]

NOVELS = {  # janeaustenr name -> (short id, title, chapter count)
    "prideprejudice": ("pp", "Pride and Prejudice", 61),
    "emma": ("emma", "Emma", 55),
    "northangerabbey": ("na", "Northanger Abbey", 31),
    "persuasion": ("pers", "Persuasion", 24),
    "sensesensibility": ("ss", "Sense and Sensibility", 50),
    "mansfieldpark": ("mp", "Mansfield Park", 48),
}
KJV_QUICK = ["Ruth", "Jonah", "Philemon"]
KJV_FULL = ["Ruth", "Jonah", "Philemon", "Esther", "Ezra", "Daniel", "Nehemiah", "Job", "Joshua", "Judges"]
# The quick set uses short chapters: xquant-cl3's decode step costs ~13x fp16's at 1K context
# and ~20x at 8K on this CPU, and it dominates the run time.
AUSTEN_QUICK = [("prideprejudice", 1), ("prideprejudice", 2), ("northangerabbey", 4), ("northangerabbey", 5),
                ("emma", 17), ("emma", 55)]
LONG_QUICK = ("persuasion", 1, 3)  # chapters 1..3 joined: ~9.4K tokens, over the 8K context

# Character names per source: canonical name word -> aliases. Hand-made from the texts.
NAMES = {
    "prideprejudice": {"Elizabeth": ["Lizzy", "Eliza"], "Darcy": [], "Jane": [], "Bingley": [], "Bennet": [],
                       "Lydia": [], "Wickham": [], "Collins": [], "Charlotte": [], "Lucas": [], "Kitty": [],
                       "Catherine": [], "Mary": [], "Gardiner": [], "Georgiana": [], "Fitzwilliam": [],
                       "Caroline": [], "Hurst": [], "Louisa": [], "Forster": [], "Phillips": [], "Bourgh": [],
                       "Maria": [], "Denny": []},
    "emma": {"Emma": [], "Harriet": [], "Knightley": [], "Elton": [], "Weston": [], "Frank": [], "Churchill": [],
             "Jane": [], "Fairfax": [], "Woodhouse": [], "Bates": [], "Smith": [], "Martin": [], "Isabella": [],
             "John": [], "Taylor": [], "Perry": [], "Campbell": [], "Dixon": [], "Cole": [], "Goddard": [],
             "Augusta": [], "Hawkins": [], "Robert": [], "Suckling": []},
    "northangerabbey": {"Catherine": [], "Tilney": [], "Isabella": [], "Henry": [], "Eleanor": [], "Morland": [],
                        "Thorpe": [], "James": [], "John": [], "Allen": [], "Frederick": []},
    "persuasion": {"Anne": [], "Elliot": [], "Wentworth": [], "Russell": [], "Walter": [], "Charles": [],
                   "Musgrove": [], "Mary": [], "Louisa": [], "Henrietta": [], "Elizabeth": [], "Harville": [],
                   "Benwick": [], "Smith": [], "Clay": [], "Croft": [], "Hayter": [], "Shepherd": [],
                   "Dalrymple": [], "Carteret": [], "Frederick": [], "Wallis": [], "Rooke": []},
    "sensesensibility": {"Elinor": [], "Marianne": [], "Edward": [], "Lucy": [], "Willoughby": [], "Brandon": [],
                         "Dashwood": [], "John": [], "Jennings": [], "Middleton": [], "Fanny": [], "Ferrars": [],
                         "Steele": [], "Margaret": [], "Robert": [], "Palmer": [], "Charlotte": [], "Grey": [],
                         "Eliza": []},
    "mansfieldpark": {"Fanny": [], "Edmund": [], "Crawford": [], "Bertram": [], "Thomas": [], "Norris": [],
                      "Julia": [], "Maria": [], "Henry": [], "Mary": [], "William": [], "Tom": [], "Rushworth": [],
                      "Yates": [], "Grant": [], "Price": [], "Susan": [], "Betsey": []},
    "Ruth": {"Naomi": ["Mara"], "Ruth": [], "Boaz": [], "Orpah": [], "Elimelech": [], "Mahlon": [], "Chilion": [],
             "Obed": [], "Jesse": [], "David": []},
    "Jonah": {"Jonah": [], "Amittai": []},
    "Philemon": {"Paul": [], "Philemon": [], "Onesimus": [], "Timothy": ["Timotheus"], "Apphia": [],
                 "Archippus": [], "Epaphras": [], "Marcus": [], "Aristarchus": [], "Demas": [], "Lucas": []},
    "Esther": {"Esther": ["Hadassah"], "Mordecai": [], "Haman": [], "Ahasuerus": [], "Vashti": [], "Hegai": [],
               "Hatach": [], "Zeresh": [], "Harbonah": [], "Bigthan": [], "Teresh": [], "Memucan": []},
    "Ezra": {"Ezra": [], "Cyrus": [], "Artaxerxes": [], "Darius": [], "Zerubbabel": [], "Jeshua": [],
             "Haggai": [], "Zechariah": [], "Tatnai": [], "Rehum": [], "Shimshai": [], "Sheshbazzar": [],
             "Shechaniah": []},
    "Daniel": {"Daniel": ["Belteshazzar"], "Nebuchadnezzar": [], "Belshazzar": [], "Darius": [], "Cyrus": [],
               "Shadrach": [], "Meshach": [], "Abednego": [], "Hananiah": [], "Mishael": [], "Azariah": [],
               "Gabriel": [], "Michael": [], "Ashpenaz": [], "Arioch": [], "Melzar": []},
    "Nehemiah": {"Nehemiah": [], "Artaxerxes": [], "Sanballat": [], "Tobiah": [], "Geshem": [], "Ezra": [],
                 "Eliashib": [], "Hanani": [], "Hananiah": []},
    "Job": {"Job": [], "Eliphaz": [], "Bildad": [], "Zophar": [], "Elihu": [], "Satan": []},
    "Joshua": {"Joshua": [], "Moses": [], "Nun": [], "Rahab": [], "Caleb": [], "Achan": [], "Eleazar": [],
               "Phinehas": [], "Adonizedek": [], "Jabin": []},
    "Judges": {"Samson": [], "Gideon": ["Jerubbaal"], "Jephthah": [], "Deborah": [], "Barak": [], "Delilah": [],
               "Abimelech": [], "Ehud": [], "Othniel": [], "Manoah": [], "Micah": [], "Sisera": [], "Jael": [],
               "Eglon": [], "Jotham": []},
}

# Rough cost model for the estimates printed before a run, per sequence of P prompt and G generated
# tokens on 2 ranks of the 2-core machine: prefill a*P + b*P^2 seconds, decode G*(d0 + d1*context).
# Fitted to measured runs (see the report's timings); generation is assumed to run to its limit
# (the 135M model usually does).
TOKENS_PER_WORD = 1.3
COST = {  # format: (a, b, d0, d1)
    "fp16": (3.0e-3, 3.6e-7, 0.021, 5e-6),
    "nuq3-1%": (3.3e-3, 4.5e-7, 0.022, 6e-6),
    "xquant-cl3": (4.5e-3, 8.0e-7, 0.030, 3.0e-4),
}
PROMPT_OVERHEAD = 60  # chat template + instruction tokens
MAP_TOKENS = 160      # the command's --map-tokens default


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- write


def reflow(lines):
    """Hard-wrapped lines -> paragraphs (one line each, blank line between)."""
    paras, cur = [], []
    for line in lines:
        s = " ".join(line.split())
        if s:
            cur.append(s)
        elif cur:
            paras.append(" ".join(cur))
            cur = []
    if cur:
        paras.append(" ".join(cur))
    return paras


END_MATTER = re.compile(r"^\s*(FINIS|Finis|THE END|A NOTE ON THE TEXT)\s*$")
CHAPTER = re.compile(r"^(CHAPTER|Chapter)\s+([0-9]+|[IVXLC]+)\.?\s*$")
VOLUME = re.compile(r"^VOLUME\s+([IVX]+)\s*$")


def austen_chapters(novel_lines, name):
    """[{heading, volume, paras}] in order; front matter, volume lines and end matter dropped."""
    chapters, cur, volume = [], None, None
    for line in novel_lines:
        if END_MATTER.match(line):
            break
        m = VOLUME.match(line)
        if m:
            volume = m.group(1)
            continue
        if CHAPTER.match(line):
            cur = {"heading": line.strip(), "volume": volume, "lines": []}
            chapters.append(cur)
        elif cur is not None:
            cur["lines"].append(line)
    want = NOVELS[name][2]
    if len(chapters) != want:
        raise SystemExit(f"{name}: found {len(chapters)} chapters, expected {want}")
    for c in chapters:
        c["paras"] = reflow(c.pop("lines"))
    return chapters


def heading(c):
    """'CHAPTER III' -> 'Chapter III' (numerals kept)."""
    word, num = c["heading"].rstrip(".").split()[:2]
    return word.capitalize() + " " + num


def kjv_book(book):
    """[(chapter number, [verse text])] from `bible -l0 BOOK1:1-999:999` (verse numbers dropped)."""
    p = subprocess.run(["bible", "-l0", f"{book}1:1-999:999"], capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"`bible` failed for {book} (install bible-kjv): {p.stderr.strip()}")
    chapters, header = [], re.compile(r"^(.+) ([0-9]+)$")
    for line in p.stdout.splitlines():
        if not line.strip():
            continue
        m = re.match(r"^\s+([0-9]+) (.*)$", line)
        if m:
            if not chapters:
                raise SystemExit(f"{book}: verse before any chapter header")
            chapters[-1][1].append(" ".join(m.group(2).split()))
            continue
        h = header.match(line)
        if not h or h.group(1).replace(" ", "").lower() != book.lower():
            raise SystemExit(f"{book}: unexpected line from `bible`: {line!r}")
        chapters.append((int(h.group(2)), []))
    if not chapters or any(not v for _, v in chapters):
        raise SystemExit(f"{book}: no verses read")
    return chapters


def name_pattern(word):
    return re.compile(r"(?<![A-Za-z])" + re.escape(word) + r"(?:'s|s|es)?(?![A-Za-z])")


def count_names(text, source):
    """[(name, count)] of the source's character names, most frequent first (count > 0)."""
    counts = []
    for canon, aliases in NAMES[source].items():
        n = sum(len(name_pattern(w).findall(text)) for w in [canon] + aliases)
        if n:
            counts.append((canon, n))
    order = list(NAMES[source])
    counts.sort(key=lambda t: (-t[1], order.index(t[0])))
    return counts


def mentions(summary, source, canon):
    return any(name_pattern(w).search(summary) for w in [canon] + NAMES[source][canon])


def build_docs(full):
    """[(meta, text)] for the chosen set."""
    import austen_text  # tests/data: reads janeaustenr's Rdata without R
    novels = {k: v.split("\n") for k, v in austen_text.novels().items()}
    chapters = {name: austen_chapters(novels[name], name) for name in NOVELS}
    docs = []

    def chapter_doc(name, i):
        c = chapters[name][i - 1]
        short, title, _ = NOVELS[name]
        where = (f"Volume {c['volume']}, " if c["volume"] else "") + heading(c)
        return ({"id": f"{short}-ch{i:02d}", "source": name, "kind": "chapter", "title": f"{title}, {where}"},
                "\n\n".join(c["paras"]))

    def joined_doc(name, first, last, kind, doc_id, title):
        parts = []
        for c in chapters[name][first - 1:last]:
            parts.append(heading(c) + "\n\n" + "\n\n".join(c["paras"]))
        return ({"id": doc_id, "source": name, "kind": kind, "title": title}, "\n\n".join(parts))

    if full:
        for name in NOVELS:
            for i in range(1, len(chapters[name]) + 1):
                docs.append(chapter_doc(name, i))
    else:
        for name, i in AUSTEN_QUICK:
            docs.append(chapter_doc(name, i))
    for book in (KJV_FULL if full else KJV_QUICK):
        text = "\n\n".join(" ".join(verses) for _, verses in kjv_book(book))
        docs.append(({"id": f"kjv-{book.lower()}", "source": book, "kind": "book", "title": f"KJV, {book}"}, text))
    if full:
        for name, (short, title, n) in NOVELS.items():
            docs.append(joined_doc(name, 1, n, "novel", f"{short}-novel", f"{title} (whole novel)"))
    else:
        name, a, b = LONG_QUICK
        short, title, _ = NOVELS[name]
        docs.append(joined_doc(name, a, b, "chapters", f"{short}-ch{a:02d}-{b:02d}",
                               f"{title}, chapters {a}-{b} joined"))
    return docs


def est_seconds(meta, fmt, args):
    """Seconds for one document from the cost model (chunked like the command's map-reduce)."""
    a, b, d0, d1 = COST.get(fmt, COST["xquant-cl3"])
    toks = meta["words"] * TOKENS_PER_WORD
    seqs = []  # (prompt tokens, generated tokens)
    if toks + PROMPT_OVERHEAD + args.max_tokens + 16 <= args.ctx:
        seqs.append((toks + PROMPT_OVERHEAD, args.max_tokens))
    else:
        room = args.ctx - MAP_TOKENS - PROMPT_OVERHEAD - 16
        full, rest = divmod(toks, room)
        seqs += [(room + PROMPT_OVERHEAD, MAP_TOKENS)] * int(full) + ([(rest + PROMPT_OVERHEAD, MAP_TOKENS)] if rest else [])
        seqs.append((len(seqs) * MAP_TOKENS + PROMPT_OVERHEAD, args.max_tokens))
    return sum(a * p + b * p * p + g * (d0 + d1 * (p + g / 2)) for p, g in seqs) + 1.0


def step_write(args):
    os.makedirs(os.path.join(args.dir, "docs"), exist_ok=True)
    log(f"write: building the {'full' if args.full else 'quick'} set in {os.path.relpath(args.dir, ROOT)}")
    docs = build_docs(args.full)
    if args.ids:
        want = args.ids.split(",")
        docs = [d for d in docs if d[0]["id"] in want]
        missing = set(want) - {d[0]["id"] for d in docs}
        if missing:
            raise SystemExit(f"--ids: unknown ids {sorted(missing)}")
    if args.limit:
        docs = docs[:args.limit]
    metas = []
    with open(args.docs, "w") as f:
        for meta, text in docs:
            meta["words"] = len(text.split())
            meta["chars"] = len(text)
            meta["names"] = count_names(text, meta["source"])
            line = {"id": meta["id"]}
            if meta["kind"] in ("chapters", "novel"):  # long ones go by file (the "path" form)
                rel = os.path.join("docs", meta["id"] + ".txt")
                with open(os.path.join(args.dir, rel), "w") as g:
                    g.write(text + "\n")
                line["path"] = rel
            else:
                line["text"] = text
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
            metas.append(meta)
            top = ", ".join(f"{n} {c}" for n, c in meta["names"][:3])
            log(f"  {meta['id']:16s} {meta['words']:7d} words  ~{meta['words'] * TOKENS_PER_WORD / 1000:5.1f}K tok"
                f"  {meta['title']}  [{top}]")
    with open(args.meta, "w") as f:
        json.dump({"set": "full" if args.full else "quick", "docs": metas}, f, indent=1)
    total = {fmt: sum(est_seconds(m, fmt, args) for m in metas) for fmt in args.formats.split(",")}
    words = sum(m["words"] for m in metas)
    log(f"write: {len(metas)} documents, {words} words (~{words * TOKENS_PER_WORD / 1000:.0f}K tokens) -> "
        f"{os.path.relpath(args.docs, ROOT)}")
    log("write: rough run time, 2 ranks on 2 cores: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in total.items())
        + f" (total {sum(total.values()) / 60:.0f} min + ~1 min calibration)")


# ---------------------------------------------------------------- run


def safe(fmt):
    return fmt.replace("%", "pct")


def out_path(args, fmt):
    return os.path.join(args.dir, f"summaries_{safe(fmt)}.jsonl")


def count_lines(path):
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def last_id(path):
    try:
        with open(path, "rb") as f:
            lines = [l for l in f.read().splitlines() if l.strip()]
        j = json.loads(lines[-1])
        return j.get("id", "?") + (" ERROR" if "error" in j else "")
    except (OSError, IndexError, ValueError):
        return "?"


def log_tail_line(path):
    """The last non-empty line of a log, '\r' progress updates included."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 4096))
            parts = [p.strip() for p in re.split(r"[\r\n]", f.read().decode("utf-8", "replace"))]
        return next((p for p in reversed(parts) if p), "")
    except OSError:
        return ""


def run_bounded(cmd, log_path, timeout, progress=None, append=False):
    """Runs cmd in its own process group, output to log_path; kills that group after timeout s.
    Prints progress() when it changes, and the command's own last log line every minute or so."""
    t0 = time.time()
    with open(log_path, "a" if append else "w") as lf:
        p = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        last, last_tail, tail_at = None, None, t0
        while True:
            try:
                rc = p.wait(timeout=5)
                break
            except subprocess.TimeoutExpired:
                pass
            if progress:
                msg = progress()
                if msg != last:
                    log(f"    {time.time() - t0:7.0f} s  {msg}")
                    last, tail_at = msg, time.time()
            if time.time() - tail_at >= 60:
                t = log_tail_line(log_path)
                if t and t != last_tail:
                    log(f"    {time.time() - t0:7.0f} s  | {t[:150]}")
                    last_tail = t
                tail_at = time.time()
            if timeout and time.time() - t0 > timeout:
                log(f"    timeout after {timeout:.0f} s: stopping process group {p.pid}")
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    rc = p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    rc = p.wait()
                rc = rc if rc else 124
                break
    return rc, time.time() - t0


def tail(path, n=5):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def step_run(args):
    if not os.path.exists(args.docs):
        raise SystemExit(f"{args.docs} missing: run the write step first")
    with open(args.meta) as f:
        metas = json.load(f)["docs"]
    h = subprocess.run([args.xctx, "summarize", "--help"], capture_output=True, text=True)
    if h.returncode != 0:
        raise SystemExit(f"`{args.xctx} summarize --help` failed (rc {h.returncode}): is the binary built?")
    formats = args.formats.split(",")
    calib = args.calib
    if any(f.startswith("nuq") for f in formats) and not calib:
        calib = os.path.join(TMP, "SmolLM2-135M-Instruct.s8.calib")
        if not os.path.exists(calib):
            cmd = [args.xctx] + CALIB_CMD + ["--out", calib]
            log(f"run: calibrating for nuq (~1 min): {shlex.join(cmd)}")
            rc, wall = run_bounded(cmd, calib + ".log", 900)
            if rc != 0 or not os.path.exists(calib):
                raise SystemExit(f"calibration failed (rc {rc}):\n{tail(calib + '.log')}")
            log(f"run: calibration done in {wall:.0f} s")
    runs_path = os.path.join(args.dir, "runs.json")
    runs = json.load(open(runs_path)) if os.path.exists(runs_path) else {}
    for fmt in formats:
        out = out_path(args, fmt)
        if not args.resume and os.path.exists(out):
            os.unlink(out)
            runs.pop(fmt, None)
        before = count_lines(out)
        cmd = [os.path.join(ROOT, "launch", "xctx-mpirun"), "-np", str(args.ranks), args.xctx, "summarize",
               "--in", args.docs, "--out", out, "--cache", fmt]
        if args.max_tokens != 200:
            cmd += ["--max-tokens", str(args.max_tokens)]
        if args.ctx != 8192:
            cmd += ["--ctx", str(args.ctx)]
        if args.instruction:
            cmd += ["--instruction", args.instruction]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        if fmt.startswith("nuq"):
            cmd += ["--calib", calib]
        if args.sampling:
            cmd += shlex.split(args.sampling)
        if args.resume:
            cmd += ["--resume"]
        est = sum(est_seconds(m, fmt, args) for m in metas)
        timeout = args.timeout if args.timeout else 3 * est + 600
        log(f"run: {fmt}: {len(metas)} documents, rough estimate {est / 60:.1f} min (limit {timeout / 60:.0f} min)")
        log(f"run: {shlex.join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd)}")
        log_path = os.path.join(args.dir, f"run_{safe(fmt)}.log")
        rc, wall = run_bounded(cmd, log_path, timeout,
                               progress=lambda: f"{count_lines(out)}/{len(metas)} done (last: {last_id(out)})",
                               append=args.resume)
        after = count_lines(out)
        log(f"run: {fmt}: rc {rc}, {after}/{len(metas)} lines, {wall:.0f} s wall (log: {os.path.relpath(log_path, ROOT)})")
        if rc != 0:
            log(tail(log_path))
        rec = runs.get(fmt, {"segments": []})
        rec["segments"].append({"cmd": cmd, "rc": rc, "wall_s": wall, "lines_before": before, "lines_after": after,
                                "ended": datetime.datetime.now().isoformat(timespec="seconds")})
        rec["calib"] = calib if fmt.startswith("nuq") else None
        runs[fmt] = rec
        with open(runs_path, "w") as f:
            json.dump(runs, f, indent=1)


# ---------------------------------------------------------------- report


def degenerate(summary):
    words = re.findall(r"[a-z0-9]+(?:'[a-z]+)?", summary.lower())
    if not words:
        return "empty"
    for n, times in ((8, 2), (4, 4)):
        grams = collections.Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
        if grams and max(grams.values()) >= times:
            g, k = grams.most_common(1)[0]
            return f"repeats '{' '.join(g)}' x{k}"
    if len(words) >= 30 and len(set(words)) / len(words) < 0.3:
        return "few distinct words"
    return ""


def cpu_name():
    """Model, logical CPUs and the vector extensions the kernels dispatch on (results differ by ISA)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.readlines()
    except OSError:
        return "unknown"
    models = [l.split(":", 1)[1].strip() for l in lines if l.startswith("model name")]
    flags = next((l.split(":", 1)[1].split() for l in lines if l.startswith("flags")), [])
    isa = [x for x in ("avx2", "fma", "f16c", "avx512f", "avx512vbmi", "avx512_vnni", "avx_vnni", "amx_tile")
           if x in flags]
    if not models:
        return "unknown"
    return (f"{models[0]} ({len(models)} logical CPUs; {' '.join(isa) or 'no AVX2'}"
            f"{'' if 'avx512f' in flags else '; no AVX-512'})")


def step_report(args):
    with open(args.meta) as f:
        meta = json.load(f)
    runs_path = os.path.join(args.dir, "runs.json")
    runs = json.load(open(runs_path)) if os.path.exists(runs_path) else {}
    formats = [f for f in args.formats.split(",") if os.path.exists(out_path(args, f))]
    if not formats:
        raise SystemExit("report: no summaries found; run the run step first")
    docs = meta["docs"]
    doc_max = {}
    with open(args.docs) as f:
        for line in f:
            j = json.loads(line)
            doc_max[j["id"]] = j.get("max_tokens")
    rows, per_fmt = [], {}
    for fmt in formats:
        got = {}
        with open(out_path(args, fmt)) as f:
            for line in f:
                if line.strip():
                    j = json.loads(line)
                    got[j.get("id")] = j
        for m in docs:
            j = got.get(m["id"])
            top = [n for n, _ in m["names"][:3]]
            r = {"format": fmt, "id": m["id"], "kind": m["kind"], "title": m["title"], "words": m["words"],
                 "top_names": " ".join(f"{n}:{c}" for n, c in m["names"][:3])}
            if j is None:
                r["error"] = "missing"
            elif "error" in j:
                r["error"] = j["error"]
            else:
                s = j.get("summary", "")
                for k in ("prompt_tokens", "generated_tokens", "prefill_s", "decode_s", "method", "chunks", "ranks",
                          "cache"):
                    r[k] = j.get(k)
                r["summary_words"] = len(s.split())
                r["degenerate"] = degenerate(s)
                if j.get("method") == "single":  # map-reduce: the reduce step's count is not reported apart
                    r["hit_max_tokens"] = int(j.get("generated_tokens", 0) >= (doc_max.get(m["id"]) or args.max_tokens))
                if top:
                    r["names_top1"] = int(mentions(s, m["source"], top[0]))
                    r["names_top3"] = int(any(mentions(s, m["source"], n) for n in top))
                r["summary"] = s
            rows.append(r)
        ok = [r for r in rows if r["format"] == fmt and "error" not in r]
        seg = runs.get(fmt, {}).get("segments", [])
        wall = sum(s["wall_s"] for s in seg)
        done = sum(s["lines_after"] - s["lines_before"] for s in seg)
        ptok = sum(r["prompt_tokens"] or 0 for r in ok)
        gtok = sum(r["generated_tokens"] or 0 for r in ok)
        pre = sum(r["prefill_s"] or 0 for r in ok)
        dec = sum(r["decode_s"] or 0 for r in ok)
        named = [r for r in ok if "names_top1" in r]
        def frac(xs, key):
            xs = [r for r in xs if key in r]
            return sum(1 for r in xs if r[key]) / len(xs) if xs else float("nan")
        per_fmt[fmt] = {
            "docs": len(docs), "ok": len(ok), "errors": len(docs) - len(ok), "wall_s": wall,
            "docs_per_hour": done / wall * 3600 if wall else float("nan"),
            "prompt_tokens": ptok, "generated_tokens": gtok,
            "prefill_tok_s": ptok / pre if pre else float("nan"), "decode_tok_s": gtok / dec if dec else float("nan"),
            "wall_tok_s": (ptok + gtok) / wall if wall else float("nan"),
            "model_s_share": (pre + dec) / wall if wall else float("nan"),
            "top1": frac(named, "names_top1"), "top3": frac(named, "names_top3"), "named_docs": len(named),
            "degenerate": frac(ok, "degenerate"), "empty": (sum(1 for r in ok if r["degenerate"] == "empty") / len(ok))
            if ok else float("nan"), "hit_max": frac(ok, "hit_max_tokens"),
            "map_reduce": sum(1 for r in ok if r.get("method") == "map-reduce"),
            "calib": runs.get(fmt, {}).get("calib"), "cmds": [s["cmd"] for s in seg],
        }

    cols = ["format", "id", "kind", "title", "words", "prompt_tokens", "generated_tokens", "prefill_s", "decode_s",
            "method", "chunks", "ranks", "top_names", "names_top1", "names_top3", "degenerate", "hit_max_tokens",
            "summary_words", "error", "summary"]
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)

    def num(v, spec):
        return format(v, spec) if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)) else "n/a"

    def pct(v):
        return num(100 * v if isinstance(v, float) else v, ".0f") + "%" if isinstance(v, float) and not math.isnan(v) \
            else "n/a"

    rel = lambda p: os.path.relpath(p, ROOT) if isinstance(p, str) and p.startswith(ROOT) else p
    words = sum(m["words"] for m in docs)
    L = [f"# Batch summarization demo: `xctx summarize` per cache format ({meta['set']} set)", "",
         f"Model: SmolLM2-135M-Instruct Q4_1 (the default; a 135M model, so expect weak summaries). "
         f"Machine: {cpu_name()}, CPU only. Build: launch/build (Release, portable binary, AVX2/AVX-512 "
         f"kernels chosen at run time). Date: {datetime.date.today().isoformat()}.", "",
         f"Documents: {len(docs)} ({words} words): "
         + ", ".join(f"{sum(1 for m in docs if m['kind'] == k)} {k}" for k in ("chapter", "book", "chapters", "novel")
                     if any(m["kind"] == k for m in docs))
         + ". Austen chapters from Debian's r-cran-janeaustenr (reflowed paragraphs, chapter heading dropped);"
           " KJV books from Debian's bible-kjv (`bible -l0 BOOK1:1-999:999`, verse numbers dropped, one paragraph"
           " per chapter). Documents over the 8K context are summarized by map-reduce.", "",
         "## Commands", "",
         "```",
         "/usr/bin/python3 benchmarks/summarize_demo.py" + (" --full" if meta["set"] == "full" else "")
         + f" --formats {','.join(formats)} --ranks {args.ranks}   # write + run + report", ]
    for fmt in formats:
        for c in per_fmt[fmt]["cmds"]:
            L.append(shlex.join(rel(x) for x in c))
    if any(per_fmt[f]["calib"] for f in formats):
        L.append(shlex.join(["build/xctx"] + CALIB_CMD + ["--out", rel(next(per_fmt[f]["calib"] for f in formats
                                                                            if per_fmt[f]["calib"]))]))
    L += ["```", "",
          "## Throughput and quality per format", "",
          "docs/hour and wall tokens/s use the wall time of the whole `mpirun` (model load, tokenization and map-reduce"
          " included); prefill and decode tokens/s use the command's own `prefill_s`/`decode_s` sums. For map-reduce"
          " documents `prompt_tokens`, `generated_tokens` and the times add up every sequence (chunk summaries"
          " and the reduce step).", "",
          "| format | docs ok | wall s | docs/hour | prefill tok/s | decode tok/s | (prompt+gen) tok/s of wall |"
          " names top-1 | names a top-3 | degenerate | empty | hit max tokens |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for fmt in formats:
        p = per_fmt[fmt]
        L.append(f"| {fmt} | {p['ok']}/{p['docs']} | {num(p['wall_s'], '.0f')} | {num(p['docs_per_hour'], '.1f')} | "
                 f"{num(p['prefill_tok_s'], '.0f')} | {num(p['decode_tok_s'], '.1f')} | {num(p['wall_tok_s'], '.0f')} | "
                 f"{pct(p['top1'])} | {pct(p['top3'])} | {pct(p['degenerate'])} | {pct(p['empty'])} | "
                 f"{pct(p['hit_max'])} |")
    L += ["", "Quality signal (simple, and only a proxy): each source has a hand-made list of its characters' name"
          " words (in benchmarks/summarize_demo.py; names of the deity -- God, LORD, Lord, Jesus, Christ -- are left"
          " out); the names are counted in each document (case-sensitive whole words), and a summary scores when it"
          " contains the most frequent name (top-1) or any of the three most frequent (top-3). Degenerate = empty,"
          " or an 8-word sequence repeated, or a 4-word sequence 4 times, or under 30% distinct words (30+ words)."
          " 'hit max tokens' = generation stopped at --max-tokens rather than at end-of-turn (single-sequence documents only).", ""]
    for fmt in formats:
        L += [f"## {fmt}", "",
              "| id | words | prompt tok | gen tok | prefill s | decode s | method (chunks) | top names (count) |"
              " top-1 | top-3 | degenerate |", "|---|---:|---:|---:|---:|---:|---|---|---|---|---|"]
        for r in rows:
            if r["format"] != fmt:
                continue
            if "error" in r:
                L.append(f"| {r['id']} | {r['words']} | error: {r['error'][:80]} | | | | | {r['top_names']} | | | |")
                continue
            yn = lambda k: ("yes" if r[k] else "no") if k in r else "n/a"
            L.append(f"| {r['id']} | {r['words']} | {r['prompt_tokens']} | {r['generated_tokens']} | "
                     f"{num(r['prefill_s'], '.1f')} | {num(r['decode_s'], '.1f')} | {r['method']} ({r['chunks']}) | "
                     f"{r['top_names']} | {yn('names_top1')} | {yn('names_top3')} | {r['degenerate'] or 'no'} |")
        L.append("")
    L += ["## Example summaries", ""]
    kinds_seen, examples = set(), []
    for m in docs:
        if m["kind"] not in kinds_seen:
            kinds_seen.add(m["kind"])
            examples.append(m)
    for m in examples[:4]:
        L += [f"### {m['id']}: {m['title']} ({m['words']} words; top names: "
              + ", ".join(f"{n} {c}" for n, c in m["names"][:3]) + ")", ""]
        for fmt in formats:
            r = next(r for r in rows if r["format"] == fmt and r["id"] == m["id"])
            text = r.get("summary", "(error: " + r.get("error", "?") + ")")
            L += [f"**{fmt}**" + (f" (map-reduce, {r['chunks']} chunks)" if r.get("method") == "map-reduce" else "") + ":", "",
                  "> " + (text.strip().replace("\n", "\n> ") or "(empty)"), ""]
    L += ["All summaries are in the CSV (`summary` column)."]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(L) + "\n")

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no PNG (Debian's /usr/bin/python3 has python3-matplotlib)")
        log(f"wrote {args.out}.csv/.md")
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = range(len(formats))
    a1.bar(xs, [per_fmt[f]["docs_per_hour"] for f in formats], color="tab:blue")
    a1.set_xticks(list(xs), formats)
    a1.set_ylabel("documents / hour (wall)")
    a1.set_title(f"throughput, {args.ranks} ranks, {meta['set']} set ({len(docs)} docs)")
    for x, f in zip(xs, formats):
        y = per_fmt[f]["docs_per_hour"]
        a1.annotate(num(y, ".0f"), (x, 0 if math.isnan(y) else y), ha="center",
                    va="bottom", fontsize=8)
    keys = [("top1", "names top-1", "tab:green"), ("top3", "names a top-3", "tab:olive"),
            ("degenerate", "degenerate", "tab:red")]
    wbar = 0.26
    for k, (key, label, color) in enumerate(keys):
        a2.bar([x + (k - 1) * wbar for x in xs], [100 * per_fmt[f][key] for f in formats], wbar, label=label,
               color=color)
    a2.set_xticks(list(xs), formats)
    a2.set_ylabel("% of summaries")
    a2.set_ylim(0, 100)
    a2.set_title("quality signal (character names; degeneration)")
    a2.legend(fontsize=8)
    for a in (a1, a2):
        a.grid(axis="y", alpha=0.3)
    fig.suptitle("xctx summarize, SmolLM2-135M-Instruct Q4_1, CPU")
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=120)
    log(f"wrote {args.out}.csv/.md/.png")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("steps", nargs="*", help="write, run, report (default: all three)")
    ap.add_argument("--full", action="store_true", help="all chapters, ten KJV books and the six whole novels (hours)")
    ap.add_argument("--ids", help="write: only these document ids (comma-separated)")
    ap.add_argument("--limit", type=int, default=0, help="write: only the first N documents of the set")
    ap.add_argument("--tag", help="name of the working folder and of the results (default: quick or full; "
                                  "with --ids/--limit: check)")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--ranks", type=int, default=2, help="MPI ranks (launch/xctx-mpirun -np)")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--instruction", help="override the command's default instruction")
    ap.add_argument("--threads", type=int, default=0, help="--threads per rank (default: the launcher's)")
    ap.add_argument("--calib", help="nuq calibration file (default: made once under benchmarks/results/tmp/)")
    ap.add_argument("--sampling", default="",
                    help="run: sampler flags for `xctx summarize`, e.g. \"--repeat-penalty 1.2 --no-repeat-ngram 3\" "
                         "(default: the command's, greedy); the report lists the commands that ran")
    ap.add_argument("--resume", action="store_true", help="run: keep existing summaries and pass --resume")
    ap.add_argument("--timeout", type=float, default=0,
                    help="run: seconds per format before the run is stopped (default: 3x the estimate + 10 min)")
    ap.add_argument("--xctx", default=os.path.join(ROOT, "build", "xctx"))
    ap.add_argument("--out", help="results prefix (default: benchmarks/results/summarize_demo[_full]; other tags: "
                                  "their folder under benchmarks/results/tmp/)")
    args = ap.parse_args()
    steps = args.steps or ["write", "run", "report"]
    if set(steps) - {"write", "run", "report"}:
        ap.error(f"unknown step(s) {sorted(set(steps) - {'write', 'run', 'report'})}: use write, run, report")
    tag = args.tag or ("check" if (args.ids or args.limit) else ("full" if args.full else "quick"))
    args.dir = os.path.join(TMP, tag)
    args.docs = os.path.join(args.dir, "docs.jsonl")
    args.meta = os.path.join(args.dir, "docs.meta.json")
    if not args.out:
        # the quick and full sets report into benchmarks/results/; checks stay in their ignored folder
        args.out = os.path.join(RESULTS, "summarize_demo" + ("" if tag == "quick" else "_" + tag)) \
            if tag in ("quick", "full") else os.path.join(args.dir, "summarize_demo")
    if "write" in steps:
        step_write(args)
    if "run" in steps:
        step_run(args)
    if "report" in steps:
        step_report(args)


if __name__ == "__main__":
    main()
