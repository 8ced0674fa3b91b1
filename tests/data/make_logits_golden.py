"""Golden logits from an independent implementation (llama.cpp via llama-cpp-python).

Run at development time (the tool is not a dependency of xctx):
    pip install llama-cpp-python gguf
    python3 tests/data/make_logits_golden.py models/SmolLM2-135M-Instruct.Q4_1.gguf
Writes tests/data/logits_golden.json: for each prompt the token ids, the top-K logits at every
position (teacher-forced, one batched evaluation) and llama.cpp's greedy 32-token continuation
(one token per evaluation, i.e. its decode path).
"""
import hashlib
import json
import os
import sys

import numpy as np
from llama_cpp import Llama

sys.path.insert(0, os.path.dirname(__file__))
import austen_text  # noqa: E402

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
        cont = []
        last = scores[-1]
        for _ in range(N_CONTINUE):
            nxt = int(np.argmax(last))
            cont.append(nxt)
            llm.eval([nxt])
            last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        out["cases"].append({
            "name": name, "text": text, "parse_special": special, "ids": [int(i) for i in ids],
            "top_ids": top_ids.astype(int).tolist(),
            "top_logits": [[round(float(v), 4) for v in row] for row in top_vals],
            "greedy_continuation": cont,
        })
        print(f"{name}: {len(ids)} tokens, continuation {llm.detokenize(cont)!r}", file=sys.stderr)
    dst = os.path.join(os.path.dirname(__file__), "logits_golden.json")
    with open(dst, "w") as f:
        json.dump(out, f, separators=(",", ":"))
    print(f"wrote {dst} ({os.path.getsize(dst)} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "models/SmolLM2-135M-Instruct.Q4_1.gguf")
