// attn/kernels/gemm.hpp: the float GEMM of the projections, dispatched at run time by
// instruction set (a plain -O2 build runs the AVX2 or AVX-512 kernel the CPU has).
//
//   c (M, N) = a (M, K) b (K, N) [+ c] [+ bias (N) on every row]
//
// All row-major with free row strides (lda, ldb, ldc, in elements). For the projections,
// M = B*S rows of x, K = in features, N = out features, b = W stored (in, out).
//
// Blocking (GotoBLAS / BLIS, transposed for row-major c: vectors run along N):
//   register block   mr x nr = gemm_rows x gemm_vectors * lanes of c in registers
//                    (avx512 14 x 32: 28 zmm accumulators; avx2 6 x 16: 12 ymm), each step
//                    of K one row of the b panel (nr floats) and mr broadcasts of a.
//   kc               the depth of a block, at most 256 (equal blocks): the b panel (kc x nr,
//                    32 KB / 16 KB) stays near L1 while the a panels of a block pass under it.
//   mc               rows of a packed per block (avx512 112, avx2 144): mc x kc of a, ~110-140
//                    KB, stays in L2 while the b panels of the whole column block pass over it.
//   nc               columns of b packed at once (at most 4096): kc x nc, in L3, shared by the
//                    threads.
// Packing copies both operands once per block into panels in the order the micro-kernel
// reads them (kernels/simd/gemm_micro.inl), so that its loads are contiguous whatever the
// strides. A product of at most gemm_unpacked_rows rows (decoding one token) skips it: each
// row of c runs the same chains straight from a and b (Gemm::rows_unpacked), which for one
// row is 3 to 6 times faster than packing b and computing a whole register block (tiny LM
// and BERT-base shapes, AVX2 and AVX-512), and gives the same bits.
//
// Order of summation: every c[i, j] is one FMA chain over k = 0 .. K-1 in order, started
// from c (accumulate) or 0, the bias added after the last step; K is never split between
// threads and blocks never change the chain, so results are bitwise identical for any thread
// count. Threads (OpenMP): each (K-block) the team packs the b block together, then every
// thread computes its own rows of c (or its own columns, when there are too few rows).
// With parallel = false (plan_gemm: problems under 1 MFLOP) it runs on the calling thread.
//
// Extra memory (none for a few rows): kc * nc_used floats for the packed b block (nc_used = N
// rounded up to nr, at most 4096: 2.4 MB at K = 768, N = 2304) plus mc * kc floats per thread for
// the packed a block (112 KB for avx512, 144 KB for avx2). The buffer belongs to the calling thread
// and is kept for its next call (it grows to the largest problem seen, never shrinks).
//
// Speed against Eigen's GEMM and the FMA probe: bench/bench_gemm.cpp, docs/performance.md.
//
// The generic path (Isa::generic, and every scalar but float) is Eigen's product on maps,
// compiled for the translation unit's own flags, with Eigen's own threading.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/cpu.hpp"
#include "attn/kernels/generic.hpp"
#include "attn/kernels/simd/tile_products.hpp"
#include "attn/tensor.hpp"

namespace attn::detail {

/// c = a b [+ c] [+ bias] with Eigen's GEMM, for any scalar and any CPU.
template <class T>
void gemm_generic(Index m, Index n, Index k, const T* a, Index lda, const T* b, Index ldb, T* c,
                  Index ldc, const T* bias = nullptr, bool accumulate = false) {
  using Rows = Eigen::Map<Matrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
  using ConstRows = Eigen::Map<const Matrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
  if (m == 0 || n == 0)
    return;
  Rows cm(c, m, n, Eigen::OuterStride<>(ldc));
  if (k == 0) {
    if (!accumulate)
      cm.setZero();
  } else {
    const ConstRows am(a, m, k, Eigen::OuterStride<>(lda));
    const ConstRows bm(b, k, n, Eigen::OuterStride<>(ldb));
    if (accumulate)
      cm.noalias() += am * bm;
    else
      cm.noalias() = am * bm;
  }
  if (bias != nullptr)
    cm.rowwise() += Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>(bias, n);
}

/// Blocks of at most `most` covering n as evenly as possible, each a multiple of `multiple`
/// (except the last): the size of all but the last.
inline Index gemm_even_block(Index n, Index most, Index multiple) {
  const Index blocks = (n + most - 1) / most;
  const Index size = (n + blocks - 1) / blocks;
  return std::min(most, (size + multiple - 1) / multiple * multiple);
}

/// [begin, end) of `part` of `parts` equal shares of `count` units of `unit` elements,
/// clipped to `total` elements.
inline void gemm_share(Index count, Index unit, Index total, int part, int parts, Index& begin,
                       Index& end) {
  begin = std::min(total, count * part / parts * unit);
  end = std::min(total, count * (part + 1) / parts * unit);
}

/// 64-byte aligned float storage, uninitialised; grows, never shrinks.
class GemmBuffer {
 public:
  float* reserve(std::size_t floats) {
    if (floats > capacity_) {
      storage_.reset(new float[floats + 16]);
      capacity_ = floats;
    }
    const auto address = reinterpret_cast<std::uintptr_t>(storage_.get());
    return storage_.get() + (((64 - address % 64) % 64) / sizeof(float));
  }

 private:
  std::unique_ptr<float[]> storage_;
  std::size_t capacity_ = 0;
};

/// The packed panels of the calling thread, kept between calls: the projections of a model
/// call the GEMM again and again at the same shapes, and fresh pages cost a fault each.
inline GemmBuffer& gemm_thread_buffer() {
  thread_local GemmBuffer buffer;
  return buffer;
}

/// The packed GEMM on the kernels of one instruction set (K = avx2::Gemm or avx512::Gemm, with
/// their cache blocks).
template <class K>
void gemm_packed(Index m, Index n, Index k, const float* a, Index lda, const float* b, Index ldb,
                 float* c, Index ldc, const float* bias, bool accumulate, bool parallel) {
  constexpr Index mr = K::rows, nr = K::columns;
  const Index kc = gemm_even_block(k, K::block_depth, 8);
  const Index nc = gemm_even_block(n, K::block_columns, nr);
  const Index mc = K::block_rows;
  const Index b_floats = kc * ((std::min(nc, n) + nr - 1) / nr * nr);
  const Index a_floats = (mc * kc + 15) / 16 * 16;
  const int max_team = parallel ? max_threads() : 1;
  // Reserved here, not in the parallel region, so that std::bad_alloc reaches the caller.
  float* const bp =
      gemm_thread_buffer().reserve(static_cast<std::size_t>(b_floats + a_floats * max_team));
  const Index row_panels = (m + mr - 1) / mr;

#if ATTN_HAS_OPENMP
#pragma omp parallel if (parallel) num_threads(max_team)
#endif
  {
#if ATTN_HAS_OPENMP
    const int team = omp_get_num_threads(), me = omp_get_thread_num();
#else
    const int team = 1, me = 0;
#endif
    float* const ap = bp + b_floats + a_floats * me;
    for (Index jc = 0; jc < n; jc += nc) {
      const Index nb = std::min(nc, n - jc);
      const Index column_panels = (nb + nr - 1) / nr;
      // this thread's rows [i0, i1) and columns [j0, j1) of the column block
      Index i0 = 0, i1 = m, j0 = 0, j1 = nb;
      if (row_panels >= Index{4} * team || row_panels >= column_panels)
        gemm_share(row_panels, mr, m, me, team, i0, i1);
      else
        gemm_share(column_panels, nr, nb, me, team, j0, j1);
      for (Index pc = 0; pc < k; pc += kc) {
        const Index kb = std::min(kc, k - pc);
        const bool last = pc + kb == k;
#if ATTN_HAS_OPENMP
#pragma omp for schedule(static)
#endif
        for (Index q = 0; q < column_panels; ++q) {
          K::pack_b(b + pc * ldb + jc + q * nr, ldb, kb, std::min(nr, nb - q * nr),
                    bp + q * nr * kb);
        }
        if (j0 < j1) {
          for (Index ic = i0; ic < i1; ic += mc) {
            const Index mb = std::min(mc, i1 - ic);
            K::pack_a(a + ic * lda + pc, lda, mb, kb, ap);
            K::block(mb, j1 - j0, kb, ap, bp + j0 * kb, c + ic * ldc + jc + j0, ldc,
                     accumulate || pc > 0, last && bias != nullptr ? bias + jc + j0 : nullptr);
          }
        }
#if ATTN_HAS_OPENMP
#pragma omp barrier  // before the b block is packed again
#endif
      }
    }
  }
}

/// Products of at most this many rows skip the packing (gemm_unpacked): decoding one token
/// multiplies one row, for which packing b and computing a register block of mr rows cost
/// several times the product. The same bits either way. Measured (Xeon, AVX-512 and AVX2;
/// K x N of 64 x 192 to 768 x 2304): unpacked 3-6x faster for one row, 1.3-3x for two,
/// from three or four rows on at par or slower where b is large.
inline constexpr Index gemm_unpacked_rows = 2;

/// The GEMM of a few rows on the kernels of one instruction set, a and b read as they lie
/// (K::rows_unpacked): the columns in strips of 256, shared by the threads with `parallel`.
template <class K>
void gemm_unpacked(Index m, Index n, Index k, const float* a, Index lda, const float* b, Index ldb,
                   float* c, Index ldc, const float* bias, bool accumulate, bool parallel) {
  constexpr Index strip = 256;
  const Index strips = (n + strip - 1) / strip;
  (void)parallel;
#if ATTN_HAS_OPENMP
#pragma omp parallel for if (parallel && strips > 1) schedule(static)
#endif
  for (Index s = 0; s < strips; ++s) {
    const Index j = s * strip;
    K::rows_unpacked(m, std::min(strip, n - j), k, a, lda, b + j, ldb, c + j, ldc,
                     bias == nullptr ? nullptr : bias + j, accumulate);
  }
}

/// The GEMM entry of an instruction set's table (kernels/dispatch.hpp): c (M, N) = a (M, K)
/// * b (K, N) [+ c if accumulate] [+ bias (N) on every row], row-major, strides in elements;
/// the packed kernels of K (avx2::Gemm, avx512::Gemm), or Eigen's product for generic::Gemm.
/// c must not overlap a, b or bias. With `parallel` (plan_gemm's choice, attn/plan.hpp) the
/// OpenMP threads share it (the same bits for any thread count). T is float: a parameter only so
/// that the tables name a specialization they instantiate when asked for it.
template <class K, class T>
void gemm_of(Index m, Index n, Index k, const T* a, Index lda, const T* b, Index ldb, T* c,
             Index ldc, const T* bias, bool accumulate, bool parallel) {
  static_assert(std::is_same_v<T, float>, "gemm_of: float only");
  ATTN_ASSERT(m >= 0 && n >= 0 && k >= 0);
  ATTN_ASSERT(m <= 1 || lda >= k);
  ATTN_ASSERT(k <= 1 || ldb >= n);
  ATTN_ASSERT(m <= 1 || ldc >= n);
  if (m == 0 || n == 0)
    return;
  if constexpr (K::packed) {
    if (k == 0) {  // the chain without a step
      for (Index i = 0; i < m; ++i) {
        for (Index j = 0; j < n; ++j) {
          float x = accumulate ? c[i * ldc + j] : 0.0f;
          if (bias != nullptr)
            x += bias[j];
          c[i * ldc + j] = x;
        }
      }
      return;
    }
    if (m <= gemm_unpacked_rows) {
      gemm_unpacked<K>(m, n, k, a, lda, b, ldb, c, ldc, bias, accumulate, parallel);
      return;
    }
    gemm_packed<K>(m, n, k, a, lda, b, ldb, c, ldc, bias, accumulate, parallel);
  } else {
    (void)parallel;
    gemm_generic(m, n, k, a, lda, b, ldb, c, ldc, bias, accumulate);
  }
}

}  // namespace attn::detail
