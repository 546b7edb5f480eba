// attn/safetensors/reader.hpp: SafetensorsFile, a checked .safetensors file read or viewed in
// place (attn/safetensors.hpp).
#pragma once

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
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

#if defined(__unix__) || defined(__APPLE__)
#define ATTN_SAFETENSORS_MMAP 1
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#else
#define ATTN_SAFETENSORS_MMAP 0
#endif

namespace attn {

namespace detail {

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

}  // namespace attn
