#!/usr/bin/env python3
"""Writes tests/data/dequant_golden/: reference values from the independent `gguf` Python
package (GGUFReader + gguf.quants), against which tests/kernels/test_quant_ref.cpp checks
xctx's C++ (de)quantizers.

  * model_*.f32.bin  the first rows of a few tensors of the real model, dequantized by gguf.
  * <type>.*.bin     per type, seeded synthetic data:
      - types gguf can encode (F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): the float input, the
        blocks gguf.quants.quantize produced (the C++ encoder must reproduce them byte for
        byte) and their dequantized values;
      - K-quants (decode-only in gguf): random block bytes with finite fp16 scales, and the
        values gguf.quants.dequantize decodes them to.
  * llamacpp.*.bin   rows of a tiny F32 model and the blocks llama.cpp's own quantizer
                     (llama_model_quantize, via llama-cpp-python) made of them for Q4_0, Q4_1,
                     Q5_0, Q5_1, Q8_0: the C++ encoder must reproduce them byte for byte.
  * index.json       what each file holds, plus the model's sha256 and size.

All .bin files are little-endian. Re-run after changing the seed or the model:
  python3 tests/data/make_dequant_golden.py [--model PATH]
"""
import argparse
import ctypes
import hashlib
import importlib.metadata
import json
import os
import tempfile

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
OUT = os.path.join(HERE, "dequant_golden")
MODEL_REL = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
SEED = 20240611

# (tensor, rows): one tensor per type present in the model, rows kept small.
MODEL_TENSORS = [
    ("token_embd.weight", 2),        # Q8_0
    ("blk.0.attn_q.weight", 2),      # Q4_1, 576 columns
    ("blk.0.ffn_down.weight", 2),    # Q4_1, 1536 columns
    ("output_norm.weight", 1),       # F32
]

ENCODABLE = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
DECODE_ONLY = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
LEGACY_BLOCKS = 8   # x 32 elements
K_BLOCKS = 4        # x 256 elements

# Byte offsets of the fp16 scale fields in each K-quant block (see kernels/quant_blocks.h).
K_SCALE_FIELDS = {
    T.Q2_K: [80, 82],   # d, dmin at the end
    T.Q3_K: [108],      # d at the end
    T.Q4_K: [0, 2],     # d, dmin first
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write(name, array):
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(np.ascontiguousarray(array).tobytes())
    return name


def synthetic_input(rng, n_blocks, block):
    """Blocks that exercise the corner cases of the encoders, then ordinary data."""
    x = rng.standard_normal((n_blocks, block)).astype(np.float32)
    x *= np.float32(10.0) ** rng.uniform(-3, 1, size=(n_blocks, 1)).astype(np.float32)
    x[0] = 0.0                      # all-zero block: d = 0, codes must stay finite
    x[1] = 0.25                     # constant block: max == min for the _1 formats
    x[2, 5] = -40.0                 # negative outlier sets the sign of d
    x[3] = np.abs(x[3])             # one-signed block
    x[4, ::2] = np.float32(0.5)     # repeated values / ties in the rounding
    return x.reshape(-1)


def model_goldens(model_path, entries):
    reader = gguf.GGUFReader(model_path)
    tensors = {t.name: t for t in reader.tensors}
    for name, rows in MODEL_TENSORS:
        t = tensors[name]
        data = np.asarray(t.data)
        n_cols = int(t.shape[0])
        if data.ndim == 1:
            data = data.reshape(1, -1)
        values = dequantize(data[:rows], t.tensor_type).astype(np.float32).reshape(rows, n_cols)
        fname = write("model_" + name.replace(".", "_") + ".f32.bin", values)
        entries.append({"tensor": name, "type": t.tensor_type.name, "rows": rows, "n_cols": n_cols,
                        "values": fname})


def encodable_goldens(rng, entries):
    for qt in ENCODABLE:
        block, _ = gguf.GGML_QUANT_SIZES[qt]
        # Plain float types are "blocks" of one element; give them as many values as a legacy row.
        n = LEGACY_BLOCKS * 32
        x = synthetic_input(rng, n // 32, 32)
        if qt == T.BF16:
            blocks = quantize(x.reshape(1, -1), qt).reshape(-1)
        else:
            blocks = np.asarray(quantize(x.reshape(1, -1), qt)).view(np.uint8).reshape(-1)
        values = dequantize(blocks.reshape(1, -1), qt).astype(np.float32).reshape(-1)
        base = qt.name.lower()
        entries.append({"type": qt.name, "type_id": int(qt), "n": n,
                        "input": write(base + ".input.f32.bin", x),
                        "blocks": write(base + ".blocks.bin", blocks),
                        "values": write(base + ".values.f32.bin", values)})


def decode_only_goldens(rng, entries):
    for qt in DECODE_ONLY:
        block, type_size = gguf.GGML_QUANT_SIZES[qt]
        raw = rng.integers(0, 256, size=(K_BLOCKS, type_size), dtype=np.uint8)
        for off in K_SCALE_FIELDS[qt]:
            # Finite scales of both signs and a wide range of magnitudes.
            scale = rng.uniform(1e-4, 5e-2, size=K_BLOCKS) * rng.choice([-1.0, 1.0], size=K_BLOCKS)
            raw[:, off:off + 2] = scale.astype(np.float16).view(np.uint8).reshape(K_BLOCKS, 2)
        values = dequantize(raw.reshape(1, -1), qt).astype(np.float32).reshape(-1)
        base = qt.name.lower()
        entries.append({"type": qt.name, "type_id": int(qt), "n": K_BLOCKS * block,
                        "blocks": write(base + ".blocks.bin", raw),
                        "values": write(base + ".values.f32.bin", values)})


# llama.cpp file types (enum llama_ftype) for the encoders xctx reproduces.
LLAMA_FTYPES = {T.Q4_0: 2, T.Q4_1: 3, T.Q5_0: 8, T.Q5_1: 9, T.Q8_0: 7}
LLAMA_ROWS, LLAMA_COLS = 8, 256


def llama_cpp_goldens(rng, entries):
    """Quantizes one tensor of a minimal F32 llama GGUF with llama.cpp itself."""
    import llama_cpp  # llama-cpp-python; imported here so the other goldens need only gguf

    n_embd, n_ff, vocab = LLAMA_COLS, 2 * LLAMA_COLS, 32
    rows = synthetic_input(rng, LLAMA_ROWS * LLAMA_COLS // 32, 32).reshape(LLAMA_ROWS, LLAMA_COLS)
    rows *= np.float32(10.0) ** rng.uniform(-2, 1, size=(LLAMA_ROWS, 1)).astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "f32.gguf")
        w = gguf.GGUFWriter(src, "llama")
        w.add_block_count(1)
        w.add_context_length(128)
        w.add_embedding_length(n_embd)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(4)
        w.add_head_count_kv(4)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_vocab_size(vocab)
        w.add_tokenizer_model("none")
        ones = np.ones(n_embd, np.float32)
        mat = lambda r, c: rng.standard_normal((r, c)).astype(np.float32)
        w.add_tensor("token_embd.weight", mat(vocab, n_embd))
        w.add_tensor("output_norm.weight", ones)
        w.add_tensor("output.weight", mat(vocab, n_embd))
        w.add_tensor("blk.0.attn_norm.weight", ones)
        w.add_tensor("blk.0.ffn_norm.weight", ones)
        q = np.concatenate([rows, mat(n_embd - LLAMA_ROWS, n_embd)])
        w.add_tensor("blk.0.attn_q.weight", q)
        for name in ("attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"blk.0.{name}.weight", mat(n_embd, n_embd))
        w.add_tensor("blk.0.ffn_gate.weight", mat(n_ff, n_embd))
        w.add_tensor("blk.0.ffn_up.weight", mat(n_ff, n_embd))
        w.add_tensor("blk.0.ffn_down.weight", mat(n_embd, n_ff))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        inputs = write("llamacpp.input.f32.bin", rows)
        for qt, ftype in LLAMA_FTYPES.items():
            dst = os.path.join(tmp, qt.name + ".gguf")
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = ftype
            params.nthread = 1
            rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
            assert rc == 0, f"llama_model_quantize to {qt.name} failed ({rc})"
            t = next(t for t in gguf.GGUFReader(dst).tensors if t.name == "blk.0.attn_q.weight")
            assert t.tensor_type == qt, f"llama.cpp stored attn_q as {t.tensor_type.name}, not {qt.name}"
            blocks = np.asarray(t.data)[:LLAMA_ROWS].reshape(-1)
            entries.append({"type": qt.name, "type_id": int(qt), "rows": LLAMA_ROWS, "n_cols": LLAMA_COLS,
                            "input": inputs, "blocks": write(f"llamacpp.{qt.name.lower()}.blocks.bin", blocks)})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, MODEL_REL))
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(SEED)

    model_entries, synthetic, llama = [], [], []
    model_goldens(args.model, model_entries)
    encodable_goldens(rng, synthetic)
    decode_only_goldens(rng, synthetic)
    llama_cpp_goldens(rng, llama)

    index = {
        "generator": "tests/data/make_dequant_golden.py",
        "gguf_python_version": importlib.metadata.version("gguf"),
        "numpy_version": np.__version__,
        "seed": SEED,
        "model": {"file": MODEL_REL, "sha256": sha256(args.model), "bytes": os.path.getsize(args.model),
                  "tensors": model_entries},
        "synthetic": synthetic,
        "llama_cpp_python_version": importlib.metadata.version("llama_cpp_python"),
        "llama_cpp_quantized": llama,
    }
    with open(os.path.join(OUT, "index.json"), "w") as f:
        json.dump(index, f, indent=1)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(OUT, n)) for n in os.listdir(OUT))
    print(f"wrote {len(model_entries)} model, {len(synthetic)} synthetic and {len(llama)} llama.cpp goldens, "
          f"{total} bytes, to {OUT}")


if __name__ == "__main__":
    main()
