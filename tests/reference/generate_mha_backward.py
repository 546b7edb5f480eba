#!/usr/bin/env python3
"""Reference gradients for attn::MultiHeadAttention::backward, from torch autograd.

How to run (from the repository root):

    /usr/bin/python3 tests/reference/generate_mha_backward.py

Needs NumPy and PyTorch (written against Debian's torch 1.13). Deterministic: every draw
comes from a NumPy generator seeded by the case name, torch runs single-threaded in
float64, so a rerun writes a byte-identical file. Every gradient is cross-checked by
central finite differences of the same float64 forward on a few random entries.

File written next to this script: mha_backward.json
----------------------------------------------------
{"cases": [case, ...]}; each case has
  name, config   {"embed_dim", "num_heads", "num_kv_heads", "kdim", "vdim", "bias",
                  "add_bias_kv", "add_zero_attn", "rotary": null or
                  {"pairing": "half_split" | "interleaved", "base"}}
  self           true: query = key = value (key and value are null)
  query (B, L, E), key (B, S, kdim), value (B, S, vdim)
  key_padding_mask  bool (B, S), true = IGNORE (PyTorch MHA polarity), or null
  attn_mask      (L, S) or (B*H, L, S), bool (true = NOT allowed) or float, or null
  is_causal      torch is given triu(ones(L, S), 1) as a bool mask; C++ uses is_causal
  state_dict     {name: tensor}, torch's names and layouts
  d_output       (B, L, E), the cotangent: the loss is sum(output * d_output)
  output         (B, L, E)
  grads          {"query", "key", "value" (cross only), and one entry per state_dict
                  name}: torch's .grad

Cases with num_kv_heads < num_heads (grouped-query) or rotary run the explicit formula in
torch (nn.MultiheadAttention has neither): in_proj_weight (E + 2 Ekv, E) sliced by rows
as torch's in-projection does, q and k rotated after the projection (query i and key j
at positions i and j; pair i turns by p * base^(-2i/D); half_split pairs (x[i],
x[i + D/2]), interleaved (x[2i], x[2i + 1])), the kv heads repeated over their groups,
softmax attention, out_proj. The other cases run nn.MultiheadAttention itself.
Inputs and weights are rounded through float32, so the float tests start from the same
numbers. No query row is fully masked.
Encoding: tensors are {"shape", "data"} (flat, row-major), bools carry "dtype": "bool".
"""

import json
import math
import os
import zlib

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
torch.set_num_threads(1)
torch.manual_seed(0)


def f32(x):
    return np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64)


def num(x):
    x = float(x)
    if x == int(x) and abs(x) < 2 ** 53:
        return int(x)
    return x


def tensor(a):
    a = np.asarray(a)
    if a.dtype == np.bool_:
        return {"shape": list(a.shape), "data": [int(v) for v in a.ravel()], "dtype": "bool"}
    return {"shape": list(a.shape), "data": [num(v) for v in a.astype(np.float64).ravel()]}


def rng_for(name):
    return np.random.default_rng(zlib.crc32(name.encode("utf-8")))


def rotate(x, pairing, base):
    """x (B, H, L, D) rotated at positions 0..L-1 (the C++ forward's rule)."""
    B, H, L, D = x.shape
    half = D // 2
    freq = base ** (-2.0 * torch.arange(half, dtype=torch.float64) / D)
    ang = torch.arange(L, dtype=torch.float64)[:, None] * freq[None, :]  # (L, D/2)
    c, s = torch.cos(ang), torch.sin(ang)
    if pairing == "half_split":
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * c - b * s, b * c + a * s], dim=-1).reshape(B, H, L, D)


def explicit_mha(p, cfg, q_in, k_in, v_in, kpm, attn_mask, causal):
    """GQA / rotary MHA in torch ops (no add_bias_kv / add_zero_attn)."""
    E, H, Hkv = cfg["embed_dim"], cfg["num_heads"], cfg["num_kv_heads"]
    D = E // H
    Ekv = Hkv * D
    w = p["in_proj_weight"]
    b = p.get("in_proj_bias")
    q = F.linear(q_in, w[:E], None if b is None else b[:E])
    k = F.linear(k_in, w[E:E + Ekv], None if b is None else b[E:E + Ekv])
    v = F.linear(v_in, w[E + Ekv:], None if b is None else b[E + Ekv:])
    B, L, _ = q.shape
    S = k.shape[1]
    q = q.reshape(B, L, H, D).transpose(1, 2)
    k = k.reshape(B, S, Hkv, D).transpose(1, 2)
    v = v.reshape(B, S, Hkv, D).transpose(1, 2)
    if cfg["rotary"] is not None:
        q = rotate(q, cfg["rotary"]["pairing"], cfg["rotary"]["base"])
        k = rotate(k, cfg["rotary"]["pairing"], cfg["rotary"]["base"])
    k = k.repeat_interleave(H // Hkv, dim=1)
    v = v.repeat_interleave(H // Hkv, dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    hidden = torch.zeros(B, H, L, S, dtype=torch.bool)
    if causal:
        hidden |= torch.triu(torch.ones(L, S, dtype=torch.bool), 1)
    if kpm is not None:
        hidden |= torch.as_tensor(kpm)[:, None, None, :]
    if attn_mask is not None:
        m = torch.as_tensor(attn_mask)
        m = m if m.dim() == 2 else m.reshape(B, H, L, S)
        if m.dtype == torch.bool:
            hidden |= m
        else:
            s = s + m
    s = s.masked_fill(hidden, -math.inf)
    o = torch.softmax(s, dim=-1) @ v  # (B, H, L, D)
    o = o.transpose(1, 2).reshape(B, L, E)
    return F.linear(o, p["out_proj.weight"], p.get("out_proj.bias"))


CASES = []


def add_case(name, E, H, B, L, S, Hkv=None, kdim=None, vdim=None, bias=True, add_bias_kv=False,
             add_zero_attn=False, self_attn=False, kpm=None, attn_mask=None, is_causal=False,
             rotary=None):
    rng = rng_for(name)
    Hkv = Hkv or H
    kdim, vdim = kdim or E, vdim or E
    D = E // H
    Ekv = Hkv * D
    cfg = {"embed_dim": E, "num_heads": H, "num_kv_heads": Hkv, "kdim": kdim, "vdim": vdim,
           "bias": bias, "add_bias_kv": add_bias_kv, "add_zero_attn": add_zero_attn,
           "rotary": rotary}
    explicit = Hkv != H or rotary is not None
    if explicit:
        shapes = {"in_proj_weight": (E + 2 * Ekv, E), "out_proj.weight": (E, E)}
        if bias:
            shapes["in_proj_bias"] = (E + 2 * Ekv,)
            shapes["out_proj.bias"] = (E,)
    else:
        mha = torch.nn.MultiheadAttention(E, H, dropout=0.0, bias=bias, add_bias_kv=add_bias_kv,
                                          add_zero_attn=add_zero_attn, kdim=kdim, vdim=vdim,
                                          batch_first=True, dtype=torch.float64)
        mha.eval()
        shapes = {n: tuple(p.shape) for n, p in mha.named_parameters()}
    sd = {}
    for n in sorted(shapes):
        scale = 0.5 if "weight" in n else 0.2
        sd[n] = f32(rng.uniform(-scale, scale, size=shapes[n]))
    q_in = f32(rng.standard_normal((B, L, E)))
    k_in = q_in if self_attn else f32(rng.standard_normal((B, S, kdim)))
    v_in = q_in if self_attn else f32(rng.standard_normal((B, S, vdim)))
    d_out = f32(rng.standard_normal((B, L, E)))
    if kpm is not None:
        kpm = np.asarray(kpm, dtype=bool)
    if attn_mask is not None and attn_mask == "float":
        attn_mask = f32(rng.uniform(-1, 1, size=(L, S)))
    elif attn_mask is not None and attn_mask == "bool3":
        attn_mask = rng.uniform(size=(B * H, L, S)) < 0.3
        attn_mask[..., 0] = False  # no fully hidden row

    params = {n: torch.tensor(v, requires_grad=True) for n, v in sd.items()}
    xq = torch.tensor(q_in, requires_grad=True)
    xk = xq if self_attn else torch.tensor(k_in, requires_grad=True)
    xv = xq if self_attn else torch.tensor(v_in, requires_grad=True)

    def forward(pp, a, b_, c):
        if explicit:
            return explicit_mha(pp, cfg, a, b_, c, kpm, attn_mask, is_causal)
        with torch.no_grad():
            for n, prm in mha.named_parameters():
                prm.copy_(pp[n])
        for n, prm in mha.named_parameters():  # route the gradients to pp
            prm.requires_grad_(False)
        mask = None
        if is_causal:
            mask = torch.triu(torch.ones(L, S, dtype=torch.bool), 1)
        elif attn_mask is not None:
            mask = torch.as_tensor(attn_mask)
        # functional form with our leaf tensors as the parameters
        out, _ = F.multi_head_attention_forward(
            a.transpose(0, 1), b_.transpose(0, 1), c.transpose(0, 1), E, H,
            pp.get("in_proj_weight"), pp.get("in_proj_bias"), pp.get("bias_k"), pp.get("bias_v"),
            add_zero_attn, 0.0, pp["out_proj.weight"], pp.get("out_proj.bias"), training=False,
            key_padding_mask=None if kpm is None else torch.as_tensor(kpm), need_weights=False,
            attn_mask=mask, use_separate_proj_weight="q_proj_weight" in pp,
            q_proj_weight=pp.get("q_proj_weight"), k_proj_weight=pp.get("k_proj_weight"),
            v_proj_weight=pp.get("v_proj_weight"))
        return out.transpose(0, 1)

    out = forward(params, xq, xk, xv)
    if not explicit:  # the functional call equals the module's
        with torch.no_grad():
            mask = torch.triu(torch.ones(L, S, dtype=torch.bool), 1) if is_causal else (
                None if attn_mask is None else torch.as_tensor(attn_mask))
            ref, _ = mha(torch.tensor(q_in), torch.tensor(k_in), torch.tensor(v_in),
                         key_padding_mask=None if kpm is None else torch.as_tensor(kpm),
                         attn_mask=mask, need_weights=False)
        assert torch.allclose(out.detach(), ref, atol=1e-13, rtol=0), name
    (out * torch.tensor(d_out)).sum().backward()
    grads = {"query": xq.grad.numpy()}
    if not self_attn:
        grads["key"] = xk.grad.numpy()
        grads["value"] = xv.grad.numpy()
    for n, prm in params.items():
        grads[n] = prm.grad.numpy()

    # Finite differences of the float64 forward on a few entries of every gradient.
    def loss(pp, a, b_, c):
        with torch.no_grad():
            return float((forward(pp, a, b_, c) * torch.tensor(d_out)).sum())

    base = {n: torch.tensor(v) for n, v in sd.items()}
    inputs = {"query": q_in, "key": k_in, "value": v_in}
    for g_name, g in grads.items():
        for _ in range(3):
            idx = tuple(int(rng.integers(0, s)) for s in g.shape)
            h = 1e-6
            vals = []
            for sign in (1, -1):
                pp = {n: t.clone() for n, t in base.items()}
                xs = {n: torch.tensor(v) for n, v in inputs.items()}
                if g_name in pp:
                    pp[g_name][idx] += sign * h
                else:
                    xs[g_name][idx] += sign * h
                a = xs["query"]
                b_ = a if self_attn else xs["key"]
                c = a if self_attn else xs["value"]
                vals.append(loss(pp, a, b_, c))
            fd = (vals[0] - vals[1]) / (2 * h)
            assert abs(fd - g[idx]) <= 1e-6 * (1 + abs(g[idx])), (name, g_name, fd, g[idx])

    CASES.append({
        "name": name, "config": cfg, "self": self_attn,
        "query": tensor(q_in), "key": None if self_attn else tensor(k_in),
        "value": None if self_attn else tensor(v_in),
        "key_padding_mask": None if kpm is None else tensor(kpm),
        "attn_mask": None if attn_mask is None else tensor(attn_mask),
        "is_causal": is_causal,
        "state_dict": {n: tensor(v) for n, v in sd.items()},
        "d_output": tensor(d_out), "output": tensor(out.detach().numpy()),
        "grads": {n: tensor(v) for n, v in grads.items()},
    })


add_case("self", E=8, H=2, B=2, L=5, S=5, self_attn=True)
add_case("self_causal", E=8, H=2, B=2, L=5, S=5, self_attn=True, is_causal=True)
add_case("self_padding_float_mask", E=8, H=4, B=2, L=4, S=4, self_attn=True,
         kpm=[[False, False, True, False], [False, False, False, True]], attn_mask="float")
add_case("cross_kdim_vdim_bool_mask", E=8, H=2, B=2, L=4, S=6, kdim=6, vdim=5,
         attn_mask="bool3")
add_case("self_bias_kv_zero_attn", E=8, H=2, B=2, L=4, S=4, self_attn=True, add_bias_kv=True,
         add_zero_attn=True, kpm=[[False, True, False, False], [False, False, False, True]])
add_case("cross_bias_kv_causal", E=6, H=3, B=2, L=3, S=5, add_bias_kv=True, is_causal=True)
add_case("cross_no_bias", E=8, H=2, B=1, L=3, S=7, bias=False)
add_case("gqa_self_causal", E=8, H=4, Hkv=2, B=2, L=5, S=5, self_attn=True, is_causal=True)
add_case("mqa_cross_padding", E=8, H=4, Hkv=1, B=2, L=3, S=5,
         kpm=[[False, False, False, True, True], [False, True, False, False, False]])
add_case("rotary_self_causal", E=8, H=2, B=2, L=6, S=6, self_attn=True, is_causal=True,
         rotary={"pairing": "half_split", "base": 10000.0})
add_case("rotary_gqa_cross_interleaved", E=16, H=4, Hkv=2, B=2, L=4, S=6, bias=False,
         rotary={"pairing": "interleaved", "base": 100.0})

with open(os.path.join(HERE, "mha_backward.json"), "w") as f:
    json.dump({"cases": CASES}, f, separators=(",", ":"))
    f.write("\n")
print(f"wrote {len(CASES)} cases to mha_backward.json")
