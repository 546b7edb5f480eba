#!/usr/bin/env python3
"""Reference fixtures for attn::MultiHeadAttention, from torch.nn.MultiheadAttention.

How to run (from the repository root):

    /usr/bin/python3 tests/reference/generate_mha.py

Needs NumPy and PyTorch (written against Debian's torch 1.13). Deterministic:
every random draw comes from a NumPy generator seeded by the case name and
torch runs single-threaded in float64, so a rerun writes a byte-identical
file. Every case is also recomputed by an independent NumPy implementation
(explicit per-head loops, no torch) and must agree to 1e-12, or the script
stops with an AssertionError.

File written next to this script: mha.json
------------------------------------------
{"cases": [case, ...]}; each case has
  name
  config        {"embed_dim", "num_heads", "kdim", "vdim", "bias",
                 "add_bias_kv", "add_zero_attn"}  (torch's constructor args)
  self          true when query, key and value are the same tensor (then key
                and value are null and the C++ side passes query three times,
                which takes the fused one-GEMM path)
  query (B, L, E), key (B, S, kdim), value (B, S, vdim)     batch first
  key_padding_mask  bool (B, S), true = IGNORE this key (PyTorch MHA
                polarity, the opposite of SDPA's keep-mask), or null
  attn_mask     (L, S) or (B*H, L, S); bool (true = NOT allowed, PyTorch MHA
                polarity) or float (added to the scores), or null
  is_causal     true when the case is causal. torch 1.13's MHA has no
                is_causal argument: torch is called with the bool mask
                triu(ones(L, S), 1) (true = not allowed) and the C++ side
                uses is_causal instead of a mask.
  state_dict    {name: tensor} in PyTorch's layout and names:
                  in_proj_weight (3E, E), in_proj_bias (3E)   when kdim = vdim = E
                  q_proj_weight (E, E), k_proj_weight (E, kdim),
                  v_proj_weight (E, vdim), in_proj_bias (3E)  otherwise
                  bias_k, bias_v (1, 1, E)                    with add_bias_kv
                  out_proj.weight (E, E), out_proj.bias (E)
                (biases are absent when bias is false).
  output        (B, L, E)
  weights_avg   (B, L, S')     need_weights=True, average_attn_weights=True
  weights_heads (B, H, L, S')  average_attn_weights=False
                S' = S + add_bias_kv + add_zero_attn (the appended keys).

Every input and weight is exactly representable in float32 (rounded through
float32 after drawing), so the float tests start from the same numbers.
No case has a fully masked query row (torch returns NaN there; attn returns
zeros, which the SDPA fixtures test).

The QKV-projection tutorial's case (E=768, H=12, B=2, L=S=10) keeps the file small:
its input projection weights are small integers in [-8, 8] (written as JSON
integers), its output projection weights are in {-1, 0, 1} * 2^-5 and its
inputs are scaled by 2^-7, so that q, k, v and the output are of order 1
(which keeps float32's rounding error well below the 1e-5 test bound, whose
error is relative only above 1). About 2.4 million weights take ~9 MB this
way instead of ~45 MB as float reprs.

Encoding
--------
Tensor: {"shape": [...], "data": [flat row-major list]}, as the other
fixtures. Non-finite numbers are the strings "inf", "-inf", "nan"; boolean
tensors hold 0/1 and carry "dtype": "bool". Floats are Python reprs (they
round-trip exactly); integral values are written as integers.
"""

import json
import math
import os
import zlib

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TOL = 1e-12

torch.set_num_threads(1)
torch.manual_seed(0)  # the weights are overwritten, but keep construction deterministic


def f32(x):
    """Round to the nearest float32 value, returned as float64."""
    return np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64)


def num(x):
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == int(x) and abs(x) < 2 ** 53:
        return int(x)
    return x


def tensor(a):
    a = np.asarray(a)
    if a.dtype == np.bool_:
        return {"shape": list(a.shape), "data": [int(v) for v in a.ravel()], "dtype": "bool"}
    a = a.astype(np.float64)
    return {"shape": list(a.shape), "data": [num(v) for v in a.ravel()]}


def rng_for(name):
    return np.random.default_rng(zlib.crc32(name.encode("utf-8")))


def close(a, b, tol=TOL):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return a.shape == b.shape and bool(np.all(np.abs(a - b) <= tol * (1.0 + np.abs(b))))


# ---------------------------------------------------------------------------
# independent NumPy reference (batch first, explicit loops over b and h)
# ---------------------------------------------------------------------------

def numpy_mha(sd, cfg, q_in, k_in, v_in, kpm, attn_mask):
    E, H = cfg["embed_dim"], cfg["num_heads"]
    D = E // H
    if "in_proj_weight" in sd:
        wq, wk, wv = np.split(sd["in_proj_weight"], 3, axis=0)
    else:
        wq, wk, wv = sd["q_proj_weight"], sd["k_proj_weight"], sd["v_proj_weight"]
    bq = bk = bv = np.zeros(E)
    if "in_proj_bias" in sd:
        bq, bk, bv = np.split(sd["in_proj_bias"], 3)
    Q = q_in @ wq.T + bq        # (B, L, E)
    K = k_in @ wk.T + bk        # (B, S, E)
    V = v_in @ wv.T + bv
    B, L, _ = Q.shape
    S = K.shape[1]
    extra = 0
    if cfg["add_bias_kv"]:
        K = np.concatenate([K, np.broadcast_to(sd["bias_k"].reshape(1, 1, E), (B, 1, E))], 1)
        V = np.concatenate([V, np.broadcast_to(sd["bias_v"].reshape(1, 1, E), (B, 1, E))], 1)
        extra += 1
    if cfg["add_zero_attn"]:
        K = np.concatenate([K, np.zeros((B, 1, E))], 1)
        V = np.concatenate([V, np.zeros((B, 1, E))], 1)
        extra += 1
    S2 = S + extra
    out = np.zeros((B, L, E))
    weights = np.zeros((B, H, L, S2))
    for b in range(B):
        for h in range(H):
            q = Q[b, :, h * D:(h + 1) * D]
            k = K[b, :, h * D:(h + 1) * D]
            v = V[b, :, h * D:(h + 1) * D]
            s = q @ k.T / math.sqrt(D)
            for i in range(L):
                for j in range(S2):
                    hidden = False
                    if kpm is not None and j < S and kpm[b, j]:
                        hidden = True
                    if attn_mask is not None and j < S:
                        m = attn_mask if attn_mask.ndim == 2 else attn_mask[b * H + h]
                        if m.dtype == np.bool_:
                            hidden = hidden or bool(m[i, j])
                        else:
                            s[i, j] += m[i, j]
                    if hidden:
                        s[i, j] = -np.inf
            mx = s.max(axis=1, keepdims=True)
            p = np.exp(s - mx)
            p /= p.sum(axis=1, keepdims=True)
            weights[b, h] = p
            out[b, :, h * D:(h + 1) * D] = p @ v
    y = out @ sd["out_proj.weight"].T
    if "out_proj.bias" in sd:
        y = y + sd["out_proj.bias"]
    return y, weights


# ---------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------

CASES = []


def add_case(name, E, H, B, L, S, kdim=None, vdim=None, bias=True, add_bias_kv=False,
             add_zero_attn=False, self_attn=False, kpm=None, attn_mask=None, is_causal=False,
             integer_weights=False, rng_name=None):
    rng = rng_for(rng_name or name)
    kdim = kdim or E
    vdim = vdim or E
    cfg = {"embed_dim": E, "num_heads": H, "kdim": kdim, "vdim": vdim, "bias": bias,
           "add_bias_kv": add_bias_kv, "add_zero_attn": add_zero_attn}
    mha = torch.nn.MultiheadAttention(E, H, dropout=0.0, bias=bias, add_bias_kv=add_bias_kv,
                                      add_zero_attn=add_zero_attn, kdim=kdim, vdim=vdim,
                                      batch_first=True, dtype=torch.float64)
    mha.eval()
    # Fresh weights from our generator (rounded to float32), written into the module.
    sd = {}
    for pname, p in mha.state_dict().items():
        shape = tuple(p.shape)
        if integer_weights and pname in ("in_proj_weight", "q_proj_weight", "k_proj_weight",
                                         "v_proj_weight"):
            w = rng.integers(-8, 9, size=shape).astype(np.float64)
        elif integer_weights and pname == "out_proj.weight":
            w = rng.integers(-1, 2, size=shape).astype(np.float64) * 2.0 ** -5
        elif pname.endswith("bias") or pname in ("bias_k", "bias_v"):
            w = f32(rng.standard_normal(shape) * 0.1)
        else:
            fan_in = shape[-1]
            w = f32(rng.uniform(-1, 1, size=shape) * math.sqrt(3.0 / fan_in))
        sd[pname] = w
    mha.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in sd.items()})

    scale_in = 2.0 ** -7 if integer_weights else 1.0
    query = f32(rng.standard_normal((B, L, E))) * scale_in
    if self_attn:
        assert L == S and kdim == E and vdim == E
        key = value = query
    else:
        key = f32(rng.standard_normal((B, S, kdim))) * scale_in
        value = f32(rng.standard_normal((B, S, vdim))) * scale_in

    kpm_np = kpm(rng) if kpm else None
    mask_np = attn_mask(rng) if attn_mask else None
    if is_causal:
        assert mask_np is None
        mask_np = np.triu(np.ones((L, S), dtype=bool), 1)

    def run(average):
        tq = torch.from_numpy(query)
        tk = tq if self_attn else torch.from_numpy(key)
        tv = tq if self_attn else torch.from_numpy(value)
        out, w = mha(tq, tk, tv,
                     key_padding_mask=None if kpm_np is None else torch.from_numpy(kpm_np),
                     need_weights=True,
                     attn_mask=None if mask_np is None else torch.from_numpy(mask_np),
                     average_attn_weights=average)
        return out.detach().numpy(), w.detach().numpy()

    out, w_avg = run(True)
    out2, w_heads = run(False)
    assert np.array_equal(out, out2)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(w_heads)), name + ": fully masked row"
    ref_out, ref_w = numpy_mha(sd, cfg, query, key, value, kpm_np, mask_np)
    assert close(out, ref_out), name + ": torch and NumPy outputs differ"
    assert close(w_heads, ref_w), name + ": torch and NumPy weights differ"
    assert close(w_avg, ref_w.mean(axis=1)), name + ": averaged weights differ"

    case = {
        "name": name,
        "config": cfg,
        "self": self_attn,
        "query": tensor(query),
        "key": None if self_attn else tensor(key),
        "value": None if self_attn else tensor(value),
        "key_padding_mask": None if kpm_np is None else tensor(kpm_np),
        "attn_mask": None if (mask_np is None or is_causal) else tensor(mask_np),
        "is_causal": is_causal,
        "state_dict": {k: tensor(v) for k, v in sd.items()},
        "output": tensor(out),
        "weights_avg": tensor(w_avg),
        "weights_heads": tensor(w_heads),
    }
    CASES.append(case)
    return case


def padding(lengths, S):
    """key_padding_mask with true (= ignore) at positions >= lengths[b]."""
    def make(rng):
        del rng
        return np.array([[j >= n for j in range(S)] for n in lengths], dtype=bool)
    return make


def random_bool_mask(shape, p_hide=0.4):
    """Bool attn_mask, true = NOT allowed; the diagonal-ish key j = i % S stays allowed."""
    def make(rng):
        m = rng.random(shape) < p_hide
        L, S = shape[-2], shape[-1]
        for i in range(L):
            m[..., i, i % S] = False
        return m
    return make


def random_float_mask(shape, p_inf=0.3):
    def make(rng):
        m = f32(rng.standard_normal(shape))
        hide = rng.random(shape) < p_inf
        L, S = shape[-2], shape[-1]
        for i in range(L):
            hide[..., i, i % S] = False
        m[hide] = -np.inf
        return m
    return make


def build():
    E, H, B = 32, 4, 2
    add_case("self_e32_h4_b2_l7", E, H, B, 7, 7, self_attn=True)
    add_case("self_e32_h4_no_bias", E, H, B, 7, 7, bias=False, self_attn=True)
    add_case("cross_same_dims_l5_s7", E, H, B, 5, 7)
    add_case("cross_kdim24_vdim20_l5_s7", E, H, B, 5, 7, kdim=24, vdim=20)
    add_case("key_padding_mask_self", E, H, B, 7, 7, self_attn=True, kpm=padding([6, 4], 7))
    add_case("key_padding_mask_cross_kdim24_vdim20", E, H, B, 5, 7, kdim=24, vdim=20,
             kpm=padding([7, 3], 7))
    add_case("attn_mask_bool_ls", E, H, B, 5, 7, attn_mask=random_bool_mask((5, 7)))
    add_case("attn_mask_bool_bhls", E, H, B, 5, 7, attn_mask=random_bool_mask((B * H, 5, 7)))
    add_case("attn_mask_float_ls", E, H, B, 5, 7, attn_mask=random_float_mask((5, 7)))
    add_case("attn_mask_float_bhls", E, H, B, 5, 7, attn_mask=random_float_mask((B * H, 5, 7)))
    add_case("attn_mask_bool_and_key_padding", E, H, B, 6, 6, self_attn=True,
             kpm=padding([6, 5], 6), attn_mask=random_bool_mask((6, 6)))
    add_case("attn_mask_float_and_key_padding", E, H, B, 5, 7, kpm=padding([7, 5], 7),
             attn_mask=random_float_mask((B * H, 5, 7)))
    add_case("causal_self_l7", E, H, B, 7, 7, self_attn=True, is_causal=True)
    add_case("causal_cross_l5_s7", E, H, B, 5, 7, is_causal=True)
    add_case("add_bias_kv", E, H, B, 5, 7, add_bias_kv=True)
    add_case("add_zero_attn", E, H, B, 5, 7, add_zero_attn=True)
    add_case("add_bias_kv_zero_attn_masks_kdim24_vdim20", E, H, B, 5, 7, kdim=24, vdim=20,
             add_bias_kv=True, add_zero_attn=True, kpm=padding([7, 4], 7),
             attn_mask=random_bool_mask((5, 7)))
    add_case("add_bias_kv_zero_attn_self_float_mask", E, H, B, 6, 6, self_attn=True,
             add_bias_kv=True, add_zero_attn=True, attn_mask=random_float_mask((6, 6)))
    add_case("add_bias_kv_causal_self", E, H, B, 6, 6, self_attn=True, add_bias_kv=True,
             is_causal=True)
    add_case("e24_h1_single_head", 24, 1, 3, 4, 4, self_attn=True)
    # The QKV-projection tutorial's shape; its draws keep the name the case was first given.
    add_case("qkv_tutorial_e768_h12_b2_s10", 768, 12, 2, 10, 10, self_attn=True,
             integer_weights=True, rng_name="seed002_e768_h12_b2_s10")


def main():
    build()
    path = os.path.join(HERE, "mha.json")
    text = json.dumps({"cases": CASES}, separators=(",", ":"), allow_nan=False)
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        fh.write(text)
        fh.write("\n")
    for c in CASES:
        print("  %-44s out %s weights %s" % (c["name"], c["output"]["shape"],
                                             c["weights_heads"]["shape"]))
    print("wrote %s (%d bytes)" % (os.path.relpath(path), os.path.getsize(path)))


if __name__ == "__main__":
    main()
