// attn/tensor.hpp: the matrix and tensor types of the library and strided head views.
//
// Shape legend used throughout the library:
//   B  batch            H  heads (Hq query heads, Hkv key/value heads)
//   L  sequence length  (Lq queries, Lk keys)
//   D  head dim of q/k  Dv head dim of v     E embedding width
//
// Storage is row-major everywhere, like NumPy and PyTorch: a (B, H, L, D) tensor has D
// contiguous. Kernels never see tensors, only HeadsView: a (B, H, L, D) view whose B, H
// and L strides are free and whose D stride is 1. That is what lets the same kernel read
// PyTorch's (B, H, L, D) layout, FlashAttention's (B, L, H, D) layout and the slices of a
// fused QKV projection without a transpose or a copy.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>

#include "attn/config.hpp"

namespace attn {

static_assert(std::is_same_v<Index, Eigen::Index>, "attn::Index must equal Eigen::Index");

/// Dynamic row-major matrix: rows are tokens, columns are features.
template <class T>
using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// Dynamic column vector.
template <class T>
using Vector = Eigen::Matrix<T, Eigen::Dynamic, 1>;

/// Row-major tensor, the layout of NumPy and PyTorch.
template <class T, int Rank>
using Tensor = Eigen::Tensor<T, Rank, Eigen::RowMajor, Index>;

/// Non-owning row-major tensor map (use `const T` for read-only data).
template <class T, int Rank>
using TensorMap = Eigen::TensorMap<Eigen::Tensor<T, Rank, Eigen::RowMajor, Index>>;

/// One (L, D) slice of a HeadsView as an Eigen matrix with a row stride.
template <class T>
using HeadMatrix = Eigen::Map<
    std::conditional_t<std::is_const_v<T>, const Matrix<std::remove_const_t<T>>, Matrix<T>>,
    Eigen::Unaligned, Eigen::OuterStride<>>;

/// Rows [first, first + count) of a head matrix, as a head matrix (Eigen's middleRows() is a
/// Block expression, which the kernels' HeadMatrix parameters do not accept).
template <class HeadMatrixT>  // HeadMatrix<T> or HeadMatrix<const T>
HeadMatrixT middle_rows(HeadMatrixT m, Index first, Index count) {
  ATTN_ASSERT(first >= 0 && count >= 0 && first + count <= m.rows());
  return HeadMatrixT(m.data() + first * m.outerStride(), count, m.cols(),
                     Eigen::OuterStride<>(m.outerStride()));
}

/// A (B, H, L, D) view over strided memory: free strides for B, H and L, unit stride for D.
/// `T` is `const S` for inputs and `S` for outputs. Non-owning: the memory must outlive it.
///
/// A packed view (packed_view()) holds B sequences of different lengths one after another
/// in (T, H, D) memory: `row_offsets` (B + 1 entries, FlashAttention's cu_seqlens) gives
/// where each starts, sequence b has rows(b) rows and `length` is the longest.
///
/// A paged view (attn/paged_kv_cache.hpp) holds each sequence's rows in pages of
/// `page_rows` rows taken from a pool at `data`: row r of sequence b lies in pool page
/// pages[b * pages_stride + r / page_rows] (negative: released, never read), which starts
/// batch_stride elements after the previous page; within a page the heads are head_stride
/// apart and the rows row_stride. Only the decode and flash kernels read paged views
/// (through row_data and contiguous_rows); head() refuses them.
template <class T>
struct HeadsView {
  T* data = nullptr;
  Index batch = 0, heads = 0, length = 0, dim = 0;          // (B, H, L, D)
  Index batch_stride = 0, head_stride = 0, row_stride = 0;  // in elements
  const Index* row_offsets = nullptr;                       // (B + 1), packed views only
  const Index* pages = nullptr;                             // (B, pages_stride), paged only
  Index page_rows = 0, pages_stride = 0;                    // paged views only

  /// Rows of sequence b: `length`, or its own length in a packed view.
  Index rows(Index b) const {
    return row_offsets == nullptr ? length : row_offsets[b + 1] - row_offsets[b];
  }

  /// The (rows(b), D) matrix of batch b, head h.
  HeadMatrix<T> head(Index b, Index h) const {
    ATTN_ASSERT(b >= 0 && b < batch && h >= 0 && h < heads && pages == nullptr);
    const Index first = row_offsets == nullptr ? b * batch_stride : row_offsets[b] * row_stride;
    // No arithmetic on the null data of an empty view (e.g. a (1, H, 0, D) sequence).
    T* base = data == nullptr ? nullptr : data + first + h * head_stride;
    return HeadMatrix<T>(base, rows(b), dim, Eigen::OuterStride<>(row_stride));
  }

  std::array<Index, 4> shape() const { return {batch, heads, length, dim}; }

  /// A read-only view of the same memory.
  operator HeadsView<const T>() const {  // NOLINT(google-explicit-constructor): const view
    return {data,        batch,      heads,       length, dim,       batch_stride,
            head_stride, row_stride, row_offsets, pages,  page_rows, pages_stride};
  }
};

namespace detail {

/// Throws unless `offsets` are FlashAttention's cu_seqlens for `tokens` tokens: at least one
/// entry, starting at 0, non-decreasing, ending at `tokens`.
inline void check_sequence_offsets(const char* function, const char* name,
                                   const std::vector<Index>& offsets, Index tokens) {
  if (offsets.empty() || offsets.front() != 0) {
    throw_invalid_argument(function, std::string(name) + " is " + list_string(offsets) +
                                         ": it must have B + 1 >= 1 entries starting at 0");
  }
  for (std::size_t b = 0; b + 1 < offsets.size(); ++b) {
    if (offsets[b + 1] < offsets[b]) {
      throw_invalid_argument(function, std::string(name) + " is " + list_string(offsets) +
                                           ": offsets must not decrease (entry " +
                                           std::to_string(b + 1) + ")");
    }
  }
  if (offsets.back() != tokens) {
    throw_invalid_argument(function, std::string(name) + " is " + list_string(offsets) +
                                         ": its last entry must equal the number of tokens, " +
                                         std::to_string(tokens));
  }
}

/// The address of row `row` of head (b, h): head(b, h).row(row).data() without forming a
/// matrix, so also for views of quantized blocks (attn/quantized.hpp).
template <class T>
T* row_data(const HeadsView<T>& x, Index b, Index h, Index row) {
  if (x.pages != nullptr) {
    const Index page = x.pages[b * x.pages_stride + row / x.page_rows];
    return x.data + page * x.batch_stride + h * x.head_stride + (row % x.page_rows) * x.row_stride;
  }
  const Index first =
      x.row_offsets == nullptr ? b * x.batch_stride : x.row_offsets[b] * x.row_stride;
  return x.data + first + h * x.head_stride + row * x.row_stride;
}

/// Where the rows after the run [row, row + count) of head (b, h) continue: the next page's
/// row_data in a paged view while that page is held, else right after the run in memory
/// (where an unpaged view continues; the address may lie past the data, for prefetching
/// only). What the decode kernel's prefetches request ahead of the rows it reads.
template <class T>
T* rows_after(const HeadsView<T>& x, Index b, Index h, Index row, Index count) {
  const Index next = row + count;
  if (x.pages != nullptr && next / x.page_rows < x.pages_stride &&
      x.pages[b * x.pages_stride + next / x.page_rows] >= 0 && next % x.page_rows == 0)
    return row_data(x, b, h, next);
  const auto after = reinterpret_cast<std::uintptr_t>(row_data(x, b, h, row)) +
                     static_cast<std::uintptr_t>(count * x.row_stride) * sizeof(T);
  return reinterpret_cast<T*>(after);  // NOLINT(performance-no-int-to-ptr): never dereferenced
}

/// Whether every row of `inner` lies within the same row of `outer`: one memory, the same
/// strides and pages, inner's columns among outer's (V as the first C columns of K in MLA's
/// latent cache).
template <class A, class B>
bool rows_within(const HeadsView<A>& inner, const HeadsView<B>& outer) {
  if constexpr (!std::is_same_v<std::remove_const_t<A>, std::remove_const_t<B>>) {
    return false;
  } else {
    // Addresses, not pointers: the two need not point into one array.
    const auto first = reinterpret_cast<std::uintptr_t>(inner.data);
    const auto outer_first = reinterpret_cast<std::uintptr_t>(outer.data);
    const auto bytes = [](Index units) {
      return static_cast<std::uintptr_t>(units) * sizeof(std::remove_const_t<A>);
    };
    return inner.data != nullptr && first >= outer_first &&
           first + bytes(inner.dim) <= outer_first + bytes(outer.dim) &&
           inner.row_stride == outer.row_stride && inner.head_stride == outer.head_stride &&
           inner.batch_stride == outer.batch_stride && inner.row_offsets == outer.row_offsets &&
           inner.pages == outer.pages && inner.page_rows == outer.page_rows &&
           inner.pages_stride == outer.pages_stride;
  }
}

/// How many rows from `row` on lie in the same memory run as `row` (row_stride apart): the
/// rest of its page in a paged view, else all the rest of the head.
template <class T>
Index contiguous_rows(const HeadsView<T>& x, Index row) {
  return x.pages == nullptr ? x.length - row : x.page_rows - row % x.page_rows;
}

/// packed_view() without its checks, for offsets the caller has validated.
template <class T>
HeadsView<T> unchecked_packed_view(HeadsView<T> tokens,                  // (1, H, T, D)
                                   const std::vector<Index>& offsets) {  // (B + 1)
  tokens.batch = offsets.empty() ? 0 : static_cast<Index>(offsets.size()) - 1;
  tokens.batch_stride = 0;
  tokens.row_offsets = offsets.data();
  tokens.length = 0;
  for (Index b = 0; b < tokens.batch; ++b)
    tokens.length = std::max(tokens.length, tokens.rows(b));
  return tokens;
}

/// A packed view's memory as the (1, H, T, D) view of all its tokens; other views unchanged.
/// What the overlap checks measure.
template <class T>
HeadsView<T> all_tokens(HeadsView<T> x) {
  if (x.row_offsets == nullptr)
    return x;
  const Index tokens = x.batch == 0 ? 0 : x.row_offsets[x.batch] - x.row_offsets[0];
  if (x.data != nullptr)
    x.data += x.row_offsets[0] * x.row_stride;
  return {x.data, 1, x.heads, tokens, x.dim, 0, x.head_stride, x.row_stride, nullptr};
}

}  // namespace detail

/// Packed sequences as one view: `tokens` (1, H, T, D), e.g. blhd_view(data, 1, T, H, D) of
/// (T, H, D) memory, read as B sequences one after another, sequence b being rows
/// [cu_seqlens[b], cu_seqlens[b + 1]) (FlashAttention's varlen layout). The result is a
/// (B, H, max length, D) view that every attention call accepts in place of a padded one.
/// `cu_seqlens` (B + 1 entries from 0 to T, non-decreasing) is checked here and must outlive
/// the view (a temporary does not compile).
template <class T>
HeadsView<T> packed_view(const HeadsView<T>& tokens,              // (1, H, T, D)
                         const std::vector<Index>& cu_seqlens) {  // (B + 1)
  constexpr const char* function = "packed_view";
  if (tokens.batch != 1 || tokens.row_offsets != nullptr) {
    detail::throw_invalid_argument(
        function,
        "tokens is " +
            detail::shape_string({tokens.batch, tokens.heads, tokens.length, tokens.dim}) +
            (tokens.row_offsets != nullptr ? ", already packed" : "") +
            ": it must be the (1, H, T, D) view of all tokens (e.g. "
            "blhd_view(data, 1, T, H, D))");
  }
  detail::check_sequence_offsets(function, "cu_seqlens", cu_seqlens, tokens.length);
  return detail::unchecked_packed_view(tokens, cu_seqlens);
}
template <class T>
HeadsView<T> packed_view(const HeadsView<T>& tokens, std::vector<Index>&& cu_seqlens) = delete;

namespace detail {

/// Where the kernels write per-row values (the log-sum-exp): (B, H, L) contiguous for padded
/// problems, (H, T) for packed ones (FlashAttention's varlen layout); null = not wanted.
template <class T>
struct RowValues {
  T* data = nullptr;
  Index batch_stride = 0, head_stride = 0;
  const Index* row_offsets = nullptr;  // (B + 1) for packed problems

  /// The row values of (b, h), row i at [i].
  T* head(Index b, Index h) const {
    if (data == nullptr)
      return nullptr;
    return data + (row_offsets == nullptr ? b * batch_stride : row_offsets[b]) + h * head_stride;
  }
};

/// (B, H, L) contiguous.
template <class T>
RowValues<T> padded_rows(T* data, Index heads, Index length) {
  return {data, heads * length, length, nullptr};
}

}  // namespace detail

/// Per-row values of (B, H, L) heads, such as the log-sum-exp of every query row: free B and
/// H strides, the L rows of one head contiguous (the layout of PyTorch's (B, H, L) and of
/// FlashAttention's packed (H, T) log-sum-exp). Packed like a packed HeadsView: `row_offsets`
/// (B + 1) gives where each sequence starts and `length` is the longest (packed_view()).
/// Non-owning: the memory must outlive it.
template <class T>
struct RowsView {
  T* data = nullptr;
  Index batch = 0, heads = 0, length = 0;   // (B, H, L)
  Index batch_stride = 0, head_stride = 0;  // in elements; the row stride is 1
  const Index* row_offsets = nullptr;       // (B + 1), packed views only

  std::array<Index, 3> shape() const { return {batch, heads, length}; }

  /// A read-only view of the same memory.
  operator RowsView<const T>() const {  // NOLINT(google-explicit-constructor): const view
    return {data, batch, heads, length, batch_stride, head_stride, row_offsets};
  }
};

/// View of contiguous (B, H, L) memory.
template <class T>
RowsView<T> bhl_view(T* data, Index batch, Index heads, Index length) {
  return {data, batch, heads, length, heads * length, length, nullptr};
}

/// View of a rank-3 row-major tensor (B, H, L).
template <class S>
RowsView<const S> bhl_view(const Tensor<S, 3>& t) {
  return bhl_view(t.data(), t.dimension(0), t.dimension(1), t.dimension(2));
}
template <class S>
RowsView<S> bhl_view(Tensor<S, 3>& t) {
  return bhl_view(t.data(), t.dimension(0), t.dimension(1), t.dimension(2));
}

/// Packed per-row values: `tokens` (1, H, T), e.g. bhl_view(data, 1, H, T) of FlashAttention's
/// (H, T) log-sum-exp, read as the sequences of `cu_seqlens` (checked as packed_view() of
/// heads checks it, and must outlive the view).
template <class T>
RowsView<T> packed_view(const RowsView<T>& tokens,               // (1, H, T)
                        const std::vector<Index>& cu_seqlens) {  // (B + 1)
  constexpr const char* function = "packed_view";
  if (tokens.batch != 1 || tokens.row_offsets != nullptr) {
    detail::throw_invalid_argument(
        function, "tokens is " + detail::shape_string({tokens.batch, tokens.heads, tokens.length}) +
                      (tokens.row_offsets != nullptr ? ", already packed" : "") +
                      ": it must be the (1, H, T) rows of all tokens (e.g. "
                      "bhl_view(data, 1, H, T))");
  }
  detail::check_sequence_offsets(function, "cu_seqlens", cu_seqlens, tokens.length);
  RowsView<T> packed = tokens;
  packed.batch = static_cast<Index>(cu_seqlens.size()) - 1;
  packed.batch_stride = 0;
  packed.row_offsets = cu_seqlens.data();
  packed.length = 0;
  for (std::size_t b = 0; b + 1 < cu_seqlens.size(); ++b)
    packed.length = std::max(packed.length, cu_seqlens[b + 1] - cu_seqlens[b]);
  return packed;
}
template <class T>
RowsView<T> packed_view(const RowsView<T>& tokens, std::vector<Index>&& cu_seqlens) = delete;

/// packed_view() of an (H, T) tensor, FlashAttention's packed log-sum-exp.
template <class S>
RowsView<const S> packed_view(const Tensor<S, 2>& tokens,              // (H, T)
                              const std::vector<Index>& cu_seqlens) {  // (B + 1)
  return packed_view(bhl_view(tokens.data(), 1, tokens.dimension(0), tokens.dimension(1)),
                     cu_seqlens);
}
template <class S>
RowsView<S> packed_view(Tensor<S, 2>& tokens,                    // (H, T)
                        const std::vector<Index>& cu_seqlens) {  // (B + 1)
  return packed_view(bhl_view(tokens.data(), 1, tokens.dimension(0), tokens.dimension(1)),
                     cu_seqlens);
}
template <class S>
RowsView<const S> packed_view(const Tensor<S, 2>& tokens, std::vector<Index>&& cu_seqlens) = delete;
template <class S>
RowsView<S> packed_view(Tensor<S, 2>& tokens, std::vector<Index>&& cu_seqlens) = delete;

/// View of contiguous (B, H, L, D) memory (PyTorch's SDPA layout).
template <class T>
HeadsView<T> bhld_view(T* data, Index batch, Index heads, Index length, Index dim) {
  return {data, batch, heads, length, dim, heads * length * dim, length * dim, dim};
}

/// View of contiguous (B, L, H, D) memory as (B, H, L, D) (FlashAttention's layout and the
/// natural output of a projection): no transpose, only different strides.
template <class T>
HeadsView<T> blhd_view(T* data, Index batch, Index length, Index heads, Index dim) {
  return {data, batch, heads, length, dim, length * heads * dim, dim, heads * dim};
}

/// View of a rank-4 row-major tensor or tensor map holding (B, H, L, D).
template <class S>
HeadsView<const S> bhld_view(const Tensor<S, 4>& t) {
  return bhld_view(t.data(), t.dimension(0), t.dimension(1), t.dimension(2), t.dimension(3));
}
template <class S>
HeadsView<S> bhld_view(Tensor<S, 4>& t) {
  return bhld_view(t.data(), t.dimension(0), t.dimension(1), t.dimension(2), t.dimension(3));
}
template <class S>
HeadsView<const S> bhld_view(
    const Eigen::TensorMap<const Eigen::Tensor<S, 4, Eigen::RowMajor, Index>>& t) {
  return bhld_view(t.data(), t.dimension(0), t.dimension(1), t.dimension(2), t.dimension(3));
}
template <class S>
HeadsView<S> bhld_view(const Eigen::TensorMap<Eigen::Tensor<S, 4, Eigen::RowMajor, Index>>& t) {
  return bhld_view(t.data(), t.dimension(0), t.dimension(1), t.dimension(2), t.dimension(3));
}

/// packed_view() of (T, H, D) tensors: the usual storage of packed tokens.
template <class S>
HeadsView<const S> packed_view(const Tensor<S, 3>& tokens,              // (T, H, D)
                               const std::vector<Index>& cu_seqlens) {  // (B + 1)
  return packed_view(
      blhd_view(tokens.data(), 1, tokens.dimension(0), tokens.dimension(1), tokens.dimension(2)),
      cu_seqlens);
}
template <class S>
HeadsView<S> packed_view(Tensor<S, 3>& tokens,                    // (T, H, D)
                         const std::vector<Index>& cu_seqlens) {  // (B + 1)
  return packed_view(
      blhd_view(tokens.data(), 1, tokens.dimension(0), tokens.dimension(1), tokens.dimension(2)),
      cu_seqlens);
}
template <class S>
HeadsView<const S> packed_view(const Tensor<S, 3>& tokens,
                               std::vector<Index>&& cu_seqlens) = delete;
template <class S>
HeadsView<S> packed_view(Tensor<S, 3>& tokens, std::vector<Index>&& cu_seqlens) = delete;

namespace detail {

/// Recognises the rank-4 row-major tensors and maps the batched API accepts.
template <class X>
struct rank4_tensor : std::false_type {};
template <class S>
struct rank4_tensor<Eigen::Tensor<S, 4, Eigen::RowMajor, Index>> : std::true_type {
  using scalar = S;
};
template <class S, int Options, template <class> class MakePointer>
struct rank4_tensor<
    Eigen::TensorMap<Eigen::Tensor<S, 4, Eigen::RowMajor, Index>, Options, MakePointer>>
    : std::true_type {
  using scalar = S;
};
template <class S, int Options, template <class> class MakePointer>
struct rank4_tensor<
    Eigen::TensorMap<const Eigen::Tensor<S, 4, Eigen::RowMajor, Index>, Options, MakePointer>>
    : std::true_type {
  using scalar = S;
};
template <class S, int Options, template <class> class MakePointer>
struct rank4_tensor<
    Eigen::TensorMap<Eigen::Tensor<const S, 4, Eigen::RowMajor, Index>, Options, MakePointer>>
    : std::true_type {
  using scalar = S;
};
template <class S>
struct rank4_tensor<HeadsView<S>> : std::true_type {
  using scalar = std::remove_const_t<S>;
};

template <class X>
inline constexpr bool is_rank4_tensor_v = rank4_tensor<X>::value;

template <class X>
using rank4_scalar_t = typename rank4_tensor<X>::scalar;

/// False when views a and b (padded or packed) cannot share an element: their address ranges are
/// disjoint, or both are disjoint column blocks of the same rows of a row-major buffer (e.g. the q,
/// k and v blocks of a fused QKV buffer). True otherwise (conservative: they may overlap).
template <class S>
bool views_may_overlap(const HeadsView<const S>& a_view, const HeadsView<const S>& b_view) {
  const HeadsView<const S> a = all_tokens(a_view), b = all_tokens(b_view);
  const auto empty = [](const HeadsView<const S>& x) {
    return x.batch == 0 || x.heads == 0 || x.length == 0 || x.dim == 0;
  };
  if (empty(a) || empty(b))
    return false;
  const auto span = [](const HeadsView<const S>& x) {  // elements from data to the last + 1
    return (x.batch - 1) * x.batch_stride + (x.heads - 1) * x.head_stride +
           (x.length - 1) * x.row_stride + x.dim;
  };
  const S* a_end = a.data + span(a);
  const S* b_end = b.data + span(b);
  if (a_end <= b.data || b_end <= a.data)
    return false;
  const Index width = a.row_stride;                       // columns of the shared rows
  const auto columns = [](const HeadsView<const S>& x) {  // used columns of a row
    return (x.heads - 1) * x.head_stride + x.dim;
  };
  if (width <= 0 || b.row_stride != width || a.batch_stride % width != 0 ||
      b.batch_stride % width != 0 || columns(a) > width || columns(b) > width)
    return true;
  const S* base = std::min(a.data, b.data);
  const Index a_column = (a.data - base) % width, b_column = (b.data - base) % width;
  if (a_column + columns(a) > width || b_column + columns(b) > width)
    return true;
  return a_column < b_column + columns(b) && b_column < a_column + columns(a);
}

/// Whether two views of different scalars may share memory: their byte ranges overlap.
template <class A, class B>
bool byte_ranges_overlap(const HeadsView<const A>& a_view, const HeadsView<const B>& b_view) {
  const HeadsView<const A> a = all_tokens(a_view);
  const HeadsView<const B> b = all_tokens(b_view);
  const auto bytes = [](const auto& x) {  // [first, last) byte addresses, empty if no element
    using S = std::remove_const_t<std::remove_pointer_t<decltype(x.data)>>;
    const Index elements = x.batch == 0 || x.heads == 0 || x.length == 0 || x.dim == 0
                               ? 0
                               : (x.batch - 1) * x.batch_stride + (x.heads - 1) * x.head_stride +
                                     (x.length - 1) * x.row_stride + x.dim;
    const auto first = reinterpret_cast<std::uintptr_t>(x.data);
    return std::array<std::uintptr_t, 2>{first,
                                         first + static_cast<std::uintptr_t>(elements) * sizeof(S)};
  };
  const auto [a_first, a_last] = bytes(a);
  const auto [b_first, b_last] = bytes(b);
  return a_first < a_last && b_first < b_last && a_first < b_last && b_first < a_last;
}

/// A RowsView as the (B, H, L, 1) heads view that the shape, packing and overlap checks
/// measure.
template <class T>
HeadsView<T> rows_as_heads(const RowsView<T>& r) {
  return {r.data, r.batch, r.heads, r.length, 1, r.batch_stride, r.head_stride, 1, r.row_offsets};
}

/// Where the kernels write a RowsView's values (row i of (b, h) at head(b, h)[i]).
template <class T>
RowValues<T> row_values(const RowsView<T>& r) {
  return {r.data, r.batch_stride, r.head_stride, r.row_offsets};
}

/// Read-only (B, H, L, D) view of anything rank4_tensor accepts.
template <class X>
HeadsView<const rank4_scalar_t<X>> as_heads_view(const X& x) {
  if constexpr (std::is_same_v<X, HeadsView<rank4_scalar_t<X>>> ||
                std::is_same_v<X, HeadsView<const rank4_scalar_t<X>>>) {
    return x;
  } else {
    return bhld_view(static_cast<const rank4_scalar_t<X>*>(x.data()), x.dimension(0),
                     x.dimension(1), x.dimension(2), x.dimension(3));
  }
}

}  // namespace detail
}  // namespace attn
