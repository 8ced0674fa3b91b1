"""An exact (float64) Llama forward in numpy over weights dequantized by the `gguf` package.

Independent of both xctx and llama.cpp: it shows what the quantized model computes in exact
arithmetic, so the golden test can tell engine error from llama.cpp's own rounding (llama.cpp
rounds activations to 8-bit blocks before its quantized matmuls and rounds q to fp16 for K·q).
Development-time only (used by make_logits_golden.py).
"""
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


class Reference:
    def __init__(self, path):
        r = GGUFReader(path)
        self.t = {t.name: t for t in r.tensors}
        f = {k: v for k, v in r.fields.items()}

        def scalar(key):
            p = f[key]
            return p.parts[p.data[0]][0]
        arch = "llama"
        self.n_layer = int(scalar(f"{arch}.block_count"))
        self.n_embd = int(scalar(f"{arch}.embedding_length"))
        self.n_head = int(scalar(f"{arch}.attention.head_count"))
        self.n_head_kv = int(scalar(f"{arch}.attention.head_count_kv"))
        self.eps = float(scalar(f"{arch}.attention.layer_norm_rms_epsilon"))
        self.base = float(scalar(f"{arch}.rope.freq_base"))
        self.hd = self.n_embd // self.n_head
        self.w = {name: self._load(name) for name in self.t}
        self.emb = self.w["token_embd.weight"]
        self.out = self.w.get("output.weight", self.emb)

    def _load(self, name):
        t = self.t[name]
        a = dequantize(t.data, t.tensor_type).astype(np.float64)
        return a.reshape([int(x) for x in reversed(t.shape)])

    def _rms(self, x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * w

    def _rope(self, x, pos):  # x [n, h, hd]; adjacent pairs (2i, 2i+1)
        i = np.arange(self.hd // 2)
        th = pos[:, None] * self.base ** (-2.0 * i / self.hd)
        c, s = np.cos(th)[:, None, :], np.sin(th)[:, None, :]
        out = np.empty_like(x)
        out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
        out[..., 1::2] = x[..., 0::2] * s + x[..., 1::2] * c
        return out

    def new_cache(self):
        return [[np.zeros((0, self.n_head_kv, self.hd)), np.zeros((0, self.n_head_kv, self.hd))]
                for _ in range(self.n_layer)]

    def forward(self, ids, cache):
        """Appends ids to cache (list per layer of [K, V]); returns logits [n, vocab]."""
        n, hd, g = len(ids), self.hd, self.n_head // self.n_head_kv
        start = cache[0][0].shape[0]
        pos = np.arange(start, start + n, dtype=np.float64)
        x = self.emb[np.array(ids)]
        for l in range(self.n_layer):
            p = f"blk.{l}."
            h = self._rms(x, self.w[p + "attn_norm.weight"])
            q = self._rope((h @ self.w[p + "attn_q.weight"].T).reshape(n, self.n_head, hd), pos)
            k = self._rope((h @ self.w[p + "attn_k.weight"].T).reshape(n, self.n_head_kv, hd), pos)
            v = (h @ self.w[p + "attn_v.weight"].T).reshape(n, self.n_head_kv, hd)
            cache[l][0] = np.concatenate([cache[l][0], k])
            cache[l][1] = np.concatenate([cache[l][1], v])
            K, V = cache[l]
            m = K.shape[0]
            mask = np.arange(m)[None, :] > (start + np.arange(n))[:, None]
            o = np.zeros((n, self.n_head, hd))
            for hh in range(self.n_head):
                s = q[:, hh] @ K[:, hh // g].T / np.sqrt(hd)
                s[mask] = -np.inf
                s = np.exp(s - s.max(-1, keepdims=True))
                o[:, hh] = (s / s.sum(-1, keepdims=True)) @ V[:, hh // g]
            x = x + o.reshape(n, self.n_embd) @ self.w[p + "attn_output.weight"].T
            h = self._rms(x, self.w[p + "ffn_norm.weight"])
            gt, up = h @ self.w[p + "ffn_gate.weight"].T, h @ self.w[p + "ffn_up.weight"].T
            x = x + ((gt / (1 + np.exp(-gt))) * up) @ self.w[p + "ffn_down.weight"].T
        return self._rms(x, self.w["output_norm.weight"]) @ self.out.T
