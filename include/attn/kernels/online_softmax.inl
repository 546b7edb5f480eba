// attn/kernels/online_softmax.inl: the online softmax (FlashAttention's forward) and the two
// kernels built on it, flash and decode, written once and compiled for every instruction set.
//
// No include guard and no #include: kernels/online_softmax.hpp includes this file once per
// instruction set (simd/foreach_isa.hpp), inside attn::detail::generic, ::avx2 and ::avx512.
// The tile products it calls are those of that namespace (kernels/generic.hpp,
// simd/tile_products.inl): pack_queries, scores, column_maxima, hide_outside_intervals,
// exp_columns, exp_difference, accumulate, widen, dot_scores, row_maxima, exp_rows,
// weighted_sum, and `padded` and `widens_in_registers`. Its entry points, flash_tile,
// decode_split and merge_splits, are listed in each namespace's table (simd/table.inl) and
// are not inline, so that attn::compiled can instantiate them once.
//
// The online softmax of one query over the key tiles t = 1, 2, ... (m_0 = -inf, l_0 = 0):
//   m_t = max(m_{t-1}, max_j s_tj)
//   p_tj = exp(s_tj - m_t)
//   l_t = l_{t-1} exp(m_{t-1} - m_t) + sum_j p_tj
//   acc_t = acc_{t-1} exp(m_{t-1} - m_t) + sum_j p_tj v_j
// and at the end out = acc / l, logsumexp = m + log l. While a query has seen only hidden
// keys (m = -inf) its shift is 0, so exp(-inf - 0) = 0 and nothing accumulates. Partial
// results over disjoint key ranges (decode's splits) merge by log-sum-exp.

/// Before the exp of a tile, for n queries with this tile's maxima: m = max(m, tile_max);
/// shift = the new m (0 where it is still -inf); alpha = exp(old m - new m), the factor
/// that rescales l and acc (1 where nothing has been seen yet).
template <class T>
inline void rescale_factors(const T* tile_max, Index n, T* m, T* shift, T* alpha) {
  constexpr T minus_inf = -std::numeric_limits<T>::infinity();
  for (Index i = 0; i < n; ++i)
    shift[i] = tile_max[i] > m[i] ? tile_max[i] : m[i];  // NaN maxima do not enter m
  exp_difference(m, shift, alpha, n);
  for (Index i = 0; i < n; ++i) {
    if (shift[i] == minus_inf) {
      alpha[i] = T(1);
      shift[i] = T(0);
    } else {
      m[i] = shift[i];
    }
  }
}

/// After the exp: l = l * alpha + the tile's sums of probabilities.
template <class T>
inline void add_sums(const T* alpha, const T* sums, Index n, T* l) {
  for (Index i = 0; i < n; ++i)
    l[i] = l[i] * alpha[i] + sums[i];
}

/// One query's output from `parts` partial online softmaxes (m_s, l_s, acc_s) and, when
/// `sink` is not null, a learned sink (a part with m = sink, l = 1 and acc = 0):
///   M = max_s m_s;  l = sum_s l_s exp(m_s - M);  out = sum_s acc_s exp(m_s - M) / l
///   logsumexp = M + log l
/// m_s and l_s are `part_stride` apart; acc_s[e] is at acc[s * acc_part_stride +
/// e * acc_stride]. A part that saw nothing (m_s = -inf and l_s = 0) is skipped (its acc
/// was never written); a query that saw nothing gets zeros and logsumexp -inf (the sink
/// with one). NaN propagates: a NaN score may leave m_s = -inf (vector maxima drop NaN),
/// but its probability makes l_s NaN, and then exp(m_s - M) or l_s makes the output NaN.
template <class T>
inline void finish_query(Index parts, const T* m, const T* l, Index part_stride, const T* acc,
                         Index acc_part_stride, Index acc_stride, Index value_dim, const T* sink,
                         T* out, T* logsumexp) {  // (Dv), (1) or null
  constexpr T minus_inf = -std::numeric_limits<T>::infinity();
  const auto saw_nothing = [&](Index s) {
    return m[s * part_stride] == minus_inf && l[s * part_stride] == T(0);
  };
  T max = minus_inf;
  for (Index s = 0; s < parts; ++s) {
    const T m_s = m[s * part_stride];
    if (!saw_nothing(s) && (m_s > max || std::isnan(m_s)))  // once NaN, max stays NaN
      max = m_s;
  }
  if (sink != nullptr && *sink > max)
    max = *sink;
  T sum = 0;
  bool started = false;
  for (Index s = 0; s < parts; ++s) {
    if (saw_nothing(s))
      continue;
    const T factor = std::exp(m[s * part_stride] - max);  // exactly 1 for a single part
    const T* acc_s = acc + s * acc_part_stride;
    sum += l[s * part_stride] * factor;
    if (started) {
      for (Index e = 0; e < value_dim; ++e)
        out[e] += factor * acc_s[e * acc_stride];
    } else {
      for (Index e = 0; e < value_dim; ++e)
        out[e] = factor * acc_s[e * acc_stride];
      started = true;
    }
  }
  const T no_key = sink != nullptr ? *sink : minus_inf;
  // The query sees no key: zeros, logsumexp -inf or the sink. (With a sink, sum can also
  // underflow to 0 when the sink dominates: then the weights are 0 and out = 0 * acc
  // below, NaN where acc is, as naive's 0 * v.)
  if (!started || (sum == T(0) && sink == nullptr)) {
    std::fill(out, out + value_dim, T(0));
    if (logsumexp != nullptr)
      *logsumexp = no_key;
    return;
  }
  if (sink != nullptr)
    sum += std::exp(*sink - max);
  const T inverse = T(1) / sum;
  for (Index e = 0; e < value_dim; ++e)
    out[e] *= inverse;
  if (logsumexp != nullptr)
    *logsumexp = max + std::log(sum);
}

/// dst (count, dim), contiguous = `count` rows of K or V stored as S, `stride` S apart (S
/// 16-bit, or quantized blocks, dim a multiple of 32): widened or dequantized to float.
template <class S>
inline void widen_rows(const S* rows, Index stride, Index count, Index dim, float* dst) {
  for (Index r = 0; r < count; ++r)
    widen(rows + r * stride, dst + r * dim, dim);
}

/// Rows [first, first + count) of head (b, h) of x in the compute scalar T: the memory itself
/// when S is T and the rows are one run (always, unless x is paged), else widened,
/// dequantized or copied run by run into `buffer` (at least (count, values per row)). Rows
/// of a released page read as zeros: the caller's mask hides them.
template <class T, class S>
inline HeadMatrix<const T> tile_rows(const HeadsView<const S>& x,  // (B, H, L, units per row)
                                     Index b, Index h, Index first, Index count,
                                     Scratch<T>& buffer) {
  const Index dim = x.dim * values_per_unit_v<S>;
  if constexpr (std::is_same_v<S, T>) {
    if (count <= contiguous_rows(x, first)) {
      return HeadMatrix<const T>(row_data(x, b, h, first), count, dim,
                                 Eigen::OuterStride<>(x.row_stride));
    }
  }
  for (Index r = first, n = 0; r < first + count; r += n) {
    n = std::min(first + count - r, contiguous_rows(x, r));
    T* to = buffer.data() + (r - first) * dim;
    if (x.pages != nullptr && x.pages[b * x.pages_stride + r / x.page_rows] < 0) {
      std::fill_n(to, n * dim, T(0));
    } else if constexpr (std::is_same_v<S, T>) {
      for (Index i = 0; i < n; ++i)
        std::copy_n(row_data(x, b, h, r + i), dim, to + i * dim);
    } else {
      widen_rows(row_data(x, b, h, r), x.row_stride, n, dim, to);
    }
  }
  return HeadMatrix<const T>(buffer.data(), count, dim, Eigen::OuterStride<>(dim));
}

/// The products of flash in the compute scalar T, for K stored as SK and V as SV: the query
/// tile transposed with the scale folded in (pass 1), each key and value tile read in place
/// or widened into the workspace (tile_rows), and this instruction set's tile products.
/// (kernels/simd/bf16_tiles.hpp has the same three steps on bf16 dot products.)
template <class T, class SK, class SV>
struct ScalarTileProducts {
  /// qt (D, width) = scale * q^T, zero columns past q's rows.
  static void pack_query_tile(const HeadMatrix<const T>& q,  // (rows, D)
                              T scale, Index width, Workspace<T>& workspace) {
    pack_queries(q.data(), q.outerStride(), q.rows(), q.cols(), scale, workspace.q.data(), width,
                 width);
  }
  /// st (cols, width) = k[j0:j0+cols] qt, and tile_max (width) its column maxima when not null.
  static void tile_scores(const HeadsView<const SK>& k,  // (B, Hkv, Lk, D)
                          Index b, Index kv_head, Index j0, Index cols, Index dim, Index width,
                          T /*scale: in qt*/, Workspace<T>& workspace, T* tile_max) {
    const HeadMatrix<const T> k_tile = tile_rows<T, SK>(k, b, kv_head, j0, cols, workspace.k);
    scores(k_tile.data(), k_tile.outerStride(), cols, workspace.q.data(), width, dim, width,
           workspace.s.data(), width, tile_max);
  }
  /// ot (Dv, width) = alpha ot + v[j0:j0+cols]^T st (alpha null: ot = v^T st).
  static void tile_accumulate(const HeadsView<const SV>& v,  // (B, Hkv, Lk, Dv)
                              Index b, Index kv_head, Index j0, Index cols, Index width,
                              const T* alpha, Workspace<T>& workspace) {
    const HeadMatrix<const T> v_tile = tile_rows<T, SV>(v, b, kv_head, j0, cols, workspace.v);
    accumulate(workspace.s.data(), width, cols, width, v_tile.data(), v_tile.outerStride(),
               v_tile.cols(), alpha, workspace.acc.data(), width);
  }
};

/// Flash attention for queries [i0, i0 + rows) of one (batch b, query head h) pair, whose
/// rows of q and out are given, against head kv_head of k and v, stored as SK and SV (T,
/// or 16-bit or quantized blocks widened tile by tile; contiguous, packed or paged), with
/// the tile products of `Products` (ScalarTileProducts, or bf16 ones). `workspace` is
/// reserved for at least padded(rows) queries and key_tile keys.
///   pass 1: qt = scale * q tile^T                    (the scale folded into the operand)
///   pass 2: for each key tile [j0, j1) the mask does not hide:
///             st = k[j0:j1] qt                        (the column maxima in the same pass
///                                                      when the tile needs no mask)
///             otherwise mask st (-inf where hidden), then its column maxima
///             online softmax down the columns of st  (a vector of queries at a time)
///             ot = alpha ot + v[j0:j1]^T st
///   pass 3: out = ot^T / l (zeros when the query sees nothing), logsumexp = m + log l
template <class T, class SK, class SV, class Products>
void flash_tile_with(const HeadMatrix<const T>& q,  // (rows, D)  queries i0 ..
                     const HeadsView<const SK>& k,  // (B, Hkv, Lk, D)  (blocks: D / 32 units)
                     const HeadsView<const SV>& v,  // (B, Hkv, Lk, Dv)
                     HeadMatrix<T> out,             // (rows, Dv) written
                     const AttentionProblem<T>& problem, Index b, Index h, Index kv_head, T scale,
                     Index i0, Index key_tile, Workspace<T>& workspace,
                     T* logsumexp) {  // (rows) or null
  constexpr T minus_inf = -std::numeric_limits<T>::infinity();
  const Index rows = q.rows(), i1 = i0 + rows, width = padded(rows);
  const Index dim = q.cols(), value_dim = v.dim * values_per_unit_v<SV>;
  // Row stride of qt, st and ot: this tile's width, not the workspace's, so that a tile
  // gives the same bits whatever the longest sequence of the call (Eigen's products round
  // differently at different strides).
  const Index stride = width;
  ATTN_ASSERT(rows > 0 && width <= workspace.q.cols() && key_tile <= workspace.s.rows());
  T* m = workspace.m.data();
  T* l = workspace.l.data();
  T* ot = workspace.acc.data();
  std::fill_n(m, width, minus_inf);
  std::fill_n(l, width, T(0));

  const auto [keys_first, keys_last] = problem.mask().key_range(b, i0, i1);
  if (keys_first < keys_last) {
    T* st = workspace.s.data();
    T* tile_max = workspace.tile_max.data();
    Products::pack_query_tile(q, scale, width, workspace);  // pass 1
    const Dropout<T>& dropout = problem.dropout();
    if (dropout.active()) {
      for (Index r = 0; r < rows; ++r)
        workspace.dropout_rows[static_cast<std::size_t>(r)] = dropout.row_key(b, h, i0 + r);
    }
    bool first_tile = true;
    for (Index j0 = keys_first; j0 < keys_last; j0 += key_tile) {  // pass 2
      const Index j1 = std::min(j0 + key_tile, keys_last), cols = j1 - j0;
      const TileVisibility visibility = problem.mask().classify(b, h, i0, i1, j0, j1);
      if (visibility == TileVisibility::hidden)
        continue;
      const bool masked = visibility == TileVisibility::partial || problem.modifies_scores();
      Products::tile_scores(k, b, kv_head, j0, cols, dim, width, scale, workspace,
                            masked ? nullptr : tile_max);
      // Element by element for a keep-mask, changed scores, or sink tokens in the tile (a
      // row's visible keys are then two intervals); else one interval per row.
      const bool elementwise =
          problem.mask().has_elementwise_mask() || problem.modifies_scores() ||
          (problem.mask().has_sink_tokens() && j0 < problem.mask().sink_tokens());
      if (masked && elementwise) {
        // the element-wise mask on (rows, cols) of scores, a column-major view of st
        Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>, 0, Eigen::OuterStride<>>
            scores_view(st, rows, cols, Eigen::OuterStride<>(stride));
        problem.apply(b, h, i0, j0, scores_view, visibility);
        column_maxima(st, stride, cols, width, tile_max);
      } else if (masked) {  // only intervals (the diagonal tiles of a causal problem)
        std::int32_t* lo = workspace.key_lo.data();
        std::int32_t* hi = workspace.key_hi.data();
        for (Index r = 0; r < width; ++r) {
          const auto [first, last] =
              r < rows ? problem.mask().key_interval(b, i0 + r) : std::array<Index, 2>{j0, j1};
          lo[r] = static_cast<std::int32_t>(std::clamp(first - j0, Index(0), cols));
          hi[r] = static_cast<std::int32_t>(std::clamp(last - j0, Index(0), cols));
        }
        hide_outside_intervals(st, stride, cols, width, lo, hi, tile_max);
      }
      T* alpha = workspace.alpha.data();
      rescale_factors(tile_max, width, m, workspace.shift.data(), alpha);
      exp_columns(st, stride, cols, width, workspace.shift.data(), workspace.sums.data());
      add_sums(alpha, workspace.sums.data(), width, l);
      if (dropout.active()) {  // on the weights of out only: l and lse are the softmax's
        for (Index j = 0; j < cols; ++j)
          dropout.apply_for_key(workspace.dropout_rows.data(), rows, j0 + j, st + j * stride);
      }
      Products::tile_accumulate(v, b, kv_head, j0, cols, width, first_tile ? nullptr : alpha,
                                workspace);
      first_tile = false;
    }
  }
  for (Index r = 0; r < rows; ++r) {  // pass 3 (with Dv = 0, ot is an empty buffer: null)
    finish_query(1, m + r, l + r, 0, value_dim > 0 ? ot + r : ot, 0, stride, value_dim,
                 problem.sink(h), out.row(r).data(),
                 logsumexp != nullptr ? logsumexp + r : nullptr);
  }
}

/// flash_tile_with in the compute scalar (ScalarTileProducts): the entry of the tables.
template <class T, class SK, class SV = SK>
void flash_tile(const HeadMatrix<const T>& q,  // (rows, D)  queries i0 ..
                const HeadsView<const SK>& k,  // (B, Hkv, Lk, D)  (blocks: D / 32 units)
                const HeadsView<const SV>& v,  // (B, Hkv, Lk, Dv)
                HeadMatrix<T> out,             // (rows, Dv) written
                const AttentionProblem<T>& problem, Index b, Index h, Index kv_head, T scale,
                Index i0, Index key_tile, Workspace<T>& workspace,
                T* logsumexp) {  // (rows) or null
  flash_tile_with<T, SK, SV, ScalarTileProducts<T, SK, SV>>(
      q, k, v, out, problem, b, h, kv_head, scale, i0, key_tile, workspace, logsumexp);
}

/// The scores of decode in the compute scalar: s = q tile k block^T with k widened in
/// registers (or first, into the workspace, on the generic path). decode_split_with's
/// KeyScores policy; int8 products are the other one (kernels/int8_decode.hpp).
template <class T, class SK>
struct WidenedKeyScores {
  /// Called once per split after pass 1 (nothing to prepare).
  static void prepare(const T* /*q_tile*/, Index /*rows*/, Index /*dim*/,
                      Workspace<T>& /*workspace*/) {}
  static void scores(const T* q_tile, Index rows,                   // (rows, D)
                     const SK* k_rows, Index k_stride, Index cols,  // (cols, D / units)
                     Index dim, T* s, Index s_stride,               // (rows, cols)
                     const SK* ahead, const SK* /*far*/, Workspace<T>& workspace) {
    if constexpr (widens_in_registers || std::is_same_v<SK, T>) {
      dot_scores(q_tile, dim, rows, k_rows, k_stride, cols, dim, s, s_stride, ahead);
    } else {
      widen_rows(k_rows, k_stride, cols, dim, workspace.k.data());
      dot_scores(q_tile, dim, rows, workspace.k.data(), dim, cols, dim, s, s_stride,
                 workspace.k.data());
    }
  }
};

/// One split [j0, j1) of the keys of one (b, kv head) for all R = G * Lq queries of the
/// group: their partial online softmax, written as m (R), l (R), acc (R, Dv) at `partial`.
/// Queries that see no key of the split keep m = -inf, l = 0 (acc is then not written).
/// The scores come from `KeyScores` (WidenedKeyScores, or int8 products).
///   pass 1: q tile = scale * the group's queries (KeyScores::prepare then sees them)
///   pass 2: for each key block the mask does not hide:
///             s = q tile k block^T              (KeyScores::scores)
///             mask s (per query head: bias, keep-mask and ALiBi depend on it)
///             online softmax along the rows of s
///             acc = alpha acc + s v block
template <class T, class SK, class SV, class KeyScores>
void decode_split_with(const HeadsView<const T>& q,   // (B, Hq, Lq, D)
                       const HeadsView<const SK>& k,  // (B, Hkv, Lk, D / values_per_unit_v<SK>)
                       const HeadsView<const SV>& v,  // (B, Hkv, Lk, Dv / values_per_unit_v<SV>)
                       const AttentionProblem<T>& problem, T scale, Index b, Index kv_head,
                       Index j0, Index j1, Index key_block, Workspace<T>& workspace,
                       T* partial) {  // m (R), l (R), acc (R, Dv)
  // Partials are laid out for the longest sequence, R = G * q.length rows; this one's rows
  // are r = g * Lq_b + i.
  const Index group = q.heads / k.heads, q_length = q.rows(b), rows = group * q_length;
  const Index layout_rows = group * q.length;
  const Index dim = q.dim, value_dim = v.dim * values_per_unit_v<SV>;
  T* m = partial;
  T* l = partial + layout_rows;
  T* acc = partial + 2 * layout_rows;
  std::fill_n(m, rows, -std::numeric_limits<T>::infinity());
  std::fill_n(l, rows, T(0));

  const Index first_head = kv_head * group;
  const auto [keys_first, keys_last] = problem.mask().key_range(b, 0, q_length);
  const Index lo = std::max(j0, keys_first), hi = std::min(j1, keys_last);
  if (lo >= hi || problem.mask().classify_heads(b, first_head, first_head + group, 0, q_length, lo,
                                                hi) == TileVisibility::hidden)
    return;

  T* q_tile = workspace.q.data();  // pass 1: (rows, D)
  for (Index g = 0; g < group; ++g) {
    for (Index i = 0; i < q_length; ++i) {
      const T* from = q.head(b, first_head + g).row(i).data();
      T* to = q_tile + (g * q_length + i) * dim;
      for (Index d = 0; d < dim; ++d)
        to[d] = scale * from[d];
    }
  }
  KeyScores::prepare(q_tile, rows, dim, workspace);
  T* s = workspace.s.data();
  const Index s_stride = workspace.s.cols();
  T* alpha = workspace.alpha.data();
  // V read from K's rows (MLA's latent cache): the keys' prefetches have requested them.
  const bool values_in_keys = rows_within(v, k);
  bool first_block = true;
  for (Index c0 = lo, c1 = lo; c0 < hi; c0 = c1) {  // pass 2
    // Blocks end at multiples of key_block and at page ends (a paged cache): a cache in
    // pages of a multiple of key_block rows is then cut where a contiguous one is.
    c1 = std::min({hi, (c0 / key_block + 1) * key_block, c0 + contiguous_rows(k, c0),
                   c0 + contiguous_rows(v, c0)});
    const Index cols = c1 - c0;
    const TileVisibility visibility =
        problem.mask().classify_heads(b, first_head, first_head + group, 0, q_length, c0, c1);
    if (visibility == TileVisibility::hidden)
      continue;
    const SK* k_rows = row_data(k, b, kv_head, c0);
    const SV* v_rows = row_data(v, b, kv_head, c0);
    KeyScores::scores(q_tile, rows, k_rows, k.row_stride, cols, dim, s, s_stride,
                      rows_after(k, b, kv_head, c0, cols), far_rows(k, b, kv_head, c0, cols),
                      workspace);
    if (visibility == TileVisibility::partial || problem.modifies_scores()) {
      for (Index g = 0; g < group; ++g) {
        Eigen::Map<Matrix<T>, 0, Eigen::OuterStride<>> head_rows(
            s + g * q_length * s_stride, q_length, cols, Eigen::OuterStride<>(s_stride));
        problem.apply(b, first_head + g, 0, c0, head_rows, visibility);
      }
    }
    row_maxima(s, s_stride, rows, cols, workspace.tile_max.data());
    rescale_factors(workspace.tile_max.data(), rows, m, workspace.shift.data(), alpha);
    exp_rows(s, s_stride, rows, cols, workspace.shift.data(), workspace.sums.data());
    add_sums(alpha, workspace.sums.data(), rows, l);
    if constexpr (widens_in_registers || std::is_same_v<SV, T>) {
      weighted_sum(s, s_stride, rows, v_rows, v.row_stride, cols, value_dim,
                   first_block ? nullptr : alpha, acc, value_dim,
                   values_in_keys ? nullptr : rows_after(v, b, kv_head, c0, cols),
                   values_in_keys ? nullptr : far_rows(v, b, kv_head, c0, cols));
    } else {
      widen_rows(v_rows, v.row_stride, cols, value_dim, workspace.v.data());
      weighted_sum(s, s_stride, rows, workspace.v.data(), value_dim, cols, value_dim,
                   first_block ? nullptr : alpha, acc, value_dim, workspace.v.data(),
                   static_cast<const T*>(nullptr));
    }
    first_block = false;
  }
}

/// decode_split_with on scores in the compute scalar (WidenedKeyScores): the entry of the
/// tables.
template <class T, class SK, class SV>
void decode_split(const HeadsView<const T>& q,   // (B, Hq, Lq, D)
                  const HeadsView<const SK>& k,  // (B, Hkv, Lk, D / values_per_unit_v<SK>)
                  const HeadsView<const SV>& v,  // (B, Hkv, Lk, Dv / values_per_unit_v<SV>)
                  const AttentionProblem<T>& problem, T scale, Index b, Index kv_head, Index j0,
                  Index j1, Index key_block, Workspace<T>& workspace,
                  T* partial) {  // m (R), l (R), acc (R, Dv)
  decode_split_with<T, SK, SV, WidenedKeyScores<T, SK>>(q, k, v, problem, scale, b, kv_head, j0, j1,
                                                        key_block, workspace, partial);
}

/// Merges the `splits` partials of one (b, kv head) (consecutive, `partial_size` apart)
/// into out and logsumexp (or null), in split order.
template <class T>
void merge_splits(const T* partials, Index splits, Index partial_size, Index b, Index kv_head,
                  Index group, const HeadsView<T>& out,  // (B, Hq, Lq, Dv)
                  const AttentionProblem<T>& problem, const RowValues<T>& logsumexp) {
  const Index q_length = out.rows(b), rows = group * q_length, value_dim = out.dim;
  const Index layout_rows = group * out.length;
  for (Index r = 0; r < rows; ++r) {
    const Index h = kv_head * group + r / q_length, i = r % q_length;
    T* lse = logsumexp.data != nullptr ? logsumexp.head(b, h) + i : nullptr;
    if (splits == 0) {  // Lk = 0: no partials to point into; the row sees no key
      finish_query<T>(0, nullptr, nullptr, 0, nullptr, 0, 1, value_dim, problem.sink(h),
                      out.head(b, h).row(i).data(), lse);
      continue;
    }
    // NOLINTNEXTLINE(readability-suspicious-call-argument): the splits are the parts
    finish_query(splits, partials + r, partials + layout_rows + r, partial_size,
                 partials + 2 * layout_rows + r * value_dim, partial_size, 1, value_dim,
                 problem.sink(h), out.head(b, h).row(i).data(), lse);
  }
}
