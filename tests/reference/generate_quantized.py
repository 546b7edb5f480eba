#!/usr/bin/env python3
"""Reference blocks for attn's q8_0 and q4_0 quantizers (include/attn/quantized.hpp).

How to run (from the repository root; needs NumPy only):

    /usr/bin/python3 tests/reference/generate_quantized.py

Deterministic: rows come from a generator with a fixed seed and from hand-made edge cases, so
running it again rewrites a byte-identical quantized.json.

What is computed: a plain re-implementation of llama.cpp's reference quantizers
(quantize_row_q8_0_ref and quantize_row_q4_0_ref in ggml-quants.c), every operation in
float32 as in C, each rounded on its own:

    q8_0  amax = max |x|; d = amax / 127; id = 1 / d (0 when d = 0)
          q_j = roundf(x_j * id)            (halves away from zero)
          block = fp16(d) (round to nearest even, little-endian) then the 32 int8 q_j
    q4_0  m = the x_j of largest |x_j| (the first on ties); d = m / -8; id as above
          n_j = min(15, trunc(x_j * id + 8.5))
          block = fp16(d) then byte j = n_j | n_{j+16} << 4 for j < 16

Rows are finite (the NaN rule is attn's own, tested in C++), and chosen so that 1 / d never
overflows (where ggml's C is undefined). Each case holds 2 blocks (64 values).
"""
import json
import math
import pathlib

import numpy as np

F = np.float32


def round_half_away(x):
    """roundf: the float32 x rounded to an integer, halves away from zero (exact in double)."""
    value = float(x)
    return int(math.copysign(math.floor(abs(value) + 0.5), value))


def q8_0(block):
    amax = F(0)
    for x in block:
        amax = max(amax, F(abs(x)))
    d = F(amax / F(127))
    inverse = F(F(1) / d) if d != 0 else F(0)
    out = np.float16(d).tobytes()
    quants = [round_half_away(F(x * inverse)) for x in block]
    return out + bytes(q & 0xFF for q in quants)


def q4_0(block):
    amax, peak = F(0), F(0)
    for x in block:
        if amax < F(abs(x)):
            amax, peak = F(abs(x)), x
    d = F(peak / F(-8))
    inverse = F(F(1) / d) if d != 0 else F(0)
    nibbles = [min(15, int(F(F(x * inverse) + F(8.5)))) for x in block]
    out = np.float16(d).tobytes()
    return out + bytes(nibbles[j] | (nibbles[j + 16] << 4) for j in range(16))


def blocks(row, quantize):
    return b"".join(quantize(row[i:i + 32]) for i in range(0, len(row), 32)).hex()


def cases():
    rng = np.random.default_rng(20261203)
    ramp = np.arange(64, dtype=np.float32) - F(31.5)
    ties = np.zeros(64, dtype=np.float32)  # d = 1 exactly: x * id lands on halves
    ties[0], ties[1:9] = F(127), np.array([2.5, -2.5, 0.5, -0.5, 1.5, -1.5, 126.5, -126.5], F)
    ties[32], ties[33:41] = F(-8), np.array([0.5, -0.5, 1.5, -1.5, 7.5, -7.5, 3.5, -3.5], F)
    equal_peaks = np.zeros(64, dtype=np.float32)  # q4_0 keeps the first of |3| and |-3|
    equal_peaks[[3, 7]] = [F(3), F(-3)]
    equal_peaks[[40, 50]] = [F(-3), F(3)]
    outlier = rng.standard_normal(64).astype(F)
    outlier[[5, 37]] = [F(40), F(-55)]
    rows = {
        "zeros": np.zeros(64, dtype=np.float32),
        "negative zeros": -np.zeros(64, dtype=np.float32),
        "constant positive": np.full(64, F(0.75)),
        "constant negative": np.full(64, F(-3.25)),
        "ramp": ramp,
        "halves at scale 1": ties,
        "equal peaks of both signs": equal_peaks,
        "one outlier per block": outlier,
        "large: 1e4": (rng.standard_normal(64) * 1e4).astype(F),
        "fp16 scale overflow": np.concatenate([np.full(32, F(9e6)), np.full(32, F(-6e5))]),
        "tiny: fp16-subnormal scale": (rng.standard_normal(64) * 1e-3).astype(F),
        "tiny: scale below fp16": (rng.standard_normal(64) * 1e-6).astype(F),
        "tiny: float-subnormal values": (rng.standard_normal(64) * 1e-36).astype(F),
    }
    for i in range(6):
        rows[f"normal {i}"] = rng.standard_normal(64).astype(F)
    for i in range(2):
        rows[f"uniform {i}"] = rng.uniform(-2, 2, 64).astype(F)
    for name, row in rows.items():
        yield {"name": name, "values": [float(x) for x in row],
               "q8_0": blocks(row, q8_0), "q4_0": blocks(row, q4_0)}


def main():
    out = pathlib.Path(__file__).with_name("quantized.json")
    data = {"generator": "tests/reference/generate_quantized.py", "cases": list(cases())}
    out.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out} ({len(data['cases'])} cases)")


if __name__ == "__main__":
    main()
