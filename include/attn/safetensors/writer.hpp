// attn/safetensors/writer.hpp: .safetensors files written from tensors (attn/safetensors.hpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <Eigen/Core>
#include <nlohmann/json.hpp>

#include "attn/config.hpp"
#include "attn/safetensors/dtype.hpp"
#include "attn/safetensors/header.hpp"
#include "attn/tensor.hpp"

namespace attn {

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
