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
    else:
        # A row with no finite score (no visible key, or a bias of -inf on all of them):
        # its softmax is NaN, and so would be its gradients; the rule is zeros. The scores of
        # such rows are replaced by zeros first, so that nothing NaN enters the graph.
        sees_something = torch.isfinite(s).any(dim=-1, keepdim=True)
        s = torch.where(sees_something, s, torch.zeros_like(s))
        w = torch.softmax(s, dim=-1)
        w = torch.where(sees_something, w, torch.zeros_like(w))
    return torch.matmul(w, vt)


def gradients(c, dout):
    inputs = {name: torch.tensor(load_array(c[name]), requires_grad=True)
              for name in ("q", "k", "v")}
    bias = load_array(c["bias"])
    inputs["bias"] = None if bias is None else torch.tensor(bias, requires_grad=True)
    inputs["sinks"] = (None if c["sinks"] is None
                       else torch.tensor(c["sinks"], requires_grad=True))
    out = forward(c, inputs["q"], inputs["k"], inputs["v"], inputs["bias"], inputs["sinks"])
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
    path = generate.write_json("backward.json", {"cases": cases})
    print("wrote %s (%d cases, %d bytes)" % (os.path.relpath(path), len(cases),
                                            os.path.getsize(path)))


if __name__ == "__main__":
    main()
