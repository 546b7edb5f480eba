#!/usr/bin/env python3
"""The PyTorch twin of examples/train_copy: the same model, initial weights, data and Adam
steps as the C++ example, in float64, to check the C++ training step by step.

How to run (from the repository root):

    /usr/bin/python3 examples/train_copy/train_copy.py            # writes the fixture
    /usr/bin/python3 examples/train_copy/train_copy.py --steps 400 --no-write

Writes tests/reference/train_copy.json: the configuration and the losses of the first
RECORDED steps, which tests/test_train_copy.cpp compares with the C++ training.

The task: a sequence of N symbols in [0, V), a separator, the same N symbols again; the
model reads the sequence without its last token and predicts each next token; the loss is
the mean cross-entropy over the N predictions of the second copy (the first half is random
and not predictable). The model (docs/training.md#training-example):

    x = tok_emb[tokens] + pos_emb[t]                          (B, L, E), L = 2N
    x = x + MultiheadAttention_l(x, causal)   for each layer  nn.MultiheadAttention
    logits = x readout.weight^T + readout.bias                 (B, L, V + 1)

Every random number comes from SplitMix64 (seed 2026), in this order: the initial weights
(each parameter in the order below, row-major, uniform in [-a, a) as
a * (2 * (next() >> 11) * 2^-53 - 1)), then the batches (each token next() % V, row by
row). The C++ side implements the same generator, so nothing but the losses is stored.
"""

import argparse
import json
import math
import os

import torch

MASK64 = (1 << 64) - 1
CONFIG = {"symbols": 16, "length": 8, "embed_dim": 32, "num_heads": 4, "layers": 2,
          "batch": 16, "lr": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "seed": 2026}
RECORDED = 12


class SplitMix64:
    def __init__(self, seed):
        self.state = seed & MASK64

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def uniform(self, a, shape):
        n = math.prod(shape)
        vals = [a * (2.0 * ((self.next() >> 11) * 2.0 ** -53) - 1.0) for _ in range(n)]
        return torch.tensor(vals, dtype=torch.float64).reshape(shape)


def build(cfg, rng):
    V, N, E, H = cfg["symbols"] + 1, cfg["length"], cfg["embed_dim"], cfg["num_heads"]
    L = 2 * N
    model = torch.nn.ModuleDict()
    model["tok_emb"] = torch.nn.Embedding(V, E, dtype=torch.float64)
    model["pos_emb"] = torch.nn.Embedding(L, E, dtype=torch.float64)
    model["layers"] = torch.nn.ModuleList(
        [torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
         for _ in range(cfg["layers"])])
    model["readout"] = torch.nn.Linear(E, V, dtype=torch.float64)
    with torch.no_grad():  # the documented order and ranges
        model["tok_emb"].weight.copy_(rng.uniform(1.0, (V, E)))
        model["pos_emb"].weight.copy_(rng.uniform(1.0, (L, E)))
        for layer in model["layers"]:
            layer.in_proj_weight.copy_(rng.uniform(math.sqrt(6.0 / (4 * E)), (3 * E, E)))
            layer.in_proj_bias.zero_()
            layer.out_proj.weight.copy_(rng.uniform(1.0 / math.sqrt(E), (E, E)))
            layer.out_proj.bias.zero_()
        model["readout"].weight.copy_(rng.uniform(1.0 / math.sqrt(E), (V, E)))
        model["readout"].bias.zero_()
    return model


def batch(cfg, rng):
    B, N, S = cfg["batch"], cfg["length"], cfg["symbols"]
    rows = []
    for _ in range(B):
        a = [rng.next() % S for _ in range(N)]
        rows.append(a + [S] + a)  # S is the separator
    return torch.tensor(rows, dtype=torch.long)  # (B, 2N + 1)


def forward(model, cfg, seq):
    N = cfg["length"]
    inp, target = seq[:, :-1], seq[:, 1:]
    L = inp.shape[1]
    x = model["tok_emb"](inp) + model["pos_emb"](torch.arange(L))[None]
    causal = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)
    for layer in model["layers"]:
        x = x + layer(x, x, x, attn_mask=causal, need_weights=False)[0]
    logits = model["readout"](x)  # (B, L, V)
    pred = logits[:, N:]  # the second copy: targets a_0 .. a_{N-1}
    loss = torch.nn.functional.cross_entropy(pred.reshape(-1, pred.shape[-1]),
                                             target[:, N:].reshape(-1))
    accuracy = (pred.argmax(-1) == target[:, N:]).double().mean().item()
    return loss, accuracy


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=RECORDED)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = CONFIG
    rng = SplitMix64(cfg["seed"])
    model = build(cfg, rng)
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"], betas=(cfg["beta1"], cfg["beta2"]),
                           eps=cfg["eps"])
    losses = []
    for step in range(args.steps):
        seq = batch(cfg, rng)
        loss, accuracy = forward(model, cfg, seq)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.6f}  accuracy {accuracy:.3f}")
    if not args.no_write:
        out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests",
                           "reference", "train_copy.json")
        with open(out, "w") as f:
            json.dump({"config": cfg, "losses": losses[:RECORDED]}, f, indent=1)
            f.write("\n")
        print(f"wrote {os.path.normpath(out)}")


if __name__ == "__main__":
    main()
