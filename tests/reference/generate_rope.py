#!/usr/bin/env python3
"""Reference values for attn's rotary position embeddings (include/attn/rope.hpp).

How to run (from the repository root; needs PyTorch and NumPy):

    /usr/bin/python3 tests/reference/generate_rope.py

Deterministic: every draw comes from a generator seeded by the case name, so
running it again rewrites a byte-identical rope.json. Inputs are rounded to
float16-representable values right after drawing (hence exact in float, double,
half), so every storage type the tests use sees exactly the fixture's inputs;
everything else is float64.

What is computed (written out plainly in torch float64, from the published formulas)
------------------------------------------------------------------------------------
R = rotary_dim features of each (b, h, t) row rotate; features [R, D) are copied.
Frequencies f_i = base^(-2i / R), i in [0, R/2), then per scaling:

    none       f_i
    linear     f_i / factor                               (position interpolation)
    ntk_aware  base' = base * factor^(R / (R - 2)), f_i = base'^(-2i / R)
    yarn       c(n) = R ln(orig / (2 pi n)) / (2 ln base)  the dim that turns n times
               low = max(floor(c(beta_fast)), 0), high = min(ceil(c(beta_slow)), R - 1)
               (no floor/ceil when truncate is false); high += 0.001 if low == high
               ramp_i = clamp((i - low) / (high - low), 0, 1)
               f_i = (f_i / factor) ramp_i + f_i (1 - ramp_i)
               cos and sin scaled by the attention factor: given, or
               m(factor, mscale) / m(factor, mscale_all_dim) when both are given, else
               m(factor, 1), where m(s, k) = 0.1 k ln(s) + 1 (1 for s <= 1)
    llama3     wavelength w_i = 2 pi / f_i, low_w = orig / low_freq_factor,
               high_w = orig / high_freq_factor:
               w_i > low_w: f_i / factor; w_i < high_w: f_i; otherwise with
               s = (orig / w_i - low_freq_factor) / (high_freq_factor - low_freq_factor):
               (1 - s) f_i / factor + s f_i

Angle a = p f_i for a token at position p. The pairings:

    half_split   HF transformers' form: out = x cos2 + rotate_half(x) sin2, where
                 cos2 = cat(cos a, cos a), rotate_half(x) = cat(-x[R/2:], x[:R/2])
    interleaved  GPT-J's form: out = x cosi + rotate_every_two(x) sini, where
                 cosi repeats each cos a_i twice and rotate_every_two(x) turns every
                 pair (x[2i], x[2i+1]) into (-x[2i+1], x[2i])

Cross-check: every case is recomputed by plain Python loops (math.cos, math.sin)
over b, h, t and pairs; the two must agree to 1e-12 (absolute; |x| < 4).

Positions: a case has "offsets" (B; token t of sequence b at offsets[b] + t) or
"positions" (B * L; token t of sequence b at positions[b * L + t]).

Attention cases (attn::MultiHeadAttention with config.rotary)
--------------------------------------------------------------
Written from the formulas in torch float64: q = x Wq^T + bq, k = x Wk^T + bk,
v = x Wv^T + bv (Wq, Wk, Wv the row blocks of in_proj_weight (E + 2 Ekv, E)),
split into H query and Hkv key/value heads of D = E / H, q and k rotated as above
(query token i at position i, key j at position j), every group of H / Hkv query
heads reading one key/value head (repeat_interleave), softmax(q k^T / sqrt(D))
with keys j > i hidden when causal, heads merged, then x Wo^T + bo. A packed case
holds several sequences one after another (cu_seqlens); each is computed alone,
its positions starting at 0. Cross-check: NumPy loops over b and h, the rotation
by rotate_loops, must agree to 1e-12.

File: rope.json
---------------
  {"cases": [case, ...], "attention_cases": [attention case, ...]}
  case: name, dim, rotary_dim, base, pairing ("half_split" | "interleaved"),
        max_positions, scaling ("none" | "linear" | "ntk_aware" | "yarn" | "llama3"),
        factor, original_max_positions, beta_fast, beta_slow, attention_factor
        (given; 0 = unset), mscale, mscale_all_dim, truncate, low_freq_factor,
        high_freq_factor, offsets or positions,
        frequencies (R/2), expected_attention_factor,
        x (B, H, L, D), out (B, H, L, D)
  attention case: name, the rope fields above (dim = D), embed_dim, num_heads,
        num_kv_heads, bias, causal, state_dict {in_proj_weight (E + 2 Ekv, E),
        out_proj.weight (E, E), and with bias in_proj_bias, out_proj.bias}, then
        either query (B, L, E), key and value (B, S, E) (null for self-attention:
        query is all three) and output (B, L, E), or x (T, E), cu_seqlens (B + 1)
        and output (T, E) (packed)
Tensors are {"shape", "data"} (flat, row-major), floats written with repr so
they round-trip exactly, compact JSON.
"""

import json
import math
import os
import zlib

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
torch.set_default_dtype(torch.float64)

DEFAULTS = {
    "base": 10000.0,
    "pairing": "half_split",
    "scaling": "none",
    "factor": 1.0,
    "original_max_positions": 0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "attention_factor": 0.0,
    "mscale": 0.0,
    "mscale_all_dim": 0.0,
    "truncate": True,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
}


def tensor(a):
    a = np.asarray(a, dtype=np.float64)
    for v in a.ravel():
        assert math.isfinite(v)
    return {"shape": list(a.shape), "data": [float(v) for v in a.ravel()]}


def yarn_m(scale, k):
    return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0


def frequencies(c):
    """(R/2) frequencies after scaling, and the attention factor (torch float64)."""
    r = c["rotary_dim"]
    base = c["base"]
    factor = c["factor"]
    if c["scaling"] == "ntk_aware":
        base = base * factor ** (r / (r - 2))
    inv_freq = 1.0 / base ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    attention = 1.0
    if c["scaling"] == "linear":
        inv_freq = inv_freq / factor
    elif c["scaling"] == "yarn":
        orig = c["original_max_positions"]

        def correction_dim(n):
            return r * math.log(orig / (n * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(c["beta_fast"]), correction_dim(c["beta_slow"])
        if c["truncate"]:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, r - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(r // 2, dtype=torch.float64) - low) / (high - low), 0, 1)
        inv_freq = (inv_freq / factor) * ramp + inv_freq * (1 - ramp)
        if c["attention_factor"] > 0:
            attention = c["attention_factor"]
        elif c["mscale"] > 0 and c["mscale_all_dim"] > 0:
            attention = yarn_m(factor, c["mscale"]) / yarn_m(factor, c["mscale_all_dim"])
        else:
            attention = yarn_m(factor, 1.0)
    elif c["scaling"] == "llama3":
        orig = c["original_max_positions"]
        low_w = orig / c["low_freq_factor"]
        high_w = orig / c["high_freq_factor"]
        w = 2 * math.pi / inv_freq
        smooth = (orig / w - c["low_freq_factor"]) / (c["high_freq_factor"] - c["low_freq_factor"])
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(
            w > low_w, inv_freq / factor, torch.where(w < high_w, inv_freq, blended)
        )
    return inv_freq, attention


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def position_grid(c, batch, length):
    if "offsets" in c:
        return torch.tensor([[c["offsets"][b] + t for t in range(length)] for b in range(batch)],
                            dtype=torch.float64)
    return torch.tensor(c["positions"], dtype=torch.float64).reshape(batch, length)


def rotate_torch(c, x, inv_freq, attention):
    """x (B, H, L, D) -> out (B, H, L, D)."""
    batch, _, length, _ = x.shape
    r = c["rotary_dim"]
    angles = position_grid(c, batch, length)[:, None, :, None] * inv_freq  # (B, 1, L, R/2)
    cos, sin = torch.cos(angles) * attention, torch.sin(angles) * attention
    xr, tail = x[..., :r], x[..., r:]
    if c["pairing"] == "half_split":
        cos2, sin2 = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        out = xr * cos2 + rotate_half(xr) * sin2
    else:
        cosi = torch.repeat_interleave(cos, 2, dim=-1)
        sini = torch.repeat_interleave(sin, 2, dim=-1)
        out = xr * cosi + rotate_every_two(xr) * sini
    return torch.cat((out, tail), dim=-1)


def rotate_loops(c, x, inv_freq, attention):
    batch, heads, length, dim = x.shape
    r = c["rotary_dim"]
    grid = position_grid(c, batch, length).tolist()
    f = inv_freq.tolist()
    out = x.tolist()
    for b in range(batch):
        for h in range(heads):
            for t in range(length):
                row = out[b][h][t]
                for i in range(r // 2):
                    j0, j1 = (i, i + r // 2) if c["pairing"] == "half_split" else (2 * i, 2 * i + 1)
                    a = grid[b][t] * f[i]
                    cs, sn = attention * math.cos(a), attention * math.sin(a)
                    x0, x1 = row[j0], row[j1]
                    row[j0] = x0 * cs - x1 * sn
                    row[j1] = x1 * cs + x0 * sn
    return torch.tensor(out, dtype=torch.float64)


def case(name, shape, **fields):
    c = dict(DEFAULTS)
    c.update(fields)
    c["name"] = name
    c["dim"] = shape[3]
    c.setdefault("rotary_dim", shape[3])
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    x = torch.tensor(rng.uniform(-2.0, 2.0, size=shape).astype(np.float16).astype(np.float64))
    inv_freq, attention = frequencies(c)
    out = rotate_torch(c, x, inv_freq, attention)
    check = rotate_loops(c, x, inv_freq, attention)
    assert torch.max(torch.abs(out - check)).item() <= 1e-12, name
    assert torch.equal(out[..., c["rotary_dim"]:], x[..., c["rotary_dim"]:]), name
    c["frequencies"] = tensor(inv_freq.numpy())
    c["expected_attention_factor"] = attention
    c["x"] = tensor(x.numpy())
    c["out"] = tensor(out.numpy())
    return c


def spread_positions(batch, length, top, seed):
    rng = np.random.default_rng(seed)
    return [int(p) for p in rng.integers(0, top, size=batch * length)]


def build_cases():
    return [
        # the two pairings on the same shape and offsets; D = 24 has whole AVX2 and
        # AVX-512 vectors and a scalar tail in both pairings
        case("half_split", (2, 2, 5, 24), pairing="half_split", max_positions=32, offsets=[0, 7]),
        case("interleaved", (2, 2, 5, 24), pairing="interleaved", max_positions=32,
             offsets=[0, 7]),
        # partial rotation (GPT-NeoX rotary_pct): [R, D) untouched
        case("partial_half_split", (1, 3, 4, 40), rotary_dim=24, max_positions=16,
             offsets=[3]),
        case("partial_interleaved", (1, 2, 4, 20), rotary_dim=12, pairing="interleaved",
             max_positions=16, offsets=[5]),
        case("linear", (2, 1, 3, 16), scaling="linear", factor=4.0, max_positions=2048,
             positions=spread_positions(2, 3, 2048, 1)),
        case("ntk_aware", (2, 1, 3, 16), scaling="ntk_aware", factor=8.0, max_positions=2048,
             positions=spread_positions(2, 3, 2048, 2)),
        case("yarn", (1, 2, 4, 32), scaling="yarn", factor=4.0, original_max_positions=2048,
             max_positions=8192, positions=spread_positions(1, 4, 8192, 3)),
        case("yarn_untruncated_mscale", (1, 2, 3, 32), scaling="yarn", factor=16.0,
             original_max_positions=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
             mscale_all_dim=0.5, truncate=False, base=50000.0, max_positions=8192,
             positions=spread_positions(1, 3, 8192, 4)),
        case("yarn_attention_factor", (1, 1, 3, 16), scaling="yarn", factor=2.0,
             original_max_positions=512, attention_factor=1.25, pairing="interleaved",
             max_positions=1024, positions=spread_positions(1, 3, 1024, 5)),
        case("llama3", (1, 2, 4, 32), scaling="llama3", factor=8.0, base=500000.0,
             original_max_positions=256, low_freq_factor=1.0, high_freq_factor=4.0,
             max_positions=4096, positions=spread_positions(1, 4, 4096, 6)),
    ]


def half_values(rng, shape, scale):
    return torch.tensor((rng.uniform(-scale, scale, size=shape)).astype(np.float16)
                        .astype(np.float64))


def attention_torch(c, sd, query, key, value):
    """Rotary multi-head attention in torch float64: (B, L, E), (B, S, E) -> (B, L, E)."""
    e, h, hkv = c["embed_dim"], c["num_heads"], c["num_kv_heads"]
    d, ekv = e // h, (e // h) * hkv
    w = sd["in_proj_weight"]
    bias = sd.get("in_proj_bias", torch.zeros(e + 2 * ekv))
    batch, length, _ = query.shape
    keys = key.shape[1]
    q = (query @ w[:e].T + bias[:e]).reshape(batch, length, h, d).transpose(1, 2)
    k = (key @ w[e:e + ekv].T + bias[e:e + ekv]).reshape(batch, keys, hkv, d).transpose(1, 2)
    v = (value @ w[e + ekv:].T + bias[e + ekv:]).reshape(batch, keys, hkv, d).transpose(1, 2)
    inv_freq, attention = frequencies(c)
    at_zero = dict(c, offsets=[0] * batch)
    q = rotate_torch(at_zero, q, inv_freq, attention)
    k = rotate_torch(at_zero, k, inv_freq, attention)
    k = torch.repeat_interleave(k, h // hkv, dim=1)
    v = torch.repeat_interleave(v, h // hkv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    if c["causal"]:
        hidden = torch.ones(length, keys, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    merged = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(batch, length, e)
    return merged @ sd["out_proj.weight"].T + sd.get("out_proj.bias", torch.zeros(e))


def attention_loops(c, sd, query, key, value):
    """The same with NumPy and plain loops over b and h (rotation by rotate_loops)."""
    e, h, hkv = c["embed_dim"], c["num_heads"], c["num_kv_heads"]
    d, ekv = e // h, (e // h) * hkv
    w = sd["in_proj_weight"].numpy()
    bias = sd["in_proj_bias"].numpy() if "in_proj_bias" in sd else np.zeros(e + 2 * ekv)
    wo = sd["out_proj.weight"].numpy()
    bo = sd["out_proj.bias"].numpy() if "out_proj.bias" in sd else np.zeros(e)
    inv_freq, attention = frequencies(c)
    batch, length, _ = query.shape
    keys = key.shape[1]
    out = np.zeros((batch, length, e))
    for b in range(batch):
        xq, xk = query[b].numpy(), key[b].numpy()
        qp = xq @ w[:e].T + bias[:e]
        kp = xk @ w[e:e + ekv].T + bias[e:e + ekv]
        vp = value[b].numpy() @ w[e + ekv:].T + bias[e + ekv:]
        merged = np.zeros((length, e))
        for head in range(h):
            g = head // (h // hkv)
            one = dict(c, offsets=[0])
            qh = rotate_loops(one, torch.tensor(qp[None, None, :, head * d:(head + 1) * d]),
                              inv_freq, attention).numpy()[0, 0]
            kh = rotate_loops(one, torch.tensor(kp[None, None, :, g * d:(g + 1) * d]),
                              inv_freq, attention).numpy()[0, 0]
            vh = vp[:, g * d:(g + 1) * d]
            for i in range(length):
                sc = np.array([qh[i] @ kh[j] / math.sqrt(d) for j in range(keys)])
                if c["causal"]:
                    sc[i + 1:] = -np.inf
                p = np.exp(sc - sc.max())
                merged[i, head * d:(head + 1) * d] = (p / p.sum()) @ vh
        out[b] = merged @ wo.T + bo
    return torch.tensor(out)


def attention_case(name, embed_dim, num_heads, num_kv_heads, bias, causal, batch=1, length=0,
                   keys=None, cu_seqlens=None, **rope_fields):
    c = dict(DEFAULTS)
    c.update(rope_fields)
    d = embed_dim // num_heads
    c.update(name=name, dim=d, embed_dim=embed_dim, num_heads=num_heads,
             num_kv_heads=num_kv_heads, bias=bias, causal=causal)
    c.setdefault("rotary_dim", d)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    ekv = d * num_kv_heads
    sd = {"in_proj_weight": half_values(rng, (embed_dim + 2 * ekv, embed_dim), 0.5),
          "out_proj.weight": half_values(rng, (embed_dim, embed_dim), 0.5)}
    if bias:
        sd["in_proj_bias"] = half_values(rng, (embed_dim + 2 * ekv,), 0.5)
        sd["out_proj.bias"] = half_values(rng, (embed_dim,), 0.5)
    c["state_dict"] = {k: tensor(v.numpy()) for k, v in sd.items()}

    def both(query, key, value):
        out = attention_torch(c, sd, query, key, value)
        check = attention_loops(c, sd, query, key, value)
        assert torch.max(torch.abs(out - check)).item() <= 1e-12, name
        return out

    if cu_seqlens is not None:
        x = half_values(rng, (cu_seqlens[-1], embed_dim), 1.0)
        parts = []
        for b in range(len(cu_seqlens) - 1):
            seq = x[cu_seqlens[b]:cu_seqlens[b + 1]][None]
            if seq.shape[1] > 0:
                parts.append(both(seq, seq, seq)[0])
        c.update(x=tensor(x.numpy()), cu_seqlens=cu_seqlens,
                 output=tensor(torch.cat(parts).numpy()))
        return c
    query = half_values(rng, (batch, length, embed_dim), 1.0)
    if keys is None:
        key = value = query
        c.update(key=None, value=None)
    else:
        key = half_values(rng, (batch, keys, embed_dim), 1.0)
        value = half_values(rng, (batch, keys, embed_dim), 1.0)
        c.update(key=tensor(key.numpy()), value=tensor(value.numpy()))
    c.update(query=tensor(query.numpy()), output=tensor(both(query, key, value).numpy()))
    return c


def build_attention_cases():
    return [
        # Llama's arrangement: grouped-query heads, causal, half-split pairing
        attention_case("gqa_causal", 32, 4, 2, True, True, batch=2, length=7, max_positions=16),
        # multi-query, partial interleaved rotation with YaRN's attention factor, no mask
        attention_case("mqa_yarn_partial_interleaved", 48, 2, 1, False, False, batch=1, length=5,
                       rotary_dim=16, pairing="interleaved", scaling="yarn", factor=4.0,
                       original_max_positions=8, max_positions=32),
        # cross-attention: queries at [0, L), keys at [0, S)
        attention_case("cross", 32, 4, 4, True, False, batch=2, length=3, keys=6,
                       max_positions=8),
        # packed sequences (one empty): positions restart at 0 in each
        attention_case("packed_gqa_causal", 32, 4, 2, True, True, cu_seqlens=[0, 4, 4, 9],
                       max_positions=16),
    ]


def main():
    cases = build_cases()
    attention_cases = build_attention_cases()
    path = os.path.join(HERE, "rope.json")
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        fh.write(json.dumps({"cases": cases, "attention_cases": attention_cases},
                            separators=(",", ":"), allow_nan=False))
        fh.write("\n")
    for c in cases + attention_cases:
        print("  %s" % c["name"])
    print("wrote %s (%d bytes)" % (os.path.relpath(path), os.path.getsize(path)))


if __name__ == "__main__":
    main()
