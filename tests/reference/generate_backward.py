#!/usr/bin/env python3
"""Writes backward.json: gradients of every sdpa.json case, by torch autograd in float64.

How to run (from the repository root; Debian's python3-torch and python3-numpy):

    /usr/bin/python3 tests/reference/generate_backward.py

For each case of sdpa.json (same name, same q, k, v, masks and options) a cotangent dout
(B, Hq, Lq, Dv) is drawn (float32-representable, seeded by the case's name), and the loss
L = sum(out * dout) is differentiated by autograd through the explicit formula of
generate.py's sdpa_torch (the documented rules: softcap's tanh, ALiBi, the bias, the
visibility mask as -inf, the learned sink as one more softmax column that is then dropped),
giving dq, dk, dv, dbias (in the bias's own broadcast shape: autograd sums over the
broadcast dimensions) and dsinks. Rows that see no key (or only scores of -inf) would have a
softmax of NaN in that formula; their scores are replaced by zeros and their weights by zeros,
so their gradients are zero, the library's documented rule.

"dropout_cases" adds cases with dropout (sdpa.json has none): their own inputs, the dropout
factors computed from docs/training.md's rule (re-implemented here from the text), and the
forward's out beside the gradients.

Each case is cross-checked by central finite differences of the same loss in float64 on a few
entries of every input (an independent check of the autograd graph). Cases whose bias has
-inf entries keep those entries' dbias at the value autograd gives them (0: the key is hidden).
"""

import json
import math
import os
import sys
import zlib

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import generate  # noqa: E402  (the forward's helpers and encoders)

torch.set_default_dtype(torch.float64)


def decode(x):
    if isinstance(x, str):
        return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[x]
    return x


def load_array(t):
    if t is None:
        return None
    data = [decode(x) for x in t["data"]]
    if t.get("dtype") == "bool":
        return np.asarray(data, dtype=np.bool_).reshape(t["shape"])
    return np.asarray(data, dtype=np.float64).reshape(t["shape"])


def forward(c, q, k, v, bias, sinks):
    """out of case c for torch tensors q, k, v, bias (or None), sinks (or None)."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    kt = k.repeat_interleave(group, dim=1)
    vt = v.repeat_interleave(group, dim=1)
    scale = (1.0 / math.sqrt(D)) if c["scale"] is None else c["scale"]
    s = torch.matmul(q, kt.transpose(-1, -2)) * scale
    if c["softcap"] is not None:
        s = c["softcap"] * torch.tanh(s / c["softcap"])
    if c["alibi_slopes"] is not None:
        s = s + generate.alibi_torch(c["alibi_slopes"], B, Hq, Lq, Lk, c["causal"],
                                     c["key_lengths"], c["query_lengths"])
    if bias is not None:
        s = s + bias
    keep = load_array(c["keep_mask"])
    vis = generate.visibility_torch(B, Hq, Lq, Lk, c["causal"], c["window"], c["key_lengths"],
                                    keep, c["query_lengths"], c["sink_tokens"])
    s = s.masked_fill(~vis, -math.inf)
    if sinks is not None:
        column = sinks.view(1, Hq, 1, 1).expand(B, Hq, Lq, 1)
        w = torch.softmax(torch.cat([s, column], dim=-1), dim=-1)[..., :-1]
        if c.get("dropout_p"):
            w = w * torch.tensor(dropout_factors(B, Hq, Lq, Lk, c["dropout_p"],
                                                 c["dropout_seed"]))
    else:
        # A row with no finite score (no visible key, or a bias of -inf on all of them):
        # its softmax is NaN, and so would be its gradients; the rule is zeros. The scores of
        # such rows are replaced by zeros first, so that nothing NaN enters the graph.
        sees_something = torch.isfinite(s).any(dim=-1, keepdim=True)
        s = torch.where(sees_something, s, torch.zeros_like(s))
        w = torch.softmax(s, dim=-1)
        w = torch.where(sees_something, w, torch.zeros_like(w))
        if c.get("dropout_p"):
            w = w * torch.tensor(dropout_factors(B, Hq, Lq, Lk, c["dropout_p"],
                                                 c["dropout_seed"]))
    return torch.matmul(w, vt)


def mix64(z):
    z = (z + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def mix32(x):
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def dropout_factors(B, Hq, Lq, Lk, p, seed):
    """docs/training.md's dropout rule: f (B, Hq, Lq, Lk), 0 or 1 / (1 - p)."""
    threshold = round(p * 2 ** 32)
    f = np.zeros((B, Hq, Lq, Lk))
    for b in range(B):
        for h in range(Hq):
            for i in range(Lq):
                row = mix64(mix64(mix64(mix64(seed) ^ b) ^ h) ^ i) >> 32
                for j in range(Lk):
                    x = mix32((row + j * 0x9E3779B9) & 0xFFFFFFFF)
                    f[b, h, i, j] = 1.0 / (1.0 - p) if x >= threshold else 0.0
    return f


def gradients(c, dout):
    inputs = {name: torch.tensor(load_array(c[name]), requires_grad=True)
              for name in ("q", "k", "v")}
    bias = load_array(c["bias"])
    inputs["bias"] = None if bias is None else torch.tensor(bias, requires_grad=True)
    inputs["sinks"] = (None if c["sinks"] is None
                       else torch.tensor(c["sinks"], requires_grad=True))
    out = forward(c, inputs["q"], inputs["k"], inputs["v"], inputs["bias"], inputs["sinks"])
    if "out" in c:
        expected_out = load_array(c["out"])
        assert np.allclose(out.detach().numpy(), expected_out, rtol=1e-12, atol=1e-12), \
            c["name"] + ": the forward differs from sdpa.json"
    loss = (out * torch.tensor(dout)).sum()
    wanted = [t for t in inputs.values() if t is not None]
    grads = torch.autograd.grad(loss, wanted, allow_unused=True)
    result = {}
    for name, t in inputs.items():
        if t is None:
            result[name] = None
            continue
        g = grads[[x is t for x in wanted].index(True)]
        result[name] = torch.zeros_like(t) if g is None else g
    return inputs, result


def finite_difference_check(c, dout, inputs, grads, rng):
    """Central differences of L = sum(out * dout) on a few entries of each input."""
    h = 1e-6
    dout_t = torch.tensor(dout)

    def loss(values):
        with torch.no_grad():
            return float((forward(c, values["q"], values["k"], values["v"], values["bias"],
                                  values["sinks"]) * dout_t).sum())

    base = {n: (None if t is None else t.detach().clone()) for n, t in inputs.items()}
    for name, t in base.items():
        if t is None or t.numel() == 0:
            continue
        flat = t.view(-1)
        for index in rng.choice(flat.numel(), size=min(3, flat.numel()), replace=False):
            if not math.isfinite(float(flat[index])):
                continue
            original = float(flat[index])
            flat[index] = original + h
            up = loss(base)
            flat[index] = original - h
            down = loss(base)
            flat[index] = original
            numeric = (up - down) / (2 * h)
            analytic = float(grads[name].reshape(-1)[index])
            assert abs(numeric - analytic) <= 1e-5 * (1 + abs(analytic)), \
                "%s: d%s[%d] autograd %r, finite difference %r" % (
                    c["name"], name, index, analytic, numeric)


def main():
    with open(os.path.join(HERE, "sdpa.json"), encoding="utf-8") as fh:
        sdpa = json.load(fh)
    cases = []
    for c in sdpa["cases"]:
        rng = np.random.default_rng(zlib.crc32(("backward " + c["name"]).encode("utf-8")))
        out_shape = c["out"]["shape"]
        dout = generate.f32(rng.standard_normal(out_shape))
        inputs, grads = gradients(c, dout)
        for name, g in grads.items():
            if g is not None:
                assert torch.isfinite(g).all(), c["name"] + ": non-finite d" + name
        finite_difference_check(c, dout, inputs, grads, rng)
        cases.append({
            "name": c["name"],
            "dout": generate.tensor(dout),
            "dq": generate.tensor(grads["q"].numpy()),
            "dk": generate.tensor(grads["k"].numpy()),
            "dv": generate.tensor(grads["v"].numpy()),
            "dbias": None if grads["bias"] is None else generate.tensor(grads["bias"].numpy()),
            "dsinks": None if grads["sinks"] is None else [float(x) for x in grads["sinks"]],
        })
        print("  %-80s ok" % c["name"])
    # Dropout: cases of their own (sdpa.json has none), with the forward's out and lse.
    dropout_cases = []
    for name, B, Hq, Hkv, Lq, Lk, D, Dv, p, seed, causal, with_bias, with_sinks in (
            ("dropout_0.3_causal_bottom_right_gqa", 2, 4, 2, 7, 9, 5, 3, 0.3, 7, "bottom_right",
             False, False),
            ("dropout_0.5_bias_1_h_lq_lk", 1, 2, 2, 6, 11, 4, 4, 0.5, 123456789, "none", True,
             False),
            ("dropout_0.1_sinks_causal_top_left", 2, 2, 1, 8, 8, 3, 5, 0.1, 2 ** 40 + 3,
             "top_left", False, True)):
        rng = np.random.default_rng(zlib.crc32(name.encode("utf-8")))
        c = {"name": name,
             "q": generate.tensor(generate.f32(rng.standard_normal((B, Hq, Lq, D)))),
             "k": generate.tensor(generate.f32(rng.standard_normal((B, Hkv, Lk, D)))),
             "v": generate.tensor(generate.f32(rng.standard_normal((B, Hkv, Lk, Dv)))),
             "scale": None, "causal": causal, "window": [-1, -1], "key_lengths": None,
             "keep_mask": None,
             "bias": (generate.tensor(generate.f32(rng.standard_normal((1, Hq, Lq, Lk))))
                      if with_bias else None),
             "alibi_slopes": None, "softcap": None, "query_lengths": None, "sink_tokens": 0,
             "sinks": ([float(np.float32(x)) for x in rng.standard_normal(Hq)]
                       if with_sinks else None),
             "dropout_p": p, "dropout_seed": seed}
        f = dropout_factors(B, Hq, Lq, Lk, p, seed)
        visible = generate.visibility_torch(B, Hq, Lq, Lk, causal, [-1, -1], None, None).numpy()
        kept = (f[visible] > 0).mean()
        assert abs(kept - (1 - p)) < 0.2, name + ": keep rate %g" % kept
        dout = generate.f32(rng.standard_normal((B, Hq, Lq, Dv)))
        inputs, grads = gradients(c, dout)
        finite_difference_check(c, dout, inputs, grads, rng)
        with torch.no_grad():
            out = forward(c, inputs["q"], inputs["k"], inputs["v"], inputs["bias"],
                          inputs["sinks"]).numpy()
        c.update({
            "out": generate.tensor(out),
            "dout": generate.tensor(dout),
            "dq": generate.tensor(grads["q"].numpy()),
            "dk": generate.tensor(grads["k"].numpy()),
            "dv": generate.tensor(grads["v"].numpy()),
            "dbias": None if grads["bias"] is None else generate.tensor(grads["bias"].numpy()),
            "dsinks": None if grads["sinks"] is None else [float(x) for x in grads["sinks"]],
        })
        dropout_cases.append(c)
        print("  %-80s ok (kept %.3f)" % (name, kept))
    path = generate.write_json("backward.json", {"cases": cases,
                                                 "dropout_cases": dropout_cases})
    print("wrote %s (%d cases, %d bytes)" % (os.path.relpath(path), len(cases),
                                            os.path.getsize(path)))


if __name__ == "__main__":
    main()
