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
#pragma once

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <Eigen/Core>
#include <nlohmann/json.hpp>

#include "attn/config.hpp"
#include "attn/tensor.hpp"

#if defined(__unix__) || defined(__APPLE__)
#define ATTN_SAFETENSORS_MMAP 1
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#else
#define ATTN_SAFETENSORS_MMAP 0
#endif

// The data section is used in place (views, memcpy): the host must be little-endian, as the
// format is. Every platform attn targets is; a big-endian one would need byte swaps.
#if defined(__BYTE_ORDER__) && defined(__ORDER_LITTLE_ENDIAN__) && \
    __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "attn/safetensors.hpp supports little-endian hosts only"
#endif

namespace attn {

/// The element types attn reads and writes ("F64", "F32", "F16", "BF16" in a file).
enum class DType : std::uint8_t { f64, f32, f16, bf16 };

/// "F64", "F32", "F16" or "BF16" ("?" for a value outside the enum).
inline const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f64:
      return "F64";
    case DType::f32:
      return "F32";
    case DType::f16:
      return "F16";
    case DType::bf16:
      return "BF16";
  }
  return "?";
}

/// Bytes per element (0 for a value outside the enum).
inline std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f64:
      return 8;
    case DType::f32:
      return 4;
    case DType::f16:
    case DType::bf16:
      return 2;
  }
  return 0;
}

/// The scalars a safetensors tensor is read into or written from.
template <class T>
inline constexpr bool is_safetensors_scalar_v =
    std::is_same_v<T, double> || std::is_same_v<T, float> || std::is_same_v<T, Eigen::half> ||
    std::is_same_v<T, Eigen::bfloat16>;

/// The DType of double, float, Eigen::half, Eigen::bfloat16.
template <class T>
constexpr DType dtype_of() {
  static_assert(is_safetensors_scalar_v<T>,
                "safetensors: T must be double, float, Eigen::half or Eigen::bfloat16");
  if constexpr (std::is_same_v<T, double>)
    return DType::f64;
  else if constexpr (std::is_same_v<T, float>)
    return DType::f32;
  else if constexpr (std::is_same_v<T, Eigen::half>)
    return DType::f16;
  else
    return DType::bf16;
}

/// One tensor of a file's header.
struct TensorEntry {
  std::string name;
  DType dtype;
  std::vector<Index> shape;  ///< row-major; empty for a scalar (rank 0)
  std::size_t begin, end;    ///< byte offsets [begin, end) in the data section

  /// Number of elements: the product of shape (1 for a scalar).
  Index elements() const {
    Index n = 1;
    for (const Index d : shape)
      n *= d;
    return n;
  }
};

/// Every error of this header: malformed files, missing tensors, wrong rank or dtype, bad
/// arguments to the writers. The message starts with "safetensors: ". (A file that cannot
/// be opened, read or written throws std::runtime_error instead, as viz.hpp does.)
class SafetensorsError : public std::invalid_argument {
 public:
  explicit SafetensorsError(const std::string& message) : std::invalid_argument(message) {}
};

/// The largest header accepted, in bytes (the reference implementation's bound: a header
/// is parsed into memory before anything is checked, so its size is limited).
inline constexpr std::uint64_t safetensors_max_header_bytes = 100000000;

namespace detail {

/// How deep a header's JSON may nest: a valid header needs 3 (the header, an entry, its
/// shape); more is allowed for the ignored extra keys of an entry.
inline constexpr int safetensors_max_nesting = 8;

[[noreturn]] inline void safetensors_fail(const std::string& where, const std::string& message) {
  throw SafetensorsError("safetensors: " + where + message);
}

/// A string as a JSON literal (quoted and escaped), invalid UTF-8 replaced: for messages.
inline std::string json_quote(const std::string& s) {
  return nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

/// "a number", "a string", "a list", "an object", "a boolean", "null".
inline std::string json_kind(const nlohmann::json& j) {
  switch (j.type()) {
    case nlohmann::json::value_t::null:
      return "null";
    case nlohmann::json::value_t::object:
      return "an object";
    case nlohmann::json::value_t::array:
      return "a list";
    case nlohmann::json::value_t::string:
      return "a string";
    case nlohmann::json::value_t::boolean:
      return "a boolean";
    case nlohmann::json::value_t::number_integer:
    case nlohmann::json::value_t::number_unsigned:
    case nlohmann::json::value_t::number_float:
      return "a number";
    case nlohmann::json::value_t::binary:
    case nlohmann::json::value_t::discarded:
      break;
  }
  return "binary";
}

/// A JSON value as text for a message, cut to about 40 characters (at a UTF-8 boundary).
inline std::string json_show(const nlohmann::json& j) {
  std::string s = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (s.size() > 40) {
    std::size_t cut = 37;
    while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0U) == 0x80U)
      --cut;
    s = s.substr(0, cut) + "...";
  }
  return s;
}

/// j as an integer >= 0 (3 and -0; not 3.0, -1 or "3").
inline bool json_uint(const nlohmann::json& j, std::uint64_t& out) {
  if (j.is_number_unsigned()) {
    out = j.get<std::uint64_t>();
    return true;
  }
  if (j.is_number_integer() && j.get<std::int64_t>() >= 0) {
    out = static_cast<std::uint64_t>(j.get<std::int64_t>());
    return true;
  }
  return false;
}

inline std::string offsets_string(std::uint64_t begin, std::uint64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
}

/// "[begin, end)": a range of bytes.
inline std::string range_string(std::uint64_t begin, std::uint64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + ")";
}

/// The dtype names of the format that attn does not read (the reference implementation's
/// list): rejected as "not supported" rather than "unknown".
inline bool is_other_safetensors_dtype(const std::string& name) {
  static const char* const names[] = {"BOOL",    "U8",      "I8",      "I16", "U16",     "I32",
                                      "U32",     "I64",     "U64",     "C64", "F8_E5M2", "F8_E4M3",
                                      "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4"};
  return std::find(std::begin(names), std::end(names), name) != std::end(names);
}

/// Product of the non-zero dimensions, or -1 when it exceeds Index: bounding it (not only
/// the product, which a 0 makes 0) keeps every partial product Eigen computes in range.
inline Index checked_elements(const std::vector<Index>& shape, bool& overflow) {
  Index nonzero = 1;
  bool zero = false;
  overflow = false;
  for (const Index d : shape) {
    if (d == 0) {
      zero = true;
    } else if (nonzero > std::numeric_limits<Index>::max() / d) {
      overflow = true;
      return -1;
    } else {
      nonzero *= d;
    }
  }
  return zero ? 0 : nonzero;
}

/// One entry of the header, checked against itself and the data section's size.
inline TensorEntry parse_safetensors_entry(const std::string& where, const std::string& name,
                                           const nlohmann::json& value, std::uint64_t data_size) {
  const std::string who = "tensor " + json_quote(name) + ": ";
  const auto fail = [&](const std::string& message) { safetensors_fail(where, who + message); };
  if (!value.is_object())
    fail("entry is " + json_kind(value) + ", not an object");

  TensorEntry entry{name, DType::f32, {}, 0, 0};
  const auto dtype_it = value.find("dtype");
  if (dtype_it == value.end())
    fail("no \"dtype\"");
  if (!dtype_it->is_string())
    fail("\"dtype\" is " + json_kind(*dtype_it) + ", not a string");
  const auto& dtype = dtype_it->get_ref<const std::string&>();
  if (dtype == "F64") {
    entry.dtype = DType::f64;
  } else if (dtype == "F32") {
    entry.dtype = DType::f32;
  } else if (dtype == "F16") {
    entry.dtype = DType::f16;
  } else if (dtype == "BF16") {
    entry.dtype = DType::bf16;
  } else if (is_other_safetensors_dtype(dtype)) {
    fail("dtype " + json_quote(dtype) + " is not supported (attn reads F64, F32, F16, BF16)");
  } else {
    fail("unknown dtype " + json_quote(dtype) + " (attn reads F64, F32, F16, BF16)");
  }

  const auto shape_it = value.find("shape");
  if (shape_it == value.end())
    fail("no \"shape\"");
  if (!shape_it->is_array())
    fail("\"shape\" is " + json_kind(*shape_it) + ", not a list");
  entry.shape.reserve(shape_it->size());
  for (std::size_t i = 0; i < shape_it->size(); ++i) {
    const nlohmann::json& d = (*shape_it)[i];
    std::uint64_t u = 0;
    if (!json_uint(d, u)) {
      fail("shape[" + std::to_string(i) + "] is " + json_show(d) + ", not a non-negative integer");
    }
    if (u > static_cast<std::uint64_t>(std::numeric_limits<Index>::max()))
      fail("shape[" + std::to_string(i) + "] is " + std::to_string(u) + ", more than 2^63 - 1");
    entry.shape.push_back(static_cast<Index>(u));
  }
  bool overflow = false;
  const Index elements = checked_elements(entry.shape, overflow);
  if (overflow) {
    fail("shape " + list_string(entry.shape) +
         " overflows: its non-zero dimensions multiply to more than 2^63 - 1");
  }

  const auto offsets_it = value.find("data_offsets");
  if (offsets_it == value.end())
    fail("no \"data_offsets\"");
  if (!offsets_it->is_array())
    fail("\"data_offsets\" is " + json_kind(*offsets_it) + ", not a list");
  if (offsets_it->size() != 2) {
    fail("\"data_offsets\" has " + std::to_string(offsets_it->size()) +
         " entries, not 2 ([begin, end])");
  }
  std::uint64_t offsets[2] = {0, 0};
  for (std::size_t i = 0; i < 2; ++i) {
    const nlohmann::json& o = (*offsets_it)[i];
    if (!json_uint(o, offsets[i])) {
      fail("data_offsets[" + std::to_string(i) + "] is " + json_show(o) +
           ", not a non-negative integer");
    }
  }
  const std::uint64_t begin = offsets[0], end = offsets[1];
  if (begin > end)
    fail("data_offsets " + offsets_string(begin, end) + ": begin is after end");
  if (end > data_size) {
    fail("data_offsets " + offsets_string(begin, end) + ": end is beyond the data section (" +
         std::to_string(data_size) + " bytes)");
  }
  const std::uint64_t size = dtype_size(entry.dtype);
  const auto count = static_cast<std::uint64_t>(elements);
  if (count > std::numeric_limits<std::uint64_t>::max() / size) {
    fail("shape " + list_string(entry.shape) + " of " + dtype + " needs more than 2^64 - 1 bytes");
  }
  if (count * size != end - begin) {
    fail("shape " + list_string(entry.shape) + " of " + dtype + " needs " +
         std::to_string(count * size) + " bytes but data_offsets " + offsets_string(begin, end) +
         " hold " + std::to_string(end - begin));
  }
  entry.begin = static_cast<std::size_t>(begin);
  entry.end = static_cast<std::size_t>(end);
  return entry;
}

/// The checked header of a file of `size` bytes: its entries in file order, its metadata
/// and where the data section starts.
struct SafetensorsHeader {
  std::vector<TensorEntry> entries;
  std::map<std::string, std::string> metadata;
  std::size_t data_offset = 0;
};

inline SafetensorsHeader parse_safetensors_header(const std::uint8_t* bytes, std::size_t size,
                                                  const std::string& where) {
  if (size < 8) {
    safetensors_fail(
        where, "file is " + std::to_string(size) + " bytes, shorter than the 8-byte header length");
  }
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i)
    n = (n << 8U) | bytes[i];
  if (n > safetensors_max_header_bytes) {
    safetensors_fail(where, "header length " + std::to_string(n) + " exceeds the bound of " +
                                std::to_string(safetensors_max_header_bytes) + " bytes");
  }
  if (n > size - 8) {
    safetensors_fail(where, "header length " + std::to_string(n) +
                                " runs past the end of the file (" + std::to_string(size) +
                                " bytes)");
  }

  // Parse, rejecting duplicate keys (nlohmann's objects would keep the last) and deep
  // nesting, and remembering the order of the top-level keys (its objects are sorted).
  std::vector<std::string> order;
  std::vector<std::set<std::string>> keys;  // one per open object
  std::string current;                      // the top-level key being parsed
  int nesting = 0;
  const auto context = [&]() -> std::string {
    if (nesting < 2)
      return "";
    return current == "__metadata__" ? "__metadata__: " : "tensor " + json_quote(current) + ": ";
  };
  using Event = nlohmann::json::parse_event_t;
  const nlohmann::json::parser_callback_t callback = [&](int /*depth*/, Event event,
                                                         nlohmann::json& parsed) {
    switch (event) {
      case Event::object_start:
      case Event::array_start:
        if (++nesting > safetensors_max_nesting) {
          safetensors_fail(where, context() + "header nests deeper than " +
                                      std::to_string(safetensors_max_nesting) +
                                      " levels (a header needs 3)");
        }
        if (event == Event::object_start)
          keys.emplace_back();
        break;
      case Event::object_end:
        keys.pop_back();
        --nesting;
        break;
      case Event::array_end:
        --nesting;
        break;
      case Event::key: {
        const auto& key = parsed.get_ref<const std::string&>();
        if (!keys.back().insert(key).second) {
          if (nesting == 1) {
            safetensors_fail(where, (key == "__metadata__" ? std::string("\"__metadata__\"")
                                                           : "tensor " + json_quote(key)) +
                                        " appears twice in the header");
          }
          safetensors_fail(where, context() + "key " + json_quote(key) + " appears twice");
        }
        if (nesting == 1) {
          order.push_back(key);
          current = key;
        }
        break;
      }
      case Event::value:
        break;
    }
    return true;
  };
  const char* text = reinterpret_cast<const char*>(bytes + 8);
  // nlohmann's lexer ends the input at a NUL byte; JSON allows none (not even in strings).
  if (const void* nul = std::memchr(text, 0, static_cast<std::size_t>(n)); nul != nullptr) {
    safetensors_fail(where, "header is not valid JSON: a NUL byte at offset " +
                                std::to_string(static_cast<const char*>(nul) - text) +
                                " of the header");
  }
  nlohmann::json root;
  try {
    root = nlohmann::json::parse(text, text + n, callback);
  } catch (const nlohmann::json::exception& e) {
    safetensors_fail(where, std::string("header is not valid JSON: ") + e.what());
  }
  if (!root.is_object())
    safetensors_fail(where, "header is " + json_kind(root) + ", not a JSON object");

  SafetensorsHeader header;
  header.data_offset = static_cast<std::size_t>(8 + n);
  const std::uint64_t data_size = size - header.data_offset;
  header.entries.reserve(order.size());
  for (const std::string& key : order) {
    const nlohmann::json& value = *root.find(key);
    if (key != "__metadata__") {
      header.entries.push_back(parse_safetensors_entry(where, key, value, data_size));
      continue;
    }
    if (value.is_null())
      continue;
    if (!value.is_object())
      safetensors_fail(where, "\"__metadata__\" is " + json_kind(value) + ", not an object");
    for (const auto& item : value.items()) {
      if (!item.value().is_string()) {
        safetensors_fail(where, "__metadata__: " + json_quote(item.key()) + " is " +
                                    json_kind(item.value()) + ", not a string");
      }
      header.metadata.emplace(item.key(), item.value().get<std::string>());
    }
  }

  // The tensors must tile the data section: sorted by offsets, each starts where the
  // previous one ends, from 0 to the end of the file.
  std::vector<std::size_t> by_offset(header.entries.size());
  for (std::size_t i = 0; i < by_offset.size(); ++i)
    by_offset[i] = i;
  std::sort(by_offset.begin(), by_offset.end(), [&](std::size_t a, std::size_t b) {
    const TensorEntry &x = header.entries[a], &y = header.entries[b];
    return std::tie(x.begin, x.end, a) < std::tie(y.begin, y.end, b);
  });
  std::uint64_t covered = 0;
  const TensorEntry* previous = nullptr;
  for (const std::size_t i : by_offset) {
    const TensorEntry& e = header.entries[i];
    if (e.begin < covered) {
      safetensors_fail(where, "tensor " + json_quote(e.name) + ": data_offsets " +
                                  offsets_string(e.begin, e.end) + " overlap tensor " +
                                  json_quote(previous->name) + " " +
                                  offsets_string(previous->begin, previous->end));
    }
    if (e.begin > covered) {
      safetensors_fail(where, "bytes " + range_string(covered, e.begin) +
                                  " of the data section belong to no tensor (a hole before "
                                  "tensor " +
                                  json_quote(e.name) + ")");
    }
    covered = e.end;
    previous = &e;
  }
  if (covered != data_size) {
    safetensors_fail(
        where,
        "bytes " + range_string(covered, data_size) + " of the data section belong to no tensor (" +
            (previous == nullptr ? std::string("the header lists none")
                                 : "after tensor " + json_quote(previous->name) + ", the last") +
            ")");
  }
  return header;
}

/// The bytes of a file: a read-only mapping, or a copy in memory. Move-only.
class SafetensorsBytes {
 public:
  SafetensorsBytes() = default;
  explicit SafetensorsBytes(std::vector<std::uint8_t> bytes) : owned_(std::move(bytes)) {
    data_ = owned_.data();
    size_ = owned_.size();
  }
  SafetensorsBytes(const SafetensorsBytes&) = delete;
  SafetensorsBytes& operator=(const SafetensorsBytes&) = delete;
  SafetensorsBytes(SafetensorsBytes&& other) noexcept { swap(other); }
  SafetensorsBytes& operator=(SafetensorsBytes&& other) noexcept {
    SafetensorsBytes(std::move(other)).swap(*this);
    return *this;
  }
  ~SafetensorsBytes() { unmap(); }

  /// The file at `path`: mapped when it is a non-empty regular file and mmap works, else
  /// read. Throws std::runtime_error if it cannot be opened or read.
  static SafetensorsBytes open(const std::string& path) {
    SafetensorsBytes b;
#if ATTN_SAFETENSORS_MMAP
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      throw std::runtime_error("safetensors: cannot open " + path + ": " + std::strerror(errno));
    }
    struct stat status {};
    if (::fstat(fd, &status) == 0 && S_ISREG(status.st_mode) && status.st_size > 0) {
      const auto length = static_cast<std::size_t>(status.st_size);
      void* map = ::mmap(nullptr, length, PROT_READ, MAP_PRIVATE, fd, 0);
      if (map != MAP_FAILED) {  // NOLINT(performance-no-int-to-ptr): POSIX's MAP_FAILED
        b.map_ = map;
        b.data_ = static_cast<const std::uint8_t*>(map);
        b.size_ = length;
      }
    }
    ::close(fd);
    if (b.map_ != nullptr)
      return b;
#endif
    std::ifstream in(path, std::ios::binary);
    if (!in)
      throw std::runtime_error("safetensors: cannot open " + path);
    std::vector<std::uint8_t> bytes((std::istreambuf_iterator<char>(in)),
                                    std::istreambuf_iterator<char>());
    if (in.bad())
      throw std::runtime_error("safetensors: cannot read " + path);
    return SafetensorsBytes(std::move(bytes));
  }

  const std::uint8_t* data() const {
    return data_;
  }
  std::size_t size() const {
    return size_;
  }
  bool mapped() const {
    return map_ != nullptr;
  }

 private:
  void swap(SafetensorsBytes& other) noexcept {
    std::swap(owned_, other.owned_);
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
    std::swap(map_, other.map_);
  }
  void unmap() noexcept {
#if ATTN_SAFETENSORS_MMAP
    if (map_ != nullptr)
      ::munmap(map_, size_);
#endif
    map_ = nullptr;
  }

  std::vector<std::uint8_t> owned_;  // a vector's buffer survives moves: data_ stays valid
  const std::uint8_t* data_ = nullptr;
  std::size_t size_ = 0;
  void* map_ = nullptr;
};

/// Round to odd, double to float: the float nearest d towards zero, its last bit set when
/// that is inexact. Rounding the result to nearest even at 16 bits then gives the correctly
/// rounded 16-bit value (float keeps at least 2 more bits than half and bfloat16 in every
/// range), where double -> float -> 16 bits, both to nearest, can round twice.
inline float round_to_odd_float(double d) {
  auto f = static_cast<float>(d);
  if (d != d || static_cast<double>(f) == d)  // NaN, or exact (zeros, infinities included)
    return f;
  if (std::abs(static_cast<double>(f)) > std::abs(d))
    f = std::nextafter(f, 0.0F);
  std::uint32_t bits = 0;
  std::memcpy(&bits, &f, sizeof bits);
  bits |= 1U;
  std::memcpy(&f, &bits, sizeof bits);
  return f;
}

/// d as T, correctly rounded.
template <class T>
T from_double(double d) {
  if constexpr (std::is_same_v<T, double>)
    return d;
  else if constexpr (std::is_same_v<T, float>)
    return static_cast<float>(d);
  else
    return T(round_to_odd_float(d));
}

/// f as T (exact to double and float; correctly rounded to the 16-bit types).
template <class T>
T from_float(float f) {
  if constexpr (std::is_same_v<T, double> || std::is_same_v<T, float>)
    return f;
  else
    return T(f);
}

template <class S>
S load_scalar(const std::uint8_t* p) {
  S s;
  std::memcpy(&s, p, sizeof(S));
  return s;
}

/// out[0:n) = the n elements of dtype `source` at `bytes` (any alignment), as T.
template <class T>
void convert_safetensors(DType source, const std::uint8_t* bytes, Index n, T* out) {
  static_assert(is_safetensors_scalar_v<T>);
  const auto count = static_cast<std::size_t>(n);
  if (source == dtype_of<T>()) {  // bit for bit, NaN payloads included
    if (count > 0)
      std::memcpy(static_cast<void*>(out), bytes, count * sizeof(T));
    return;
  }
  switch (source) {
    case DType::f64:
      for (std::size_t i = 0; i < count; ++i)
        out[i] = from_double<T>(load_scalar<double>(bytes + 8 * i));
      break;
    case DType::f32:
      for (std::size_t i = 0; i < count; ++i)
        out[i] = from_float<T>(load_scalar<float>(bytes + 4 * i));
      break;
    case DType::f16:
      for (std::size_t i = 0; i < count; ++i)
        out[i] = from_float<T>(static_cast<float>(load_scalar<Eigen::half>(bytes + 2 * i)));
      break;
    case DType::bf16:
      for (std::size_t i = 0; i < count; ++i)
        out[i] = from_float<T>(static_cast<float>(load_scalar<Eigen::bfloat16>(bytes + 2 * i)));
      break;
  }
}

}  // namespace detail

/// A checked .safetensors file: its entries and metadata, and its tensors read (converted,
/// into new memory) or viewed (in place). Move-only; const member functions may be called
/// from any number of threads at once.
class SafetensorsFile {
 public:
  /// Opens, maps (POSIX mmap, read-only; elsewhere the file is read into memory) and checks
  /// `path`. Throws SafetensorsError ("safetensors: <path>: ...") for a malformed file,
  /// std::runtime_error if it cannot be opened or read. The file must not be truncated
  /// while mapped (reading a page that is gone raises SIGBUS).
  explicit SafetensorsFile(const std::string& path)
      : SafetensorsFile(detail::SafetensorsBytes::open(path), path) {}

  /// The file held in `bytes` (kept, not copied), checked like a file on disk.
  static SafetensorsFile from_bytes(std::vector<std::uint8_t> bytes) {
    return {detail::SafetensorsBytes(std::move(bytes)), ""};
  }

  /// The tensors, in the order of the header.
  const std::vector<TensorEntry>& entries() const { return entries_; }

  bool contains(const std::string& name) const { return index_.count(name) != 0; }

  /// The entry called `name`; throws SafetensorsError naming it if there is none.
  const TensorEntry& entry(const std::string& name) const {
    const auto it = index_.find(name);
    if (it == index_.end()) {
      std::string names;
      for (std::size_t i = 0; i < entries_.size() && i < 8; ++i)
        names += (i == 0 ? "" : ", ") + detail::json_quote(entries_[i].name);
      if (entries_.size() > 8)
        names += ", ...";
      fail("no tensor " + detail::json_quote(name) + " (the file has " +
           std::to_string(entries_.size()) + (entries_.size() == 1 ? " tensor" : " tensors") +
           (entries_.empty() ? "" : ": " + names) + ")");
    }
    return entries_[it->second];
  }

  /// The "__metadata__" strings (empty if the header has none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  /// The bytes [begin, end) of tensor `name` in the data section: native little-endian,
  /// row-major, aligned only as the file happens to be.
  const std::uint8_t* bytes(const std::string& name) const { return bytes(entry(name)); }

  /// Tensor `name` converted to T (any of the four dtypes to any T, correctly rounded; bit
  /// for bit when the dtypes are equal), in newly allocated memory. Throws if its rank is
  /// not Rank.
  template <class T, int Rank>
  Tensor<T, Rank> read(const std::string& name) const {
    static_assert(is_safetensors_scalar_v<T>,
                  "safetensors: read<T>: T must be double, float, Eigen::half or Eigen::bfloat16");
    const TensorEntry& e = entry(name);
    check_rank(e, Rank, "read");
    Tensor<T, Rank> t(dimensions<Rank>(e));
    detail::convert_safetensors(e.dtype, bytes(e), e.elements(), t.data());
    return t;
  }

  /// Tensor `name` as a zero-copy read-only map into the file's bytes (valid while this
  /// object lives). Throws unless its dtype is T's, its rank is Rank and its data are
  /// aligned for T (files written by save_safetensors and by the reference implementation
  /// are; read() accepts any).
  template <class T, int Rank>
  TensorMap<const T, Rank> view(const std::string& name) const {
    static_assert(is_safetensors_scalar_v<T>,
                  "safetensors: view<T>: T must be double, float, Eigen::half or Eigen::bfloat16");
    const TensorEntry& e = entry(name);
    if (e.dtype != dtype_of<T>()) {
      fail("tensor " + detail::json_quote(name) + " is " + dtype_name(e.dtype) + ": view<" +
           dtype_name(dtype_of<T>()) + "> needs " + dtype_name(dtype_of<T>()) +
           " data (read converts, into a copy)");
    }
    check_rank(e, Rank, "view");
    const std::uint8_t* p = bytes(e);
    if (e.elements() > 0 && reinterpret_cast<std::uintptr_t>(p) % alignof(T) != 0) {
      fail("tensor " + detail::json_quote(name) + " starts at byte " +
           std::to_string(data_offset_ + e.begin) + " of the file, not aligned for " +
           dtype_name(e.dtype) + " (" + std::to_string(alignof(T)) +
           " bytes): view cannot map it (read copies it)");
    }
    return TensorMap<const T, Rank>(reinterpret_cast<const T*>(p), dimensions<Rank>(e));
  }

  /// Tensor `name` as a row-major matrix (rank 2), converted like read().
  template <class T>
  Matrix<T> read_matrix(const std::string& name) const {
    const Tensor<T, 2> t = read<T, 2>(name);
    return Eigen::Map<const Matrix<T>>(t.data(), t.dimension(0), t.dimension(1));
  }

  /// Tensor `name` as a vector (rank 1), converted like read().
  template <class T>
  Vector<T> read_vector(const std::string& name) const {
    const Tensor<T, 1> t = read<T, 1>(name);
    return Eigen::Map<const Vector<T>>(t.data(), t.dimension(0));
  }

  /// The elements of tensor `name`, any rank, row-major, converted like read().
  template <class T>
  std::vector<T> read_values(const std::string& name) const {
    static_assert(is_safetensors_scalar_v<T>,
                  "safetensors: read_values<T>: T must be double, "
                  "float, Eigen::half or Eigen::bfloat16");
    const TensorEntry& e = entry(name);
    std::vector<T> values(static_cast<std::size_t>(e.elements()));
    detail::convert_safetensors(e.dtype, bytes(e), e.elements(), values.data());
    return values;
  }

  /// Whether the bytes are a memory mapping (else a copy in memory).
  bool memory_mapped() const { return bytes_.mapped(); }
  /// The file's size in bytes.
  std::size_t file_size() const { return bytes_.size(); }
  /// Where the data section starts in the file (8 + the header's length).
  std::size_t data_offset() const { return data_offset_; }
  /// The path it was opened from; empty for from_bytes.
  const std::string& path() const { return path_; }

 private:
  SafetensorsFile(detail::SafetensorsBytes bytes, std::string path)
      : bytes_(std::move(bytes)), path_(std::move(path)) {
    detail::SafetensorsHeader header =
        detail::parse_safetensors_header(bytes_.data(), bytes_.size(), where());
    entries_ = std::move(header.entries);
    metadata_ = std::move(header.metadata);
    data_offset_ = header.data_offset;
    index_.reserve(entries_.size());
    for (std::size_t i = 0; i < entries_.size(); ++i)
      index_.emplace(entries_[i].name, i);
  }

  std::string where() const { return path_.empty() ? "" : path_ + ": "; }
  [[noreturn]] void fail(const std::string& message) const {
    detail::safetensors_fail(where(), message);
  }
  const std::uint8_t* bytes(const TensorEntry& e) const {
    return bytes_.data() + data_offset_ + e.begin;
  }
  void check_rank(const TensorEntry& e, int rank, const char* function) const {
    if (static_cast<Index>(e.shape.size()) != rank) {
      fail("tensor " + detail::json_quote(e.name) + " has rank " + std::to_string(e.shape.size()) +
           " (shape " + detail::list_string(e.shape) + ") but " + function + " asks for rank " +
           std::to_string(rank));
    }
  }
  template <int Rank>
  static Eigen::DSizes<Index, Rank> dimensions(const TensorEntry& e) {
    Eigen::DSizes<Index, Rank> dims;
    for (int i = 0; i < Rank; ++i)
      dims[static_cast<std::size_t>(i)] = e.shape[static_cast<std::size_t>(i)];
    return dims;
  }

  detail::SafetensorsBytes bytes_;
  std::string path_;
  std::vector<TensorEntry> entries_;
  std::unordered_map<std::string, std::size_t> index_;
  std::map<std::string, std::string> metadata_;
  std::size_t data_offset_ = 0;
};

/// One tensor to write: row-major, native little-endian, `data` holding product(shape) *
/// dtype_size(dtype) bytes (not owned: it must outlive the call).
struct SafetensorsTensor {
  std::string name;
  DType dtype;
  std::vector<Index> shape;  ///< empty for a scalar
  const void* data;
};

namespace detail {

/// The header (padded with spaces so that the data section starts 8-aligned, as the
/// reference implementation does) and the order and sizes of the tensors to write after it.
struct SafetensorsLayout {
  std::string header;
  std::vector<std::size_t> order;
  std::vector<std::size_t> nbytes;
};

inline std::string json_dump_strict(const std::string& s, const std::string& what) {
  try {
    return nlohmann::json(s).dump();
  } catch (const nlohmann::json::exception&) {
    safetensors_fail("save_safetensors: ", what + " is not valid UTF-8");
  }
}

inline SafetensorsLayout safetensors_layout(const std::vector<SafetensorsTensor>& tensors,
                                            const std::map<std::string, std::string>& metadata) {
  const std::string where = "save_safetensors: ";
  SafetensorsLayout layout;
  layout.nbytes.resize(tensors.size());
  std::set<std::string> names;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const SafetensorsTensor& t = tensors[i];
    const std::string who = "tensor " + json_quote(t.name) + ": ";
    if (t.name == "__metadata__")
      safetensors_fail(where, who + "the name is reserved for the metadata");
    if (!names.insert(t.name).second)
      safetensors_fail(where, who + "the name appears twice");
    const std::size_t size = dtype_size(t.dtype);
    if (size == 0) {
      safetensors_fail(
          where, who + "dtype " + std::to_string(static_cast<int>(t.dtype)) + " is not a DType");
    }
    for (const Index d : t.shape) {
      if (d < 0)
        safetensors_fail(where, who + "shape " + list_string(t.shape) + " has a negative size");
    }
    bool overflow = false;
    const Index elements = checked_elements(t.shape, overflow);
    if (overflow ||
        static_cast<std::uint64_t>(elements) > std::numeric_limits<std::size_t>::max() / size) {
      safetensors_fail(where, who + "shape " + list_string(t.shape) + " of " + dtype_name(t.dtype) +
                                  " is too large to address");
    }
    layout.nbytes[i] = static_cast<std::size_t>(elements) * size;
    if (layout.nbytes[i] > 0 && t.data == nullptr) {
      safetensors_fail(where, who + "data is null but shape " + list_string(t.shape) + " holds " +
                                  std::to_string(elements) + " elements");
    }
  }
  // Wider dtypes first, each group in the order given: with the 8-aligned data section,
  // every tensor is then aligned for its dtype (view() can map it).
  layout.order.resize(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i)
    layout.order[i] = i;
  std::stable_sort(layout.order.begin(), layout.order.end(), [&](std::size_t a, std::size_t b) {
    return dtype_size(tensors[a].dtype) > dtype_size(tensors[b].dtype);
  });

  std::string& h = layout.header;
  h = "{";
  if (!metadata.empty()) {
    h += "\"__metadata__\":{";
    const char* separator = "";
    for (const auto& [key, value] : metadata) {
      h += separator + json_dump_strict(key, "metadata key " + json_quote(key)) + ":" +
           json_dump_strict(value, "metadata value of " + json_quote(key));
      separator = ",";
    }
    h += "}";
  }
  std::size_t offset = 0;
  for (const std::size_t i : layout.order) {
    const SafetensorsTensor& t = tensors[i];
    if (h.size() > 1)
      h += ",";
    h += json_dump_strict(t.name, "tensor name " + json_quote(t.name)) + R"(:{"dtype":")" +
         dtype_name(t.dtype) + R"(","shape":[)";
    for (std::size_t d = 0; d < t.shape.size(); ++d)
      h += (d == 0 ? "" : ",") + std::to_string(t.shape[d]);
    h += "],\"data_offsets\":[" + std::to_string(offset) + "," +
         std::to_string(offset + layout.nbytes[i]) + "]}";
    offset += layout.nbytes[i];
  }
  h += "}";
  h.append((8 - h.size() % 8) % 8, ' ');
  if (h.size() > safetensors_max_header_bytes) {
    safetensors_fail(where, "the header would be " + std::to_string(h.size()) +
                                " bytes, more than readers accept (" +
                                std::to_string(safetensors_max_header_bytes) + ")");
  }
  return layout;
}

/// Calls write(bytes, count) for the file's pieces in order.
template <class Write>
void write_safetensors(const std::vector<SafetensorsTensor>& tensors,
                       const std::map<std::string, std::string>& metadata, Write&& write) {
  const SafetensorsLayout layout = safetensors_layout(tensors, metadata);
  std::uint8_t length[8];
  std::uint64_t n = layout.header.size();
  for (std::uint8_t& byte : length) {
    byte = static_cast<std::uint8_t>(n & 0xFFU);
    n >>= 8U;
  }
  write(length, sizeof length);
  write(layout.header.data(), layout.header.size());
  for (const std::size_t i : layout.order) {
    if (layout.nbytes[i] > 0)
      write(tensors[i].data, layout.nbytes[i]);
  }
}

}  // namespace detail

/// The .safetensors file of `tensors` and `metadata`, in memory. The header lists wider
/// dtypes first (F64, F32, then F16 and BF16), each group in the order given, so that every
/// tensor is aligned for its dtype; it is padded with spaces to a multiple of 8 bytes.
/// Throws SafetensorsError for a reserved ("__metadata__") or repeated name, a negative
/// size, null data, or a name, key or value that is not valid UTF-8.
inline std::vector<std::uint8_t> safetensors_bytes(
    const std::vector<SafetensorsTensor>& tensors,
    const std::map<std::string, std::string>& metadata = {}) {
  std::vector<std::uint8_t> out;
  detail::write_safetensors(tensors, metadata, [&](const void* data, std::size_t count) {
    const auto* p = static_cast<const std::uint8_t*>(data);
    out.insert(out.end(), p, p + count);
  });
  return out;
}

/// safetensors_bytes() written to `path` (created or truncated), without building the file
/// in memory first. Throws std::runtime_error if the file cannot be written.
inline void save_safetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                             const std::map<std::string, std::string>& metadata = {}) {
  detail::safetensors_layout(tensors, metadata);  // argument errors before the file is touched
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out)
    throw std::runtime_error("safetensors: save_safetensors: cannot write " + path);
  detail::write_safetensors(tensors, metadata, [&](const void* data, std::size_t count) {
    out.write(static_cast<const char*>(data), static_cast<std::streamsize>(count));
  });
  out.close();
  if (!out)
    throw std::runtime_error("safetensors: save_safetensors: cannot write " + path);
}

/// A tensor to write, from an attn Tensor or TensorMap (not owned: `t` must outlive the
/// write). Its dtype is T's.
template <class T, int Rank>
SafetensorsTensor safetensors_tensor(std::string name, const Tensor<T, Rank>& t) {
  std::vector<Index> shape(static_cast<std::size_t>(Rank));
  for (int i = 0; i < Rank; ++i)
    shape[static_cast<std::size_t>(i)] = t.dimension(static_cast<std::size_t>(i));
  return {std::move(name), dtype_of<T>(), std::move(shape), t.data()};
}
template <class T, int Rank>
SafetensorsTensor safetensors_tensor(std::string name, Tensor<T, Rank>&& t) = delete;  // dangles
template <class T, int Rank>
SafetensorsTensor safetensors_tensor(std::string name, const TensorMap<T, Rank>& t) {
  std::vector<Index> shape(static_cast<std::size_t>(Rank));
  for (int i = 0; i < Rank; ++i)
    shape[static_cast<std::size_t>(i)] = t.dimension(static_cast<std::size_t>(i));
  return {std::move(name), dtype_of<std::remove_const_t<T>>(), std::move(shape), t.data()};
}

/// A tensor to write, from a row-major Eigen matrix (attn::Matrix<T>: shape (rows, cols)) or
/// a vector (a compile-time row or column vector such as attn::Vector<T>: shape (size)).
template <class T, int Rows, int Cols, int Options, int MaxRows, int MaxCols>
SafetensorsTensor safetensors_tensor(
    std::string name, const Eigen::Matrix<T, Rows, Cols, Options, MaxRows, MaxCols>& m) {
  constexpr bool is_vector = Rows == 1 || Cols == 1;
  static_assert(is_vector || (Options & Eigen::RowMajor) != 0,
                "safetensors_tensor: a column-major matrix would be written transposed; use "
                "attn::Matrix<T> (row-major)");
  std::vector<Index> shape;
  if (is_vector)
    shape = {m.size()};
  else
    shape = {m.rows(), m.cols()};
  return {std::move(name), dtype_of<T>(), std::move(shape), m.data()};
}
template <class T, int Rows, int Cols, int Options, int MaxRows, int MaxCols>
SafetensorsTensor safetensors_tensor(std::string name,
                                     Eigen::Matrix<T, Rows, Cols, Options, MaxRows, MaxCols>&& m) =
    delete;  // dangles

}  // namespace attn
