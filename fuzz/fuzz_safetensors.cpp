// Fuzz target (libFuzzer) for attn/safetensors.hpp: each input is a whole .safetensors file.
//
// Build and run: ctest --preset ci -R fuzz_safetensors, or scripts/fuzz.sh (fuzz/README.md).
//
// Oracle:
//   - SafetensorsFile::from_bytes either accepts the input or throws SafetensorsError whose
//     message starts with "safetensors: "; any other exception, a crash or a sanitizer
//     report is a failure;
//   - an accepted file obeys the rules the header promises (docs/safetensors.md): the
//     tensors tile the data section exactly, each holds product(shape) * dtype size bytes;
//   - every tensor of an accepted file is read in each of the four scalars; read_values<double>
//     agrees with a decoding of the raw bytes written here from IEEE 754 (no Eigen), NaN
//     where the bytes hold NaN; read<T, Rank> (ranks 0 to 4) gives the same elements; view()
//     maps the file's own bytes or refuses with SafetensorsError (misaligned data);
//   - the file written back by safetensors_bytes() from the tensors and metadata read is
//     accepted and holds the same names, dtypes, shapes, bytes and metadata.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include <attn/safetensors.hpp>

namespace {

[[noreturn]] void fail(const std::string& what) {
  std::cerr << "fuzz_safetensors: " << what << "\n";
  std::abort();
}

/// Element i of the raw bytes of dtype d, as double, from the IEEE 754 layouts.
double decode(attn::DType d, const std::uint8_t* p, std::size_t i) {
  std::uint64_t bits = 0;
  const std::size_t size = attn::dtype_size(d);
  for (std::size_t k = 0; k < size; ++k)
    bits |= static_cast<std::uint64_t>(p[i * size + k]) << (8 * k);
  int exponent_bits = 11, mantissa_bits = 52;
  switch (d) {
    case attn::DType::f64:
      break;
    case attn::DType::f32:
      exponent_bits = 8, mantissa_bits = 23;
      break;
    case attn::DType::f16:
      exponent_bits = 5, mantissa_bits = 10;
      break;
    case attn::DType::bf16:
      exponent_bits = 8, mantissa_bits = 7;
      break;
  }
  const std::uint64_t mantissa = bits & ((std::uint64_t(1) << mantissa_bits) - 1);
  const auto exponent =
      static_cast<int>((bits >> mantissa_bits) & ((std::uint64_t(1) << exponent_bits) - 1));
  const bool negative = ((bits >> (exponent_bits + mantissa_bits)) & 1U) != 0;
  const int bias = (1 << (exponent_bits - 1)) - 1;
  double magnitude = 0;
  if (exponent == (1 << exponent_bits) - 1) {
    magnitude = mantissa == 0 ? HUGE_VAL : std::nan("");
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<double>(mantissa), 1 - bias - mantissa_bits);
  } else {
    magnitude = std::ldexp(static_cast<double>(mantissa + (std::uint64_t(1) << mantissa_bits)),
                           exponent - bias - mantissa_bits);
  }
  return negative ? -magnitude : magnitude;
}

template <class T, int Rank>
void check_read(const attn::SafetensorsFile& file, const attn::TensorEntry& e,
                const std::vector<T>& values) {
  if constexpr (Rank <= 4) {
    if (static_cast<int>(e.shape.size()) != Rank) {
      check_read<T, Rank + 1>(file, e, values);
      return;
    }
    const attn::Tensor<T, Rank> t = file.read<T, Rank>(e.name);
    if (static_cast<std::size_t>(t.size()) != values.size() ||
        (t.size() > 0 && std::memcmp(t.data(), values.data(), values.size() * sizeof(T)) != 0)) {
      fail("read<T, " + std::to_string(Rank) + "> and read_values differ for " + e.name);
    }
    try {
      const attn::TensorMap<const T, Rank> v = file.view<T, Rank>(e.name);
      if (e.dtype != attn::dtype_of<T>())
        fail("view of another dtype accepted for " + e.name);
      if (static_cast<const void*>(v.data()) != static_cast<const void*>(file.bytes(e.name)))
        fail("view does not map the file's bytes for " + e.name);
    } catch (const attn::SafetensorsError& error) {
      const bool misaligned =
          reinterpret_cast<std::uintptr_t>(file.bytes(e.name)) % alignof(T) != 0;
      if (e.dtype == attn::dtype_of<T>() && !misaligned)
        fail("view refused an aligned tensor of its dtype: " + std::string(error.what()));
    }
  } else {
    (void)file;
    (void)values;
    const bool rank_too_large = e.shape.size() > 4;
    if (!rank_too_large)
      fail("no rank matched for " + e.name);
  }
}

template <class T>
void check_tensor(const attn::SafetensorsFile& file, const attn::TensorEntry& e) {
  const std::vector<T> values = file.read_values<T>(e.name);
  if (static_cast<attn::Index>(values.size()) != e.elements())
    fail("read_values size for " + e.name);
  check_read<T, 0>(file, e, values);
}

void check_file(const attn::SafetensorsFile& file, std::size_t size) {
  // The tensors tile the data section.
  std::vector<const attn::TensorEntry*> sorted;
  for (const attn::TensorEntry& e : file.entries())
    sorted.push_back(&e);
  std::sort(sorted.begin(), sorted.end(), [](const auto* a, const auto* b) {
    return std::make_pair(a->begin, a->end) < std::make_pair(b->begin, b->end);
  });
  std::size_t covered = 0;
  for (const attn::TensorEntry* e : sorted) {
    if (e->begin != covered)
      fail("tensor " + e->name + " does not start where the previous one ends");
    if (e->end - e->begin != static_cast<std::size_t>(e->elements()) * attn::dtype_size(e->dtype))
      fail("tensor " + e->name + " has the wrong byte count");
    covered = e->end;
  }
  if (file.data_offset() + covered != size || file.file_size() != size)
    fail("the tensors do not cover the data section");

  const std::uint8_t* section = nullptr;  // the data section, as the first tensor places it
  std::vector<attn::SafetensorsTensor> tensors;
  for (const attn::TensorEntry& e : file.entries()) {
    const std::uint8_t* raw = file.bytes(e.name);
    if (section == nullptr)
      section = raw - e.begin;
    if (raw != section + e.begin)
      fail("bytes() of " + e.name + " is not at its offset in the data section");
    const std::vector<double> values = file.read_values<double>(e.name);
    for (std::size_t i = 0; i < values.size(); ++i) {
      const double want = decode(e.dtype, raw, i);
      const bool same = std::isnan(want)
                            ? std::isnan(values[i])
                            : values[i] == want && std::signbit(values[i]) == std::signbit(want);
      if (!same)
        fail("element " + std::to_string(i) + " of " + e.name + " decodes differently");
    }
    check_tensor<double>(file, e);
    check_tensor<float>(file, e);
    check_tensor<Eigen::half>(file, e);
    check_tensor<Eigen::bfloat16>(file, e);
    tensors.push_back({e.name, e.dtype, e.shape, raw});
  }

  // Written back and read again: the same file content.
  const attn::SafetensorsFile again =
      attn::SafetensorsFile::from_bytes(attn::safetensors_bytes(tensors, file.metadata()));
  if (again.metadata() != file.metadata() || again.entries().size() != file.entries().size())
    fail("the rewritten file differs");
  for (const attn::TensorEntry& e : file.entries()) {
    const attn::TensorEntry& f = again.entry(e.name);
    if (f.dtype != e.dtype || f.shape != e.shape || f.end - f.begin != e.end - e.begin ||
        (e.end > e.begin &&
         std::memcmp(again.bytes(e.name), file.bytes(e.name), e.end - e.begin) != 0)) {
      fail("the rewritten file differs for " + e.name);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::optional<attn::SafetensorsFile> file;
  try {
    file.emplace(attn::SafetensorsFile::from_bytes(std::vector<std::uint8_t>(data, data + size)));
  } catch (const attn::SafetensorsError& e) {
    if (std::string(e.what()).rfind("safetensors: ", 0) != 0)
      fail(std::string("message without the prefix: ") + e.what());
    return 0;
  }
  // Outside the try: on an accepted file every exception is a failure.
  check_file(*file, size);
  return 0;
}
