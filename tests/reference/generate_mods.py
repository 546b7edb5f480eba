#!/usr/bin/env python3
"""Reference values for attn's programmable attention (include/attn/mods.hpp,
include/attn/mod_gallery.hpp, docs/mods.md).

How to run (from the repository root; needs PyTorch and NumPy):

    /usr/bin/python3 tests/reference/generate_mods.py

Deterministic: inputs come from a generator with a fixed seed, rounded to
float16-representable values (exact in float and double), so running it again
rewrites a byte-identical mods.json.

What is computed (torch float64, written from the published definitions, not from attn)
---------------------------------------------------------------------------------------
"buckets": T5's relative-position buckets (Raffel et al. 2020; the bucketing of
HF transformers' T5Attention._relative_position_bucket, re-derived in torch ops) of
relative_position = kv_idx - q_idx for every relative position in [-300, 300], per
(bidirectional, buckets, max_distance) configuration.

"cases": one attention problem q, k, v (B = 2, H = 2, L = 37, D = 8) and, per gallery
variant, a dense boolean visibility V (B, H, L, L) and an additive bias A from the
variant's definition, then out = softmax(q k^T / sqrt(D) + A, hidden keys excluded) v
(a row that sees no key gives zeros). Variants:
    causal            j <= i
    sliding_window    i - 5 <= j <= i + 2
    prefix_lm         j <= i or j < prefix[b], prefix = (5, 12)
    document          doc[i] == doc[j], doc = run lengths 9, 1, 14, 13
    document_causal   document and causal
    longformer        |i - j| <= 3 or global[i] or global[j], global = {0, 17}
    alibi             A = -slope_h |i - j|, slopes of 2 heads: 2^-4, 2^-8
    softcap           s = 8 tanh(s / 8) on the scaled scores
    t5_bias           A = table[bucket(j - i), h] (bidirectional, 32 buckets, max 128)
"""
import json
import math
import os

import numpy as np
import torch

torch.set_default_dtype(torch.float64)
HERE = os.path.dirname(os.path.abspath(__file__))


def f16(a):
    return a.astype(np.float16).astype(np.float64)


def tensor(a):
    a = np.asarray(a, dtype=np.float64)
    return {"shape": list(a.shape), "data": [float(v) for v in a.ravel()]}


def t5_bucket(relative_position, bidirectional, num_buckets, max_distance):
    rp = torch.as_tensor(relative_position, dtype=torch.int64)
    bucket = torch.zeros_like(rp)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (rp > 0).to(torch.int64) * num_buckets
        n = rp.abs()
    else:
        n = -torch.minimum(rp, torch.zeros_like(rp))
    max_exact = num_buckets // 2
    is_small = n < max_exact
    large = max_exact + (
        torch.log(n.to(torch.float64) / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.int64)
    large = torch.minimum(large, torch.full_like(large, num_buckets - 1))
    return bucket + torch.where(is_small, n, large)


def attention(q, k, v, visible, bias, softcap=None):
    d = q.shape[-1]
    s = q @ k.transpose(-1, -2) / math.sqrt(d)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s + bias
    s = torch.where(visible, s, torch.full_like(s, -math.inf))
    m = s.max(dim=-1, keepdim=True).values
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    den = e.sum(dim=-1, keepdim=True)
    w = torch.where(den > 0, e / den, torch.zeros_like(e))
    return w @ v


def main():
    rng = np.random.default_rng(19)
    B, H, L, D = 2, 2, 37, 8
    q = torch.tensor(f16(rng.uniform(-2, 2, (B, H, L, D))))
    k = torch.tensor(f16(rng.uniform(-2, 2, (B, H, L, D))))
    v = torch.tensor(f16(rng.uniform(-2, 2, (B, H, L, D))))
    i = torch.arange(L).view(L, 1)
    j = torch.arange(L).view(1, L)
    full = torch.ones(B, H, L, L, dtype=torch.bool)
    zero = torch.zeros(B, H, L, L)
    doc = torch.tensor(sum([[n] * r for n, r in enumerate([9, 1, 14, 13])], []))
    prefix = [5, 12]
    glob = torch.zeros(L, dtype=torch.bool)
    glob[[0, 17]] = True
    slopes = [2.0 ** -4, 2.0 ** -8]
    table = f16(rng.uniform(-1, 1, (32, H)))

    def per_batch(f):
        return torch.stack([f(b).expand(H, L, L) for b in range(B)])

    variants = {
        "causal": (full & (j <= i), zero, None),
        "sliding_window": (full & (j >= i - 5) & (j <= i + 2), zero, None),
        "prefix_lm": (per_batch(lambda b: (j <= i) | (j < prefix[b])), zero, None),
        "document": (full & (doc.view(L, 1) == doc.view(1, L)), zero, None),
        "document_causal": (full & (doc.view(L, 1) == doc.view(1, L)) & (j <= i), zero, None),
        "longformer": (full & (((i - j).abs() <= 3) | glob.view(L, 1) | glob.view(1, L)), zero, None),
        "alibi": (full, torch.stack([-s * (i - j).abs().to(torch.float64) for s in slopes]).expand(B, H, L, L), None),
        "softcap": (full, zero, 8.0),
        "t5_bias": (full, torch.tensor(table)[t5_bucket(j - i, True, 32, 128)].permute(2, 0, 1).expand(B, H, L, L), None),
    }
    cases = []
    for name, (visible, bias, cap) in variants.items():
        out = attention(q, k, v, visible, bias, cap)
        # Cross-check with plain loops for one head.
        b, h = 1, 1
        for row in range(L):
            scores = []
            for col in range(L):
                if not bool(visible[b, h, row, col]):
                    continue
                s = float(q[b, h, row] @ k[b, h, col]) / math.sqrt(D)
                if cap is not None:
                    s = cap * math.tanh(s / cap)
                scores.append((s + float(bias[b, h, row, col]), col))
            if not scores:
                assert float(out[b, h, row].abs().max()) == 0
                continue
            m = max(s for s, _ in scores)
            den = sum(math.exp(s - m) for s, _ in scores)
            for e in range(D):
                ref = sum(math.exp(s - m) / den * float(v[b, h, col, e]) for s, col in scores)
                assert abs(ref - float(out[b, h, row, e])) < 1e-12
        cases.append({"name": name, "out": tensor(out.numpy())})

    configs = [(True, 32, 128), (False, 32, 128), (True, 16, 64), (False, 8, 20)]
    positions = list(range(-300, 301))
    buckets = [
        {"bidirectional": bd, "buckets": nb, "max_distance": md,
         "values": [int(x) for x in t5_bucket(positions, bd, nb, md)]}
        for bd, nb, md in configs
    ]
    fixture = {
        "q": tensor(q.numpy()), "k": tensor(k.numpy()), "v": tensor(v.numpy()),
        "documents": [int(x) for x in doc], "prefix": prefix, "global": [0, 17],
        "slopes": slopes, "softcap": 8.0, "t5_table": tensor(table),
        "cases": cases, "positions": [positions[0], positions[-1]], "buckets": buckets,
    }
    with open(os.path.join(HERE, "mods.json"), "w") as fh:
        fh.write(json.dumps(fixture, separators=(",", ":")))
        fh.write("\n")


if __name__ == "__main__":
    main()
