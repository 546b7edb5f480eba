// attn/safetensors.hpp: reading and writing .safetensors files (Hugging Face's tensor file
// format). MultiHeadAttention weights from and to them: attn/safetensors_multihead.hpp.
//
// Not included by attn/attn.hpp: this header needs nlohmann/json 3 (Debian:
// nlohmann-json3-dev), which the rest of attn does not. With CMake, link attn::safetensors
// (attn::attn plus nlohmann_json); docs/safetensors.md has the API and every rule below.
//
// File layout (all integers little-endian, tensors row-major and packed):
//   8 bytes   N, u64: the header's length
//   N bytes   header, UTF-8 JSON: {"name": {"dtype": "F32", "shape": [2, 3],
//             "data_offsets": [begin, end]}, ..., "__metadata__": {"key": "value", ...}}
//   the rest  the data section; a tensor's bytes are [begin, end) of it
//
// The header is untrusted input. SafetensorsFile checks all of it before any tensor is
// read and throws SafetensorsError ("safetensors: ...", naming the tensor and the rule):
// N <= 100,000,000 (the reference implementation's bound) and within the file; valid JSON,
// an object, nested at most 8 deep, no key twice in any object; each entry an object with a
// "dtype" (F64, F32, F16 or BF16), a "shape" of integers >= 0 whose product fits in Index
// and "data_offsets" [begin, end] of integers with begin <= end <= the data section's size
// and end - begin = product(shape) * dtype size; the tensors tile the data section exactly,
// as the reference implementation requires: sorted by offset, each starts where the
// previous ends, the first at 0, the last ends at the end of the file (no overlap, no hole,
// no trailing bytes); "__metadata__" (optional, may be null) maps strings to strings. Keys
// of an entry other than the three are ignored, like the reference implementation does.
//
// Memory: a file is memory-mapped read-only where POSIX mmap exists (else read into
// memory); view() is a zero-copy TensorMap into the mapping, read() allocates and converts.
// Conversions between dtypes are correctly rounded (round to nearest even, also F64 to F16
// and BF16); NaN stays NaN, its payload kept only when the dtype does not change.
//
// The parts: safetensors/dtype.hpp (element types, conversions), safetensors/header.hpp (the
// header's checks), safetensors/reader.hpp (SafetensorsFile), safetensors/writer.hpp.
#pragma once

#include "attn/safetensors/dtype.hpp"
#include "attn/safetensors/header.hpp"
#include "attn/safetensors/reader.hpp"
#include "attn/safetensors/writer.hpp"
