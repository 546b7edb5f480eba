// attn/safetensors/header.hpp: a .safetensors header parsed and checked as untrusted input
// (attn/safetensors.hpp lists the rules): the entries, SafetensorsError.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include <Eigen/Core>
#include <nlohmann/json.hpp>

#include "attn/config.hpp"
#include "attn/safetensors/dtype.hpp"
#include "attn/tensor.hpp"

namespace attn {

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

}  // namespace detail

}  // namespace attn
