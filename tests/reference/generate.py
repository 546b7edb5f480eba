#!/usr/bin/env python3
"""Reference-value fixture generator for the `attn` C++ attention library.

How to run (from the repository root):

    /usr/bin/python3 tests/reference/generate.py

Needs NumPy and PyTorch (written against torch 1.13). The script is
deterministic: every random draw comes from a fixed seed and torch runs with a
single thread, so running it again rewrites byte-identical files. It checks
its own results (see "Cross-checks" below) and stops with an AssertionError if
anything disagrees.

Files written next to this script
---------------------------------

walkthrough.json
    Replays the NumPy self-attention tutorial: np.random.seed(42),
    then X = randn(3, 4), Wq = randn(4, 3), Wk = randn(4, 3), Wv = randn(4, 3)
    drawn in that order (each rounded to float32-representable values right
    after drawing). Keys:
      X, Wq, Wk, Wv                 inputs
      Q, K, V                       X@Wq, X@Wk, X@Wv
      scores                        Q@K.T
      scaled_scores                 scores / sqrt(3)
      weights                       row softmax of scaled_scores
      output                        weights @ V
      causal_mask                   tril(ones(3, 3)) (bool tensor)
      causal_weights, causal_output softmax over j <= i only (masked keys are
                                    excluded exactly, weight exactly 0)
      tutorial_minus_1e9_causal_weights the tutorial's own masking,
                                    softmax(scaled_scores - 1e9*(1-mask)),
                                    in float64
      tutorial_linear_attention_output  the tutorial's linear_attention(Q, K, V):
                                    KV = K.T@V; Z = 1/(Q.sum(1, keepdims)+1e-8);
                                    Z * (Q@KV)   (not a normalised attention)
      correct_linear_attention_output
                                    phi = elu + 1;
                                    out_i = phi(q_i) @ (phi(K).T @ V)
                                            / (phi(q_i) . sum_j phi(k_j) + 1e-6)
      minus_1e9_fully_masked_scores the 1x3 score row used below
                                    (= scaled_scores[0:1])
      minus_1e9_fully_masked_weights
                                    softmax(row - 1e9*(1 - mask)) with an
                                    all-zero mask, computed in float64 the way
                                    the tutorial does. In float64 subtracting
                                    1e9 keeps the score differences, so this is
                                    (up to ~1e-7) the UNMASKED softmax of the
                                    row: nonzero weights summing to 1.
      minus_1e9_fully_masked_weights_float32
                                    the same computed in float32: row - 1e9f
                                    rounds every entry to exactly -1e9f, giving
                                    uniform weights 1/3.
    (The attn library returns all-zero weights for a fully masked row.)

softmax.json
    {"rows": [{"name", "x", "softmax", "logsumexp"}, ...], "matrix": {...}}
    x and softmax are 1-D tensors, logsumexp is a number or "-inf". An all
    -inf row has softmax = zeros and logsumexp = "-inf" (the library's
    convention). "matrix" = {"x": (5, 9), "softmax": (5, 9),
    "logsumexp": (5,)} for the matrix API.

sdpa.json
    {"cases": [case, ...]}; each case has
      name
      q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv)
      scale        number, or null meaning 1/sqrt(D)
      causal       "none" | "top_left" | "bottom_right"
      window       [left, right], -1 = unbounded on that side
      key_lengths  list of B ints, or null
      keep_mask    bool tensor of rank 4, each dim 1 or the full size of
                   (B, Hq, Lq, Lk), or null
      bias         float tensor of rank 4 broadcastable the same way (may hold
                   "-inf"), or null
      alibi_slopes list of Hq numbers (ALiBi), or null
      softcap      number > 0 (logit soft-capping), or null
      out (B, Hq, Lq, Dv), weights (B, Hq, Lq, Lk), lse (B, Hq, Lq)
    and {"alibi_schedules": {"n": [slopes]}} gives the standard ALiBi slope
    schedule for n = 1..16 heads (Press et al., the authors' get_slopes).

Semantics implemented for sdpa.json
-----------------------------------
  * off = 0 if causal == "top_left", else off = Lk - Lq (used for
    "bottom_right", and for the window when causal == "none"; the window is
    aligned top-left only when causal is "top_left", otherwise bottom-right as
    in FlashAttention). For query row i let c = i + off.
  * Key j is visible to query i (batch b, query head h) iff ALL of:
        j < key_lengths[b]                      (if key_lengths given)
        causal == "none" or j <= c
        left  < 0 or j >= c - left
        right < 0 or j <= c + right
        keep_mask[b, h, i, j] is true           (broadcast; if given)
  * GQA / MQA: query head h reads kv head h // (Hq // Hkv)
    (torch.repeat_interleave on the head dimension).
  * s[i, j] = cap * tanh(scale * (q_i . k_j) / cap)   (softcap; else no tanh)
              - alibi_slopes[h] * |c - j|              (if alibi_slopes given)
              + bias[b, h, i, j]                       (broadcast; if given)
    for visible j. Hidden j are excluded (masked_fill(-inf) before softmax).
  * If a row has no visible key, or all its visible scores are -inf:
    weights row = 0, out row = 0, lse = "-inf".
    Otherwise weights = softmax over the visible j (exactly 0 elsewhere),
    out = weights @ v, lse = log(sum over visible j of exp(s[i, j])),
    computed stably (max subtracted).
  * Everything is computed in float64 from inputs that are exactly
    representable in float32 (inputs are rounded through float32 after being
    drawn; a custom scale is rounded through float32 as well).

Cross-checks done by this script
--------------------------------
  * sdpa: the stored values come from a vectorised torch float64
    implementation (torch.softmax / torch.logsumexp on a masked score tensor).
    Every case is recomputed independently in NumPy with explicit loops over
    b, h, i, j and a scalar visibility test; both must agree to 1e-12
    (absolute + relative). Cases without bias are also compared, on their
    non-empty rows, against torch.nn.functional._scaled_dot_product_attention
    (torch 1.13, boolean keep mask, top-left is_causal) when it exists; plain
    and top-left causal cases without other masks are also compared against
    is_causal=True and against a hand-written torch.softmax(q@k^T*scale +
    triu(-inf)) formula. Every visible weight row must sum to 1 within 1e-12,
    hidden weights must be exactly 0, out/weights must be finite, and the
    cases that are meant to contain fully masked rows (and only those) do.
  * softmax: NumPy (max-subtracted, math.fsum) against torch.softmax /
    torch.logsumexp.
  * walkthrough: NumPy against the torch sdpa implementation above.

Encoding
--------
Tensor: {"shape": [...], "data": [flat row-major list]}. Non-finite numbers
are the strings "inf", "-inf", "nan". Boolean tensors hold 0/1 and carry an
extra key "dtype": "bool". Floats are written with Python's repr (the json
module's default), so they round-trip exactly. JSON is compact.
"""

import json
import math
import os
import zlib

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
TOL = 1e-12

torch.set_num_threads(1)


# ---------------------------------------------------------------------------
# encoding helpers
# ---------------------------------------------------------------------------

def f32(x):
    """Round to the nearest float32 value, returned as float64."""
    return np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64)


def assert_f32_exact(x, what):
    x = np.asarray(x, dtype=np.float64)
    assert np.array_equal(x, f32(x)), what + " is not float32-representable"


def num(x):
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def tensor(a):
    a = np.asarray(a)
    if a.dtype == np.bool_:
        return {"shape": list(a.shape),
                "data": [int(v) for v in a.ravel()],
                "dtype": "bool"}
    a = a.astype(np.float64)
    return {"shape": list(a.shape), "data": [num(v) for v in a.ravel()]}


def write_json(filename, obj):
    path = os.path.join(HERE, filename)
    text = json.dumps(obj, separators=(",", ":"), allow_nan=False)
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        fh.write(text)
        fh.write("\n")
    return path


def close(a, b, tol=TOL):
    """Elementwise |a-b| <= tol*(1+max(|a|,|b|)); equal infinities match."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return False
    same = (a == b)
    fin = np.isfinite(a) & np.isfinite(b)
    a0 = np.where(fin, a, 0.0)
    b0 = np.where(fin, b, 0.0)
    diff = np.abs(a0 - b0)
    mag = np.maximum(np.abs(a0), np.abs(b0))
    ok = same | (fin & (diff <= tol * (1.0 + mag)))
    return bool(np.all(ok))


def rng_for(name):
    return np.random.default_rng(zlib.crc32(name.encode("utf-8")))


# ---------------------------------------------------------------------------
# softmax.json
# ---------------------------------------------------------------------------

def softmax_ref(x):
    """Stable softmax + logsumexp of a 1-D float64 array (NumPy, fsum)."""
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x)
    if m == -np.inf:
        return np.zeros_like(x), -math.inf
    e = np.exp(x - m)
    s = math.fsum(e.tolist())
    return e / s, m + math.log(s)


def softmax_torch(x):
    t = torch.tensor(np.asarray(x, dtype=np.float64), dtype=torch.float64)
    sm = torch.softmax(t, dim=-1)
    sm = torch.nan_to_num(sm, nan=0.0)  # all -inf rows -> zeros
    return sm.numpy(), torch.logsumexp(t, dim=-1).numpy()


def build_softmax():
    rows = []

    def add(name, x):
        x = f32(x)
        sm, lse = softmax_ref(x)
        tsm, tlse = softmax_torch(x)
        assert close(sm, tsm), name
        assert close(lse, tlse), name
        assert np.all(np.isfinite(sm)), name
        if np.isfinite(lse):
            assert abs(math.fsum(sm.tolist()) - 1.0) <= TOL, name
        rows.append({"name": name, "x": tensor(x), "softmax": tensor(sm),
                     "logsumexp": num(lse)})

    inf = math.inf
    add("random_n7", rng_for("softmax_random_n7").standard_normal(7))
    x = rng_for("softmax_some_neg_inf_n6").standard_normal(6)
    x[[1, 4]] = -inf
    add("some_neg_inf_n6", x)
    add("all_neg_inf_n4", [-inf] * 4)
    add("single_neg_inf_n1", [-inf])
    add("large_positive_1e4", [10000.0, 9999.0, 9998.0, -10000.0])
    add("large_negative_1e4", [-10000.0, -10001.0, -10003.0, -9998.5])
    add("large_positive_with_neg_inf", [10000.0, -inf, 9999.5, 9990.0])
    add("all_equal_n5", [0.7] * 5)
    add("single_element", [3.25])
    add("long_n1000", rng_for("softmax_long_n1000").standard_normal(1000) * 10.0)

    mx = f32(rng_for("softmax_matrix_5x9").standard_normal((5, 9)))
    msm = np.zeros_like(mx)
    mlse = np.zeros(mx.shape[0])
    for r in range(mx.shape[0]):
        msm[r], mlse[r] = softmax_ref(mx[r])
    tsm, tlse = softmax_torch(mx)
    assert close(msm, tsm) and close(mlse, tlse)
    matrix = {"x": tensor(mx), "softmax": tensor(msm), "logsumexp": tensor(mlse)}
    return {"rows": rows, "matrix": matrix}


# ---------------------------------------------------------------------------
# sdpa reference, implementation 1: vectorised torch float64 (stored)
# ---------------------------------------------------------------------------

def sequence_lengths(B, Lq, Lk, key_lengths, query_lengths):
    """n_k(b) and n_q(b): the given lengths, or the padded extents."""
    nk = [Lk] * B if key_lengths is None else list(key_lengths)
    nq = [Lq] * B if query_lengths is None else list(query_lengths)
    return nk, nq


def diagonals_torch(B, Lq, Lk, causal, key_lengths, query_lengths):
    """c_b(i) as a (B, 1, Lq, 1) tensor: i, or i + n_k(b) - n_q(b) unless top-left."""
    nk, nq = sequence_lengths(B, Lq, Lk, key_lengths, query_lengths)
    i = torch.arange(Lq).view(1, 1, Lq, 1)
    if causal == "top_left":
        return i.expand(B, 1, Lq, 1)
    off = torch.tensor([nk[b] - nq[b] for b in range(B)]).view(B, 1, 1, 1)
    return i + off


def visibility_torch(B, Hq, Lq, Lk, causal, window, key_lengths, keep_mask,
                     query_lengths=None, sink_tokens=0):
    j = torch.arange(Lk).view(1, 1, 1, Lk)
    c = diagonals_torch(B, Lq, Lk, causal, key_lengths, query_lengths)
    nk, nq = sequence_lengths(B, Lq, Lk, key_lengths, query_lengths)
    vis = torch.ones(B, Hq, Lq, Lk, dtype=torch.bool)
    vis = vis & (j < torch.tensor(nk).view(B, 1, 1, 1))
    vis = vis & (torch.arange(Lq).view(1, 1, Lq, 1) < torch.tensor(nq).view(B, 1, 1, 1))
    if causal != "none":
        vis = vis & (j <= c)
    left, right = window
    in_window = torch.ones(B, Hq, Lq, Lk, dtype=torch.bool)
    if left >= 0:
        in_window = in_window & (j >= c - left)
    if right >= 0:
        in_window = in_window & (j <= c + right)
    vis = vis & (in_window | (j < sink_tokens))  # sink tokens are exempt from the window
    if keep_mask is not None:
        vis = vis & torch.from_numpy(np.ascontiguousarray(keep_mask))
    return vis


def alibi_torch(slopes, B, Hq, Lq, Lk, causal, key_lengths=None, query_lengths=None):
    """The explicit ALiBi bias tensor (B, Hq, Lq, Lk): -slope[h] * |c_b(i) - j|."""
    c = diagonals_torch(B, Lq, Lk, causal, key_lengths, query_lengths).to(torch.float64)
    j = torch.arange(Lk, dtype=torch.float64).view(1, 1, 1, Lk)
    distance = (c - j).abs()
    return -torch.tensor(slopes, dtype=torch.float64).view(1, Hq, 1, 1) * distance


def sdpa_torch(q, k, v, scale, causal, window, key_lengths, keep_mask, bias,
               alibi_slopes=None, softcap=None, query_lengths=None, sink_tokens=0,
               sinks=None):
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    qt = torch.from_numpy(q)
    kt = torch.from_numpy(k).repeat_interleave(group, dim=1)
    vt = torch.from_numpy(v).repeat_interleave(group, dim=1)
    sc = (1.0 / math.sqrt(D)) if scale is None else scale
    s = torch.matmul(qt, kt.transpose(-1, -2)) * sc
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        s = s + alibi_torch(alibi_slopes, B, Hq, Lq, Lk, causal, key_lengths, query_lengths)
    if bias is not None:
        s = s + torch.from_numpy(bias)
    vis = visibility_torch(B, Hq, Lq, Lk, causal, window, key_lengths, keep_mask,
                           query_lengths, sink_tokens)
    s = s.masked_fill(~vis, -math.inf)
    if sinks is not None:
        # gpt-oss's eager formula: the sink joins the softmax as one more column, which is
        # then dropped.
        sink = torch.tensor(sinks, dtype=torch.float64).view(1, Hq, 1, 1).expand(B, Hq, Lq, 1)
        combined = torch.cat([s, sink], dim=-1)
        lse = torch.logsumexp(combined, dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        w = torch.softmax(combined, dim=-1)[..., :-1]
        out = torch.matmul(w, vt)
        return out.numpy(), w.numpy(), lse.numpy(), vis.numpy()
    lse = torch.logsumexp(s, dim=-1)
    valid = torch.isfinite(lse)
    w = torch.softmax(s, dim=-1)
    w = torch.where(valid.unsqueeze(-1), w, torch.zeros_like(w))
    out = torch.matmul(w, vt)
    lse = torch.where(valid, lse, torch.full_like(lse, -math.inf))
    return out.numpy(), w.numpy(), lse.numpy(), vis.numpy()


# ---------------------------------------------------------------------------
# sdpa reference, implementation 2: NumPy with explicit loops (check only)
# ---------------------------------------------------------------------------

def bcast_index(shape, b, h, i, j):
    idx = (b, h, i, j)
    return tuple(0 if shape[d] == 1 else idx[d] for d in range(4))


def centre_of(b, i, Lq, Lk, causal, key_lengths, query_lengths):
    nk = Lk if key_lengths is None else key_lengths[b]
    nq = Lq if query_lengths is None else query_lengths[b]
    return i if causal == "top_left" else i + nk - nq


def key_visible(b, h, i, j, Lq, Lk, causal, window, key_lengths, keep_mask,
                query_lengths=None, sink_tokens=0):
    if key_lengths is not None and not (j < key_lengths[b]):
        return False
    if query_lengths is not None and not (i < query_lengths[b]):
        return False
    centre = centre_of(b, i, Lq, Lk, causal, key_lengths, query_lengths)
    if causal != "none" and j > centre:
        return False
    left, right = window
    if j >= sink_tokens and left >= 0 and j < centre - left:
        return False
    if j >= sink_tokens and right >= 0 and j > centre + right:
        return False
    if keep_mask is not None and not keep_mask[bcast_index(keep_mask.shape, b, h, i, j)]:
        return False
    return True


def sdpa_loops(q, k, v, scale, causal, window, key_lengths, keep_mask, bias,
               alibi_slopes=None, softcap=None, query_lengths=None, sink_tokens=0,
               sinks=None):
    B, Hq, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    per_kv = Hq // Hkv
    sc = (1.0 / math.sqrt(D)) if scale is None else scale
    out = np.zeros((B, Hq, Lq, Dv))
    w = np.zeros((B, Hq, Lq, Lk))
    lse = np.full((B, Hq, Lq), -np.inf)
    for b in range(B):
        for h in range(Hq):
            g = h // per_kv
            for i in range(Lq):
                js, ss = [], []
                for j in range(Lk):
                    if not key_visible(b, h, i, j, Lq, Lk, causal, window,
                                       key_lengths, keep_mask, query_lengths, sink_tokens):
                        continue
                    sij = sc * math.fsum(q[b, h, i, d] * k[b, g, j, d] for d in range(D))
                    if softcap is not None:
                        sij = softcap * math.tanh(sij / softcap)
                    if alibi_slopes is not None:
                        c = centre_of(b, i, Lq, Lk, causal, key_lengths, query_lengths)
                        sij -= alibi_slopes[h] * abs(c - j)
                    if bias is not None:
                        sij += bias[bcast_index(bias.shape, b, h, i, j)]
                    if sij == -math.inf:
                        continue
                    js.append(j)
                    ss.append(sij)
                if not js:
                    if sinks is not None:
                        lse[b, h, i] = sinks[h]
                    continue
                m = max(ss) if sinks is None else max(max(ss), sinks[h])
                ex = [math.exp(x - m) for x in ss]
                tot = math.fsum(ex + ([] if sinks is None else [math.exp(sinks[h] - m)]))
                lse[b, h, i] = m + math.log(tot)
                for j, e in zip(js, ex):
                    w[b, h, i, j] = e / tot
                for d in range(Dv):
                    out[b, h, i, d] = math.fsum(w[b, h, i, j] * v[b, g, j, d] for j in js)
    return out, w, lse


# ---------------------------------------------------------------------------
# sdpa.json
# ---------------------------------------------------------------------------

CASES = []
_HAS_PRIVATE_SDPA = hasattr(F, "_scaled_dot_product_attention")


def check_bcast_shape(a, full, what):
    assert a.ndim == 4, what + " must be rank 4"
    for d in range(4):
        assert a.shape[d] in (1, full[d]), "%s dim %d: %d vs %d" % (what, d, a.shape[d], full[d])


def torch_private_sdpa(q, k, v, scale, D, group, mask=None, is_causal=False):
    qt = torch.from_numpy(q)
    if scale is not None:
        qt = qt * (scale * math.sqrt(D))
    kt = torch.from_numpy(k).repeat_interleave(group, dim=1)
    vt = torch.from_numpy(v).repeat_interleave(group, dim=1)
    m = None if mask is None else torch.from_numpy(np.ascontiguousarray(mask))
    out, w = F._scaled_dot_product_attention(qt, kt, vt, m, 0.0, True, is_causal)
    return out.numpy(), w.numpy()


def add_case(name, B, Hq, Hkv, Lq, Lk, D, Dv, scale=None, causal="none",
             window=(-1, -1), key_lengths=None, keep_mask=None, bias=None,
             qkv=None, expect_empty=False, same_as=None, alibi_slopes=None,
             softcap=None, query_lengths=None, sink_tokens=0, sinks=None):
    """Build, verify and record one sdpa case.

    keep_mask / bias may be callables taking the case's rng. qkv may be a
    (q, k, v) tuple or a callable taking the rng. same_as: a dict of
    alternative settings that must give identical results on these inputs.
    """
    assert causal in ("none", "top_left", "bottom_right")
    assert Hq % Hkv == 0
    assert all(n["name"] != name for n in CASES), "duplicate name " + name
    rng = rng_for(name)
    if qkv is None:
        q = rng.standard_normal((B, Hq, Lq, D))
        k = rng.standard_normal((B, Hkv, Lk, D))
        v = rng.standard_normal((B, Hkv, Lk, Dv))
    else:
        q, k, v = qkv(rng) if callable(qkv) else qkv
    q, k, v = f32(q), f32(k), f32(v)
    assert q.shape == (B, Hq, Lq, D) and k.shape == (B, Hkv, Lk, D)
    assert v.shape == (B, Hkv, Lk, Dv)
    if callable(keep_mask):
        keep_mask = keep_mask(rng)
    if keep_mask is not None:
        keep_mask = np.asarray(keep_mask, dtype=np.bool_)
        check_bcast_shape(keep_mask, (B, Hq, Lq, Lk), name + " keep_mask")
    if callable(bias):
        bias = bias(rng)
    if bias is not None:
        bias = f32(bias)
        check_bcast_shape(bias, (B, Hq, Lq, Lk), name + " bias")
        assert not np.any(np.isnan(bias)) and not np.any(bias == np.inf)
    if scale is not None:
        scale = float(np.float32(scale))
    if key_lengths is not None:
        key_lengths = [int(n) for n in key_lengths]
        assert len(key_lengths) == B and all(0 <= n <= Lk for n in key_lengths)
    if query_lengths is not None:
        query_lengths = [int(n) for n in query_lengths]
        assert len(query_lengths) == B and all(0 <= n <= Lq for n in query_lengths)
    if sinks is not None:
        sinks = [float(np.float32(x)) for x in sinks]
        assert len(sinks) == Hq
    window = [int(window[0]), int(window[1])]
    assert window[0] >= -1 and window[1] >= -1
    for arr, what in ((q, "q"), (k, "k"), (v, "v")):
        assert_f32_exact(arr, name + " " + what)
    if bias is not None:
        assert_f32_exact(bias, name + " bias")

    if alibi_slopes is not None:
        alibi_slopes = [float(np.float32(x)) for x in alibi_slopes]
        assert len(alibi_slopes) == Hq
    if softcap is not None:
        softcap = float(np.float32(softcap))
        assert softcap > 0
    modified = alibi_slopes is not None or softcap is not None or sinks is not None
    args = (scale, causal, window, key_lengths, keep_mask, bias)
    extra = (alibi_slopes, softcap, query_lengths, sink_tokens, sinks)
    out, w, lse, vis = sdpa_torch(q, k, v, *args, *extra)

    # --- independent NumPy loop implementation
    out2, w2, lse2 = sdpa_loops(q, k, v, *args, *extra)
    assert close(out, out2), name + ": out differs from loop reference"
    assert close(w, w2), name + ": weights differ from loop reference"
    assert close(lse, lse2), name + ": lse differs from loop reference"

    # --- structural properties
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(w)), name
    assert np.all(w[~vis] == 0.0), name + ": hidden key got weight"
    valid = np.isfinite(lse)
    assert np.all(np.isfinite(lse) | (lse == -np.inf)), name
    sums = w.sum(axis=-1)
    if sinks is None:
        assert np.all(np.abs(sums[valid] - 1.0) <= TOL), name + ": row sum"
        assert np.all(w[~valid] == 0.0) and np.all(out[~valid] == 0.0), name
        n_empty = int((~valid).sum())
    else:  # the weights and the sink's share make 1
        share = np.exp(np.array(sinks).reshape(1, Hq, 1) - lse)
        assert np.all(np.abs(sums + share - 1.0) <= TOL), name + ": row sum with the sink"
        assert np.all(sums < 1.0), name + ": the sink takes a share"
        n_empty = int((sums == 0.0).sum())
    assert (n_empty > 0) == expect_empty, "%s: %d empty rows, expected %s" % (
        name, n_empty, "some" if expect_empty else "none")

    # --- torch cross-checks
    group = Hq // Hkv
    plain_like = (key_lengths is None and keep_mask is None and bias is None
                  and window == [-1, -1] and causal in ("none", "top_left") and not modified)
    if plain_like or (causal == "bottom_right" and Lq == Lk and key_lengths is None
                      and keep_mask is None and bias is None and window == [-1, -1]
                      and not modified):
        # hand-written formula: softmax(q k^T * scale + triu(-inf))
        sc = (1.0 / math.sqrt(D)) if scale is None else scale
        kt = torch.from_numpy(k).repeat_interleave(group, dim=1)
        vt = torch.from_numpy(v).repeat_interleave(group, dim=1)
        s = torch.from_numpy(q) @ kt.transpose(-1, -2) * sc
        if causal != "none":
            s = s + torch.triu(torch.full((Lq, Lk), -math.inf, dtype=torch.float64), 1)
        w3 = torch.softmax(s, dim=-1)
        assert close(w, w3.numpy()), name + ": formula weights"
        assert close(out, (w3 @ vt).numpy()), name + ": formula out"
        assert close(lse, torch.logsumexp(s, dim=-1).numpy()), name + ": formula lse"
        if _HAS_PRIVATE_SDPA and scale is None:
            o4, w4 = torch_private_sdpa(q, k, v, scale, D, group,
                                        is_causal=(causal != "none"))
            assert close(out, o4) and close(w, w4), name + ": private sdpa causal"
    if alibi_slopes is not None and softcap is None and sinks is None:
        # ALiBi is exactly an additive bias: the same case with the explicit tensor.
        explicit = alibi_torch(alibi_slopes, B, Hq, Lq, Lk, causal, key_lengths,
                               query_lengths).numpy()
        if bias is not None:
            explicit = explicit + bias
        o7, w7, l7, _ = sdpa_torch(q, k, v, scale, causal, window, key_lengths, keep_mask,
                                   explicit, None, None, query_lengths, sink_tokens)
        assert close(out, o7) and close(w, w7) and close(lse, l7), name + ": alibi as bias"
    if _HAS_PRIVATE_SDPA and bias is None and not modified:
        o5, w5 = torch_private_sdpa(q, k, v, scale, D, group, mask=vis)
        assert close(out[valid], o5[valid]), name + ": private sdpa (mask) out"
        assert close(w[valid], w5[valid]), name + ": private sdpa (mask) weights"

    if same_as is not None:
        alt = dict(scale=scale, causal=causal, window=window,
                   key_lengths=key_lengths, keep_mask=keep_mask, bias=bias)
        alt.update(same_as)
        o6, w6, l6, _ = sdpa_torch(q, k, v, alt["scale"], alt["causal"],
                                   list(alt["window"]), alt["key_lengths"],
                                   alt["keep_mask"], alt["bias"])
        assert np.array_equal(out, o6) and np.array_equal(w, w6) and \
            np.array_equal(lse, l6), name + ": same_as mismatch"

    CASES.append({
        "name": name,
        "q": tensor(q), "k": tensor(k), "v": tensor(v),
        "scale": scale,
        "causal": causal,
        "window": window,
        "key_lengths": key_lengths,
        "keep_mask": None if keep_mask is None else tensor(keep_mask),
        "bias": None if bias is None else tensor(bias),
        "alibi_slopes": alibi_slopes,
        "softcap": softcap,
        "query_lengths": query_lengths,
        "sink_tokens": sink_tokens,
        "sinks": sinks,
        "out": tensor(out), "weights": tensor(w), "lse": tensor(lse),
        "_summary": "B=%d Hq=%d Hkv=%d Lq=%d Lk=%d D=%d Dv=%d empty_rows=%d" % (
            B, Hq, Hkv, Lq, Lk, D, Dv, n_empty),
    })


def alibi_schedule(n):
    """The ALiBi authors' slope schedule (get_slopes in ofirpress/attention_with_linear_biases):
    a geometric sequence starting at 2^(-8/n) for n a power of two; otherwise the schedule of
    the power of two below n, then every other slope of the one above."""
    def power_of_two(m):
        start = 2.0 ** (-(2.0 ** -(math.log2(m) - 3)))
        return [start * start ** i for i in range(m)]
    if math.log2(n).is_integer():
        return power_of_two(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_two(closest) + alibi_schedule(2 * closest)[0::2][:n - closest]


def large_logit_qkv(sign):
    """Integer q, k with D=4 and the default scale 0.5 (so every score is an
    exact integer, also in float32). q row [sign*100, sign*100, 2s, 2t] and
    k row [a, b, c, d] give the scaled score sign*50*(a+b) + s*c + t*d:
    top scores sit at sign*1e4 with gaps of 0..7, one key sits ~50 below the
    top (weight ~1e-22) and one ~5000 below (weight exactly 0 in float64)."""
    def make(rng):
        q = np.array([[100, 100, 0, 0], [100, 100, 2, 0],
                      [100, 100, 0, 2], [100, 100, 2, 2]], dtype=np.float64)
        q[:, :2] *= sign
        near = 199 if sign > 0 else 201      # sign*50*near = sign*1e4 - 50
        far = 100 if sign > 0 else 300       # sign*50*far = sign*1e4 - 5000
        k = np.array([[100, 100, 0, 0],
                      [100, 100, 3, 1],
                      [99, 101, 5, 2],
                      [100, near - 100, 4, 4],
                      [far // 2, far - far // 2, 1, 0],
                      [100, 100, 1, 5]], dtype=np.float64)
        v = rng.standard_normal((1, 1, 6, 3))
        return q.reshape(1, 1, 4, 4), k.reshape(1, 1, 6, 4), v
    return make


def build_sdpa():
    # --- basic
    add_case("plain_b2_h3_lq6_lk6_d8", 2, 3, 3, 6, 6, 8, 8,
             same_as={"window": [-1, -1], "causal": "none"})
    add_case("d4_dv3_lq5_lk7", 2, 2, 2, 5, 7, 4, 3)
    add_case("custom_scale_0p3_lq5_lk5_d6", 2, 2, 2, 5, 5, 6, 6, scale=0.3)

    # --- causal
    add_case("causal_top_left_lq6_lk6", 2, 2, 2, 6, 6, 5, 4, causal="top_left")
    add_case("causal_top_left_lq4_lk7", 2, 2, 2, 4, 7, 5, 4, causal="top_left")
    add_case("causal_top_left_lq7_lk4", 2, 2, 2, 7, 4, 5, 4, causal="top_left")
    add_case("causal_bottom_right_lq6_lk6", 2, 2, 2, 6, 6, 5, 4, causal="bottom_right",
             same_as={"causal": "top_left"})
    add_case("causal_bottom_right_lq4_lk7", 2, 2, 2, 4, 7, 5, 4, causal="bottom_right")
    add_case("causal_bottom_right_lq7_lk4_first_rows_empty", 2, 2, 2, 7, 4, 5, 4,
             causal="bottom_right", expect_empty=True)

    # --- sliding window (causal none -> bottom-right aligned)
    add_case("window_l2_r1_lq6_lk6", 2, 2, 2, 6, 6, 4, 4, window=(2, 1))
    add_case("window_l2_r1_lq5_lk8", 2, 2, 2, 5, 8, 4, 4, window=(2, 1))
    add_case("window_lm1_r0_lq5_lk8_equals_causal_bottom_right", 2, 2, 2, 5, 8, 4, 4,
             window=(-1, 0),
             same_as={"causal": "bottom_right", "window": [-1, -1]})
    add_case("window_l0_r0_lq6_lk6_diagonal", 2, 2, 2, 6, 6, 4, 4, window=(0, 0))
    add_case("window_l0_r0_lq7_lk4_first_rows_empty", 1, 2, 2, 7, 4, 4, 4,
             window=(0, 0), expect_empty=True)
    add_case("window_l1_rm1_lq5_lk8", 2, 2, 2, 5, 8, 4, 4, window=(1, -1))
    add_case("window_l1_rm1_lq6_lk6", 2, 2, 2, 6, 6, 4, 4, window=(1, -1))
    add_case("causal_top_left_window_l2_rm1_lq6_lk6", 2, 2, 2, 6, 6, 4, 4,
             causal="top_left", window=(2, -1))
    add_case("causal_top_left_window_l2_rm1_lq5_lk8", 2, 2, 2, 5, 8, 4, 4,
             causal="top_left", window=(2, -1))

    # --- key lengths
    add_case("key_lengths_5_2_lq4_lk6", 2, 2, 2, 4, 6, 4, 5, key_lengths=[5, 2])
    add_case("key_lengths_0_3_lq4_lk6_batch0_empty", 2, 2, 2, 4, 6, 4, 5,
             key_lengths=[0, 3], expect_empty=True)

    # --- keep masks
    B, H, Lq, Lk = 2, 2, 5, 6

    def random_mask(shape, p=0.65):
        def make(rng):
            m = rng.random(shape) < p
            m[..., 0] |= ~m.any(axis=-1)  # no empty row unless intended
            return m
        return make

    add_case("keep_mask_full_b2_h2_lq5_lk6", B, H, H, Lq, Lk, 4, 4,
             keep_mask=random_mask((B, H, Lq, Lk)))
    add_case("keep_mask_1_1_lq_lk", B, H, H, Lq, Lk, 4, 4,
             keep_mask=random_mask((1, 1, Lq, Lk)))

    def padding_mask(rng):
        lens = [6, 3]
        return np.arange(Lk)[None, None, None, :] < np.array(lens).reshape(2, 1, 1, 1)
    add_case("keep_mask_b_1_1_lk_padding", B, H, H, Lq, Lk, 4, 4,
             keep_mask=padding_mask)

    def row_mask(rng):
        m = np.ones((1, H, Lq, 1), dtype=np.bool_)
        m[0, 0, 1, 0] = False
        m[0, 1, 3, 0] = False
        m[0, 1, 4, 0] = False
        return m
    add_case("keep_mask_1_h_lq_1_some_rows_empty", B, H, H, Lq, Lk, 4, 4,
             keep_mask=row_mask, expect_empty=True)

    def one_empty_row(rng):
        m = random_mask((B, H, Lq, Lk))(rng)
        m[1, 0, 2, :] = False
        return m
    add_case("keep_mask_fully_masked_row", B, H, H, Lq, Lk, 4, 4,
             keep_mask=one_empty_row, expect_empty=True)

    # --- bias
    add_case("bias_full_b2_h2_lq5_lk6", B, H, H, Lq, Lk, 4, 4,
             bias=lambda rng: rng.standard_normal((B, H, Lq, Lk)))
    add_case("bias_1_1_lq_lk", B, H, H, Lq, Lk, 4, 4,
             bias=lambda rng: rng.standard_normal((1, 1, Lq, Lk)))
    add_case("bias_1_h_1_1_per_head_constant", B, H, H, Lq, Lk, 4, 4,
             bias=lambda rng: np.array([1.5, -2.25]).reshape(1, H, 1, 1))

    def bias_some_inf(rng):
        b = rng.standard_normal((B, H, Lq, Lk))
        b[0, 0, 0, 1] = -np.inf
        b[0, 1, 2, 0] = -np.inf
        b[0, 1, 2, 5] = -np.inf
        b[1, 0, 4, 3] = -np.inf
        b[1, 1, 1, :4] = -np.inf
        return b
    add_case("bias_with_some_neg_inf", B, H, H, Lq, Lk, 4, 4, bias=bias_some_inf)

    def bias_row_inf(rng):
        b = rng.standard_normal((B, H, Lq, Lk))
        b[1, 0, 3, :] = -np.inf
        return b
    add_case("bias_row_all_neg_inf", B, H, H, Lq, Lk, 4, 4, bias=bias_row_inf,
             expect_empty=True)

    def complement_mask(rng):
        m = np.ones((B, H, Lq, Lk), dtype=np.bool_)
        m[0, 1, 2, :3] = False
        return m

    def complement_bias(rng):
        b = rng.standard_normal((B, H, Lq, Lk))
        b[0, 1, 2, 3:] = -np.inf      # keep_mask hides j<3, bias kills j>=3
        b[1, 1, 0, 2] = -np.inf
        return b
    add_case("keep_mask_and_bias_neg_inf_complement_row_empty", B, H, H, Lq, Lk, 4, 4,
             keep_mask=complement_mask, bias=complement_bias, expect_empty=True)

    # --- GQA / MQA
    add_case("gqa_hq8_hkv2_plain_lq5_lk7", 1, 8, 2, 5, 7, 4, 4)
    add_case("gqa_hq8_hkv2_causal_bottom_right_lq5_lk9", 1, 8, 2, 5, 9, 4, 4,
             causal="bottom_right")
    add_case("gqa_hq8_hkv2_causal_top_left_lq6_lk6", 1, 8, 2, 6, 6, 4, 3,
             causal="top_left")
    add_case("mqa_hq4_hkv1_lq6_lk6", 2, 4, 1, 6, 6, 4, 4)
    add_case("mqa_hq4_hkv1_causal_bottom_right_lq3_lk7", 2, 4, 1, 3, 7, 4, 4,
             causal="bottom_right")

    # --- combined
    def combined_mask(rng):
        m = rng.random((2, 1, 1, 9)) < 0.8
        m[:, :, :, 6] = True
        m[1, 0, 0, 3:6] = False   # batch 1 (diagonal 6 at row 4) keys left for row 4: j = 6
        return m

    def combined_bias(rng):
        b = rng.standard_normal((1, 4, 5, 9))
        b[0, 2, 4, 6] = -np.inf   # -> (b=1, h=2, i=4) has nothing left
        b[0, 0, 2, 3] = -np.inf
        return b
    add_case("combined_gqa_hq4_hkv2_causal_bottom_right_window_l3_keylen_mask_bias_lq5_lk9",
             2, 4, 2, 5, 9, 4, 3, causal="bottom_right", window=(3, -1),
             key_lengths=[9, 7], keep_mask=combined_mask, bias=combined_bias,
             expect_empty=True)

    # --- large logits (exact integer scores in float32)
    add_case("large_logits_pos_1e4_d4", 1, 1, 1, 4, 6, 4, 3, qkv=large_logit_qkv(+1))
    add_case("large_logits_neg_1e4_d4", 1, 1, 1, 4, 6, 4, 3, qkv=large_logit_qkv(-1))

    # --- single query row (decode-like)
    add_case("decode_lq1_lk9_causal_bottom_right", 1, 1, 1, 1, 9, 6, 6,
             causal="bottom_right")
    add_case("decode_lq1_lk9_causal_top_left_sees_key0", 1, 1, 1, 1, 9, 6, 6,
             causal="top_left")
    add_case("decode_lq1_lk9_window_l3_r0", 1, 1, 1, 1, 9, 6, 6, window=(3, 0))
    add_case("decode_lq1_lk9_plain", 1, 1, 1, 1, 9, 6, 6)

    # --- score modifiers: ALiBi and logit soft-capping
    add_case("alibi_h4_lq9_lk9", 1, 4, 4, 9, 9, 8, 8, alibi_slopes=alibi_schedule(4))
    add_case("alibi_causal_top_left_lq5_lk9", 2, 4, 4, 5, 9, 8, 6, causal="top_left",
             alibi_slopes=alibi_schedule(4))
    add_case("alibi_causal_bottom_right_lq5_lk9", 2, 4, 4, 5, 9, 8, 6,
             causal="bottom_right", alibi_slopes=alibi_schedule(4))
    add_case("alibi_gqa_h6_kv2_window_lq7_lk12", 1, 6, 2, 7, 12, 8, 8, window=(4, 2),
             alibi_slopes=alibi_schedule(6))
    add_case("softcap_5_large_logits_lq6_lk10", 1, 2, 2, 6, 10, 8, 8, scale=1.0,
             softcap=5.0, qkv=lambda rng: (3 * rng.standard_normal((1, 2, 6, 8)),
                                           3 * rng.standard_normal((1, 2, 10, 8)),
                                           rng.standard_normal((1, 2, 10, 8))))
    add_case("softcap_alibi_bias_causal_bottom_right_key_lengths", 2, 4, 2, 6, 11, 8, 8,
             causal="bottom_right", key_lengths=[11, 7], softcap=2.5,
             alibi_slopes=alibi_schedule(4),
             bias=lambda rng: rng.standard_normal((1, 4, 6, 11)))
    add_case("softcap_with_minus_inf_bias", 1, 1, 1, 4, 6, 8, 8, softcap=30.0,
             bias=lambda rng: np.where(rng.random((1, 1, 4, 6)) < 0.3, -np.inf, 0.0))

    # --- per-sequence lengths: each sequence's diagonal from its own n_k(b) - n_q(b)
    add_case("ragged_causal_bottom_right_lq6_lk10", 3, 2, 2, 6, 10, 8, 8,
             causal="bottom_right", key_lengths=[10, 7, 3], query_lengths=[6, 2, 3], expect_empty=True)
    add_case("ragged_causal_top_left_lq6_lk10", 3, 2, 1, 6, 10, 8, 8, causal="top_left",
             key_lengths=[10, 7, 3], query_lengths=[6, 2, 0], expect_empty=True)
    add_case("ragged_window_l2_alibi_softcap_bottom_right", 2, 4, 2, 5, 9, 8, 6,
             causal="bottom_right", window=(2, -1), key_lengths=[9, 4],
             query_lengths=[5, 3], alibi_slopes=alibi_schedule(4), softcap=3.0, expect_empty=True)
    add_case("ragged_window_l1_r1_no_causal", 2, 2, 2, 5, 8, 4, 4, window=(1, 1),
             key_lengths=[8, 5], query_lengths=[3, 5], expect_empty=True)
    # --- learned sinks (gpt-oss) and sink tokens (StreamingLLM)
    add_case("sinks_plain_lq5_lk7", 1, 4, 4, 5, 7, 8, 8, sinks=[0.5, -1.0, 2.0, 0.0])
    add_case("sinks_causal_bottom_right_key_lengths_empty_row", 2, 2, 1, 4, 6, 8, 8,
             causal="bottom_right", key_lengths=[6, 0], sinks=[1.5, -0.5], expect_empty=True)
    add_case("sinks_gqa_softcap_alibi_ragged", 2, 4, 2, 6, 9, 8, 8, causal="bottom_right",
             key_lengths=[9, 5], query_lengths=[6, 4], softcap=2.5,
             alibi_slopes=alibi_schedule(4), sinks=[0.25, 1.0, -2.0, 3.0], expect_empty=True)
    add_case("sink_tokens_2_window_l2_causal_bottom_right", 1, 2, 2, 8, 12, 8, 8,
             causal="bottom_right", window=(2, -1), sink_tokens=2)
    add_case("sink_tokens_3_window_l1_r0_sinks_ragged", 2, 2, 2, 7, 10, 4, 4,
             window=(1, 0), sink_tokens=3, key_lengths=[10, 6], query_lengths=[7, 5],
             sinks=[0.0, 1.0], expect_empty=True)

    summaries = []
    for c in CASES:
        summaries.append((c["name"], c.pop("_summary")))
    schedules = {str(n): [float(np.float32(x)) for x in alibi_schedule(n)]
                 for n in range(1, 17)}
    return {"cases": CASES, "alibi_schedules": schedules}, summaries


# ---------------------------------------------------------------------------
# walkthrough.json
# ---------------------------------------------------------------------------

def np_softmax_rows(x):
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def build_walkthrough():
    np.random.seed(42)
    X = f32(np.random.randn(3, 4))
    d_model, d_k, d_v = 4, 3, 3
    Wq = f32(np.random.randn(d_model, d_k))
    Wk = f32(np.random.randn(d_model, d_k))
    Wv = f32(np.random.randn(d_model, d_v))

    Q = np.dot(X, Wq)
    K = np.dot(X, Wk)
    V = np.dot(X, Wv)
    scores = np.dot(Q, K.T)
    scaled = scores / np.sqrt(d_k)
    weights = np_softmax_rows(scaled)
    output = np.dot(weights, V)

    mask = np.tril(np.ones((3, 3))) > 0
    cw = np.zeros((3, 3))
    for i in range(3):
        row = scaled[i, : i + 1]
        e = np.exp(row - row.max())
        cw[i, : i + 1] = e / e.sum()
    causal_output = cw @ V
    tutorial_causal = np_softmax_rows(scaled - 1e9 * (1 - np.tril(np.ones((3, 3)))))

    # tutorial's linear_attention, verbatim formula
    KV = np.dot(K.T, V)
    Z = 1 / (np.sum(Q, axis=1, keepdims=True) + 1e-8)
    tutorial_lin = Z * np.dot(Q, KV)

    def phi(x):
        return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))
    pq, pk = phi(Q), phi(K)
    num_ = pq @ (pk.T @ V)
    den = pq @ pk.sum(axis=0) + 1e-6
    correct_lin = num_ / den[:, None]
    # loop form of the same, as a check
    for i in range(3):
        acc = sum(np.dot(pq[i], pk[j]) * V[j] for j in range(3))
        nrm = sum(np.dot(pq[i], pk[j]) for j in range(3)) + 1e-6
        assert close(acc / nrm, correct_lin[i])
    assert not close(tutorial_lin, correct_lin, 1e-3)

    row = scaled[0:1]
    full_mask_row = np.zeros((1, 3))
    m1e9 = np_softmax_rows(row - 1e9 * (1 - full_mask_row))
    row32 = row.astype(np.float32)
    masked32 = row32 - np.float32(1e9) * (np.float32(1) - full_mask_row.astype(np.float32))
    m1e9_32 = np_softmax_rows(masked32).astype(np.float64)
    assert np.all(m1e9 > 0) and abs(m1e9.sum() - 1) < 1e-12
    assert np.all(m1e9_32 == np.float64(np.float32(1.0) / np.float32(3.0)))

    # cross-check against the sdpa reference implementation
    q4, k4, v4 = Q[None, None], K[None, None], V[None, None]
    o, w, _, _ = sdpa_torch(q4, k4, v4, 1.0 / math.sqrt(3), "none", [-1, -1], None, None, None)
    assert close(w[0, 0], weights) and close(o[0, 0], output)
    o, w, _, _ = sdpa_torch(q4, k4, v4, 1.0 / math.sqrt(3), "top_left", [-1, -1], None, None, None)
    assert close(w[0, 0], cw) and close(o[0, 0], causal_output)
    assert close(tutorial_causal, cw, 1e-12)
    assert close(weights.sum(axis=1), np.ones(3)) and close(cw.sum(axis=1), np.ones(3))

    return {
        "X": tensor(X), "Wq": tensor(Wq), "Wk": tensor(Wk), "Wv": tensor(Wv),
        "Q": tensor(Q), "K": tensor(K), "V": tensor(V),
        "scores": tensor(scores), "scaled_scores": tensor(scaled),
        "weights": tensor(weights), "output": tensor(output),
        "causal_mask": tensor(mask),
        "causal_weights": tensor(cw), "causal_output": tensor(causal_output),
        "tutorial_minus_1e9_causal_weights": tensor(tutorial_causal),
        "tutorial_linear_attention_output": tensor(tutorial_lin),
        "correct_linear_attention_output": tensor(correct_lin),
        "minus_1e9_fully_masked_scores": tensor(row),
        "minus_1e9_fully_masked_weights": tensor(m1e9),
        "minus_1e9_fully_masked_weights_float32": tensor(m1e9_32),
    }


# ---------------------------------------------------------------------------

def main():
    written = []
    written.append(write_json("walkthrough.json", build_walkthrough()))
    sm = build_softmax()
    written.append(write_json("softmax.json", sm))
    sdpa, summaries = build_sdpa()
    written.append(write_json("sdpa.json", sdpa))

    print("softmax.json rows:")
    for r in sm["rows"]:
        print("  %-32s n=%d" % (r["name"], r["x"]["shape"][0]))
    print("  matrix %s" % (sm["matrix"]["x"]["shape"],))
    print("sdpa.json cases (%d):" % len(summaries))
    for name, s in summaries:
        print("  %-80s %s" % (name, s))
    print("torch private _scaled_dot_product_attention cross-check: %s"
          % ("yes" if _HAS_PRIVATE_SDPA else "not available"))
    for p in written:
        print("wrote %s (%d bytes)" % (os.path.relpath(p), os.path.getsize(p)))


if __name__ == "__main__":
    main()
