// Tests for attn/safetensors.hpp: files written by tests/reference/generate_safetensors.py
// (struct, json, NumPy and torch; no code shared with the header) read back bit for bit,
// with every conversion against exact rational rounding; round trips of every dtype and
// every 16-bit pattern; zero-size tensors, scalars and metadata; the writer's layout; every
// malformed file of tests/reference/safetensors_bad/ rejected with its message; every
// other error path by its message; MultiHeadAttention loaded from torch's weights and
// saved and loaded back.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <attn/safetensors.hpp>
#include <attn/safetensors_multihead.hpp>

using attn::DType;
using attn::Index;
using json = nlohmann::json;

namespace {

const std::string reference_dir = std::string(ATTN_FIXTURE_DIR) + "/safetensors";
const std::string bad_dir = std::string(ATTN_FIXTURE_DIR) + "/safetensors_bad";

json load_json(const std::string& path) {
  std::ifstream in(path);
  REQUIRE(in.good());
  return json::parse(in);
}

std::vector<std::uint8_t> file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// A path under the temporary directory, removed when the test case ends.
/// A file in the temporary directory, removed at the end of the scope. Its name is unique to
/// the process and the object: ctest runs the test cases (each type of a template case too)
/// as processes in parallel, and one that truncates a file another has mapped makes the
/// other's reads fault (SIGBUS).
struct TempFile {
  std::filesystem::path path;
  explicit TempFile(const std::string& name)
      : path(std::filesystem::temp_directory_path() /
             ("attn_test_safetensors_" + std::to_string(std::random_device{}()) + "_" +
              std::to_string(next_id()) + "_" + name)) {}
  ~TempFile() {
    std::error_code ignored;
    std::filesystem::remove(path, ignored);
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  std::string str() const { return path.string(); }

 private:
  static unsigned next_id() {
    static std::atomic<unsigned> id{0};
    return id++;
  }
};

/// The same n bytes (NaN payloads and signed zeros included, unlike ==).
bool same_bytes(const void* a, const void* b, std::size_t n) {
  return n == 0 || std::memcmp(a, b, n) == 0;
}

template <class T>
std::uint64_t bits_of(const T& x) {
  if constexpr (sizeof(T) == 8) {
    std::uint64_t b = 0;
    std::memcpy(&b, &x, 8);
    return b;
  } else if constexpr (sizeof(T) == 4) {
    std::uint32_t b = 0;
    std::memcpy(&b, &x, 4);
    return b;
  } else {
    std::uint16_t b = 0;
    std::memcpy(&b, &x, 2);
    return b;
  }
}

template <class T>
T from_bits(std::uint64_t b) {
  T x;
  if constexpr (sizeof(T) == 8) {
    std::memcpy(&x, &b, 8);
  } else if constexpr (sizeof(T) == 4) {
    const auto b32 = static_cast<std::uint32_t>(b);
    std::memcpy(&x, &b32, 4);
  } else {
    const auto b16 = static_cast<std::uint16_t>(b);
    std::memcpy(static_cast<void*>(&x), &b16, 2);
  }
  return x;
}

/// Whether bit pattern b of dtype d is a NaN (written from IEEE 754, not from Eigen).
bool is_nan_bits(std::uint64_t b, DType d) {
  switch (d) {
    case DType::f64:
      return (b & 0x7FF0000000000000ULL) == 0x7FF0000000000000ULL && (b & 0xFFFFFFFFFFFFFULL) != 0;
    case DType::f32:
      return (b & 0x7F800000U) == 0x7F800000U && (b & 0x7FFFFFU) != 0;
    case DType::f16:
      return (b & 0x7C00U) == 0x7C00U && (b & 0x3FFU) != 0;
    case DType::bf16:
      return (b & 0x7F80U) == 0x7F80U && (b & 0x7FU) != 0;
  }
  return false;
}

DType dtype_from_name(const std::string& name) {
  for (const DType d : {DType::f64, DType::f32, DType::f16, DType::bf16}) {
    if (name == attn::dtype_name(d))
      return d;
  }
  FAIL("unknown dtype " << name);
  return DType::f32;
}

/// got (as T) against the expected bit patterns: equal bits, or both NaN when the value was
/// converted from another dtype (a conversion keeps NaN, not its payload).
template <class T>
void check_bits(const std::vector<T>& got, const json& expected, bool same_dtype,
                const std::string& what) {
  REQUIRE(got.size() == expected.size());
  const DType d = attn::dtype_of<T>();
  for (std::size_t i = 0; i < got.size(); ++i) {
    const std::uint64_t want = expected[i].get<std::uint64_t>();
    const std::uint64_t have = bits_of(got[i]);
    INFO(what << " [" << i << "] as " << attn::dtype_name(d) << ": got 0x" << std::hex << have
              << ", expected 0x" << want);
    if (!same_dtype && is_nan_bits(want, d))
      CHECK(is_nan_bits(have, d));
    else
      CHECK(have == want);
  }
}

template <class T>
void check_conversions(const attn::SafetensorsFile& file, const json& t) {
  const std::string name = t.at("name").get<std::string>();
  const DType source = dtype_from_name(t.at("dtype").get<std::string>());
  const DType target = attn::dtype_of<T>();
  const json& expected = t.at("as").at(attn::dtype_name(target));
  check_bits(file.read_values<T>(name), expected, source == target, name);
  // read<T, Rank> gives the same numbers in the right shape.
  const std::vector<Index> shape = t.at("shape").get<std::vector<Index>>();
  std::vector<T> flat;
  switch (shape.size()) {
    case 0: {
      const attn::Tensor<T, 0> x = file.read<T, 0>(name);
      flat.assign(x.data(), x.data() + x.size());
      break;
    }
    case 1: {
      const attn::Tensor<T, 1> x = file.read<T, 1>(name);
      CHECK(x.dimension(0) == shape[0]);
      flat.assign(x.data(), x.data() + x.size());
      break;
    }
    case 2: {
      const attn::Tensor<T, 2> x = file.read<T, 2>(name);
      CHECK(x.dimension(0) == shape[0]);
      CHECK(x.dimension(1) == shape[1]);
      flat.assign(x.data(), x.data() + x.size());
      const attn::Matrix<T> m = file.read_matrix<T>(name);
      CHECK(m.rows() == shape[0]);
      CHECK(m.cols() == shape[1]);
      CHECK(same_bytes(m.data(), x.data(), flat.size() * sizeof(T)));
      break;
    }
    case 3: {
      const attn::Tensor<T, 3> x = file.read<T, 3>(name);
      CHECK(x.dimension(0) == shape[0]);
      CHECK(x.dimension(1) == shape[1]);
      CHECK(x.dimension(2) == shape[2]);
      flat.assign(x.data(), x.data() + x.size());
      break;
    }
    default:
      FAIL("no case for rank " << shape.size());
  }
  check_bits(flat, expected, source == target, name);
}

/// Every tensor of the file viewed in place (those whose dtype is T), bit for bit.
template <class T>
void check_views(const attn::SafetensorsFile& file, const json& t) {
  const std::string name = t.at("name").get<std::string>();
  if (dtype_from_name(t.at("dtype").get<std::string>()) != attn::dtype_of<T>())
    return;
  const std::vector<Index> shape = t.at("shape").get<std::vector<Index>>();
  const T* data = nullptr;
  Index size = 0;
  if (shape.size() == 2) {
    const attn::TensorMap<const T, 2> v = file.view<T, 2>(name);
    data = v.data();
    size = v.size();
  } else if (shape.size() == 1) {
    const attn::TensorMap<const T, 1> v = file.view<T, 1>(name);
    data = v.data();
    size = v.size();
  } else if (shape.empty()) {
    const attn::TensorMap<const T, 0> v = file.view<T, 0>(name);
    data = v.data();
    size = v.size();
  } else {
    const attn::TensorMap<const T, 3> v = file.view<T, 3>(name);
    data = v.data();
    size = v.size();
  }
  // Zero copy: the map points into the file's bytes.
  CHECK(static_cast<const void*>(data) == static_cast<const void*>(file.bytes(name)));
  check_bits(std::vector<T>(data, data + size), t.at("bits"), true, name);
}

attn::MultiHeadAttentionConfig config_from(const std::string& text) {
  const json j = json::parse(text);
  attn::MultiHeadAttentionConfig c;
  c.embed_dim = j.at("embed_dim").get<Index>();
  c.num_heads = j.at("num_heads").get<Index>();
  c.kdim = j.value("kdim", Index(0));
  c.vdim = j.value("vdim", Index(0));
  c.add_bias_kv = j.value("add_bias_kv", false);
  return c;
}

template <class T>
void check_state_dicts_equal(const attn::StateDict<T>& a, const attn::StateDict<T>& b) {
  REQUIRE(a.size() == b.size());
  for (const auto& [name, t] : a) {
    INFO(name);
    REQUIRE(b.count(name) == 1);
    CHECK(b.at(name).shape == t.shape);
    REQUIRE(b.at(name).data.size() == t.data.size());
    CHECK(same_bytes(b.at(name).data.data(), t.data.data(), t.data.size() * sizeof(T)));
  }
}

template <class T>
attn::Tensor<T, 3> random_input(Index b, Index l, Index e, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  attn::Tensor<T, 3> x(b, l, e);
  for (Index i = 0; i < x.size(); ++i)
    x.data()[i] = static_cast<T>(normal(rng));
  return x;
}

}  // namespace

TEST_CASE("safetensors: the reference file written by Python reads back bit for bit",
          "[safetensors]") {
  const json expected = load_json(reference_dir + "/reference.json");
  const std::string path = reference_dir + "/reference.safetensors";
  const attn::SafetensorsFile mapped(path);
  const attn::SafetensorsFile copied = attn::SafetensorsFile::from_bytes(file_bytes(path));
  CHECK(mapped.memory_mapped() == (ATTN_SAFETENSORS_MMAP == 1));
  CHECK_FALSE(copied.memory_mapped());
  CHECK(mapped.path() == path);
  CHECK(copied.path().empty());
  for (const attn::SafetensorsFile* file : {&mapped, &copied}) {
    CHECK(file->data_offset() % 8 == 0);
    CHECK(file->file_size() == std::filesystem::file_size(path));
    const json& tensors = expected.at("tensors");
    REQUIRE(file->entries().size() == tensors.size());
    REQUIRE(tensors.size() == 10);
    std::map<std::string, std::string> metadata;
    for (const auto& [k, v] : expected.at("metadata").items())
      metadata[k] = v.get<std::string>();
    CHECK(file->metadata() == metadata);
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const json& t = tensors[i];
      const attn::TensorEntry& e = file->entries()[i];  // header order
      INFO("tensor " << t.at("name"));
      CHECK(e.name == t.at("name").get<std::string>());
      CHECK(&file->entry(e.name) == &e);
      CHECK(file->contains(e.name));
      CHECK(attn::dtype_name(e.dtype) == t.at("dtype").get<std::string>());
      CHECK(e.shape == t.at("shape").get<std::vector<Index>>());
      CHECK(e.begin == t.at("data_offsets")[0].get<std::size_t>());
      CHECK(e.end == t.at("data_offsets")[1].get<std::size_t>());
      CHECK(e.elements() == static_cast<Index>(t.at("bits").size()));
      check_conversions<double>(*file, t);
      check_conversions<float>(*file, t);
      check_conversions<Eigen::half>(*file, t);
      check_conversions<Eigen::bfloat16>(*file, t);
      check_views<double>(*file, t);
      check_views<float>(*file, t);
      check_views<Eigen::half>(*file, t);
      check_views<Eigen::bfloat16>(*file, t);
    }
    CHECK_FALSE(file->contains("__metadata__"));
    CHECK_FALSE(file->contains("f32"));
  }
}

TEST_CASE("safetensors: F64 to F16 and BF16 is rounded once, to nearest even", "[safetensors]") {
  // Each result must be a nearest 16-bit value (ties to the even pattern), checked with
  // long double distances to the neighbouring patterns: no double rounding through float.
  const auto check = [](auto tag, double x) {
    using T = decltype(tag);
    const T got = attn::detail::from_double<T>(x);
    const auto b = static_cast<std::uint16_t>(bits_of(got));
    const auto value = [](std::uint16_t p) { return static_cast<long double>(from_bits<T>(p)); };
    const long double d = std::fabs(static_cast<long double>(x) - value(b));
    INFO("x = " << x << " -> 0x" << std::hex << b);
    REQUIRE(std::isfinite(static_cast<double>(value(b))));
    for (const int step : {-1, 1}) {
      const auto n = static_cast<std::uint16_t>(b + step);
      const long double v = value(n);
      if (!std::isfinite(static_cast<double>(v)) || (n & 0x7FFFU) == 0)
        continue;  // past the largest finite value, or across zero
      const long double dn = std::fabs(static_cast<long double>(x) - v);
      CHECK(d <= dn);
      if (d == dn)
        CHECK((b & 1U) == 0);
    }
  };
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> mantissa(1.0, 2.0);
  std::uniform_int_distribution<int> exponent(-26, 15);
  for (int i = 0; i < 20000; ++i) {
    const double x = std::ldexp(mantissa(rng), exponent(rng)) * ((i & 1) != 0 ? -1 : 1);
    if (std::fabs(x) < 65504.0)
      check(Eigen::half(), x);
    check(Eigen::bfloat16(), x);
  }
  // The values float rounds onto a 16-bit halfway point.
  CHECK(bits_of(attn::detail::from_double<Eigen::half>(1.0 + std::ldexp(1.0, -11) +
                                                       std::ldexp(1.0, -40))) == 0x3C01);
  CHECK(bits_of(attn::detail::from_double<Eigen::bfloat16>(1.0 + std::ldexp(1.0, -8) +
                                                           std::ldexp(1.0, -40))) == 0x3F81);
  CHECK(bits_of(attn::detail::from_double<Eigen::half>(1.0 + std::ldexp(1.0, -11))) == 0x3C00);
  CHECK(bits_of(attn::detail::from_double<Eigen::half>(65520.0)) == 0x7C00);
  CHECK(bits_of(attn::detail::from_double<Eigen::half>(65519.99)) == 0x7BFF);
  CHECK(bits_of(attn::detail::from_double<Eigen::bfloat16>(1e300)) == 0x7F80);
  CHECK(bits_of(attn::detail::from_double<Eigen::bfloat16>(-1e-300)) == 0x8000);
  CHECK(bits_of(attn::detail::from_double<Eigen::half>(std::ldexp(3.0, -26))) == 0x0001);
}

TEST_CASE("safetensors: every dtype round-trips bit for bit, every 16-bit pattern included",
          "[safetensors]") {
  // All 65536 patterns of F16 and BF16 (NaNs with every payload, signalling ones, both
  // zeros, subnormals); F32 and F64 from random bits and special patterns.
  attn::Tensor<Eigen::half, 2> h(256, 256);
  attn::Tensor<Eigen::bfloat16, 1> b(65536);
  for (std::uint32_t i = 0; i < 65536; ++i) {
    h.data()[i] = from_bits<Eigen::half>(i);
    b.data()[i] = from_bits<Eigen::bfloat16>(i);
  }
  std::mt19937_64 rng(11);
  attn::Tensor<float, 3> f(3, 5, 7);
  for (Index i = 0; i < f.size(); ++i)
    f.data()[i] = from_bits<float>(rng());
  f(0, 0, 0) = from_bits<float>(0x7FC00123);  // quiet NaN with payload
  f(0, 0, 1) = from_bits<float>(0xFF800001);  // negative signalling NaN
  f(0, 0, 2) = -0.0F;
  attn::Matrix<double> d(4, 9);
  for (Index i = 0; i < d.size(); ++i)
    d.data()[i] = from_bits<double>(rng());
  d(0, 0) = from_bits<double>(0x7FF0000000000001ULL);
  d(0, 1) = -std::numeric_limits<double>::infinity();
  attn::Vector<float> bias(5);
  bias << 1.0F, -2.0F, 0.5F, 1e-40F, std::numeric_limits<float>::max();

  const std::vector<attn::SafetensorsTensor> tensors = {
      attn::safetensors_tensor("h", h), attn::safetensors_tensor("b", b),
      attn::safetensors_tensor("f", f), attn::safetensors_tensor("d", d),
      attn::safetensors_tensor("bias", bias)};
  TempFile tmp("roundtrip.safetensors");
  attn::save_safetensors(tmp.str(), tensors);
  const std::vector<std::uint8_t> bytes = attn::safetensors_bytes(tensors);
  CHECK(file_bytes(tmp.str()) == bytes);  // the file and the in-memory writer agree

  const attn::SafetensorsFile file(tmp.str());
  // Wider dtypes first, each group in the order given: every tensor aligned for its dtype.
  std::vector<std::string> order;
  for (const attn::TensorEntry& e : file.entries())
    order.push_back(e.name);
  CHECK(order == std::vector<std::string>{"d", "f", "bias", "h", "b"});
  CHECK(file.data_offset() % 8 == 0);
  CHECK(file.entry("d").shape == std::vector<Index>{4, 9});
  CHECK(file.entry("bias").shape == std::vector<Index>{5});
  CHECK(file.entry("h").dtype == DType::f16);
  CHECK(file.entry("b").dtype == DType::bf16);

  const attn::TensorMap<const Eigen::half, 2> hv = file.view<Eigen::half, 2>("h");
  CHECK(same_bytes(hv.data(), h.data(), std::size_t{65536} * 2));
  const attn::Tensor<Eigen::bfloat16, 1> br = file.read<Eigen::bfloat16, 1>("b");
  CHECK(same_bytes(br.data(), b.data(), std::size_t{65536} * 2));
  CHECK(same_bytes(file.view<Eigen::bfloat16, 1>("b").data(), b.data(), std::size_t{65536} * 2));
  const attn::Tensor<float, 3> fr = file.read<float, 3>("f");
  CHECK(same_bytes(fr.data(), f.data(), static_cast<std::size_t>(f.size()) * 4));
  const attn::Matrix<double> dr = file.read_matrix<double>("d");
  CHECK(same_bytes(dr.data(), d.data(), static_cast<std::size_t>(d.size()) * 8));
  CHECK(same_bytes(file.read_vector<float>("bias").data(), bias.data(), sizeof(float) * 5));

  // Widening is exact: every F16 and BF16 pattern read as float and double.
  const std::vector<float> hf = file.read_values<float>("h");
  const std::vector<double> bd = file.read_values<double>("b");
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const auto want_b = from_bits<float>(i << 16U);  // bfloat16 is float's top half
    INFO("pattern 0x" << std::hex << i);
    if (std::isnan(want_b)) {
      CHECK(std::isnan(bd[i]));
    } else {
      CHECK(bits_of(bd[i]) == bits_of(static_cast<double>(want_b)));
    }
    // half: sign, 5 exponent bits (bias 15), 10 mantissa bits.
    const std::uint32_t exponent = (i >> 10U) & 0x1FU, mantissa = i & 0x3FFU;
    const double sign = (i & 0x8000U) != 0 ? -1.0 : 1.0;
    if (exponent == 31) {
      if (mantissa == 0) {
        CHECK(hf[i] == static_cast<float>(sign * std::numeric_limits<double>::infinity()));
      } else {
        CHECK(std::isnan(hf[i]));
      }
    } else {
      const double magnitude = exponent == 0
                                   ? std::ldexp(static_cast<double>(mantissa), -24)
                                   : std::ldexp(1.0 + static_cast<double>(mantissa) / 1024.0,
                                                static_cast<int>(exponent) - 15);
      CHECK(bits_of(hf[i]) == bits_of(static_cast<float>(sign * magnitude)));
    }
  }
}

TEST_CASE("safetensors: zero-size tensors, scalars and metadata round-trip", "[safetensors]") {
  attn::Tensor<float, 0> scalar;
  scalar() = -3.25F;
  attn::Tensor<Eigen::bfloat16, 0> scalar16;
  scalar16() = Eigen::bfloat16(0.5F);
  attn::Tensor<Eigen::half, 2> empty(0, 3);
  attn::Tensor<double, 3> empty3(2, 0, 5);
  attn::Matrix<float> empty_matrix(0, 0);
  attn::Vector<double> empty_vector(0);
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"}, {"", "empty key"}, {"quote\"s", "ünïcödé\n\t\\"}, {"empty", ""}};
  const std::vector<std::uint8_t> bytes = attn::safetensors_bytes(
      {attn::safetensors_tensor("scalar", scalar), attn::safetensors_tensor("empty", empty),
       attn::safetensors_tensor("empty3", empty3), attn::safetensors_tensor("scalar16", scalar16),
       attn::safetensors_tensor("m", empty_matrix), attn::safetensors_tensor("v", empty_vector)},
      metadata);
  const attn::SafetensorsFile file = attn::SafetensorsFile::from_bytes(bytes);
  CHECK(file.metadata() == metadata);
  CHECK(file.entries().size() == 6);
  CHECK(file.entry("scalar").shape.empty());
  CHECK(file.entry("scalar").elements() == 1);
  CHECK(file.read<float, 0>("scalar")() == -3.25F);
  CHECK(file.view<float, 0>("scalar")() == -3.25F);
  CHECK(file.read<double, 0>("scalar16")() == 0.5);
  CHECK(file.entry("empty").shape == std::vector<Index>{0, 3});
  CHECK(file.entry("empty").begin == file.entry("empty").end);
  const attn::Tensor<float, 2> e = file.read<float, 2>("empty");
  CHECK(e.dimension(0) == 0);
  CHECK(e.dimension(1) == 3);
  CHECK(file.view<Eigen::half, 2>("empty").size() == 0);
  const attn::Tensor<Eigen::half, 3> e3 = file.read<Eigen::half, 3>("empty3");
  CHECK(e3.dimension(0) == 2);
  CHECK(e3.dimension(1) == 0);
  CHECK(e3.dimension(2) == 5);
  CHECK(file.entry("m").shape == std::vector<Index>{0, 0});
  CHECK(file.entry("v").shape == std::vector<Index>{0});
  CHECK(file.read_vector<float>("v").size() == 0);

  // Nothing at all: an empty header, no data section.
  const std::vector<std::uint8_t> none = attn::safetensors_bytes({});
  const std::string expected_none = std::string("\x08\0\0\0\0\0\0\0", 8) + "{}      ";
  CHECK(std::string(none.begin(), none.end()) == expected_none);
  const attn::SafetensorsFile empty_file = attn::SafetensorsFile::from_bytes(none);
  CHECK(empty_file.entries().empty());
  CHECK(empty_file.metadata().empty());
}

TEST_CASE("safetensors: the writer's exact bytes", "[safetensors]") {
  // 8-byte little-endian length, the header with the reference implementation's key order
  // (dtype, shape, data_offsets), spaces up to a multiple of 8, then the data.
  attn::Tensor<float, 3> t(1, 2, 3);
  for (Index i = 0; i < 6; ++i)
    t.data()[i] = static_cast<float>(i);
  const std::vector<std::uint8_t> bytes =
      attn::safetensors_bytes({attn::safetensors_tensor("attn.0", t)}, {{"format", "pt"}});
  const std::string header =
      "{\"__metadata__\":{\"format\":\"pt\"},\"attn.0\":{\"dtype\":\"F32\",\"shape\":[1,2,3],"
      "\"data_offsets\":[0,24]}}";
  const std::size_t padded = (header.size() + 7) / 8 * 8;
  REQUIRE(bytes.size() == 8 + padded + 24);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i)
    n = (n << 8U) | bytes[static_cast<std::size_t>(i)];
  CHECK(n == padded);
  CHECK(std::string(bytes.begin() + 8, bytes.begin() + 8 + static_cast<Index>(padded)) ==
        header + std::string(padded - header.size(), ' '));
  CHECK(same_bytes(bytes.data() + 8 + padded, t.data(), 24));
  // Names and values are escaped as JSON and written as UTF-8.
  const std::vector<std::uint8_t> odd =
      attn::safetensors_bytes({attn::safetensors_tensor("a\"b\\c\n\u00e9", t)}, {{"k", "\x01"}});
  const std::string text(odd.begin() + 8, odd.end() - 24);
  CHECK(text.find("\"a\\\"b\\\\c\\n\u00e9\"") != std::string::npos);
  CHECK(text.find("\"\\u0001\"") != std::string::npos);
  CHECK(attn::SafetensorsFile::from_bytes(odd).contains("a\"b\\c\n\u00e9"));
}

TEST_CASE("safetensors: every malformed file of the corpus is rejected with its message",
          "[safetensors]") {
  const json manifest = load_json(bad_dir + "/manifest.json").at("files");
  std::set<std::string> on_disk;
  for (const auto& item : std::filesystem::directory_iterator(bad_dir)) {
    if (item.path().extension() == ".safetensors")
      on_disk.insert(item.path().filename().string());
  }
  std::set<std::string> listed;
  for (const auto& item : manifest.items())
    listed.insert(item.key());
  CHECK(on_disk == listed);  // no file without an expected message, none missing
  REQUIRE(listed.size() >= 50);
  for (const auto& item : manifest.items()) {
    const std::string path = bad_dir + "/" + item.key();
    const std::string fragment = item.value().get<std::string>();
    INFO(item.key() << ": expected \"" << fragment << "\"");
    std::string from_path, from_bytes;
    try {
      const attn::SafetensorsFile file(path);
    } catch (const attn::SafetensorsError& e) {
      from_path = e.what();
    }
    try {
      const attn::SafetensorsFile file = attn::SafetensorsFile::from_bytes(file_bytes(path));
    } catch (const attn::SafetensorsError& e) {
      from_bytes = e.what();
    }
    INFO("from the path: " << from_path);
    INFO("from the bytes: " << from_bytes);
    CHECK(from_path.rfind("safetensors: " + path + ": ", 0) == 0);
    CHECK(from_path.find(fragment) != std::string::npos);
    CHECK(from_bytes.rfind("safetensors: ", 0) == 0);
    CHECK(from_bytes.find(fragment) != std::string::npos);
    CHECK(from_path == "safetensors: " + path + ": " + from_bytes.substr(13));
  }
}

TEST_CASE("safetensors: a header within the rules but unpadded: read works, view explains",
          "[safetensors]") {
  // unaligned.safetensors: 101-byte header (the data section starts at byte 109, so its
  // F32 tensor is not 4-aligned), "__metadata__": null and an extra key in the entry.
  const std::string path = reference_dir + "/unaligned.safetensors";
  const attn::SafetensorsFile file(path);
  CHECK(file.data_offset() == 109);
  CHECK(file.metadata().empty());
  const attn::Tensor<float, 1> w = file.read<float, 1>("w");
  CHECK(w(0) == 1.0F);
  CHECK(w(1) == -2.0F);
  CHECK(w(2) == 0.25F);
  CHECK(file.read_values<double>("w") == std::vector<double>{1.0, -2.0, 0.25});
  const attn::SafetensorsFile copy = attn::SafetensorsFile::from_bytes(file_bytes(path));
  for (const attn::SafetensorsFile* f : {&file, &copy}) {
    CHECK_THROWS_MATCHES(
        (f->view<float, 1>("w")), attn::SafetensorsError,
        Catch::Matchers::Message(
            "safetensors: " + f->path() + (f->path().empty() ? "" : ": ") +
            "tensor \"w\" starts at byte 109 of the file, not aligned for F32 (4 bytes): view "
            "cannot map it (read copies it)"));
  }
}

TEST_CASE("safetensors: lookups, rank and dtype errors name the tensor", "[safetensors]") {
  const std::string path = reference_dir + "/reference.safetensors";
  const attn::SafetensorsFile file(path);
  const std::string where = "safetensors: " + path + ": ";
  CHECK_THROWS_MATCHES(
      file.entry("missing"), attn::SafetensorsError,
      Catch::Matchers::Message(
          where +
          "no tensor \"missing\" (the file has 10 tensors: \"f64.values\", \"scalar.f64\", "
          "\"empty.f32\", \"f32.values\", \"names/\u00fcn\u00efc\u00f6d\u00e9 \\\"q\\\" \\\\ "
          "\\u0001 end\", \"bf16.values\", \"empty.bf16\", \"scalar.bf16\", ...)"));
  CHECK_THROWS_MATCHES(
      (file.read<float, 3>("f16.values")), attn::SafetensorsError,
      Catch::Matchers::Message(where + "tensor \"f16.values\" has rank 2 (shape [5, 5]) "
                                       "but read asks for rank 3"));
  CHECK_THROWS_MATCHES(
      (file.view<Eigen::half, 1>("f16.values")), attn::SafetensorsError,
      Catch::Matchers::Message(where + "tensor \"f16.values\" has rank 2 (shape [5, 5]) "
                                       "but view asks for rank 1"));
  CHECK_THROWS_MATCHES(
      (file.view<float, 2>("f16.values")), attn::SafetensorsError,
      Catch::Matchers::Message(where + "tensor \"f16.values\" is F16: view<F32> needs F32 "
                                       "data (read converts, into a copy)"));
  CHECK_THROWS_MATCHES(
      file.read_matrix<float>("scalar.f64"), attn::SafetensorsError,
      Catch::Matchers::Message(where + "tensor \"scalar.f64\" has rank 0 (shape []) but "
                                       "read asks for rank 2"));
  const attn::SafetensorsFile none = attn::SafetensorsFile::from_bytes(attn::safetensors_bytes({}));
  CHECK_THROWS_MATCHES(
      none.entry("x"), attn::SafetensorsError,
      Catch::Matchers::Message("safetensors: no tensor \"x\" (the file has 0 tensors)"));
}

TEST_CASE("safetensors: files that cannot be opened or written throw std::runtime_error",
          "[safetensors]") {
  const std::string missing = "/nonexistent-attn-dir/x.safetensors";
  try {
    const attn::SafetensorsFile file(missing);
    FAIL("no exception");
  } catch (const attn::SafetensorsError&) {
    FAIL("a missing file is not a malformed one");
  } catch (const std::runtime_error& e) {
    CHECK(std::string(e.what()).rfind("safetensors: cannot open " + missing, 0) == 0);
  }
  attn::Tensor<float, 1> t(2);
  t.setZero();
  CHECK_THROWS_MATCHES(
      attn::save_safetensors(missing, {attn::safetensors_tensor("t", t)}), std::runtime_error,
      Catch::Matchers::Message("safetensors: save_safetensors: cannot write " + missing));
}

TEST_CASE("safetensors: the writer rejects what no reader could read", "[safetensors]") {
  attn::Tensor<float, 1> t(2);
  t.setZero();
  const auto write = [](const std::vector<attn::SafetensorsTensor>& tensors,
                        const std::map<std::string, std::string>& metadata = {}) {
    return attn::safetensors_bytes(tensors, metadata);
  };
  const std::string where = "safetensors: save_safetensors: ";
  using Catch::Matchers::Message;
  CHECK_THROWS_MATCHES(write({attn::safetensors_tensor("__metadata__", t)}), attn::SafetensorsError,
                       Message(where + "tensor \"__metadata__\": the name is reserved for the "
                                       "metadata"));
  CHECK_THROWS_MATCHES(write({attn::safetensors_tensor("a", t), attn::safetensors_tensor("a", t)}),
                       attn::SafetensorsError,
                       Message(where + "tensor \"a\": the name appears twice"));
  CHECK_THROWS_MATCHES(write({{"n", DType::f32, {2, -1}, t.data()}}), attn::SafetensorsError,
                       Message(where + "tensor \"n\": shape [2, -1] has a negative size"));
  CHECK_THROWS_MATCHES(write({{"z", DType::f32, {2}, nullptr}}), attn::SafetensorsError,
                       Message(where + "tensor \"z\": data is null but shape [2] holds 2 "
                                       "elements"));
  CHECK_THROWS_MATCHES(write({{"x", static_cast<DType>(9), {2}, t.data()}}), attn::SafetensorsError,
                       Message(where + "tensor \"x\": dtype 9 is not a DType"));
  const Index big = Index(1) << 62;
  CHECK_THROWS_MATCHES(
      write({{"big", DType::f64, {big, 4}, t.data()}}), attn::SafetensorsError,
      Message(where + "tensor \"big\": shape [4611686018427387904, 4] of F64 is too large to "
                      "address"));
  CHECK_THROWS_MATCHES(write({attn::safetensors_tensor("bad\xff", t)}), attn::SafetensorsError,
                       Message(where + "tensor name \"bad\xef\xbf\xbd\" is not valid UTF-8"));
  CHECK_THROWS_MATCHES(write({}, {{"k\xc3", "v"}}), attn::SafetensorsError,
                       Message(where + "metadata key \"k\xef\xbf\xbd\" is not valid UTF-8"));
  CHECK_THROWS_MATCHES(write({}, {{"k", "v\xc3"}}), attn::SafetensorsError,
                       Message(where + "metadata value of \"k\" is not valid UTF-8"));
  // A null pointer is fine where there is nothing to write.
  const attn::SafetensorsFile file =
      attn::SafetensorsFile::from_bytes(write({{"empty", DType::bf16, {3, 0}, nullptr}}));
  CHECK(file.entry("empty").shape == std::vector<Index>{3, 0});
  // Argument errors leave an existing file alone.
  TempFile tmp("untouched.safetensors");
  attn::save_safetensors(tmp.str(), {attn::safetensors_tensor("t", t)});
  const std::vector<std::uint8_t> before = file_bytes(tmp.str());
  CHECK_THROWS_AS(attn::save_safetensors(tmp.str(), {{"z", DType::f32, {2}, nullptr}}),
                  attn::SafetensorsError);
  CHECK(file_bytes(tmp.str()) == before);
}

TEST_CASE("safetensors: views stay valid when the file object moves", "[safetensors]") {
  const std::string path = reference_dir + "/reference.safetensors";
  attn::SafetensorsFile file(path);
  const float* data = file.view<float, 3>("f32.values").data();
  const attn::SafetensorsFile moved = std::move(file);
  CHECK(moved.view<float, 3>("f32.values").data() == data);
  CHECK(moved.entries().size() == 10);
  attn::SafetensorsFile bytes = attn::SafetensorsFile::from_bytes(file_bytes(path));
  const float* owned = bytes.view<float, 3>("f32.values").data();
  attn::SafetensorsFile assigned = attn::SafetensorsFile::from_bytes(attn::safetensors_bytes({}));
  assigned = std::move(bytes);
  CHECK(assigned.view<float, 3>("f32.values").data() == owned);
  CHECK(assigned.read<float, 3>("f32.values")(0, 0, 0) == 0.0F);
}

TEST_CASE("safetensors: MultiHeadAttention loads torch's weights and matches torch's output",
          "[safetensors]") {
  const std::string path = reference_dir + "/mha.safetensors";
  const attn::SafetensorsFile file(path);
  const std::string enc = "encoder.layers.0.self_attn.", dec = "decoder.layers.0.cross_attn.";
  const attn::MultiHeadAttentionConfig enc_config =
      config_from(file.metadata().at("encoder.layers.0.self_attn"));
  const attn::MultiHeadAttentionConfig dec_config =
      config_from(file.metadata().at("decoder.layers.0.cross_attn"));
  CHECK(file.entry(enc + "in_proj_weight").dtype == DType::f32);
  CHECK(file.entry(dec + "q_proj_weight").dtype == DType::f16);

  // double: the stored F32 / F16 weights widen exactly, so torch's float64 output is met
  // to rounding.
  attn::MultiHeadAttention<double> enc64(enc_config), dec64(dec_config);
  attn::load_safetensors(enc64, file, enc);
  attn::load_safetensors(dec64, file, dec);
  const attn::Tensor<double, 3> x = file.read<double, 3>("inputs.x");
  const attn::Tensor<double, 3> mk = file.read<double, 3>("inputs.memory_key");
  const attn::Tensor<double, 3> mv = file.read<double, 3>("inputs.memory_value");
  const attn::Tensor<double, 3> want_enc = file.read<double, 3>("expected.encoder");
  const attn::Tensor<double, 3> want_dec = file.read<double, 3>("expected.decoder");
  const attn::Tensor<double, 3> got_enc = enc64.forward(x).output;
  const attn::Tensor<double, 3> got_dec = dec64.forward(x, mk, mv).output;
  REQUIRE(got_enc.dimensions() == want_enc.dimensions());
  REQUIRE(got_dec.dimensions() == want_dec.dimensions());
  for (Index i = 0; i < want_enc.size(); ++i)
    CHECK_THAT(got_enc.data()[i], Catch::Matchers::WithinAbs(want_enc.data()[i], 1e-12));
  for (Index i = 0; i < want_dec.size(); ++i)
    CHECK_THAT(got_dec.data()[i], Catch::Matchers::WithinAbs(want_dec.data()[i], 1e-12));

  // float: the same weights in float, within float's rounding.
  attn::MultiHeadAttention<float> enc32(enc_config);
  attn::load_safetensors(enc32, file, enc);
  const attn::Tensor<float, 3> got32 = enc32.forward(file.read<float, 3>("inputs.x")).output;
  for (Index i = 0; i < want_enc.size(); ++i) {
    CHECK_THAT(got32.data()[i],
               Catch::Matchers::WithinAbs(static_cast<float>(want_enc.data()[i]), 1e-5));
  }
  // The same module as built from the state_dict directly.
  const attn::StateDict<float> state = attn::read_state_dict<float>(file, enc);
  CHECK(state.size() == 4);
  const auto direct = attn::MultiHeadAttention<float>::from_state_dict(enc_config, state);
  check_state_dicts_equal(direct.state_dict(), enc32.state_dict());
}

TEST_CASE("safetensors: load_safetensors is strict within its prefix", "[safetensors]") {
  const std::string path = reference_dir + "/mha.safetensors";
  const attn::SafetensorsFile file(path);
  const std::string where = "safetensors: " + path + ": load_safetensors: prefix ";
  const attn::MultiHeadAttentionConfig enc_config =
      config_from(file.metadata().at("encoder.layers.0.self_attn"));
  attn::MultiHeadAttention<float> m(enc_config);
  const attn::StateDict<float> before = m.state_dict();
  using Catch::Matchers::Message;
  // Under prefix "" the names keep their prefixes: the first one looked up is missing.
  CHECK_THROWS_MATCHES(attn::load_safetensors(m, file), attn::SafetensorsError,
                       Message(where + "\"\": MultiHeadAttention::load_state_dict: missing "
                                       "\"in_proj_bias\""));
  CHECK_THROWS_MATCHES(attn::load_safetensors(m, file, "encoder."), attn::SafetensorsError,
                       Message(where + "\"encoder.\": MultiHeadAttention::load_state_dict: "
                                       "missing \"in_proj_bias\""));
  CHECK_THROWS_MATCHES(
      attn::load_safetensors(m, file, "decoder.layers.0.cross_attn."), attn::SafetensorsError,
      Message(where + "\"decoder.layers.0.cross_attn.\": MultiHeadAttention::load_state_dict: "
                      "missing \"in_proj_weight\""));
  attn::MultiHeadAttentionConfig gqa = enc_config;
  gqa.num_kv_heads = 2;
  attn::MultiHeadAttention<float> g(gqa);
  CHECK_THROWS_MATCHES(
      attn::load_safetensors(g, file, "encoder.layers.0.self_attn."), attn::SafetensorsError,
      Message(where + "\"encoder.layers.0.self_attn.\": MultiHeadAttention::load_state_dict: "
                      "\"in_proj_bias\" is [48] but must be [32] (embed_dim 16, num_heads 4, "
                      "num_kv_heads 2, kdim 16, vdim 16)"));
  check_state_dicts_equal(m.state_dict(), before);  // unchanged by the failures

  // A file with the module's tensors plus one more under the prefix: unexpected.
  const attn::StateDict<float> state = m.state_dict();
  std::vector<attn::SafetensorsTensor> tensors = attn::safetensors_tensors(state, "blk.");
  const float extra = 1.0F;
  tensors.push_back({"blk.extra", DType::f32, {}, &extra});
  tensors.push_back({"other.weight", DType::f32, {}, &extra});  // outside the prefix: ignored
  const attn::SafetensorsFile with_extra =
      attn::SafetensorsFile::from_bytes(attn::safetensors_bytes(tensors));
  CHECK_THROWS_MATCHES(attn::load_safetensors(m, with_extra, "blk."), attn::SafetensorsError,
                       Message("safetensors: load_safetensors: prefix \"blk.\": "
                               "MultiHeadAttention::load_state_dict: unexpected \"extra\""));
  tensors.erase(tensors.end() - 2);
  attn::load_safetensors(m, attn::SafetensorsFile::from_bytes(attn::safetensors_bytes(tensors)),
                         "blk.");
  check_state_dicts_equal(m.state_dict(), before);
}

TEMPLATE_TEST_CASE("safetensors: a MultiHeadAttention saved and loaded back is the same module",
                   "[safetensors]", float, double, Eigen::half, Eigen::bfloat16) {
  using T = TestType;
  attn::MultiHeadAttentionConfig config;
  config.embed_dim = 24;
  config.num_heads = 4;
  config.num_kv_heads = 2;
  config.kdim = 10;
  config.add_bias_kv = true;
  config.seed = 1;
  const attn::MultiHeadAttention<T> original(config);
  TempFile tmp("mha.safetensors");
  attn::save_safetensors(tmp.str(), original, "layers.3.attn.", {{"note", "round trip"}});

  const attn::SafetensorsFile file(tmp.str());
  CHECK(file.metadata().at("note") == "round trip");
  for (const attn::TensorEntry& e : file.entries()) {
    CHECK(e.name.rfind("layers.3.attn.", 0) == 0);
    CHECK(e.dtype == attn::dtype_of<T>());
  }
  CHECK(file.entries().size() == original.state_dict().size());
  config.seed = 2;  // different initial weights, all replaced by the load
  attn::MultiHeadAttention<T> loaded(config);
  attn::load_safetensors(loaded, file, "layers.3.attn.");
  check_state_dicts_equal(loaded.state_dict(), original.state_dict());
  const auto rebuilt = attn::MultiHeadAttention<T>::from_state_dict(config, original.state_dict());

  const attn::Tensor<T, 3> q = random_input<T>(2, 5, 24, 3);
  const attn::Tensor<T, 3> k = random_input<T>(2, 6, 10, 4);
  const attn::Tensor<T, 3> v = random_input<T>(2, 6, 24, 5);
  const attn::Tensor<T, 3> a = original.forward(q, k, v).output;
  const attn::Tensor<T, 3> b = loaded.forward(q, k, v).output;
  const attn::Tensor<T, 3> c = rebuilt.forward(q, k, v).output;
  REQUIRE(a.size() == b.size());
  CHECK(same_bytes(a.data(), b.data(), static_cast<std::size_t>(a.size()) * sizeof(T)));
  CHECK(same_bytes(a.data(), c.data(), static_cast<std::size_t>(a.size()) * sizeof(T)));

  // Loaded into double, the weights widen exactly.
  attn::MultiHeadAttention<double> wide(config);
  attn::load_safetensors(wide, file, "layers.3.attn.");
  const attn::StateDict<T> narrow = original.state_dict();
  for (const auto& [name, t] : wide.state_dict()) {
    INFO(name);
    const std::vector<T>& want = narrow.at(name).data;
    REQUIRE(t.data.size() == want.size());
    for (std::size_t i = 0; i < want.size(); ++i)
      CHECK(t.data[i] == static_cast<double>(want[i]));
  }
}
