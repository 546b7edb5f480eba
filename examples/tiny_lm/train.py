#!/usr/bin/env python3
"""Trains examples/tiny_lm, writes its weights as safetensors and the test fixture.

How to run (from the repository root; Debian's python3-torch and python3-numpy, CPU):

    /usr/bin/python3 examples/tiny_lm/train.py               # train (a few minutes), export,
                                                             # then write the fixture
    /usr/bin/python3 examples/tiny_lm/train.py --fixture-only  # only the fixture, from the
                                                             # committed weights

The model: a decoder-only transformer over bytes (vocabulary 256), the Llama recipe at a
small size:

    x = embed[tokens]                                         (L, E)
    for each layer:
        h = x + attention(rms_norm(x) * attn_norm)            RoPE on q and k (half-split
                                                              pairing, base 10000), grouped
                                                              query heads, causal
        x = h + down(silu(gate(n)) * up(n)),  n = rms_norm(h) * mlp_norm
    logits = rms_norm(x) * norm @ lm_head^T                   (L, 256)

rms_norm(x) = x / sqrt(mean(x^2) + 1e-5). No biases. The attention's input projection is one
(E + 2 Ekv, E) matrix (q rows, then k, then v), the layout of attn::MultiHeadAttention's
in_proj_weight, so that the C++ side loads each layer with one load_state_dict call.

Training text: the project's own README.md, docs/*.md and include/attn/**/*.hpp, as bytes,
read when the script runs (their SHA-256 goes into the file's metadata). Fixed seeds and one
thread; the steps are fixed, not the time.

Files written:
  examples/tiny_lm/tiny_lm.safetensors   the weights (F32), written by the small writer
                                         below (struct + json; the `safetensors` package is
                                         not in Debian), hyper-parameters in __metadata__
  tests/reference/tiny_lm.json           the fixture, computed in float64 from the weights
                                         read back from that file by the reader below:
                                         the prompt (the first of PROMPTS whose greedy path
                                         keeps a gap of at least 1e-3 between the best and
                                         second-best logit, so that the float32 C++ forward
                                         cannot flip an argmax), its logits (L, 256), 200
                                         greedy tokens (argmax, the whole sequence
                                         recomputed at every step, no cache), that smallest
                                         gap, and the logits of the last step.
"""

import argparse
import glob
import hashlib
import json
import math
import os
import struct
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "examples", "tiny_lm", "tiny_lm.safetensors")
FIXTURE = os.path.join(ROOT, "tests", "reference", "tiny_lm.json")

CONFIG = {
    "vocab_size": 256,
    "embed_dim": 64,
    "layers": 4,
    "heads": 2,
    "kv_heads": 1,
    "hidden_dim": 192,
    "rope_base": 10000.0,
    "norm_eps": 1e-5,
    "max_positions": 1024,
    "context": 256,  # training window: covers the prompt and the 200 greedy tokens
}
# The fixture's prompt is the first of these whose greedy path has no near tie (below).
PROMPTS = ["The KV cache holds", "Rotary position embeddings", "/// The attention of",
           "template <class T>"]
GREEDY_STEPS = 200
MIN_GAP = 1e-3


# ---------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------

def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_tables(length, dim, base, dtype):
    """cos, sin (length, dim / 2): angle p * base^(-2i / dim), computed in float64."""
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)


def rotate_half_split(x, cos, sin):
    """GPT-NeoX / Llama pairing: feature i pairs with i + D/2. x (B, H, L, D)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class TinyLM(torch.nn.Module):
    def __init__(self, c, dtype=torch.float32):
        super().__init__()
        self.c = c
        E, F, V = c["embed_dim"], c["hidden_dim"], c["vocab_size"]
        D = E // c["heads"]
        ekv = c["kv_heads"] * D
        p = torch.nn.Parameter
        self.embed = p(torch.randn(V, E, dtype=dtype) * 0.02)
        self.layers = torch.nn.ModuleList()
        for _ in range(c["layers"]):
            layer = torch.nn.Module()
            layer.attn_norm = p(torch.ones(E, dtype=dtype))
            layer.in_proj = p(torch.randn(E + 2 * ekv, E, dtype=dtype) / math.sqrt(E))
            layer.out_proj = p(torch.randn(E, E, dtype=dtype) / math.sqrt(E) / math.sqrt(2 * c["layers"]))
            layer.mlp_norm = p(torch.ones(E, dtype=dtype))
            layer.gate = p(torch.randn(F, E, dtype=dtype) / math.sqrt(E))
            layer.up = p(torch.randn(F, E, dtype=dtype) / math.sqrt(E))
            layer.down = p(torch.randn(E, F, dtype=dtype) / math.sqrt(F) / math.sqrt(2 * c["layers"]))
            self.layers.append(layer)
        self.norm = p(torch.ones(E, dtype=dtype))
        self.lm_head = p(torch.randn(V, E, dtype=dtype) * 0.02)

    def forward(self, tokens):  # (B, L) -> (B, L, V)
        c = self.c
        B, L = tokens.shape
        E, H, Hkv = c["embed_dim"], c["heads"], c["kv_heads"]
        D = E // H
        eps = c["norm_eps"]
        cos, sin = rope_tables(L, D, c["rope_base"], self.embed.dtype)
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        x = self.embed[tokens]
        for layer in self.layers:
            n = rms_norm(x, layer.attn_norm, eps)
            qkv = n @ layer.in_proj.T
            q = qkv[..., :E].reshape(B, L, H, D).transpose(1, 2)
            k = qkv[..., E:E + Hkv * D].reshape(B, L, Hkv, D).transpose(1, 2)
            v = qkv[..., E + Hkv * D:].reshape(B, L, Hkv, D).transpose(1, 2)
            q = rotate_half_split(q, cos, sin)
            k = rotate_half_split(k, cos, sin)
            # grouped-query heads: query head h reads key/value head h // (H / Hkv)
            k = k.repeat_interleave(H // Hkv, dim=1)
            v = v.repeat_interleave(H // Hkv, dim=1)
            s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
            s = s.masked_fill(~causal, float("-inf"))
            a = torch.softmax(s, dim=-1) @ v  # (B, H, L, D)
            x = x + a.transpose(1, 2).reshape(B, L, E) @ layer.out_proj.T
            n = rms_norm(x, layer.mlp_norm, eps)
            x = x + (torch.nn.functional.silu(n @ layer.gate.T) * (n @ layer.up.T)) @ layer.down.T
        return rms_norm(x, self.norm, eps) @ self.lm_head.T

    def named_weights(self):
        """The safetensors names, attn::MultiHeadAttention's for the attention."""
        out = {"embed.weight": self.embed, "norm.weight": self.norm, "lm_head.weight": self.lm_head}
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            out[p + "attn_norm.weight"] = layer.attn_norm
            out[p + "attn.in_proj_weight"] = layer.in_proj
            out[p + "attn.out_proj.weight"] = layer.out_proj
            out[p + "mlp_norm.weight"] = layer.mlp_norm
            out[p + "mlp.gate.weight"] = layer.gate
            out[p + "mlp.up.weight"] = layer.up
            out[p + "mlp.down.weight"] = layer.down
        return out


# ---------------------------------------------------------------------------
# safetensors, written and read by hand: 8-byte little-endian header length, JSON header
# padded with spaces to a multiple of 8, then the tensors' little-endian bytes, no holes
# ---------------------------------------------------------------------------

DTYPES = {"F64": ("<f8", 8), "F32": ("<f4", 4), "F16": ("<f2", 2)}


def write_safetensors(path, tensors, metadata):
    header = {"__metadata__": metadata}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name], dtype="<f4")
        blob = a.tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    data = raw[8 + n:]
    metadata = header.pop("__metadata__", {})
    tensors = {}
    for name, info in header.items():
        kind, size = DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        a = np.frombuffer(data[begin:end], dtype=kind).astype(np.float64)
        tensors[name] = a.reshape(info["shape"])
    return tensors, metadata


# ---------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------

def corpus():
    files = [os.path.join(ROOT, "README.md")]
    files += sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    files += sorted(glob.glob(os.path.join(ROOT, "include", "attn", "**", "*.hpp"), recursive=True))
    text = b"".join(open(f, "rb").read() for f in files)
    return text, [os.path.relpath(f, ROOT) for f in files]


def train(steps, batch, lr, seed):
    torch.manual_seed(seed)
    text, files = corpus()
    data = torch.tensor(list(text), dtype=torch.long)
    c = CONFIG
    model = TinyLM(c)
    params = sum(p.numel() for p in model.parameters())
    print(f"corpus: {len(text)} bytes from {len(files)} files; model: {params} parameters")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(seed)
    T = c["context"]
    start = time.time()
    recent = []
    for step in range(steps):
        warmup = 30
        scale = (step + 1) / warmup if step < warmup else \
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        idx = torch.randint(0, len(data) - T - 1, (batch,), generator=g)
        x = torch.stack([data[i:i + T] for i in idx])
        y = torch.stack([data[i + 1:i + T + 1] for i in idx])
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, c["vocab_size"]), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        recent = (recent + [loss.item()])[-20:]
        if step % 25 == 0 or step == steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  ({time.time() - start:.0f} s)", flush=True)
    elapsed = time.time() - start
    weights = {k: v.detach().numpy() for k, v in model.named_weights().items()}
    metadata = {k: str(v) for k, v in c.items()}
    metadata.update({
        "model": "attn tiny_lm (examples/tiny_lm/train.py)",
        "rope_pairing": "half_split",
        "trained_on": " ".join(files),
        "trained_on_sha256": hashlib.sha256(text).hexdigest(),
        "steps": str(steps), "batch": str(batch), "seed": str(seed),
        "final_loss": f"{sum(recent) / len(recent):.4f}",  # mean of the last 20 batches
        "training_seconds": f"{elapsed:.0f}",
    })
    write_safetensors(MODEL, weights, metadata)
    print(f"final loss (mean of the last 20 batches) {sum(recent) / len(recent):.4f} nats/byte")
    print(f"wrote {MODEL} ({os.path.getsize(MODEL)} bytes) after {elapsed:.0f} s")


# ---------------------------------------------------------------------------
# the fixture, in float64 from the file as written
# ---------------------------------------------------------------------------

def num(x):
    x = float(x)
    return int(x) if x == int(x) and abs(x) < 2 ** 53 else x


def greedy(model, prompt):
    """GREEDY_STEPS argmax tokens, the whole sequence recomputed at every step (no cache)."""
    tokens = torch.tensor([prompt], dtype=torch.long)
    generated, margin, last = [], math.inf, None
    for _ in range(GREEDY_STEPS):
        logits = model(tokens)[0, -1]
        top = torch.topk(logits, 2).values
        margin = min(margin, float(top[0] - top[1]))
        nxt = int(torch.argmax(logits))
        generated.append(nxt)
        tokens = torch.cat([tokens, torch.tensor([[nxt]])], dim=1)
        last = logits
    return generated, margin, last


def fixture():
    tensors, metadata = read_safetensors(MODEL)
    c = dict(CONFIG)
    model = TinyLM(c, dtype=torch.float64)
    with torch.no_grad():
        for name, p in model.named_weights().items():
            p.copy_(torch.from_numpy(tensors[name]))
        # float32 logits are within ~1e-5 of float64 ones: a smallest top-2 gap far above
        # that keeps every argmax of the C++ float forward equal to torch's.
        for text in PROMPTS:
            prompt = list(text.encode("utf-8"))
            generated, margin, last = greedy(model, prompt)
            print(f"prompt {text!r}: smallest top-2 gap {margin:.5f}")
            if margin > MIN_GAP:
                break
        else:
            raise SystemExit(f"every prompt's greedy path has a top-2 gap below {MIN_GAP}")
        prompt_logits = model(torch.tensor([prompt], dtype=torch.long))[0]
    continuation = bytes(generated).decode("utf-8", errors="replace")
    print(f"greedy continuation of {text!r}:\n{continuation}")
    out = {
        "model": os.path.relpath(MODEL, ROOT),
        "model_sha256": hashlib.sha256(open(MODEL, "rb").read()).hexdigest(),
        "prompt": text,
        "prompt_tokens": prompt,
        "prompt_logits": {"shape": list(prompt_logits.shape),
                          "data": [num(v) for v in prompt_logits.reshape(-1).tolist()]},
        "greedy_tokens": generated,
        "greedy_text": continuation,
        "greedy_min_gap": margin,
        "last_logits": {"shape": [c["vocab_size"]], "data": [num(v) for v in last.tolist()]},
    }
    with open(FIXTURE, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {FIXTURE}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fixture-only", action="store_true")
    # about five minutes on one core with Debian's torch (reference BLAS)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=6e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not args.fixture_only:
        train(args.steps, args.batch, args.lr, args.seed)
    fixture()


if __name__ == "__main__":
    main()
