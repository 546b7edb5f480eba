// attn/kernels/flash.hpp: tiled attention with an online softmax (FlashAttention's forward).
//
//   q tile   (Bq, D)    rows [i0, i1) of one (b, h) head, pre-scaled into the workspace
//   k tile   (Bk, D)    read in place through the strided head view, not transposed, not copied
//                       (16-bit keys are widened into the workspace tile by tile)
//   v tile   (Bk, Dv)   read in place (or widened, like k)
//   s tile   (Bq, Bk)   scores, then probabilities, in the workspace
//   acc      (Bq, Dv)   rescaled output accumulator, in the workspace
//   m, l     (Bq)       running max and running sum of each row
//
// Extra memory per thread: Bq * (D + Bk + Dv + 3) scalars, plus Bk * (D + Dv) when k and v
// are stored in 16 bits; independent of Lq and Lk. The
// (Lq, Lk) scores never exist. Tiles the mask hides entirely are skipped without any
// arithmetic (a causal mask does about half the work, a window O(L * window)); tiles it
// shows entirely skip mask evaluation (only a bias, if any, is added).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/mask.hpp"
#include "attn/precision.hpp"
#include "attn/softmax.hpp"
#include "attn/tensor.hpp"

namespace attn::detail {

/// Per-thread scratch of the flash kernel; sized once per call by reserve().
template <class T>
struct FlashWorkspace {
  Matrix<T> q;      // (Bq, D)   scale * q tile
  Matrix<T> s;      // (Bq, Bk)  scores -> probabilities
  Matrix<T> acc;    // (Bq, Dv)  unnormalised output
  Vector<T> m;      // (Bq)      running max
  Vector<T> l;      // (Bq)      running sum of exp(score - m)
  Vector<T> alpha;  // (Bq)    rescale factor of the current key tile
  Matrix<T> k;      // (Bk, D)   widened key tile (16-bit storage only)
  Matrix<T> v;      // (Bk, Dv)  widened value tile (16-bit storage only)

  void reserve(Index query_tile, Index key_tile, Index dim, Index value_dim,
               bool widens_kv = false) {
    if (widens_kv) {
      k.resize(key_tile, dim);
      v.resize(key_tile, value_dim);
    }
    q.resize(query_tile, dim);
    s.resize(query_tile, key_tile);
    acc.resize(query_tile, value_dim);
    m.resize(query_tile);
    l.resize(query_tile);
    alpha.resize(query_tile);
  }
};

/// Flash attention for queries [i0, i0 + rows) of one (batch b, query head h) pair, whose
/// rows of q and out are given; k and v are the whole head, stored as S (T or 16-bit).
///   pass 1: q tile = scale * q[i0:i1]            (the scale folded into the GEMM operand)
///   pass 2: for each key tile [j0, j1) the mask does not hide:
///             s = q tile * k[j0:j1]^T             one GEMM on the strided view
///             mask s unless the tile is fully visible (then only add the bias, if any)
///             m' = max(m, rowmax s); p = exp(s - m'); l = l * exp(m - m') + rowsum p
///             acc = acc * exp(m - m') + p * v[j0:j1]   one GEMM
///   pass 3: out = acc / l (zeros when l = 0), logsumexp = m + log l
/// `workspace` must have been reserved for at least `rows` query rows and key_tile keys.
template <class T, class S = T>
void flash_attention_tile(const HeadMatrix<const T>& q,  // (rows, D)  queries i0 .. i0 + rows - 1
                          const HeadMatrix<const S>& k,  // (Lk, D)    the whole head
                          const HeadMatrix<const S>& v,  // (Lk, Dv)
                          HeadMatrix<T> out,             // (rows, Dv) written
                          const Mask<T>& mask, Index b, Index h, T scale, Index i0, Index key_tile,
                          FlashWorkspace<T>& workspace,
                          T* logsumexp) {  // (rows) or null
  constexpr T minus_inf = -std::numeric_limits<T>::infinity();
  const Index rows = q.rows();
  const Index i1 = i0 + rows;
  const Index value_dim = v.cols();
  ATTN_ASSERT(rows > 0 && rows <= workspace.s.rows() && key_tile <= workspace.s.cols());

  const auto [keys_first, keys_last] = mask.key_range(b, i0, i1);

  auto m = workspace.m.head(rows);
  auto l = workspace.l.head(rows);
  m.setConstant(minus_inf);
  l.setZero();
  Eigen::Map<Matrix<T>, Eigen::Aligned16> acc(workspace.acc.data(), rows, value_dim);
  bool first_tile = true;

  if (keys_first < keys_last) {
    Eigen::Map<Matrix<T>, Eigen::Aligned16> q_tile(workspace.q.data(), rows, q.cols());
    q_tile.noalias() = scale * q;  // pass 1

    for (Index j0 = keys_first; j0 < keys_last; j0 += key_tile) {  // pass 2
      const Index j1 = std::min(j0 + key_tile, keys_last);
      const Index cols = j1 - j0;
      const TileVisibility visibility = mask.classify(b, h, i0, i1, j0, j1);
      if (visibility == TileVisibility::hidden)
        continue;

      const Index s_stride = workspace.s.cols();
      Eigen::Map<Matrix<T>, 0, Eigen::OuterStride<>> s(workspace.s.data(), rows, cols,
                                                       Eigen::OuterStride<>(s_stride));
      const HeadMatrix<const T> k_tile = rows_as<T, S>(k, j0, cols, workspace.k);
      s.noalias() = q_tile * k_tile.transpose();
      if (visibility == TileVisibility::partial || mask.modifies_scores())
        mask.apply(b, h, i0, j0, s);

      for (Index r = 0; r < rows; ++r)
        workspace.alpha(r) = online_softmax_step(s.row(r).data(), cols, m(r), l(r));
      const HeadMatrix<const T> v_tile = rows_as<T, S>(v, j0, cols, workspace.v);
      if (first_tile) {
        acc.noalias() = s * v_tile;
      } else {
        for (Index r = 0; r < rows; ++r) {
          if (workspace.alpha(r) != T(1))
            acc.row(r) *= workspace.alpha(r);
        }
        acc.noalias() += s * v_tile;
      }
      first_tile = false;
    }
  }

  // pass 3
  for (Index r = 0; r < rows; ++r) {
    auto out_row = out.row(r);
    if (first_tile || l(r) == T(0)) {  // the row sees no key: zeros, lse -inf
      out_row.setZero();
      if (logsumexp != nullptr)
        logsumexp[r] = minus_inf;
    } else {
      out_row = acc.row(r) * (T(1) / l(r));
      if (logsumexp != nullptr)
        logsumexp[r] = m(r) + std::log(l(r));
    }
  }
}

}  // namespace attn::detail
