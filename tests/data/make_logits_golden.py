"""Golden logits from two independent implementations: llama.cpp (via llama-cpp-python) and an
exact float64 numpy forward over the same dequantized weights (np_reference.py).

Run at development time (the tool is not a dependency of xctx):
    pip install llama-cpp-python gguf
    python3 tests/data/make_logits_golden.py models/SmolLM2-135M-Instruct.Q4_1.gguf
Writes tests/data/logits_golden.json: for each prompt the token ids, the top-K logits at every
position (teacher-forced, one batched evaluation) and llama.cpp's greedy 32-token continuation
(one token per evaluation, i.e. its decode path), with llama.cpp's top-K logits at each step;
and the same for the exact reference (top-K at every prompt position, greedy continuation).
llama.cpp rounds activations to 8-bit blocks before quantized matmuls, so it differs from
exact arithmetic by up to ~1.3 logits here; the exact reference separates that from engine error.
"""
import hashlib
import json
import os
import sys

import numpy as np
from llama_cpp import Llama

sys.path.insert(0, os.path.dirname(__file__))
import austen_text  # noqa: E402
from np_reference import Reference  # noqa: E402

TOP_K = 8
N_CONTINUE = 32


def prompts():
    pride = austen_text.novels()["prideprejudice"]
    start = pride.index("It is a truth universally acknowledged")
    return [
        ("capital", "The capital of France is", False),
        ("chat_haiku",
         "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
         "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n", True),
        ("code", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
        ("austen_long", pride[start:start + 5600], False),
    ]


def main(model_path):
    sha = hashlib.sha256(open(model_path, "rb").read()).hexdigest()
    llm = Llama(model_path=model_path, n_ctx=4096, n_batch=512, n_ubatch=512, logits_all=True, n_threads=2,
                flash_attn=False, verbose=False, seed=0)
    ref = Reference(model_path)
    out = {"model_sha256": sha, "tool": "llama-cpp-python " + __import__("llama_cpp").__version__,
           "top_k": TOP_K, "cases": []}
    for name, text, special in prompts():
        ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=special)
        llm.reset()
        llm.eval(ids)
        scores = np.array(llm.scores[:len(ids)], dtype=np.float32)  # [n, vocab]
        top_ids = np.argsort(-scores, axis=1, kind="stable")[:, :TOP_K]
        top_vals = np.take_along_axis(scores, top_ids, axis=1)
        # greedy continuation through the single-token decode path
        cont, cont_top_ids, cont_top_logits = [], [], []
        last = scores[-1]
        for _ in range(N_CONTINUE):
            nxt = int(np.argmax(last))
            order = np.argsort(-last, kind="stable")[:TOP_K]
            cont_top_ids.append(order.astype(int).tolist())
            cont_top_logits.append([round(float(last[t]), 4) for t in order])
            cont.append(nxt)
            llm.eval([nxt])
            last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        # exact reference: teacher-forced prompt, then its own greedy continuation
        kv = ref.new_cache()
        exact = ref.forward(ids, kv)
        ex_top = np.argsort(-exact, axis=1, kind="stable")[:, :TOP_K]
        ex_vals = np.take_along_axis(exact, ex_top, axis=1)
        ex_cont, ex_cont_top_ids, ex_cont_top_logits, ex_last = [], [], [], exact[-1]
        for _ in range(N_CONTINUE):
            nxt = int(np.argmax(ex_last))
            order = np.argsort(-ex_last, kind="stable")[:TOP_K]
            ex_cont_top_ids.append(order.astype(int).tolist())
            ex_cont_top_logits.append([round(float(ex_last[t]), 5) for t in order])
            ex_cont.append(nxt)
            ex_last = ref.forward([nxt], kv)[-1]
        llama_vs_exact = float(np.max(np.abs(np.take_along_axis(exact, top_ids, axis=1) - top_vals)))
        out["cases"].append({
            "name": name, "text": text, "parse_special": special, "ids": [int(i) for i in ids],
            "top_ids": top_ids.astype(int).tolist(),
            "top_logits": [[round(float(v), 4) for v in row] for row in top_vals],
            "greedy_continuation": cont,
            "continuation_top_ids": cont_top_ids, "continuation_top_logits": cont_top_logits,
            "exact_top_ids": ex_top.astype(int).tolist(),
            "exact_top_logits": [[round(float(v), 5) for v in row] for row in ex_vals],
            "exact_greedy_continuation": ex_cont,
            "exact_continuation_top_ids": ex_cont_top_ids, "exact_continuation_top_logits": ex_cont_top_logits,
            "llama_vs_exact_max_abs": round(llama_vs_exact, 4),
        })
        print(f"{name}: {len(ids)} tokens, llama.cpp vs exact max |logit diff| {llama_vs_exact:.3f}\n"
              f"  llama.cpp continuation {llm.detokenize(cont)!r}\n  exact continuation     {llm.detokenize(ex_cont)!r}",
              file=sys.stderr)
    dst = os.path.join(os.path.dirname(__file__), "logits_golden.json")
    with open(dst, "w") as f:
        json.dump(out, f, separators=(",", ":"))
    print(f"wrote {dst} ({os.path.getsize(dst)} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "models/SmolLM2-135M-Instruct.Q4_1.gguf")
