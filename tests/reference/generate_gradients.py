#!/usr/bin/env python3
"""Reference gradients for attn's backward passes, by torch autograd in float64.

How to run (from the repository root; needs PyTorch, written against Debian's
torch 1.13, and NumPy):

    /usr/bin/python3 tests/reference/generate_gradients.py

Deterministic: every draw comes from a NumPy generator seeded by the case name
and torch runs single-threaded in float64, so a rerun writes a byte-identical
gradients.json. Inputs are rounded to float32-representable values right after
drawing, so that the float tests start from the fixture's numbers.

Linear attention (include/attn/linear_attention.hpp, linear_attention_backward)
------------------------------------------------------------------------------
The forward is written the QUADRATIC way, as explicit torch formulas (never the
library's prefix sums), and differentiated by autograd:

    A[i, j] = phi_q(q_i) . phi_k(k_j)   if key j is visible to query i, else 0
    out_i   = sum_j A[i, j] v_j / (sum_j A[i, j] + eps)
    loss    = sum(out * dout)      so that the gradients are dq, dk, dv

Visibility and grouped-query heads as in generate_linear.py (j < key_lengths[b];
causal: j <= i + off, off = 0 for top_left, key_lengths[b] - Lq for bottom_right; query head
h reads kv head h // (Hq // Hkv)). Feature maps:

    elu_plus_one  F.elu(x) + 1
    relu          relu(x)
    identity      x (inputs drawn positive, so every normaliser is positive)
    custom        softmax(x @ W_c) over the M features, W_c (D, M) in the case
                  ("custom_weight"): a map that mixes a row's coordinates, whose
                  derivative the C++ side gives as a vector-Jacobian product
    favor_plus    Performer's features with the projection omega (m, D) of the
                  case ("omega"), s = D^(-1/4):
                    a(x)     = s x omega^T - s^2 |x|^2 / 2           (m exponents)
                    phi_q(q) = exp(a(q) - max(a(q))) / sqrt(m)       max per row
                    phi_k(k) = exp(a(k) - shift) / sqrt(m)
                  The shifts are attn's stabilisers, differentiated exactly (not
                  detached): the row max through torch.max, and the key shift is
                  one key's exponent a(k_j*)[m*], chosen as the forward chooses
                  it: scanning the keys in order, the first key's largest
                  exponent, replaced by a later key's largest when that exceeds
                  it by more than 20. Query i sees the shift after the scan of
                  the keys its chunk of `chunk` rows has absorbed: keys
                  [0, min(i0 + off + n, key_length)) for the chunk [i0, i0 + n)
                  (causal), all valid keys (non-causal). The "raise" cases put a
                  far-out key first so that the shift changes between chunks.
Cross-check: torch.autograd.gradcheck (finite differences) on every case.

Layers (include/attn/projection.hpp)
------------------------------------
    linear: y = F.linear(x, weight, bias), weight (out, in) as nn.Linear,
            loss = sum(y * dy): dx, weight.grad (out, in), bias.grad
    qkv:    q = F.linear(x_q, Wq, bq), k = F.linear(x_k, Wk, bk),
            v = F.linear(x_v, Wv, bv), loss = sum(q dq) + sum(k dk) + sum(v dv),
            with the weights as nn.MultiheadAttention holds them: fused
            in_proj_weight (Dq + Dk + Dv, E) sliced by rows (what torch's
            _in_projection_packed does), or q_proj_weight, k_proj_weight,
            v_proj_weight; in_proj_bias (Dq + Dk + Dv) in both forms. "self"
            cases use one x for the three inputs (its grad sums the paths).
Cross-check: the closed forms dx = dy W, dW = dy^T x, db = sum(dy) in NumPy,
to 1e-12.

File: gradients.json
--------------------
  {"linear_attention": [case...], "linear": [case...], "qkv": [case...]}
  linear_attention case: name, feature_map, causal, key_lengths (list or null),
      eps, chunk, q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv),
      dout (B, Hq, Lq, Dv), out, dq, dk, dv; omega (m, D) for favor_plus,
      custom_weight (D, M) for custom
  linear case: name, x (N, in), weight (out, in), bias (out) or null, dy (N, out),
      dx, weight_grad, bias_grad (or null)
  qkv case: name, fused, self, dims [Dq, Dk, Dv], x_q (B, Lq, Eq),
      x_k (B, Lk, Ek), x_v (B, Lk, Ev) (all three the same when self),
      in_proj_weight or q_proj_weight/k_proj_weight/v_proj_weight, in_proj_bias
      or null, dq, dk, dv, and the gradients: dx (self) or dx_q, dx_k, dx_v,
      and "<name>_grad" for every parameter
Encoding as in generate.py: tensors are {"shape", "data"} (flat, row-major),
floats written with repr so they round-trip exactly, compact JSON.
"""

import json
import math
import os
import zlib

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
EPS = 1e-6
MARGIN = 20.0  # FeatureMap::favor_shift_margin

torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)


def f32(x):
    return np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64)


def tensor(a):
    if isinstance(a, torch.Tensor):
        a = a.detach().numpy()
    a = np.asarray(a, dtype=np.float64)
    for v in a.ravel():
        assert math.isfinite(v)
    return {"shape": list(a.shape), "data": [float(v) for v in a.ravel()]}


def rng_for(name):
    return np.random.default_rng(zlib.crc32(name.encode("utf-8")))


def t(a):
    return torch.tensor(np.asarray(a, dtype=np.float64))


# --- linear attention ---------------------------------------------------------------


def favor_exponents(x, omega):
    d = omega.shape[1]
    s = d ** -0.25
    return s * (x @ omega.T) - 0.5 * s * s * (x * x).sum(-1, keepdim=True)


def key_shift_owners(a_k, length):
    """The forward's scan: after key j, (row, feature) of the exponent the shift is."""
    owners = []
    shift, owner = -math.inf, None
    for j in range(length):
        row = a_k[j].detach()
        row_max, feature = float(row.max()), int(row.argmax())
        if shift == -math.inf or row_max > shift + MARGIN:
            if shift != -math.inf:
                assert abs(row_max - (shift + MARGIN)) > 1e-3  # float agrees on the raise
            shift, owner = row_max, (j, feature)
        elif shift != -math.inf:
            assert abs(row_max - (shift + MARGIN)) > 1e-3
        owners.append(owner)
    return owners  # owners[j]: the owner after scanning keys [0, j]


def linear_attention_torch(fm, q, k, v, causal, key_lengths, eps, chunk, params):
    B, hq, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    group = hq // hkv
    outs = []
    for b in range(B):
        length = lk if key_lengths is None else key_lengths[b]
        off = 0 if causal == "top_left" else length - lq  # per sequence, as mask.hpp
        heads = []
        for h in range(hq):
            g = h // group
            qh, kh, vh = q[b, h], k[b, g], v[b, g]
            rows = []
            if fm == "favor_plus":
                omega = params["omega"]
                m = omega.shape[0]
                a_q = favor_exponents(qh, omega)
                phi_q = torch.exp(a_q - a_q.max(dim=-1, keepdim=True).values) / math.sqrt(m)
                a_k = favor_exponents(kh, omega)
                owners = key_shift_owners(a_k, length)
            else:
                phi_q = phi(fm, qh, params)
                phi_k = phi(fm, kh, params)
            for i in range(lq):
                if causal == "none":
                    visible = length
                    scanned = length
                else:
                    visible = max(0, min(i + off + 1, length))
                    i0 = (i // chunk) * chunk
                    n = min(chunk, lq - i0)
                    scanned = max(0, min(i0 + off + n, length))
                if visible == 0:
                    rows.append(torch.zeros(vh.shape[1]))
                    continue
                if fm == "favor_plus":
                    row, feature = owners[scanned - 1]
                    shift = a_k[row, feature]
                    pk = torch.exp(a_k[:visible] - shift) / math.sqrt(m)
                else:
                    pk = phi_k[:visible]
                w = pk @ phi_q[i]  # (visible)
                rows.append((w @ vh[:visible]) / (w.sum() + eps))
            heads.append(torch.stack(rows) if rows else torch.zeros(0, vh.shape[1]))
        outs.append(torch.stack(heads))
    return torch.stack(outs)


def phi(fm, x, params):
    if fm == "elu_plus_one":
        return F.elu(x) + 1.0
    if fm == "relu":
        return torch.relu(x)
    if fm == "identity":
        return x
    if fm == "custom":
        return torch.softmax(x @ params["custom_weight"], dim=-1)
    raise ValueError(fm)


def linear_attention_case(name, fm, B, hq, hkv, lq, lk, d, dv, causal="none", key_lengths=None,
                          chunk=16, eps=EPS, m=None, raise_shift=False):
    rng = rng_for(name)
    if fm == "identity":
        q = f32(rng.uniform(0.1, 1.0, (B, hq, lq, d)))
        k = f32(rng.uniform(0.1, 1.0, (B, hkv, lk, d)))
    else:
        q = f32(rng.standard_normal((B, hq, lq, d)))
        k = f32(rng.standard_normal((B, hkv, lk, d)))
    v = f32(rng.standard_normal((B, hkv, lk, dv)))
    dout = f32(rng.standard_normal((B, hq, lq, dv)))
    params, extra = {}, {}
    if fm == "favor_plus":
        omega = f32(rng.standard_normal((m, d)))
        params["omega"] = t(omega)
        extra["omega"] = tensor(omega)
        if raise_shift:  # keys 0 and 1 far out against omega: their largest exponent is very
            # negative, so that a later key raises the shift (each query chunk sees its own)
            direction = omega.sum(axis=0)
            direction /= np.linalg.norm(direction)
            scale = 1.0
            while float(favor_exponents(t(-scale * direction)[None], t(omega)).max()) > -30:
                scale += 0.5
            k[:, :, 0, :] = f32(-scale * direction)
            k[:, :, 1, :] = f32(-(scale - 0.5) * direction + 0.1 * rng.standard_normal(d))
    if fm == "custom":
        wc = f32(rng.standard_normal((d, m)))
        params["custom_weight"] = t(wc)
        extra["custom_weight"] = tensor(wc)
    if raise_shift:  # the shift must change along the keys of every kv head
        for b in range(B):
            for g in range(hkv):
                owners = key_shift_owners(favor_exponents(t(k[b, g]), params["omega"]), lk)
                assert owners[0][0] == 0 and owners[-1][0] >= 2, (name, owners)
    qt, kt, vt = (t(x).requires_grad_(True) for x in (q, k, v))
    out = linear_attention_torch(fm, qt, kt, vt, causal, key_lengths, eps, chunk, params)
    (out * t(dout)).sum().backward()

    def f(qq, kk, vv):
        return linear_attention_torch(fm, qq, kk, vv, causal, key_lengths, eps, chunk, params)

    assert torch.autograd.gradcheck(f, (t(q).requires_grad_(True), t(k).requires_grad_(True),
                                        t(v).requires_grad_(True)), eps=1e-6, atol=1e-7), name
    case = {"name": name, "feature_map": fm, "causal": causal, "key_lengths": key_lengths,
            "eps": eps, "chunk": chunk, "q": tensor(q), "k": tensor(k), "v": tensor(v),
            "dout": tensor(dout), "out": tensor(out), "dq": tensor(qt.grad),
            "dk": tensor(kt.grad), "dv": tensor(vt.grad)}
    case.update(extra)
    return case


def linear_attention_cases():
    cases = []
    maps = [("elu_plus_one", None), ("relu", None), ("identity", None), ("custom", 5),
            ("favor_plus", 12)]
    for fm, m in maps:
        # Non-causal, Lq != Lk, GQA (2 query heads per kv head), D != Dv, L not a multiple of
        # the chunk (chunk 4).
        cases.append(linear_attention_case(fm + "/none/B2_Hq4_Hkv2_Lq7_Lk9_D6_Dv5_chunk4", fm,
                                           2, 4, 2, 7, 9, 6, 5, chunk=4, m=m))
        cases.append(linear_attention_case(fm + "/none/key_lengths_8_3_0/Lq5_Lk8", fm, 3, 2, 1,
                                           5, 8, 4, 3, key_lengths=[8, 3, 0], chunk=3, m=m))
        cases.append(linear_attention_case(fm + "/top_left/L11_D6_Dv4_chunk4", fm, 1, 2, 1, 11,
                                           11, 6, 4, causal="top_left", chunk=4, m=m))
        cases.append(linear_attention_case(fm + "/bottom_right/Lq5_Lk9_chunk2", fm, 1, 2, 2, 5,
                                           9, 4, 6, causal="bottom_right", chunk=2, m=m))
        cases.append(linear_attention_case(fm + "/top_left/key_lengths_9_4/L9_chunk16", fm, 2,
                                           2, 1, 9, 9, 4, 3, causal="top_left",
                                           key_lengths=[9, 4], m=m))
    cases.append(linear_attention_case("elu_plus_one/bottom_right/Lq9_Lk6_chunk4",
                                       "elu_plus_one", 1, 1, 1, 9, 6, 5, 4,
                                       causal="bottom_right", chunk=4))
    cases.append(linear_attention_case("elu_plus_one/top_left/Lq4_Lk9_chunk3", "elu_plus_one", 1,
                                       1, 1, 4, 9, 5, 4, causal="top_left", chunk=3))
    cases.append(linear_attention_case("elu_plus_one/bottom_right/key_lengths_9_5_2/Lq4_chunk3",
                                       "elu_plus_one", 3, 2, 1, 4, 9, 5, 4,
                                       causal="bottom_right", key_lengths=[9, 5, 2], chunk=3))
    cases.append(linear_attention_case("relu/top_left/eps0.25/L7_chunk2", "relu", 1, 1, 1, 7, 7,
                                       4, 3, causal="top_left", chunk=2, eps=0.25))
    # FAVOR+ with the key shift raised after the first chunk, and a large eps (where the
    # shifts' gradients are largest).
    for causal in ("none", "top_left", "bottom_right"):
        for eps in (EPS, 0.25):
            cases.append(linear_attention_case(
                "favor_plus/%s/raise/eps%g/Lq7_Lk8_chunk2" % (causal, eps), "favor_plus", 1, 2, 1,
                7, 8, 4, 3, causal=causal, chunk=2, eps=eps, m=6, raise_shift=True))
    return cases


# --- layers ------------------------------------------------------------------------


def linear_case(name, n, fan_in, fan_out, bias):
    rng = rng_for(name)
    x = f32(rng.standard_normal((n, fan_in)))
    w = f32(rng.standard_normal((fan_out, fan_in)) / math.sqrt(fan_in))
    b = f32(rng.standard_normal(fan_out)) if bias else None
    dy = f32(rng.standard_normal((n, fan_out)))
    xt, wt = t(x).requires_grad_(True), t(w).requires_grad_(True)
    bt = t(b).requires_grad_(True) if bias else None
    (F.linear(xt, wt, bt) * t(dy)).sum().backward()
    assert np.allclose(xt.grad.numpy(), dy @ w, rtol=0, atol=1e-12)
    assert np.allclose(wt.grad.numpy(), dy.T @ x, rtol=0, atol=1e-12)
    if bias:
        assert np.allclose(bt.grad.numpy(), dy.sum(axis=0), rtol=0, atol=1e-12)
    return {"name": name, "x": tensor(x), "weight": tensor(w),
            "bias": tensor(b) if bias else None, "dy": tensor(dy), "dx": tensor(xt.grad),
            "weight_grad": tensor(wt.grad), "bias_grad": tensor(bt.grad) if bias else None}


def qkv_case(name, fused, self_attention, B, lq, lk, eq, ek, ev, dq, dk, dv, bias):
    rng = rng_for(name)
    if self_attention:
        assert lq == lk and eq == ek == ev
    if fused:
        assert eq == ek == ev
    xq = f32(rng.standard_normal((B, lq, eq)))
    xk = xq if self_attention else f32(rng.standard_normal((B, lk, ek)))
    xv = xq if self_attention else f32(rng.standard_normal((B, lk, ev)))
    widths = (dq, dk, dv)
    ins = (eq, ek, ev)
    ws = [f32(rng.standard_normal((o, i)) / math.sqrt(i)) for o, i in zip(widths, ins)]
    b = f32(rng.standard_normal(dq + dk + dv)) if bias else None
    grads_out = [f32(rng.standard_normal((B, l, o))) for l, o in zip((lq, lk, lk), widths)]
    case = {"name": name, "fused": fused, "self": self_attention, "dims": list(widths)}
    if self_attention:
        x_leaf = t(xq).requires_grad_(True)
        inputs = (x_leaf, x_leaf, x_leaf)
    else:
        inputs = tuple(t(x).requires_grad_(True) for x in (xq, xk, xv))
    bias_leaf = t(b).requires_grad_(True) if bias else None
    if fused:
        w_leaf = t(np.concatenate(ws, axis=0)).requires_grad_(True)
        weights = (w_leaf[:dq], w_leaf[dq:dq + dk], w_leaf[dq + dk:])
        params = {"in_proj_weight": w_leaf}
    else:
        leaves = [t(w).requires_grad_(True) for w in ws]
        weights = leaves
        params = {"q_proj_weight": leaves[0], "k_proj_weight": leaves[1],
                  "v_proj_weight": leaves[2]}
    if bias:
        biases = (bias_leaf[:dq], bias_leaf[dq:dq + dk], bias_leaf[dq + dk:])
        params["in_proj_bias"] = bias_leaf
    else:
        biases = (None, None, None)
    loss = 0
    for x, w, bb, g in zip(inputs, weights, biases, grads_out):
        loss = loss + (F.linear(x, w, bb) * t(g)).sum()
    loss.backward()
    # Closed forms, in NumPy.
    xs = (xq, xk, xv)
    dws = [np.einsum("blo,bli->oi", g, x) for g, x in zip(grads_out, xs)]
    dxs = [g @ w for g, w in zip(grads_out, ws)]
    if fused:
        assert np.allclose(params["in_proj_weight"].grad.numpy(), np.concatenate(dws), atol=1e-12)
    else:
        for key, dw in zip(("q_proj_weight", "k_proj_weight", "v_proj_weight"), dws):
            assert np.allclose(params[key].grad.numpy(), dw, atol=1e-12)
    if bias:
        db = np.concatenate([g.sum(axis=(0, 1)) for g in grads_out])
        assert np.allclose(bias_leaf.grad.numpy(), db, atol=1e-12)
    if self_attention:
        assert np.allclose(inputs[0].grad.numpy(), sum(dxs), atol=1e-12)
        case.update({"x_q": tensor(xq), "x_k": tensor(xq), "x_v": tensor(xq),
                     "dx": tensor(inputs[0].grad)})
    else:
        for key, x, leaf, dx in zip(("q", "k", "v"), xs, inputs, dxs):
            assert np.allclose(leaf.grad.numpy(), dx, atol=1e-12)
            case["x_" + key] = tensor(x)
            case["dx_" + key] = tensor(leaf.grad)
    for key, w in zip(("q", "k", "v"), ws):
        if not fused:
            case[key + "_proj_weight"] = tensor(w)
    if fused:
        case["in_proj_weight"] = tensor(np.concatenate(ws, axis=0))
    case["in_proj_bias"] = tensor(b) if bias else None
    case["dq"], case["dk"], case["dv"] = (tensor(g) for g in grads_out)
    for key, leaf in params.items():
        case[key + "_grad"] = tensor(leaf.grad)
    return case


def layer_cases():
    linear = [
        linear_case("linear/N5_in7_out3_bias", 5, 7, 3, True),
        linear_case("linear/N1_in4_out9_nobias", 1, 4, 9, False),
        linear_case("linear/N33_in17_out40_bias", 33, 17, 40, True),
    ]
    qkv = [
        # MultiheadAttention's own layouts: E = 8 fused self-attention (in_proj_weight
        # (3E, E)); grouped-query widths Dk = Dv < Dq; cross attention through the fused weight;
        # kdim/vdim != E with separate weights.
        qkv_case("qkv/fused/self/B2_S5_E8_D8_8_8_bias", True, True, 2, 5, 5, 8, 8, 8, 8, 8, 8,
                 True),
        qkv_case("qkv/fused/self/B1_S7_E6_D6_2_2_nobias", True, True, 1, 7, 7, 6, 6, 6, 6, 2, 2,
                 False),
        qkv_case("qkv/fused/cross/B2_Lq3_Lk6_E8_bias", True, False, 2, 3, 6, 8, 8, 8, 8, 4, 4,
                 True),
        qkv_case("qkv/separate/cross/B2_Lq4_Lk5_E8_kdim5_vdim3_bias", False, False, 2, 4, 5, 8, 5,
                 3, 8, 8, 8, True),
        qkv_case("qkv/separate/self/B1_S6_E5_D4_3_2_bias", False, True, 1, 6, 6, 5, 5, 5, 4, 3, 2,
                 True),
        qkv_case("qkv/separate/cross/B1_Lq2_Lk3_E4_kdim6_vdim2_nobias", False, False, 1, 2, 3, 4,
                 6, 2, 4, 4, 4, False),
    ]
    return linear, qkv


def main():
    la = linear_attention_cases()
    linear, qkv = layer_cases()
    obj = {"linear_attention": la, "linear": linear, "qkv": qkv}
    path = os.path.join(HERE, "gradients.json")
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        fh.write(json.dumps(obj, separators=(",", ":"), allow_nan=False))
        fh.write("\n")
    for c in la + linear + qkv:
        print("  %s" % c["name"])
    print("wrote %s (%d bytes; %d linear attention, %d linear, %d qkv cases)"
          % (os.path.relpath(path), os.path.getsize(path), len(la), len(linear), len(qkv)))


if __name__ == "__main__":
    main()
