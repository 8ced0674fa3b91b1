#!/usr/bin/env python3
"""Writes tests/data/tokenizer_golden.json: token ids from llama.cpp (llama-cpp-python) that
tests/model/test_tokenizer.cpp must reproduce exactly.

Usage: python3 tests/data/make_tokenizer_golden.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]

Two parts:
  "bpe": the real model's byte-level BPE vocabulary (read by the C++ test from the GGUF itself);
         every case is tokenized with add_bos in {False, True} and special in {False, True}.
  "spm": a small SentencePiece ("llama") vocabulary built here from Austen's text, written to a
         temporary GGUF with the `gguf` package so llama.cpp can tokenize with it; the JSON keeps
         the vocabulary so the C++ test can rebuild it without a GGUF writer.
  "pretok": the pre-tokenizer splits llama.cpp applies for several tokenizer.ggml.pre names. Each
         is read off a synthetic byte-level vocabulary that holds every substring of the test
         texts with a merge for every way to split it, so each pre-token merges into exactly one
         token and the tokens spell the pieces. The C++ test rebuilds the same vocabulary.
  "chat":  conversations rendered with jinja2 from the GGUF's own tokenizer.chat_template (ChatML)
         and from Meta's Llama 2 / Llama 3 chat templates (written below), for
         tests/model/test_chat_template.cpp.
Development-time only; needs llama-cpp-python, gguf, numpy, jinja2, and Debian's r-cran-janeaustenr.
"""
import json
import math
import os
import re
import sys
import tempfile
from collections import Counter

import gguf
import llama_cpp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import austen_text  # noqa: E402  (tests/data/austen_text.py)

CPP_SNIPPET = """#include <vector>

template <typename T>
T sum(const std::vector<T>& xs) {
    T acc{};  // zero
    for (const auto& x : xs) acc += x;
    return acc;
}

int main(int argc, char** argv) {
\tif (argc > 1 && argv[1][0] == '-') return 2;
\treturn sum<int>({1, 2, 3}) == 6 ? 0 : 1;
}
"""

PY_SNIPPET = """def fib(n: int) -> int:
    \"\"\"Returns the n-th Fibonacci number.\"\"\"
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class Greeter:
    def __init__(self, name):
        self.name = name  # keep it

    def greet(self):
        if not self.name:
            raise ValueError('no name')
        return f"Hello, {self.name}!"
"""

JSON_SNIPPET = '{"key": [1, 2.5, -3e-4], "nested": {"ok": true, "none": null}, "s": "a\\\\tb"}'


def austen_passage(n_words):
    text = austen_text.novels()["prideprejudice"]
    start = text.index("It is a truth universally acknowledged")
    words = 0
    for m in re.finditer(r"\S+", text[start:]):
        words += 1
        if words == n_words:
            return text[start:start + m.end()] + "\n"
    raise ValueError("novel too short")


def bpe_cases():
    return [
        ("empty", ""),
        ("hello", "Hello world"),
        ("sentence", "Hello, world! How are you today?"),
        ("leading_space", " leading space"),
        ("trailing_spaces", "trailing spaces   "),
        ("space_runs", "  multiple   spaces   between  "),
        ("tabs", "tabs\tand\t\ttabs\t"),
        ("newlines", "new\nlines\n\nand\r\nCRLF\r\n"),
        ("only_newlines", "\n\n\n"),
        ("space_newline_mix", "   \n  \n"),
        ("unicode_spaces", "mixed \t \n whitespace \u00a0 nbsp \u3000 ideographic\u2003em"),
        ("numbers", "Numbers: 0 1 12 123 1234 12345 3.14159 -42 1e10"),
        ("long_number", "1234567890123456789012345678901234567890"),
        ("money", "Phone +1-555-0100, price $1,299.99 (20% off) on 2024-03-15 at 10:30am"),
        ("spaces_digits", "abc 123 def  456\t789"),
        ("accents", "caf\u00e9 na\u00efve r\u00e9sum\u00e9 fa\u00e7ade \u00c5ngstr\u00f6m \u00fcber Stra\u00dfe"),
        ("combining", "e\u0301 combining: cafe\u0301, n\u0303, a\u0308\u0304, Zalgo z\u0335\u0321a\u0336"),
        ("japanese", "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3067\u3059\u3002\u6771\u4eac\u306f\u5927\u304d\u3044\u3002"),
        ("chinese", "\u4e2d\u6587\u6d4b\u8bd5\uff1a\u4f60\u597d\uff0c\u4e16\u754c\uff01"),
        ("korean", "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8 \uc548\ub155\ud558\uc138\uc694"),
        ("arabic", "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645\u060c \u0647\u0630\u0627 \u0646\u0635 \u0639\u0631\u0628\u064a."),
        ("greek_cyrillic", "\u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac \u03ba\u03b1\u03b9 \u0440\u0443\u0441\u0441\u043a\u0438\u0439 \u0442\u0435\u043a\u0441\u0442"),
        ("emoji", "emoji \U0001F600\U0001F603 \U0001F389 \U0001F44D\U0001F3FD \u2764\ufe0f"),
        ("emoji_zwj", "ZWJ family \U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466 flag \U0001F1EB\U0001F1F7 "
                      "\U0001F3F3\ufe0f\u200d\U0001F308!"),
        ("contractions", "I'm sure you're right, they've said it's what we'd do and I'll go. "
                         "DON'T SHOUT, You'RE 'LL"),
        ("contractions_bare", "'s 't 're 've 'm 'll 'd don't can't won't 'quoted' ''double''"),
        ("punct_runs", "Wait... what?!?! -- (really) [yes] {no} <tag/> ###***!!! ~~~ ^^ ``code``"),
        ("punct_tight", "a.b.c,d;e:f!g?h/i\\j|k"),
        ("cpp", CPP_SNIPPET),
        ("python", PY_SNIPPET),
        ("json", JSON_SNIPPET),
        ("url_email", "See https://example.com/path?q=1&r=2#frag or mail user.name+tag@example.org."),
        ("chatml_turn", "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"),
        ("chatml_system", "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                          "Face<|im_end|>\n"),
        ("endoftext_inside", "text<|endoftext|>more text"),
        ("specials_adjacent", "<|im_end|><|im_end|> <|im_start|>"),
        ("special_partial", "<|im_start| and |im_end|> and <|im_start|>"),
        ("code_specials", "<repo_name>xctx<file_sep>model/tokenizer.cpp\n<filename>a.py"),
        ("other_numbers", "Roman \u216b \u2177, superscripts x\u00b2 y\u00b3, fractions \u00bd \u00be, "
                          "Arabic-Indic \u0660\u0661\u0662\u0663 and full-width \uff11\uff12\uff13"),
        ("math", "\u2211_{i=1}^{n} x_i \u2264 \u221e \u2192 \u03b1 \u03b2 \u03b3 = \u00b1\u221a2"),
        ("case_mix", "ALL CAPS SHOUTING and lowercase and MiXeD CaSe McDonald's iPhone"),
        ("repeat_a", "a" * 300),
        ("repeat_eq", "=" * 100 + "\n" + "-" * 64),
        ("gpt2_marker_chars", "\u0120 \u010a literal byte-alphabet chars \u0100\u0101"),
        ("control_chars", "bell\x07 null\x00 escape\x1b[0m del\x7f"),
        ("zero_width", "tokens\u200bwith\u200bzero\u200bwidth and soft\u00adhyphen"),
        ("nbsp_start", "\u00a0\u00a0nbsp at start"),
        ("line_trailing_newline", "line\n"),
        ("quotes", "\u201cCurly quotes\u201d and \u2018single\u2019 \u2014 em dash \u2013 en dash \u2026"),
        ("austen", austen_passage(3000)),
    ]


def tokenize(llm, text, add_bos, special):
    return [int(t) for t in llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)]


def variants(llm, text):
    """ids for add_bos x special; a variant equal to bos0_sp0 is left out to keep the file small
    (the C++ test reads a missing variant as bos0_sp0)."""
    out = {}
    for b in (False, True):
        for s in (False, True):
            ids = tokenize(llm, text, b, s)
            key = f"bos{int(b)}_sp{int(s)}"
            if key == "bos0_sp0" or ids != out["bos0_sp0"]:
                out[key] = ids
    return out


def spm_vocab():
    """A SentencePiece-style vocabulary: <unk> <s> </s>, 256 byte pieces, a control and a
    user-defined token, single characters, and frequent substrings of Austen's words scored by
    log frequency."""
    text = austen_text.novels()["persuasion"][:60000]
    words = ["\u2581" + w for w in text.split()]
    subs = Counter()
    for w in words:
        for n in range(2, 7):
            for i in range(len(w) - n + 1):
                subs[w[i:i + n]] += 1
    chars = Counter(c for w in words for c in w)
    tokens = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % b for b in range(256)] + ["<|sep|>", "<mask>"]
    types = [2, 3, 3] + [6] * 256 + [3, 4]
    scores = [0.0] * len(tokens)
    for c, n in sorted(chars.items(), key=lambda kv: (-kv[1], kv[0])):
        if n >= 3:
            tokens.append(c)
            types.append(1)
            scores.append(-20.0 + math.log(n) * 0.25)
    best = sorted(subs.items(), key=lambda kv: (-kv[1] * (len(kv[0]) - 1), kv[0]))[:700]
    for s, n in best:
        tokens.append(s)
        types.append(1)
        scores.append(-12.0 + math.log(n))
    scores = [float(np.float32(x)) for x in scores]  # what the GGUF (f32) holds
    return tokens, scores, types


def spm_golden():
    tokens, scores, types = spm_vocab()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tiny_spm.gguf")
        w = gguf.GGUFWriter(path, "llama")
        # llama.cpp reads the architecture's hyperparameters even for vocab_only.
        w.add_context_length(64)
        w.add_embedding_length(8)
        w.add_block_count(1)
        w.add_feed_forward_length(16)
        w.add_head_count(1)
        w.add_head_count_kv(1)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(True)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
        texts = [
            ("empty", ""),
            ("sentence", "Anne Elliot was persuaded to give him up."),
            ("leading_trailing_spaces", "  two leading and trailing  "),
            ("newlines_tabs", "line one\nline two\n\n\tindented"),
            ("unknown_chars", "caf\u00e9 \u65e5\u672c \U0001F600 \u0645\u0631\u062d\u0628\u0627"),
            ("digits", "In 1814, 23 ships; 1,000,000 pounds."),
            ("specials", "before<|sep|>after <mask> end"),
            ("special_first", "<|sep|>starts with a control token"),
            ("austen", " ".join(austen_text.novels()["persuasion"][60000:64000].split())),
        ]
        cases = [{"name": n, "text": t, "ids": variants(llm, t)} for n, t in texts]
    return {"tokens": tokens, "scores": scores, "types": types, "bos_id": 1, "eos_id": 2, "unk_id": 0,
            "add_bos": True, "add_space_prefix": True, "cases": cases}


PRETOK_NAMES = ["default", "gpt-2", "llama-bpe", "qwen2", "smollm"]
PRETOK_TEXTS = [
    "Hello world's 123 4567 abc",
    "I'M YOU'RE we'Ll They'VE 's",
    "  lead\n\n  trail  ",
    "a\r\n\r\n b\t\tc \n d",
    "x!!! ?? ...y +=$5 <a|b>^~`",
    "12345678 \u0661\u0662\u0663\u0664\u0665 \u00bd\u216b",
    "na\u00efve caf\u00e9 \u65e5\u672c \U0001F600\U0001F44D",
    "(foo) [bar]{baz}, 'q' \"dq\"",
    "\u00a0nbsp\u3000ideo \u2003em",
    "e\u0301t\u0308e \u0301x",
    "don't\n\nstop's",
    "line1\nline2\r\n\n  x",
]


def byte_alphabet():
    """GPT-2's byte -> printable code point table."""
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def all_substring_vocab(texts):
    """Byte tokens, then every byte substring (length >= 2) of the texts in order of first
    appearance, and a merge for every split of every substring; then two control tokens."""
    alpha = byte_alphabet()
    enc = lambda bs: "".join(alpha[b] for b in bs)
    tokens = [alpha[b] for b in range(256)]
    seen = set(tokens)
    merges = []
    for t in texts:
        data = t.encode("utf-8")
        for n in range(2, len(data) + 1):
            for i in range(len(data) - n + 1):
                sub = data[i:i + n]
                e = enc(sub)
                if e in seen:
                    continue
                seen.add(e)
                tokens.append(e)
                merges.extend(enc(sub[:k]) + " " + enc(sub[k:]) for k in range(1, n))
    tokens += ["<|bos|>", "<|eos|>"]
    return tokens, merges


def write_bpe_gguf(path, pre, tokens, merges, n_control):
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - n_control) + [3] * n_control)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def pretok_golden():
    tokens, merges = all_substring_vocab(PRETOK_TEXTS)
    pieces = {}
    with tempfile.TemporaryDirectory() as tmp:
        for pre in PRETOK_NAMES:
            path = os.path.join(tmp, pre + ".gguf")
            write_bpe_gguf(path, pre, tokens, merges, 2)
            llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
            per_text = []
            for t in PRETOK_TEXTS:
                ids = tokenize(llm, t, False, False)
                ps = [llm.detokenize([i]).decode("utf-8", "surrogateescape") for i in ids]
                assert "".join(ps) == t, (pre, t, ps)
                per_text.append(ps)
            pieces[pre] = per_text
    return {"texts": PRETOK_TEXTS, "pieces": pieces}


# Meta's chat templates as published with Llama-2-chat and Llama-3-Instruct (tokenizer_config.json).
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

CONVERSATIONS = [
    ("user_only", [("user", "What is the capital of France?")]),
    ("system_user", [("system", "You answer in one word."), ("user", "Capital of Italy?")]),
    ("multi_turn", [("user", "Hi there"), ("assistant", "Hello! How can I help?"), ("user", "Tell me a joke.")]),
    ("system_multi_turn", [("system", "Be brief."), ("user", "  2+2?\n"), ("assistant", "4 "),
                           ("user", "And 3+3?")]),
    ("unicode_content", [("user", "Tradu\u00eds \u00ab\u65e5\u672c\u00bb \U0001F600\nline two")]),
]


def chat_golden(model_path):
    import jinja2
    reader = gguf.GGUFReader(model_path)
    field = reader.fields["tokenizer.chat_template"]
    chatml = bytes(field.parts[field.data[0]]).decode("utf-8")
    env = jinja2.Environment()
    styles = {"chatml": (chatml, "", ""), "llama2": (LLAMA2_TEMPLATE, "<s>", "</s>"),
              "llama3": (LLAMA3_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>")}
    cases = []
    for name, conv in CONVERSATIONS:
        msgs = [{"role": r, "content": c} for r, c in conv]
        rendered = {}
        for style, (tmpl, bos, eos) in styles.items():
            for gen in (False, True):
                text = env.from_string(tmpl).render(messages=msgs, add_generation_prompt=gen, bos_token=bos,
                                                    eos_token=eos)
                # The sequence-initial BOS is the tokenizer's job (encode's add_bos), not the template's.
                if bos and text.startswith(bos):
                    text = text[len(bos):]
                rendered[f"{style}_gen{int(gen)}"] = text
        cases.append({"name": name, "messages": msgs, "rendered": rendered})
    return {"smollm_template": chatml, "llama2_template": LLAMA2_TEMPLATE, "llama3_template": LLAMA3_TEMPLATE,
            "cases": cases}


def main():
    model = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
    llm = llama_cpp.Llama(model_path=model, vocab_only=True, verbose=False)
    out = {
        "generator": "tests/data/make_tokenizer_golden.py with llama-cpp-python " + llama_cpp.__version__,
        "bpe": {
            "model": os.path.basename(model),
            "cases": [{"name": n, "text": t, "ids": variants(llm, t)} for n, t in bpe_cases()],
        },
        "spm": spm_golden(),
        "pretok": pretok_golden(),
        "chat": chat_golden(model),
    }
    dest = os.path.join(HERE, "tokenizer_golden.json")
    with open(dest, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {dest}: {os.path.getsize(dest)} bytes, {len(out['bpe']['cases'])} BPE cases, "
          f"{len(out['spm']['cases'])} SPM cases, {len(out['spm']['tokens'])} SPM tokens, "
          f"{len(PRETOK_TEXTS)} pre-tokenizer texts x {len(PRETOK_NAMES)} names")


if __name__ == "__main__":
    main()
