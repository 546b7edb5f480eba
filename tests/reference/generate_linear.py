#!/usr/bin/env python3
"""Reference values for attn's linear attention (include/attn/linear_attention.hpp).

How to run (from the repository root; needs NumPy only):

    /usr/bin/python3 tests/reference/generate_linear.py

Deterministic: every draw comes from a generator seeded by the case name, so
running it again rewrites a byte-identical linear.json. Inputs are rounded to
float32-representable values right after drawing, so the float tests see exactly
the fixture's inputs; everything else is float64.

What "linear attention" means here (Katharopoulos et al. 2020)
--------------------------------------------------------------
The expected outputs are computed the QUADRATIC way, never by the linear
(prefix-sum) formula the library uses:

    A[i, j] = phi(q_i) . phi(k_j)      if key j is visible to query i, else 0
    out_i   = sum_j A[i, j] v_j / (sum_j A[i, j] + eps)

Key j is visible to query i (batch b) iff j < key_lengths[b] (if given) and,
when causal, j <= i + off with off = 0 for "top_left" and key_lengths[b] - Lq
(Lk - Lq without key_lengths) for "bottom_right" (attn/mask.hpp's per-sequence rule). Grouped-query attention: query head
h reads kv head h // (Hq // Hkv). Feature maps:

    elu_plus_one  x + 1 if x > 0 else exp(x)
    relu          max(x, 0)
    identity      x  (the tutorial's; the inputs of those cases are drawn
                  positive so that every normaliser is positive)

Cross-checks: every case is recomputed with explicit loops over b, h, i, j, and
non-causal cases with the linear formula phi(Q) (phi(K)^T V) / (phi(Q) sum phi(K)
+ eps); all must agree to 1e-12. Normalisers are either exactly 0 (a row that
sees nothing, or relu features that do not overlap) or at least 0.05, so the
float32 tests are well conditioned.

File: linear.json
-----------------
  {"cases": [case, ...], "tutorial": tutorial}
  case: name, feature_map, causal ("none" | "top_left" | "bottom_right"),
        key_lengths (list of B ints or null), eps,
        q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), out (B, Hq, Lq, Dv)
  tutorial: the tutorial's section 12 on one (L, D) = (6, 4) head:
        Q, K, V                  inputs (float32-representable)
        tutorial_normaliser          sum(Q, axis=1) + 1e-8: the tutorial's
                                 denominator (no keys in it; has a negative entry)
        tutorial_out                 Z * (Q @ (K.T @ V)), Z = 1 / tutorial_normaliser
        identity_out             phi = identity, normalised over the keys:
                                 Q (K^T V) / (Q . sum_j k_j + 1e-6)
        elu_plus_one_out         phi = elu + 1, normalised over the keys
Encoding as in generate.py: tensors are {"shape", "data"} (flat, row-major),
floats written with repr so they round-trip exactly, compact JSON.
"""

import json
import math
import os
import zlib

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TOL = 1e-12
EPS = 1e-6


def f32(x):
    return np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64)


def tensor(a):
    a = np.asarray(a, dtype=np.float64)
    for v in a.ravel():
        assert math.isfinite(v)
    return {"shape": list(a.shape), "data": [float(v) for v in a.ravel()]}


def rng_for(name):
    return np.random.default_rng(zlib.crc32(name.encode("utf-8")))


def phi(name, x):
    if name == "elu_plus_one":
        return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))
    if name == "relu":
        return np.maximum(x, 0.0)
    if name == "identity":
        return x
    raise ValueError(name)


def visible(i, j, lq, lk, causal, length):
    if j >= length:
        return False
    if causal == "none":
        return True
    off = 0 if causal == "top_left" else length - lq  # per sequence, as mask.hpp
    return j <= i + off


def quadratic(fm, q, k, v, causal, key_lengths, eps):
    """Vectorised quadratic reference; also returns the normalisers."""
    B, hq, lq, _ = q.shape
    hkv, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hkv
    out = np.zeros((B, hq, lq, dv))
    dens = []
    for b in range(B):
        length = lk if key_lengths is None else key_lengths[b]
        mask = np.array([[visible(i, j, lq, lk, causal, length) for j in range(lk)]
                         for i in range(lq)], dtype=np.float64).reshape(lq, lk)
        for h in range(hq):
            g = h // group
            a = (phi(fm, q[b, h]) @ phi(fm, k[b, g]).T) * mask
            den = a.sum(axis=1)
            dens.append(den)
            out[b, h] = (a @ v[b, g]) / (den + eps)[:, None]
    return out, np.concatenate(dens) if dens else np.zeros(0)


def loops(fm, q, k, v, causal, key_lengths, eps):
    B, hq, lq, _ = q.shape
    hkv, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    out = np.zeros((B, hq, lq, dv))
    for b in range(B):
        length = lk if key_lengths is None else key_lengths[b]
        for h in range(hq):
            g = h // (hq // hkv)
            for i in range(lq):
                num = np.zeros(dv)
                den = 0.0
                for j in range(lk):
                    if visible(i, j, lq, lk, causal, length):
                        w = float(np.dot(phi(fm, q[b, h, i]), phi(fm, k[b, g, j])))
                        num += w * v[b, g, j]
                        den += w
                out[b, h, i] = num / (den + eps)
    return out


def linear_form(fm, q, k, v, key_lengths, eps):
    """Non-causal only: the O(L) formula, as a cross-check of the quadratic one."""
    B, hq, lq, _ = q.shape
    hkv, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    out = np.zeros((B, hq, lq, dv))
    for b in range(B):
        length = lk if key_lengths is None else key_lengths[b]
        for h in range(hq):
            g = h // (hq // hkv)
            pk = phi(fm, k[b, g, :length])
            s = pk.T @ v[b, g, :length]
            z = pk.sum(axis=0)
            pq = phi(fm, q[b, h])
            out[b, h] = (pq @ s) / (pq @ z + eps)[:, None]
    return out


def close(a, b, tol=TOL):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and bool(np.all(np.abs(a - b) <= tol * (1 + np.maximum(abs(a), abs(b)))))


def make_case(name, fm, B, hq, hkv, lq, lk, d, dv, causal="none", key_lengths=None):
    rng = rng_for(name)
    if fm == "identity":  # positive q and k: every normaliser q_i . sum_j k_j > 0
        q = f32(rng.uniform(0.1, 1.0, (B, hq, lq, d)))
        k = f32(rng.uniform(0.1, 1.0, (B, hkv, lk, d)))
    else:
        q = f32(rng.standard_normal((B, hq, lq, d)))
        k = f32(rng.standard_normal((B, hkv, lk, d)))
    v = f32(rng.standard_normal((B, hkv, lk, dv)))
    out, dens = quadratic(fm, q, k, v, causal, key_lengths, EPS)
    assert close(out, loops(fm, q, k, v, causal, key_lengths, EPS)), name
    if causal == "none":
        assert close(out, linear_form(fm, q, k, v, key_lengths, EPS)), name
    assert np.all((dens == 0) | (dens >= 0.05)), (name, dens.min())
    return {
        "name": name, "feature_map": fm, "causal": causal,
        "key_lengths": key_lengths, "eps": EPS,
        "q": tensor(q), "k": tensor(k), "v": tensor(v), "out": tensor(out),
    }


def build_cases():
    cases = []
    for fm in ("elu_plus_one", "relu", "identity"):
        # Non-causal, Lq != Lk, GQA (2 query heads per kv head), D != Dv.
        cases.append(make_case(fm + "/none/B2_Hq4_Hkv2_Lq5_Lk7_D8_Dv6", fm, 2, 4, 2, 5, 7, 8, 6))
        cases.append(make_case(fm + "/none/key_lengths_9_4_0/Lq6_Lk9", fm, 3, 2, 1, 6, 9, 8, 5,
                               key_lengths=[9, 4, 0]))
        cases.append(make_case(fm + "/top_left/L11_D8_Dv5", fm, 1, 2, 2, 11, 11, 8, 5,
                               causal="top_left"))
        cases.append(make_case(fm + "/top_left/key_lengths_10_6/L10", fm, 2, 2, 1, 10, 10, 6, 4,
                               causal="top_left", key_lengths=[10, 6]))
    # Causal alignments with Lq != Lk.
    cases.append(make_case("elu_plus_one/bottom_right/Lq4_Lk9", "elu_plus_one", 1, 2, 1, 4, 9,
                           8, 6, causal="bottom_right"))
    cases.append(make_case("elu_plus_one/bottom_right/Lq9_Lk6", "elu_plus_one", 1, 1, 1, 9, 6,
                           8, 6, causal="bottom_right"))
    cases.append(make_case("elu_plus_one/top_left/Lq4_Lk9", "elu_plus_one", 1, 1, 1, 4, 9, 8, 6,
                           causal="top_left"))
    # bottom_right with key_lengths: each sequence's diagonal from its own key length
    # (Lq > key length for the last one, whose first rows see nothing).
    cases.append(make_case("elu_plus_one/bottom_right/key_lengths_9_5_2/Lq4_Lk9", "elu_plus_one",
                           3, 2, 1, 4, 9, 8, 6, causal="bottom_right", key_lengths=[9, 5, 2]))
    cases.append(make_case("elu_plus_one/top_left/Lq9_Lk6", "elu_plus_one", 1, 1, 1, 9, 6, 8, 6,
                           causal="top_left"))
    return cases


def build_tutorial():
    rng = rng_for("seed_000_section_12")  # the name its draws were first made under
    while True:  # redraw until the tutorial's denominator has a negative entry
        Q = f32(rng.standard_normal((6, 4)))
        K = f32(rng.standard_normal((6, 4)))
        V = f32(rng.standard_normal((6, 3)))
        if np.sum(Q, axis=1).min() < 0:
            break
    tutorial_norm = np.sum(Q, axis=1, keepdims=True) + 1e-8
    tutorial_out = (1 / tutorial_norm) * np.dot(Q, np.dot(K.T, V))
    ident = (Q @ (K.T @ V)) / (Q @ K.sum(axis=0) + EPS)[:, None]
    pq, pk = phi("elu_plus_one", Q), phi("elu_plus_one", K)
    elu = (pq @ (pk.T @ V)) / (pq @ pk.sum(axis=0) + EPS)[:, None]
    # The same through the quadratic reference.
    o, _ = quadratic("elu_plus_one", Q[None, None], K[None, None], V[None, None], "none", None, EPS)
    assert close(o[0, 0], elu)
    o, _ = quadratic("identity", Q[None, None], K[None, None], V[None, None], "none", None, EPS)
    assert close(o[0, 0], ident)
    assert np.abs(tutorial_out - elu).max() > 0.1 and np.abs(tutorial_out - ident).max() > 0.1
    return {"Q": tensor(Q), "K": tensor(K), "V": tensor(V),
            "tutorial_normaliser": tensor(tutorial_norm[:, 0]), "tutorial_out": tensor(tutorial_out),
            "identity_out": tensor(ident), "elu_plus_one_out": tensor(elu)}


def main():
    cases = build_cases()
    obj = {"cases": cases, "tutorial": build_tutorial()}
    path = os.path.join(HERE, "linear.json")
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        fh.write(json.dumps(obj, separators=(",", ":"), allow_nan=False))
        fh.write("\n")
    for c in cases:
        print("  %s" % c["name"])
    print("wrote %s (%d bytes)" % (os.path.relpath(path), os.path.getsize(path)))


if __name__ == "__main__":
    main()
