// attn/kernels/decode.hpp: attention for a few queries against many keys (decoding).
//
//   q      (B, Hq, Lq, D)     T: float or double; Lq small (1 when generating a token)
//   k      (B, Hkv, Lk, D)    S: T, or Eigen::half / Eigen::bfloat16 when T is float
//   v      (B, Hkv, Lk, Dv)   S
//   out    (B, Hq, Lq, Dv)    T
//
// Decoding is memory-bound: each call reads every visible key and value once and does only
// about 4 * G FLOPs per element read (G = Hq / Hkv query heads per key/value head). The
// prefill kernels take one (b, query head) per work item, so with grouped-query attention
// they read each key/value head G times, and a one-row query tile uses one lane in 16 of
// their score products. This kernel instead:
//   - takes all G * Lq query rows of one (b, kv head) as one tile: K and V are streamed once
//     per group, not once per query head;
//   - splits the keys of each (b, kv head) into splits of `split_keys` keys (a constant, not
//     derived from the thread count) and runs (b, kv head, split) items in parallel, so one
//     long sequence keeps every core busy;
//   - per split keeps a partial online softmax (running max m, sum l, unnormalised
//     accumulator acc) for every row, then merges the splits of a (b, kv head) by
//     log-sum-exp in split order. Every item is computed the same way whatever the thread
//     count and the merge order is fixed, so results are bitwise identical for any number
//     of threads;
//   - reads K and V in S, so a half cache costs half the bandwidth. With AVX-512 and float
//     compute, the two products are register-blocked kernels that widen each 16-element
//     piece of a k or v row in a register and prefetch 32 rows ahead
//     (kernels/decode_avx512.hpp); otherwise blocks of `key_block` rows are widened into
//     the workspace (detail::widen, precision.hpp) and multiplied by Eigen.
// Accumulation (scores, softmax sums, P V) is always in T, never in half: a half accumulator
// has an 11-bit significand, so summing thousands of weights stops growing once the sum
// reaches 2^11 ulps of the terms (see the long-context test).
//
// Masks: the full Mask<T> (causal either alignment, window, key lengths, keep-mask, bias,
// ALiBi, softcap). Splits and key blocks outside every row's visible interval are skipped
// without arithmetic. A row that sees no key gives zeros and log-sum-exp -inf; NaN
// propagates.
//
// Extra memory: per call, partials of splits * G * Lq * (Dv + 2) scalars for every
// (b, kv head), splits = ceil(Lk / split_keys); per thread, G * Lq * (D + key_block + Dv + 3)
// scalars, plus key_block * (D + Dv) when S != T on the portable path (the widened K and V
// block; the AVX-512 path widens in registers).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/kernels/decode_avx512.hpp"
#include "attn/mask.hpp"
#include "attn/precision.hpp"
#include "attn/softmax.hpp"
#include "attn/tensor.hpp"

namespace attn {

/// Algorithm::automatic uses the decode kernel for at most this many queries per head.
/// Measured (bench_decode's decode_vs_flash_by_Lq, Lk = 4096, D = 128, one thread): with
/// the AVX-512 products, decode takes 0.64x / 0.17x the flash time at Lq = 1 (MHA / GQA
/// 32/8), 0.85x / 0.54x at Lq = 8 and 1.2x / 0.95x at Lq = 16. Eigen's row-by-row products
/// (the path without AVX-512) stop paying earlier: 1.0x / 0.6x at Lq = 4 and 1.3x / 1.0x at
/// Lq = 8 (measured on the same machine before the AVX-512 products existed).
inline constexpr Index decode_max_queries = ATTN_HAS_AVX512_DECODE ? 8 : 4;
/// Keys per split of the decode kernel: the unit of parallel work and of the merge.
inline constexpr Index decode_split_keys = 512;
/// Keys per block inside a split (converted, scored and accumulated together).
inline constexpr Index decode_key_block = 64;

namespace detail {

/// Per-thread scratch of the decode kernel; sized once per call by reserve().
template <class T>
struct DecodeWorkspace {
  Matrix<T> q;      // (R, D)   scale * the group's queries, R = G * Lq, row g * Lq + i
  Matrix<T> s;      // (R, Bk)  scores -> probabilities of one key block
  Matrix<T> acc;    // (R, Dv)  unnormalised output of the current split
  Vector<T> m;      // (R)      running max
  Vector<T> l;      // (R)      running sum of exp(score - m)
  Vector<T> alpha;  // (R)      rescale factor of the current key block
  Matrix<T> k, v;   // (Bk, D), (Bk, Dv) the block converted to T (only when S != T)

  void reserve(Index rows, Index key_block, Index dim, Index value_dim, bool convert) {
    q.resize(rows, dim);
    s.resize(rows, key_block);
    acc.resize(rows, value_dim);
    m.resize(rows);
    l.resize(rows);
    alpha.resize(rows);
    if (convert) {
      k.resize(key_block, dim);
      v.resize(key_block, value_dim);
    }
  }
};

/// Whether decode_split runs the AVX-512 products (kernels/decode_avx512.hpp), which widen
/// K and V in registers, instead of widening blocks into the workspace for Eigen's products.
template <class T>
inline constexpr bool uses_fused_decode_v = ATTN_HAS_AVX512_DECODE != 0 && std::is_same_v<T, float>;

/// Rows [j0, j0 + rows) of one (L, cols) head of `x` as a T matrix: the memory itself when
/// S == T, else converted into `buffer` (at least (rows, cols)).
template <class T, class S>
Eigen::Map<const Matrix<T>, 0, Eigen::OuterStride<>> block_as(const HeadsView<const S>& x, Index b,
                                                              Index h, Index j0, Index rows,
                                                              Matrix<T>& buffer) {
  const S* first = x.head(b, h).row(j0).data();
  if constexpr (std::is_same_v<S, T>) {
    return {first, rows, x.dim, Eigen::OuterStride<>(x.row_stride)};
  } else {
    if (x.row_stride == x.dim) {  // contiguous rows (a KV cache): one conversion run
      widen(first, buffer.data(), rows * x.dim);
    } else {
      for (Index r = 0; r < rows; ++r)
        widen(first + r * x.row_stride, buffer.data() + r * x.dim, x.dim);
    }
    return {buffer.data(), rows, x.dim, Eigen::OuterStride<>(x.dim)};
  }
}

/// One split [j0, j1) of one (b, kv head): the partial online softmax of all R = G * Lq rows
/// of the group, written as m (R), l (R), acc (R, Dv) at `partial`. Rows that see no key of
/// the split get m = -inf, l = 0 (acc is then not written).
///   pass 1: q tile = scale * the group's queries
///   pass 2: for each key block the mask does not hide:
///             k, v block converted to T (S != T)
///             s = q tile * k block^T                   one product
///             mask s (per query head: bias, keep-mask and ALiBi depend on it)
///             m' = max(m, rowmax s); p = exp(s - m'); l = l * exp(m - m') + rowsum p
///             acc = acc * exp(m - m') + p * v block    one product
template <class T, class S>
void decode_split(const HeadsView<const T>& q,  // (B, Hq, Lq, D)
                  const HeadsView<const S>& k,  // (B, Hkv, Lk, D)
                  const HeadsView<const S>& v,  // (B, Hkv, Lk, Dv)
                  const Mask<T>& mask, T scale, Index b, Index kv_head, Index j0, Index j1,
                  Index key_block, DecodeWorkspace<T>& workspace,
                  T* partial) {  // m (R), l (R), acc (R, Dv)
  constexpr T minus_inf = -std::numeric_limits<T>::infinity();
  constexpr bool fused = uses_fused_decode_v<T>;
  const Index group = q.heads / k.heads, q_length = q.length, rows = group * q_length;
  const Index value_dim = v.dim;
  Eigen::Map<Vector<T>> m(partial, rows), l(partial + rows, rows);
  Eigen::Map<Matrix<T>> acc(partial + 2 * rows, rows, value_dim);
  m.setConstant(minus_inf);
  l.setZero();

  const auto [keys_first, keys_last] = mask.key_range(b, 0, q_length);
  const Index lo = std::max(j0, keys_first), hi = std::min(j1, keys_last);
  if (lo >= hi || mask.classify(b, kv_head * group, 0, q_length, lo, hi) == TileVisibility::hidden)
    return;

  Eigen::Map<Matrix<T>> q_tile(workspace.q.data(), rows, q.dim);  // pass 1
  for (Index g = 0; g < group; ++g)
    q_tile.middleRows(g * q_length, q_length) = scale * q.head(b, kv_head * group + g);

  bool first_block = true;
  for (Index c0 = lo; c0 < hi; c0 += key_block) {  // pass 2
    const Index c1 = std::min(c0 + key_block, hi), cols = c1 - c0;
    const TileVisibility visibility = mask.classify(b, kv_head * group, 0, q_length, c0, c1);
    if (visibility == TileVisibility::hidden)
      continue;
    Eigen::Map<Matrix<T>, 0, Eigen::OuterStride<>> s(workspace.s.data(), rows, cols,
                                                     Eigen::OuterStride<>(workspace.s.cols()));
    if constexpr (fused) {
#if ATTN_HAS_AVX512_DECODE
      avx512::decode_scores(q_tile.data(), q.dim, rows, k.head(b, kv_head).row(c0).data(),
                            k.row_stride, cols, q.dim, s.data(), s.outerStride());
#endif
    } else {
      const auto k_block = block_as<T>(k, b, kv_head, c0, cols, workspace.k);
      // One matrix-vector product per row: Eigen's GEMM packs both operands, which at
      // G * Lq <= 64 rows costs more than the arithmetic (measured 1.6x slower).
      for (Index r = 0; r < rows; ++r)
        s.row(r).noalias() = q_tile.row(r) * k_block.transpose();
    }
    if (visibility == TileVisibility::partial || mask.modifies_scores()) {
      for (Index g = 0; g < group; ++g) {
        auto head_rows = s.middleRows(g * q_length, q_length);
        mask.apply(b, kv_head * group + g, 0, c0, head_rows);
      }
    }
    for (Index r = 0; r < rows; ++r)
      workspace.alpha(r) = online_softmax_step(s.row(r).data(), cols, m(r), l(r));
    if constexpr (fused) {
#if ATTN_HAS_AVX512_DECODE
      avx512::decode_weighted_sum(s.data(), s.outerStride(), rows,
                                  v.head(b, kv_head).row(c0).data(), v.row_stride, cols, value_dim,
                                  workspace.alpha.data(), first_block, acc.data(), value_dim);
#endif
      first_block = false;
      continue;
    }
    const auto v_block = block_as<T>(v, b, kv_head, c0, cols, workspace.v);
    for (Index r = 0; r < rows; ++r) {
      if (first_block) {
        acc.row(r).noalias() = s.row(r) * v_block;
      } else {
        if (workspace.alpha(r) != T(1))
          acc.row(r) *= workspace.alpha(r);
        acc.row(r).noalias() += s.row(r) * v_block;
      }
    }
    first_block = false;
  }
}

/// Decode attention over all (b, query head): see the top of this file. `logsumexp`
/// (B, Hq, Lq) contiguous, or null. Shapes and the mask must already be validated (the
/// caller is scaled_dot_product_attention_into or KVCache::attend); `split_keys` and
/// `key_block` (> 0) are parameters only so that tests can exercise many splits cheaply.
template <class T, class S>
void decode_attention(const HeadsView<const T>& q,  // (B, Hq, Lq, D)
                      const HeadsView<const S>& k,  // (B, Hkv, Lk, D)
                      const HeadsView<const S>& v,  // (B, Hkv, Lk, Dv)
                      const HeadsView<T>& out,      // (B, Hq, Lq, Dv)
                      const Mask<T>& mask, T scale,
                      T* logsumexp,  // (B, Hq, Lq) or null
                      Index split_keys = decode_split_keys, Index key_block = decode_key_block) {
  static_assert(std::is_floating_point_v<T>, "decode_attention: T must be float or double");
  static_assert(std::is_same_v<S, T> ||
                    (std::is_same_v<T, float> &&
                     (std::is_same_v<S, Eigen::half> || std::is_same_v<S, Eigen::bfloat16>)),
                "decode_attention: S must be T, or Eigen::half / Eigen::bfloat16 with T = float");
  constexpr T minus_inf = -std::numeric_limits<T>::infinity();
  ATTN_ASSERT(split_keys > 0 && key_block > 0);
  const Index batch = q.batch, q_heads = q.heads, kv_heads = k.heads, q_length = q.length;
  const Index k_length = k.length, value_dim = v.dim;
  if (batch == 0 || q_heads == 0 || q_length == 0)
    return;
  const Index group = q_heads / kv_heads, rows = group * q_length;
  const Index splits = (k_length + split_keys - 1) / split_keys;
  const Index partial_size = rows * (value_dim + 2);
  const Index groups = batch * kv_heads, work_items = groups * splits;
  std::vector<T> partials(static_cast<std::size_t>(work_items * partial_size));
  const double flops = 2.0 * static_cast<double>(q_length * k_length) *
                       static_cast<double>(q.dim + value_dim) *
                       static_cast<double>(batch * q_heads);
  (void)flops;

#if ATTN_HAS_OPENMP
#pragma omp parallel if (work_items > 1 && flops > 1e6)
#endif
  {
    DecodeWorkspace<T> workspace;  // one per thread, allocated once per call
    workspace.reserve(rows, std::min(key_block, std::max(k_length, Index(1))), q.dim, value_dim,
                      !std::is_same_v<S, T> && !uses_fused_decode_v<T>);
#if ATTN_HAS_OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (Index item = 0; item < work_items; ++item) {
      const Index pair = item / splits, split = item % splits;  // pair = b * Hkv + kv head
      const Index j0 = split * split_keys, j1 = std::min(j0 + split_keys, k_length);
      decode_split<T, S>(q, k, v, mask, scale, pair / kv_heads, pair % kv_heads, j0, j1,
                         std::min(key_block, k_length), workspace,
                         partials.data() + item * partial_size);
    }

    // Merge the splits of each (b, kv head) in split order:
    //   M = max_s m_s;  l = sum_s l_s exp(m_s - M);  out = sum_s acc_s exp(m_s - M) / l
    // Splits a row sees nothing of (m_s = -inf) are skipped: their acc was never written.
#if ATTN_HAS_OPENMP
#pragma omp for schedule(static)
#endif
    for (Index pair = 0; pair < groups; ++pair) {
      const Index b = pair / kv_heads, kv_head = pair % kv_heads;
      const T* first = partials.data() + pair * splits * partial_size;
      for (Index r = 0; r < rows; ++r) {
        const Index h = kv_head * group + r / q_length, i = r % q_length;
        HeadMatrix<T> head_out = out.head(b, h);
        auto out_row = head_out.row(i);
        T max = minus_inf;
        for (Index s = 0; s < splits; ++s) {
          const T m_s = first[s * partial_size + r];
          if (m_s > max || std::isnan(m_s))  // once max is NaN it stays NaN
            max = m_s;
        }
        T* lse = logsumexp != nullptr ? logsumexp + (b * q_heads + h) * q_length + i : nullptr;
        if (max == minus_inf) {  // the row sees no key: zeros, lse -inf
          out_row.setZero();
          if (lse != nullptr)
            *lse = minus_inf;
          continue;
        }
        T sum = 0;
        bool started = false;
        for (Index s = 0; s < splits; ++s) {
          const T* partial = first + s * partial_size;
          const T m_s = partial[r];
          if (m_s == minus_inf)
            continue;
          const T factor = std::exp(m_s - max);
          const Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>> acc_s(
              partial + 2 * rows + r * value_dim, value_dim);
          sum += partial[rows + r] * factor;
          if (started) {
            out_row += factor * acc_s;
          } else {
            out_row = factor * acc_s;
            started = true;
          }
        }
        if (sum == T(0)) {
          out_row.setZero();
          if (lse != nullptr)
            *lse = minus_inf;
          continue;
        }
        out_row *= T(1) / sum;
        if (lse != nullptr)
          *lse = max + std::log(sum);
      }
    }
  }
}

}  // namespace detail
}  // namespace attn
