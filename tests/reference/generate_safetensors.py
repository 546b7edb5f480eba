#!/usr/bin/env python3
"""Reference .safetensors files for attn/safetensors.hpp, written without the
`safetensors` package (not in Debian): the format is written here from its
published description with struct and json, the values come from NumPy and
PyTorch.

How to run (from the repository root):

    /usr/bin/python3 tests/reference/generate_safetensors.py

Needs NumPy and PyTorch (written against Debian's torch 1.13). Deterministic:
every random draw comes from a generator seeded by name, so a rerun writes
byte-identical files.

Files written
-------------
tests/reference/safetensors/
  reference.safetensors  F64, F32, F16 and BF16 tensors full of edge values
      (signed zeros, infinities, NaN with payloads, signalling NaN, subnormals,
      the largest finite values, halfway cases of every narrowing, values that
      double rounding gets wrong), scalars (shape []), zero-size tensors, a name
      with non-ASCII characters, quotes, a backslash and a control character,
      and __metadata__. Laid out as the reference implementation lays out a
      file: tensors sorted by dtype (F64, F32, BF16, F16), then by name; the
      header padded with spaces to a multiple of 8 bytes.
  reference.json  what the C++ test expects of it: "metadata", and per tensor
      in header order "name", "dtype", "shape", "data_offsets", "bits" (each
      element's bit pattern as an unsigned integer) and "as": {dtype: bits} for
      the element converted to each of the four dtypes. Conversions are
      computed twice: by exact rational arithmetic (fractions.Fraction, round
      to nearest, ties to even), and by NumPy (astype) or, for bfloat16, by
      torch; the two must agree or the script stops, except torch's float64 ->
      bfloat16, which rounds through float32 and is wrong by one unit on the
      values built to catch double rounding (printed; the exact result is
      kept). A NaN converted to another dtype is written as that dtype's quiet
      NaN; only NaN-ness is compared then.
  unaligned.safetensors  a 101-byte header (not padded): its F32 tensor starts
      at byte 109 of the file, so view() must refuse it and read() must work.
      Also carries an ignored extra key in its entry and "__metadata__": null.
  mha.safetensors  two torch.nn.MultiheadAttention modules (batch_first, eval)
      saved as a model would hold them: "encoder.layers.0.self_attn." (E 16,
      H 4, F32, non-zero biases) and "decoder.layers.0.cross_attn." (E 16, H 2,
      kdim 12, vdim 10, add_bias_kv, F16), their inputs "inputs.x" (2, 5, 16),
      "inputs.memory_key" (2, 7, 12), "inputs.memory_value" (2, 7, 10) in F32,
      and torch's outputs in float64 from the stored weights: "expected.encoder"
      = enc(x, x, x), "expected.decoder" = dec(x, memory_key, memory_value).
      __metadata__ holds each module's configuration as JSON text.
tests/reference/safetensors_bad/
  *.safetensors  one malformed file per rule, and manifest.json mapping each
      file name to a fragment of the message SafetensorsError must carry.
fuzz/corpus_safetensors/
  seeds for fuzz/fuzz_safetensors.cpp: small valid files and every bad file.
"""

import json
import math
import os
import struct
from fractions import Fraction

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GOOD_DIR = os.path.join(HERE, "safetensors")
BAD_DIR = os.path.join(HERE, "safetensors_bad")
FUZZ_DIR = os.path.join(ROOT, "fuzz", "corpus_safetensors")

# dtype: (size in bytes, exponent bits, mantissa bits); order of the reference
# implementation's Dtype enum, which its writer sorts by (descending).
FORMATS = {"F64": (8, 11, 52), "F32": (4, 8, 23), "BF16": (2, 8, 7), "F16": (2, 5, 10)}
DTYPE_RANK = {"F16": 0, "BF16": 1, "F32": 2, "F64": 3}
QUIET_NAN = {"F64": 0x7FF8000000000000, "F32": 0x7FC00000, "F16": 0x7E00, "BF16": 0x7FC0}


def seed_of(name):
    return sum((i + 1) * ord(c) for i, c in enumerate(name))


# --- Bit patterns and exact values ---------------------------------------------


def is_nan_bits(bits, dtype):
    _, e, m = FORMATS[dtype]
    exponent = (bits >> m) & ((1 << e) - 1)
    return exponent == (1 << e) - 1 and bits & ((1 << m) - 1) != 0


def is_inf_bits(bits, dtype):
    _, e, m = FORMATS[dtype]
    return (bits & ((1 << (e + m)) - 1)) == ((1 << e) - 1) << m


def sign_of(bits, dtype):
    _, e, m = FORMATS[dtype]
    return bits >> (e + m)


def exact_value(bits, dtype):
    """The Fraction a finite bit pattern stands for (IEEE 754 binary format)."""
    _, e, m = FORMATS[dtype]
    bias = (1 << (e - 1)) - 1
    exponent = (bits >> m) & ((1 << e) - 1)
    mantissa = bits & ((1 << m) - 1)
    if exponent == 0:
        value = Fraction(mantissa, 1 << m) * Fraction(2) ** (1 - bias)
    else:
        value = (1 + Fraction(mantissa, 1 << m)) * Fraction(2) ** (exponent - bias)
    return -value if sign_of(bits, dtype) else value


def round_exact(bits, source, target):
    """bits of `source` converted to `target`: round to nearest, ties to even,
    overflow to infinity, computed on exact rationals."""
    if is_nan_bits(bits, source):
        return QUIET_NAN[target]
    _, e, m = FORMATS[target]
    sign = sign_of(bits, source) << (e + m)
    if is_inf_bits(bits, source):
        return sign | (((1 << e) - 1) << m)
    value = abs(exact_value(bits, source))
    if value == 0:
        return sign
    bias = (1 << (e - 1)) - 1
    emin = 1 - bias
    # exponent of the leading bit: 2^E <= value < 2^(E+1)
    exponent = value.numerator.bit_length() - value.denominator.bit_length()
    if Fraction(2) ** exponent > value:
        exponent -= 1
    exponent = max(exponent, emin)
    scaled = value / Fraction(2) ** (exponent - m)  # in units of the last place
    n = math.floor(scaled)
    rest = scaled - n
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and n % 2 == 1):
        n += 1
    if n == 1 << (m + 1):  # the rounding carried into the next binade
        n >>= 1
        exponent += 1
    if exponent > bias:
        return sign | (((1 << e) - 1) << m)
    if n < 1 << m:  # subnormal (only at emin)
        return sign | n
    return sign | ((exponent + bias) << m) | (n - (1 << m))


def float_bits(x, dtype):
    """bits of a Python float (a double) in `dtype`, via NumPy/torch."""
    if dtype == "F64":
        return struct.unpack("<Q", struct.pack("<d", x))[0]
    if dtype == "F32":
        return int(np.array([x], dtype=np.float64).astype(np.float32).view(np.uint32)[0])
    if dtype == "F16":
        return int(np.array([x], dtype=np.float64).astype(np.float16).view(np.uint16)[0])
    return int(torch.tensor([x], dtype=torch.float64).to(torch.bfloat16).view(torch.int16)[0]) & 0xFFFF


def library_convert(bits, source, target):
    """The same conversion by NumPy (and torch for bfloat16), for the cross-check."""
    if source == target:
        return bits
    if is_nan_bits(bits, source):
        return QUIET_NAN[target]
    size, _, _ = FORMATS[source]
    if source == "F64":
        arr = np.array([bits], dtype=np.uint64).view(np.float64)
    elif source == "F32":
        arr = np.array([bits], dtype=np.uint32).view(np.float32)
    elif source == "F16":
        arr = np.array([bits], dtype=np.uint16).view(np.float16)
    else:  # bfloat16 -> float32 is exact: the bits shifted left
        arr = np.array([bits << 16], dtype=np.uint32).view(np.float32)
    if target == "F64":
        return int(arr.astype(np.float64).view(np.uint64)[0])
    if target == "F32":
        return int(arr.astype(np.float32).view(np.uint32)[0])
    if target == "F16":
        return int(arr.astype(np.float16).view(np.uint16)[0])
    t = torch.from_numpy(arr.copy()).to(torch.bfloat16)
    return int(t.view(torch.int16)[0]) & 0xFFFF


def pack(bits_list, dtype):
    fmt = {"F64": "Q", "F32": "I", "F16": "H", "BF16": "H"}[dtype]
    return struct.pack("<%d%s" % (len(bits_list), fmt), *bits_list)


# --- Writing files ----------------------------------------------------------------


def serialize(tensors, metadata=None, sort=True, pad=True, extra=None):
    """tensors: list of (name, dtype, shape, bits). Returns (file bytes, entries in
    header order). The reference implementation's layout unless told otherwise."""
    items = list(tensors)
    if sort:
        items.sort(key=lambda t: (-DTYPE_RANK[t[1]], t[0]))
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    data = b""
    entries = []
    for name, dtype, shape, bits in items:
        assert len(bits) == int(np.prod(shape, dtype=np.int64)), name
        raw = pack(bits, dtype)
        entry = {"dtype": dtype, "shape": list(shape), "data_offsets": [len(data), len(data) + len(raw)]}
        if extra and name in extra:
            entry.update(extra[name])
        header[name] = entry
        entries.append((name, dtype, list(shape), entry["data_offsets"], bits))
        data += raw
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if pad:
        text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + data, entries


def write(path, content):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(content)


# --- reference.safetensors -------------------------------------------------------

TIE_F16 = 1 + 2.0**-11 + 2.0**-40  # double -> float gives the f16 halfway case 1 + 2^-11
TIE_BF16 = 1 + 2.0**-8 + 2.0**-40  # the same for bfloat16


def f64_values():
    specials = [0.0, -0.0, math.inf, -math.inf, TIE_F16, -TIE_BF16, TIE_BF16, 65504.0, 65520.0,
                65519.99, 5e-324, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 1e300, -1e-40, 1 / 3, math.pi,
                2.0**-126 * (1 - 2.0**-9)]
    bits = [float_bits(x, "F64") for x in specials]
    bits += [0x7FF8000000000123, 0xFFF0000000000001]  # quiet NaN with payload, negative sNaN
    rng = np.random.default_rng(seed_of("f64.values"))
    bits += [float_bits(float(x), "F64") for x in rng.standard_normal(3) * [1.0, 1e-3, 1e4]]
    return bits  # 24


def f32_values():
    specials = [0.0, -0.0, math.inf, -math.inf, 1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-8,
                -(1 + 3 * 2.0**-8), 65504.0, 65520.0, 2.0**-149, 2.0**-126, 3.4028234663852886e38,
                2.0**-24, 2.0**-25, 1 / 3]
    bits = [float_bits(x, "F32") for x in specials]
    bits += [0x7FC00001, 0xFF800001]  # quiet NaN with payload, negative sNaN
    rng = np.random.default_rng(seed_of("f32.values"))
    bits += [float_bits(float(x), "F32") for x in rng.standard_normal(6)]
    return bits  # 24


def f16_values():
    bits = [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x7D01, 0xFE55, 0x0001, 0x03FF, 0x0400,
            0x7BFF, 0xFBFF, 0x3C00, 0x3555, 0x3C01, 0xBC01]
    rng = np.random.default_rng(seed_of("f16.values"))
    bits += [float_bits(float(x), "F16") for x in rng.standard_normal(9)]
    return bits  # 25


def bf16_values():
    bits = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0x0001, 0x007F, 0x0080, 0x7F7F,
            0x3F80, 0x3EAB]
    rng = np.random.default_rng(seed_of("bf16.values"))
    bits += [float_bits(float(x), "BF16") for x in rng.standard_normal(2)]
    return bits  # 14


ODD_NAME = 'names/ünïcödé "q" \\ \x01 end'

REFERENCE_METADATA = {
    "format": "pt",
    "written_by": "tests/reference/generate_safetensors.py",
    "unicode": 'ünïcödé "quoted"\n\ttab',
}


def reference_tensors():
    return [
        ("f64.values", "F64", [4, 6], f64_values()),
        ("f32.values", "F32", [3, 2, 4], f32_values()),
        ("f16.values", "F16", [5, 5], f16_values()),
        ("bf16.values", "BF16", [2, 7], bf16_values()),
        ("scalar.f64", "F64", [], [float_bits(-2.5, "F64")]),
        ("scalar.bf16", "BF16", [], [0x4049]),
        ("empty.f32", "F32", [0, 3], []),
        ("empty.f16", "F16", [2, 0, 5], []),
        ("empty.bf16", "BF16", [0], []),
        (ODD_NAME, "F32", [2], [float_bits(1.5, "F32"), float_bits(-7.0, "F32")]),
    ]


def write_reference():
    content, entries = serialize(reference_tensors(), REFERENCE_METADATA)
    write(os.path.join(GOOD_DIR, "reference.safetensors"), content)
    expected = {"metadata": REFERENCE_METADATA, "tensors": []}
    double_rounding = []
    for name, dtype, shape, offsets, bits in entries:
        conversions = {}
        for target in FORMATS:
            exact = [b if target == dtype else round_exact(b, dtype, target) for b in bits]
            with np.errstate(over="ignore"):  # overflow to infinity is the rule
                library = [library_convert(b, dtype, target) for b in bits]
            for b, x, y in zip(bits, exact, library):
                if x == y:
                    continue
                if dtype == "F64" and target == "BF16":  # torch rounds through float32
                    double_rounding.append((name, hex(b), hex(x), hex(y)))
                    continue
                raise AssertionError("%s: %s -> %s of %#x: exact %#x, library %#x"
                                     % (name, dtype, target, b, x, y))
            conversions[target] = exact
        expected["tensors"].append({"name": name, "dtype": dtype, "shape": shape,
                                    "data_offsets": offsets, "bits": bits, "as": conversions})
    # The halfway cases must be caught: double rounding differs from the exact result.
    assert round_exact(float_bits(TIE_F16, "F64"), "F64", "F16") == 0x3C01
    assert round_exact(float_bits(float(np.float32(TIE_F16)), "F64"), "F64", "F16") == 0x3C00
    assert any(b == hex(float_bits(TIE_BF16, "F64")) for _, b, _, _ in double_rounding)
    for case in double_rounding:
        print("torch float64 -> bfloat16 rounds twice: %s %s: exact %s, torch %s" % case)
    with open(os.path.join(GOOD_DIR, "reference.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")
    return content


def write_unaligned():
    values = [float_bits(x, "F32") for x in (1.0, -2.0, 0.25)]
    text = (b'{"__metadata__":null,"w":{"dtype":"F32","shape":[3],"data_offsets":[0,12],'
            b'"extra":{"ignored":[1,2]}}}')
    assert (8 + len(text)) % 4 != 0  # not padded: the F32 data are misaligned
    content = struct.pack("<Q", len(text)) + text + pack(values, "F32")
    write(os.path.join(GOOD_DIR, "unaligned.safetensors"), content)
    return content


# --- mha.safetensors ----------------------------------------------------------------


def torch_bits(t, dtype):
    t = t.detach().contiguous()
    if dtype == "F32":
        return [int(b) & 0xFFFFFFFF for b in t.to(torch.float32).view(torch.int32).flatten().tolist()]
    if dtype == "F64":
        return [int(b) & 0xFFFFFFFFFFFFFFFF for b in t.to(torch.float64).view(torch.int64).flatten().tolist()]
    if dtype == "F16":
        return [int(b) & 0xFFFF for b in t.to(torch.float16).view(torch.int16).flatten().tolist()]
    raise ValueError(dtype)


def write_mha():
    torch.manual_seed(seed_of("mha.safetensors"))
    torch.set_num_threads(1)
    enc = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    dec = torch.nn.MultiheadAttention(16, 2, kdim=12, vdim=10, add_bias_kv=True,
                                      batch_first=True).eval()
    with torch.no_grad():
        for module in (enc, dec):  # torch starts the biases at zero: make them count
            module.in_proj_bias.uniform_(-0.5, 0.5)
            module.out_proj.bias.uniform_(-0.5, 0.5)
        # What the file stores: enc in float32, dec in float16.
        for p in enc.parameters():
            p.copy_(p.to(torch.float32))
        for p in dec.parameters():
            p.copy_(p.to(torch.float16).to(torch.float32))
        x = torch.randn(2, 5, 16)
        mk = torch.randn(2, 7, 12)
        mv = torch.randn(2, 7, 10)
        enc64 = enc.double()
        dec64 = dec.double()
        out_enc = enc64(x.double(), x.double(), x.double(), need_weights=False)[0]
        out_dec = dec64(x.double(), mk.double(), mv.double(), need_weights=False)[0]
    tensors = []
    for prefix, module, dtype in (("encoder.layers.0.self_attn.", enc64, "F32"),
                                  ("decoder.layers.0.cross_attn.", dec64, "F16")):
        for name, t in module.state_dict().items():
            tensors.append((prefix + name, dtype, list(t.shape), torch_bits(t, dtype)))
    for name, t in (("inputs.x", x), ("inputs.memory_key", mk), ("inputs.memory_value", mv)):
        tensors.append((name, "F32", list(t.shape), torch_bits(t, "F32")))
    tensors.append(("expected.encoder", "F64", list(out_enc.shape), torch_bits(out_enc, "F64")))
    tensors.append(("expected.decoder", "F64", list(out_dec.shape), torch_bits(out_dec, "F64")))
    metadata = {
        "format": "pt",
        "encoder.layers.0.self_attn": json.dumps({"embed_dim": 16, "num_heads": 4}),
        "decoder.layers.0.cross_attn": json.dumps(
            {"embed_dim": 16, "num_heads": 2, "kdim": 12, "vdim": 10, "add_bias_kv": True}),
    }
    content, _ = serialize(tensors, metadata)
    write(os.path.join(GOOD_DIR, "mha.safetensors"), content)


# --- The malformed files ---------------------------------------------------------------


def raw_file(header, data=b"", pad=True):
    """A file with the header text given verbatim (str or bytes) and a data section."""
    if isinstance(header, str):
        header = header.encode("utf-8")
    if pad:
        header += b" " * ((8 - len(header) % 8) % 8)
    return struct.pack("<Q", len(header)) + header + data


def entry(dtype="F32", shape=(2, 2), offsets=(0, 16)):
    return '{"dtype":%s,"shape":%s,"data_offsets":%s}' % (
        json.dumps(dtype), json.dumps(list(shape)), json.dumps(list(offsets)))


DATA16 = pack([float_bits(x, "F32") for x in (1.0, 2.0, 3.0, 4.0)], "F32")


def bad_cases():
    """(file name, bytes, message fragment): one rule broken per file."""
    e = entry()
    w = '{"w":%s}'
    cases = [
        ("short_file", b"\x01\x00\x00", "file is 3 bytes, shorter than the 8-byte header length"),
        ("header_too_large", struct.pack("<Q", 100000001) + b"{}",
         "header length 100000001 exceeds the bound of 100000000 bytes"),
        ("header_past_end", struct.pack("<Q", 64) + b'{"w":{}}  ',
         "header length 64 runs past the end of the file (18 bytes)"),
        ("header_empty", raw_file(b""), "header is not valid JSON"),
        ("header_truncated", raw_file('{"w":{"dtype":"F32",', DATA16), "header is not valid JSON"),
        ("header_not_utf8", raw_file(b'{"w\xff":' + e.encode() + b"}", DATA16),
         "header is not valid JSON"),
        ("header_trailing_text", raw_file(w % e + "x", DATA16), "header is not valid JSON"),
        ("header_nul_padding", raw_file((w % e).encode() + b"\x00\x00\x00", DATA16, pad=False),
         "header is not valid JSON: a NUL byte at offset %d of the header" % len(w % e)),
        ("header_nul_inside", raw_file(b"{}\x00" + (w % e).encode(), DATA16),
         "header is not valid JSON: a NUL byte at offset 2 of the header"),
        ("header_not_object", raw_file("[1,2]"), "header is a list, not a JSON object"),
        ("header_deep_nesting", raw_file("[" * 9 + "]" * 9), "header nests deeper than 8 levels"),
        ("entry_not_object", raw_file('{"w":[0,16]}', DATA16),
         'tensor "w": entry is a list, not an object'),
        ("entry_deep_nesting",
         raw_file('{"w":{"extra":[[[[[[[1]]]]]]],"dtype":"F32","shape":[2,2],'
                  '"data_offsets":[0,16]}}', DATA16),
         'tensor "w": header nests deeper than 8 levels'),
        ("dtype_missing", raw_file('{"w":{"shape":[2,2],"data_offsets":[0,16]}}', DATA16),
         'tensor "w": no "dtype"'),
        ("dtype_not_string", raw_file(w % entry(dtype=7), DATA16),
         'tensor "w": "dtype" is a number, not a string'),
        ("dtype_unknown", raw_file(w % entry(dtype="F17"), DATA16),
         'tensor "w": unknown dtype "F17"'),
        ("dtype_lowercase", raw_file(w % entry(dtype="f32"), DATA16),
         'tensor "w": unknown dtype "f32"'),
        ("dtype_unsupported", raw_file(w % entry(dtype="I64", shape=[2]), DATA16),
         'tensor "w": dtype "I64" is not supported'),
        ("name_escaped", raw_file('{"a\\"b\\n":%s}' % entry(dtype="F17"), DATA16),
         'tensor "a\\"b\\n": unknown dtype "F17"'),
        ("shape_missing", raw_file('{"w":{"dtype":"F32","data_offsets":[0,16]}}', DATA16),
         'tensor "w": no "shape"'),
        ("shape_not_list", raw_file('{"w":{"dtype":"F32","shape":4,"data_offsets":[0,16]}}', DATA16),
         'tensor "w": "shape" is a number, not a list'),
        ("shape_negative", raw_file(w % entry(shape=[2, -2]), DATA16),
         'tensor "w": shape[1] is -2, not a non-negative integer'),
        ("shape_float", raw_file(w % entry(shape=[2.0, 2]), DATA16),
         'tensor "w": shape[0] is 2.0, not a non-negative integer'),
        ("shape_string", raw_file(w % entry(shape=["2", 2]), DATA16),
         'tensor "w": shape[0] is "2", not a non-negative integer'),
        ("shape_null", raw_file(w % entry(shape=[2, None]), DATA16),
         'tensor "w": shape[1] is null, not a non-negative integer'),
        ("shape_dim_too_large", raw_file(w % entry(shape=[2**63, 0], offsets=[0, 0]), DATA16),
         'tensor "w": shape[0] is 9223372036854775808, more than 2^63 - 1'),
        ("shape_overflow", raw_file(w % entry(shape=[2**32, 2**32, 0], offsets=[0, 0]), DATA16),
         'tensor "w": shape [4294967296, 4294967296, 0] overflows'),
        ("shape_bytes_overflow", raw_file(w % entry(dtype="F64", shape=[2**61, 3]), DATA16),
         'tensor "w": shape [2305843009213693952, 3] of F64 needs more than 2^64 - 1 bytes'),
        ("offsets_missing", raw_file('{"w":{"dtype":"F32","shape":[2,2]}}', DATA16),
         'tensor "w": no "data_offsets"'),
        ("offsets_not_list",
         raw_file('{"w":{"dtype":"F32","shape":[2,2],"data_offsets":"0-16"}}', DATA16),
         'tensor "w": "data_offsets" is a string, not a list'),
        ("offsets_three", raw_file(w % entry(offsets=[0, 8, 16]), DATA16),
         'tensor "w": "data_offsets" has 3 entries, not 2'),
        ("offsets_negative", raw_file(w % entry(offsets=[-1, 15]), DATA16),
         'tensor "w": data_offsets[0] is -1, not a non-negative integer'),
        ("offsets_float", raw_file(w % entry(offsets=[0, 16.0]), DATA16),
         'tensor "w": data_offsets[1] is 16.0, not a non-negative integer'),
        ("offsets_beyond_u64", raw_file(w % entry(offsets=[0, 2**64]), DATA16),
         'tensor "w": data_offsets[1] is 1.8446744073709552e+19, not a non-negative integer'),
        ("offsets_reversed", raw_file(w % entry(offsets=[16, 0]), DATA16),
         'tensor "w": data_offsets [16, 0]: begin is after end'),
        ("offsets_past_end", raw_file(w % entry(offsets=[0, 32]), DATA16),
         'tensor "w": data_offsets [0, 32]: end is beyond the data section (16 bytes)'),
        ("offsets_u64_max", raw_file(w % entry(offsets=[16, 2**64 - 1]), DATA16),
         'tensor "w": data_offsets [16, 18446744073709551615]: end is beyond the data section'),
        ("byte_count_mismatch", raw_file(w % entry(shape=[2, 3]), DATA16),
         'tensor "w": shape [2, 3] of F32 needs 24 bytes but data_offsets [0, 16] hold 16'),
        ("byte_count_f16", raw_file(w % entry(dtype="F16", shape=[2, 2]), DATA16),
         'tensor "w": shape [2, 2] of F16 needs 8 bytes but data_offsets [0, 16] hold 16'),
        ("overlap", raw_file('{"a":%s,"b":%s}' % (entry(offsets=[0, 16]), entry(offsets=[8, 24])),
                             DATA16 + DATA16[:8]),
         'tensor "b": data_offsets [8, 24] overlap tensor "a" [0, 16]'),
        ("overlap_same_bytes",
         raw_file('{"b":%s,"a":%s}' % (entry(offsets=[0, 16]), entry(offsets=[0, 16])), DATA16),
         'tensor "a": data_offsets [0, 16] overlap tensor "b" [0, 16]'),
        ("overlap_empty_inside",
         raw_file('{"a":%s,"e":%s}' % (entry(offsets=[0, 16]), entry(shape=[0], offsets=[8, 8])),
                  DATA16),
         'tensor "e": data_offsets [8, 8] overlap tensor "a" [0, 16]'),
        ("hole_between",
         raw_file('{"a":%s,"b":%s}' % (entry(shape=[2], offsets=[0, 8]),
                                       entry(shape=[2], offsets=[12, 20])), DATA16 + DATA16[:4]),
         'bytes [8, 12) of the data section belong to no tensor (a hole before tensor "b")'),
        ("hole_at_start", raw_file(w % entry(shape=[3], offsets=[4, 16]), DATA16),
         'bytes [0, 4) of the data section belong to no tensor (a hole before tensor "w")'),
        ("trailing_bytes", raw_file(w % e, DATA16 + b"\x00" * 4),
         'bytes [16, 20) of the data section belong to no tensor (after tensor "w", the last)'),
        ("data_without_tensors", raw_file("{}", DATA16[:8]),
         "bytes [0, 8) of the data section belong to no tensor (the header lists none)"),
        ("duplicate_tensor", raw_file('{"w":%s,"w":%s}' % (e, e), DATA16),
         'tensor "w" appears twice in the header'),
        ("duplicate_entry_key",
         raw_file('{"w":{"dtype":"F32","dtype":"F16","shape":[2,2],"data_offsets":[0,16]}}',
                  DATA16),
         'tensor "w": key "dtype" appears twice'),
        ("duplicate_metadata_key",
         raw_file('{"__metadata__":{"k":"a","k":"b"},"w":%s}' % e, DATA16),
         '__metadata__: key "k" appears twice'),
        ("duplicate_metadata",
         raw_file('{"__metadata__":{},"w":%s,"__metadata__":{}}' % e, DATA16),
         '"__metadata__" appears twice in the header'),
        ("metadata_not_object", raw_file('{"__metadata__":"pt","w":%s}' % e, DATA16),
         '"__metadata__" is a string, not an object'),
        ("metadata_value_number", raw_file('{"__metadata__":{"format":1},"w":%s}' % e, DATA16),
         '__metadata__: "format" is a number, not a string'),
        ("metadata_value_object",
         raw_file('{"__metadata__":{"format":{"a":"b"}},"w":%s}' % e, DATA16),
         '__metadata__: "format" is an object, not a string'),
        ("metadata_value_null", raw_file('{"__metadata__":{"format":null},"w":%s}' % e, DATA16),
         '__metadata__: "format" is null, not a string'),
    ]
    return cases


def write_bad():
    os.makedirs(BAD_DIR, exist_ok=True)
    for name in os.listdir(BAD_DIR):
        os.remove(os.path.join(BAD_DIR, name))
    manifest = {}
    for name, content, fragment in bad_cases():
        assert name not in manifest, name
        manifest[name + ".safetensors"] = fragment
        write(os.path.join(BAD_DIR, name + ".safetensors"), content)
    with open(os.path.join(BAD_DIR, "manifest.json"), "w") as f:
        json.dump({"files": manifest}, f, indent=1, ensure_ascii=False, sort_keys=True)
        f.write("\n")
    return bad_cases()


# --- Fuzz seeds -----------------------------------------------------------------------


def write_fuzz_seeds(reference, unaligned, bad):
    os.makedirs(FUZZ_DIR, exist_ok=True)
    for name in os.listdir(FUZZ_DIR):
        os.remove(os.path.join(FUZZ_DIR, name))
    one = ("w", "F32", [2, 2], [float_bits(x, "F32") for x in (1.0, 2.0, 3.0, 4.0)])
    seeds = {
        "valid-reference": reference,
        "valid-unaligned": unaligned,
        "valid-one-f32": serialize([one])[0],
        "valid-empty": serialize([])[0],
        "valid-metadata-only": serialize([], {"format": "pt"})[0],
        "valid-every-dtype": serialize([
            ("d", "F64", [2], [float_bits(x, "F64") for x in (1.0, -0.5)]),
            ("f", "F32", [1, 2], [float_bits(x, "F32") for x in (3.0, 0.0)]),
            ("h", "F16", [3], [0x3C00, 0x7E00, 0x8001]),
            ("b", "BF16", [], [0x3F80]),
            ("z", "F16", [0, 4], []),
        ], {"k": "v"})[0],
        "valid-unsorted": serialize([one, ("a", "F16", [2], [0x3C00, 0x4000])], sort=False,
                                    pad=False)[0],
    }
    for name, content, _ in bad:
        seeds["bad-" + name] = content
    for name, content in seeds.items():
        write(os.path.join(FUZZ_DIR, name), content)


def main():
    reference = write_reference()
    unaligned = write_unaligned()
    write_mha()
    bad = write_bad()
    write_fuzz_seeds(reference, unaligned, bad)
    print("wrote %s, %s (%d files) and %s" % (GOOD_DIR, BAD_DIR, len(bad), FUZZ_DIR))


if __name__ == "__main__":
    main()
