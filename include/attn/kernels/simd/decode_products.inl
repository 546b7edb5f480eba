// attn/kernels/simd/decode_products.inl: the tile products of the decode kernel, written once
// on the vector primitives of the namespace that includes this file (simd/avx2.hpp,
// simd/avx512.hpp). No include guard and no #include: simd/tile_products.hpp includes it once
// per vector instruction set (simd/foreach_isa.hpp), after tile_products.inl.
//
// Decode keeps its few queries on the rows (s (R, Bk), acc (R, Dv)) and reduces each q . k
// dot product along D, with k and v widened in registers as they are read: float, half,
// bfloat16, or q8_0 and q4_0 blocks (attn/quantized.hpp), through one RowReader per format.

// --- Decode: queries along the rows, K and V widened in registers -----------------------

// Software prefetches: while row j of a key block is read, row j of the next block (`ahead`)
// is requested from memory: blocks of K and V alternate, a 256-byte row crosses a page every
// 16 rows, and the hardware prefetcher alone lets the loads wait. The next block is where the
// keys continue, in memory or on another page of a paged cache, so a page's end never sends
// the prefetches into another sequence's rows. The distance, one block (decode_key_block,
// 64 rows), was chosen by measurement (docs/performance.md, "Tuning choices"). Each row of the
// next block is requested once: by the first group of query rows that passes over a row (or a
// slab of a row), not again by the others (`Prefetch`), and not at all for V when V's rows lie
// in K's (MLA's latent cache, attn/latent_cache.hpp: the keys' prefetches brought them).
// q8_0 rows of a cache without pages are also requested into L2 two blocks on (`far`,
// far_rows in kernels/online_softmax.hpp): their arithmetic leaves too few requests in flight.
//
// Order of the loops: with many query rows (G * Lq = 16 for MLA, 576-value keys) a block of
// keys is 147 KB of float, beyond L1. The scores take the keys in chunks of decode_chunk_keys
// and pass every group of decode_score_rows query rows over a chunk before the next one, and the
// weighted sum takes V in slabs of decode_vectors vectors per row and passes every group over
// a slab: each chunk or slab is read from L2 once and from L1 by the other groups (MLA decode,
// 16 rows of 576 floats, on an AVX-512 Xeon: 1.3x faster than the row groups outermost, the
// prefetches once 1.1x more). Every sum is formed by the same operations in the same order
// as with the row groups outermost, so the results are the same bits.

/// Requests unit `offset` of `row`: quantized rows into L1 unless `far` (then L2), others L2.
template <class S>
inline void prefetch_element(const S* row, Index offset, bool far = false) {
  const std::uintptr_t address =
      reinterpret_cast<std::uintptr_t>(row) + static_cast<std::uintptr_t>(offset) * sizeof(S);
  if (is_quantized_v<S> && !far)
    prefetch_to_l1(address);
  else
    prefetch(address);
}

/// Rows of K or V stored as S, widened to float in registers a piece at a time: piece(j, d)
/// is the unit holding values [column + d, ...) of row j (d a multiple of `step` vectors)
/// and load(piece, i) its vector i < step, values [column + d + i lanes, ... + lanes). For a
/// scalar S a piece is one vector (step 1); for a quantized S it is one block of 32 values
/// (step 32 / lanes: a vector never straddles two blocks), whose fp16 scale is converted once
/// and multiplies each vector of quants as it is widened. `stride` is in S (blocks).
/// prefetch(j, d) requests the unit of row j of `ahead` (the next block) that piece(j, d)
/// reads of row j.
template <class S>
struct RowReader {
  static constexpr int step = 1;
  using Piece = const S*;
  const S* rows;
  Index stride;
  const S* ahead;
  Index column = 0;

  Piece piece(Index j, Index d) const { return rows + j * stride + column + d; }
  static vec load(Piece p, int /*i*/) { return load_widened(p); }
  void prefetch(Index j, Index d) const { prefetch_element(ahead, j * stride + column + d); }
  RowReader at(Index j, Index e) const {
    return {rows + j * stride, stride, ahead + j * stride, column + e};
  }
};

/// A quantized block and its scale d as float.
template <class Block>
struct ScaledBlock {
  const Block* block;
  float scale;
};

/// The reader of q8_0 and q4_0 rows: `column` is a multiple of 32. Besides the next block's
/// rows into L1, prefetch(j, d) requests those at `far` (decode_far_blocks on, or null) into L2.
template <class Block>
struct BlockRowReader {
  static constexpr int step = static_cast<int>(quantized_block_values / lanes);
  using Piece = ScaledBlock<Block>;
  const Block* rows;
  Index stride;  // blocks
  const Block* ahead;
  Index column = 0;
  const Block* far = nullptr;

  /// The block holding values [column + d, column + d + 32) of row j.
  const Block* block(Index j, Index d) const {
    return rows + j * stride + (column + d) / quantized_block_values;
  }
  Piece piece(Index j, Index d) const {
    const Block* b = block(j, d);
    return {b, half_to_float(b->scale)};
  }
  /// Vector i < step of a block's integers, exact in float: q (q8_0) or n - 8 (q4_0).
  static vec load_integers(const BlockQ8_0* b, int i) {
    return load_int8_widened(b->values + i * lanes);
  }
  static vec load_integers(const BlockQ4_0* b, int i) {
    return load_nibbles_centered(b->nibbles, i);
  }
  /// d q: exact in float (q has at most 8 significant bits, d 11).
  static vec load(const Piece& p, int i) { return mul(load_integers(p.block, i), set1(p.scale)); }
  /// (known at compile time: for q4_0 a null test of `far` alone cost 1.06x)
  static constexpr bool has_far = decode_far_prefetch<Block>;

  void prefetch(Index j, Index d) const {
    const Index unit = j * stride + (column + d) / quantized_block_values;
    prefetch_element(ahead, unit);
    if constexpr (has_far) {
      if (far != nullptr)
        prefetch_element(far, unit, true);
    }
  }
  RowReader<Block> at(Index j, Index e) const {
    return {{rows + j * stride, stride, ahead + j * stride, column + e,
             has_far && far != nullptr ? far + j * stride : nullptr}};
  }
};

template <>
struct RowReader<BlockQ8_0> : BlockRowReader<BlockQ8_0> {};
template <>
struct RowReader<BlockQ4_0> : BlockRowReader<BlockQ4_0> {};

/// n values (a multiple of 32) of q8_0 or q4_0 blocks dequantized into dst by the reader's
/// vectors: bit for bit dequantize_blocks (d q and d n - 8 d are exact products in float).
template <class Block>
inline void widen_blocks(const Block* src, float* dst, Index n) {
  const RowReader<Block> reader{{src, 0, src}};
  for (Index d = 0; d < n; d += quantized_block_values) {
    const ScaledBlock<Block> piece = reader.piece(0, d);
#pragma GCC unroll 4
    for (int i = 0; i < RowReader<Block>::step; ++i)
      store(dst + d + i * lanes, RowReader<Block>::load(piece, i));
  }
}
inline void widen(const BlockQ8_0* src, float* dst, Index n) {
  widen_blocks(src, dst, n);
}
inline void widen(const BlockQ4_0* src, float* dst, Index n) {
  widen_blocks(src, dst, n);
}

/// The reader of `rows`, `stride` S apart, prefetching the rows at `ahead`.
template <class S>
RowReader<S> reader_of(const S* rows, Index stride, const S* ahead, const S* far = nullptr) {
  if constexpr (is_quantized_v<S>)
    return {{rows, stride, ahead, 0, far}};
  else
    return {rows, stride, ahead};
}

/// Query rows per pass of the scores over rows of S (simd/avx2.hpp, simd/avx512.hpp).
template <class S>
inline constexpr int decode_score_rows_v = decode_score_rows(is_quantized_v<S>);

/// s[r, j] = q[r, 0:dim) . k[j, 0:dim) for r < Rb, j < Kb, dim a multiple of lanes: Rb x Kb
/// dot products in registers. (Nothing else in the loop: a call or a branch to a tail path
/// makes GCC keep the accumulators on the stack.)
template <int Rb, int Kb, bool Prefetch, class S>
inline void dot_block(const float* q, Index q_stride,  // (Rb, dim)
                      const RowReader<S>& k,           // (Kb, dim)
                      Index dim, float* s, Index s_stride) {
  static_assert(Kb == 1 || Kb == 2 || Kb == 4, "dot_block: 1, 2 or 4 keys");
  vec acc[static_cast<std::size_t>(Rb)][static_cast<std::size_t>(Kb)];
// Unrolled by pragmas: GCC's -O2 keeps a loop over R rolled and acc in memory otherwise.
#pragma GCC unroll 4
  for (int r = 0; r < Rb; ++r) {
#pragma GCC unroll 4
    for (int j = 0; j < Kb; ++j)
      acc[r][j] = zero();
  }
  constexpr int step = RowReader<S>::step;
  for (Index d = 0; d < dim; d += step * lanes) {
    typename RowReader<S>::Piece pieces[static_cast<std::size_t>(Kb)];
#pragma GCC unroll 4
    for (int j = 0; j < Kb; ++j) {
      pieces[j] = k.piece(j, d);
      if constexpr (Prefetch)
        k.prefetch(j, d);
    }
#pragma GCC unroll 4
    for (int i = 0; i < step; ++i) {
      vec key[static_cast<std::size_t>(Kb)];
#pragma GCC unroll 4
      for (int j = 0; j < Kb; ++j)
        key[j] = RowReader<S>::load(pieces[j], i);
#pragma GCC unroll 4
      for (int r = 0; r < Rb; ++r) {
        const vec query = load(q + r * q_stride + d + i * lanes);
#pragma GCC unroll 4
        for (int j = 0; j < Kb; ++j)
          acc[r][j] = fmadd(query, key[j], acc[r][j]);
      }
    }
  }
  if constexpr (Kb == 2) {  // two rows' two keys per sum_each4: each sum in its usual order
#pragma GCC unroll 4
    for (int r = 0; r < Rb; r += 2) {
      alignas(16) float sums[4];
      sum_each4(acc[r][0], acc[r][1], r + 1 < Rb ? acc[r + 1][0] : zero(),
                r + 1 < Rb ? acc[r + 1][1] : zero(), sums);
      s[r * s_stride] = sums[0];
      s[r * s_stride + 1] = sums[1];
      if (r + 1 < Rb) {
        s[(r + 1) * s_stride] = sums[2];
        s[(r + 1) * s_stride + 1] = sums[3];
      }
    }
  } else {
#pragma GCC unroll 4
    for (int r = 0; r < Rb; ++r) {
      if constexpr (Kb == 4)
        sum_each4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], s + r * s_stride);
      else
        s[r * s_stride] = reduce_add(acc[r][0]);
    }
  }
}

template <int Rb, bool Prefetch, class S>
inline void dot_rows(const float* q, Index q_stride, const RowReader<S>& k, Index keys, Index dim,
                     float* s, Index s_stride) {
  constexpr int Kb = decode_block_keys(Rb);
  Index j = 0;
  for (; j + Kb <= keys; j += Kb)
    dot_block<Rb, Kb, Prefetch>(q, q_stride, k.at(j, 0), dim, s + j, s_stride);
  for (; j < keys; ++j)
    dot_block<Rb, 1, Prefetch>(q, q_stride, k.at(j, 0), dim, s + j, s_stride);
}

/// The last `width` (< lanes) columns of rows of x, widened to float and zero-padded to whole
/// vectors, 64 rows at a time: the tails go through one vector path whatever S is, so that
/// 16-bit data give the same bits as the same values in float.
template <class S>
struct WidenedTails {
  static constexpr Index max_rows = 64;
  alignas(64) float rows[max_rows][lanes];

  /// body(j0, count) for each chunk of rows [j0, j0 + count) of x, with rows[j] holding row
  /// j0 + j.
  template <class Body>
  void for_each_chunk(const S* x, Index x_stride, Index row_count, Index width, Body body) {
    for (Index j0 = 0; j0 < row_count; j0 += max_rows) {
      const Index count = std::min(max_rows, row_count - j0);
      for (Index j = 0; j < count; ++j) {
        for (Index c = 0; c < lanes; ++c)
          rows[j][c] = c < width ? static_cast<float>(x[(j0 + j) * x_stride + c]) : 0.0f;
      }
      body(j0, count);
    }
  }
};

/// s[r, j] += q[r, 0:width) . k[j, 0:width) for r < rows, j < keys (width < lanes).
template <class S>
inline void dot_tails(const float* q, Index q_stride, Index rows, const S* k, Index k_stride,
                      Index keys, Index width, float* s, Index s_stride) {
  WidenedTails<S> tails;
  tails.for_each_chunk(k, k_stride, keys, width, [&](Index j0, Index count) {
    for (Index r = 0; r < rows; ++r) {
      const vec query = load_first(q + r * q_stride, width);
      for (Index j = 0; j < count; ++j)
        s[r * s_stride + j0 + j] += reduce_add(mul(query, load(tails.rows[j])));
    }
  });
}

/// dot_rows for the last `rows` (< decode_score_rows_v<S>) rows, in one pass over k.
template <bool Prefetch, class S, int Rb = decode_score_rows_v<S> - 1>
inline void dot_rest(Index rows, const float* q, Index q_stride, const RowReader<S>& k, Index keys,
                     Index dim, float* s, Index s_stride) {
  if constexpr (Rb > 0) {
    if (rows == Rb)
      return dot_rows<Rb, Prefetch>(q, q_stride, k, keys, dim, s, s_stride);
    dot_rest<Prefetch, S, Rb - 1>(rows, q, q_stride, k, keys, dim, s, s_stride);
  }
}

/// Keys per chunk of dot_scores: 8 rows of 576 floats (18 KB) stay in L1 while every group of
/// query rows passes over them.
inline constexpr Index decode_chunk_keys = 8;

/// s[r, j] = q[r] . k[j] for all `rows` rows and one chunk of keys, decode_score_rows_v<S> rows
/// at a time; the first pass prefetches (the next block's rows of the chunk), the others read
/// the chunk again.
template <class S>
inline void dot_chunk(const float* q, Index q_stride, Index rows, const RowReader<S>& k, Index keys,
                      Index dim, float* s, Index s_stride) {
  constexpr int group = decode_score_rows_v<S>;
  if (rows < group)
    return dot_rest<true>(rows, q, q_stride, k, keys, dim, s, s_stride);
  dot_rows<group, true>(q, q_stride, k, keys, dim, s, s_stride);
  Index r = group;
  for (; r + group <= rows; r += group)
    dot_rows<group, false>(q + r * q_stride, q_stride, k, keys, dim, s + r * s_stride, s_stride);
  dot_rest<false>(rows - r, q + r * q_stride, q_stride, k, keys, dim, s + r * s_stride, s_stride);
}

/// s = q k^T: s[r, j] = q[r] . k[j] for r < rows, j < keys; k_stride in S (blocks for a
/// quantized S, whose D is a multiple of 32 and so of lanes).
template <class S>
inline void dot_scores(const float* q, Index q_stride, Index rows,  // (rows, D)
                       const S* k, Index k_stride, Index keys,      // (keys, D)
                       Index dim, float* s, Index s_stride,         // (rows, keys)
                       const S* k_ahead) {  // the next block's rows, to prefetch
  const Index vector_dim = dim / lanes * lanes;
  const RowReader<S> k_rows = reader_of(k, k_stride, k_ahead);
  for (Index j = 0; j < keys; j += decode_chunk_keys) {
    dot_chunk(q, q_stride, rows, k_rows.at(j, 0), std::min(decode_chunk_keys, keys - j), vector_dim,
              s + j, s_stride);
  }
  if constexpr (!is_quantized_v<S>) {
    if (vector_dim < dim)
      dot_tails(q + vector_dim, q_stride, rows, k + vector_dim, k_stride, keys, dim - vector_dim, s,
                s_stride);
  }
}

/// out[r] = max_j s[r, j] for r < rows (-inf for an empty row).
inline void row_maxima(const float* s, Index s_stride, Index rows, Index cols, float* out) {
  for (Index r = 0; r < rows; ++r) {
    const float* row = s + r * s_stride;
    vec m0 = set1(-std::numeric_limits<float>::infinity()), m1 = m0;
    Index j = 0;
    for (; j + 2 * lanes <= cols; j += 2 * lanes) {
      m0 = maximum(load(row + j), m0);
      m1 = maximum(load(row + j + lanes), m1);
    }
    float result = -std::numeric_limits<float>::infinity();
    alignas(64) float partial[lanes];
    store(partial, maximum(m0, m1));
    for (const float x : partial)
      result = x > result ? x : result;
    for (; j < cols; ++j)
      result = row[j] > result ? row[j] : result;
    out[r] = result;
  }
}

/// s[r, j] = exp(s[r, j] - shift[r]) in place and sums[r] = sum_j s[r, j], for r < rows.
inline void exp_rows(float* s, Index s_stride, Index rows, Index cols,  // (rows, cols)
                     const float* shift, float* sums) {                 // (rows) each
  for (Index r = 0; r < rows; ++r) {
    float* row = s + r * s_stride;
    const vec shift_vector = set1(shift[r]);
    vec sum = zero();
    Index j = 0;
    for (; j + lanes <= cols; j += lanes) {
      const vec p = exp_shifted(load(row + j), shift_vector);
      store(row + j, p);
      sum = add(sum, p);
    }
    float total = reduce_add(sum);
    if (j < cols) {  // the tail, padded with -inf (weight 0)
      alignas(64) float tail[lanes];
      std::fill(tail, tail + lanes, -std::numeric_limits<float>::infinity());
      std::copy(row + j, row + cols, tail);
      store(tail, exp_shifted(load(tail), shift_vector));
      for (Index c = 0; c < cols - j; ++c) {
        row[j + c] = tail[c];
        total += tail[c];
      }
    }
    sums[r] = total;
  }
}

/// weighted_sum_block for quantized rows, whose scales multiply the weights instead of the
/// values: sum_j p[r, j] (d_j q_j) = sum_j (p[r, j] d_j) q_j, with q_j the block's integers
/// (n - 8 for q4_0) widened exactly. Per vector of values this leaves a widening (q4_0: a
/// table lookup) and the Rb FMAs, without the multiply by d_j, and it moves the scales' fp16
/// conversions out of the loop: Rb * C / step weights p[r, j] d_j per key, formed 64 keys at
/// a time, a vector of keys per multiply. The result differs from the widened values' by the
/// rounding of p d (one float rounding per term, within the float bound of docs/precision.md).
template <int Rb, int C, bool Prefetch, class Block>
inline void weighted_sum_scaled_block(const float* p, Index p_stride,  // (Rb, keys)
                                      const RowReader<Block>& v,       // (keys, C lanes)
                                      Index keys, const float* alpha, bool first, float* acc,
                                      Index acc_stride) {  // (Rb, C lanes)
  constexpr int step = RowReader<Block>::step;
  constexpr int blocks = C / step;
  static_assert(C % step == 0, "weighted_sum_scaled_block: whole blocks of a quantized row");
  constexpr Index chunk = 64;
  constexpr auto blocks_n = static_cast<std::size_t>(blocks);
  constexpr auto chunk_n = static_cast<std::size_t>(chunk);
  alignas(64) float scales[blocks_n][chunk_n];
  alignas(64) float weights[blocks_n][static_cast<std::size_t>(Rb)][chunk_n];
  vec sum[static_cast<std::size_t>(Rb)][static_cast<std::size_t>(C)];
#pragma GCC unroll 4
  for (int r = 0; r < Rb; ++r) {
    const vec rescale = set1(first ? 0.0f : alpha[r]);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c)
      sum[r][c] = first ? zero() : mul(load(acc + r * acc_stride + lanes * c), rescale);
  }
  for (Index j0 = 0; j0 < keys; j0 += chunk) {
    const Index n = std::min(chunk, keys - j0);
    // (the last vector's lanes past the keys hold 0: weights 0, never read)
    block_scales(v.block(j0, 0), v.stride, n, blocks, scales[0], chunk);
    for (int b = 0; b < blocks; ++b) {
      for (int r = 0; r < Rb; ++r) {
        const float* p_row = p + r * p_stride + j0;
        for (Index j = 0; j < n; j += lanes) {
          const vec p_j = j + lanes <= n ? load(p_row + j) : load_first(p_row + j, n - j);
          store(weights[b][r] + j, mul(p_j, load(scales[b] + j)));
        }
      }
    }
    for (Index j = 0; j < n; ++j) {
      vec value[static_cast<std::size_t>(C)];
#pragma GCC unroll 4
      for (int b = 0; b < blocks; ++b) {
        const Block* block = v.block(j0 + j, b * quantized_block_values);
        if constexpr (Prefetch)
          v.prefetch(j0 + j, b * quantized_block_values);
#pragma GCC unroll 4
        for (int i = 0; i < step; ++i)
          value[b * step + i] = RowReader<Block>::load_integers(block, i);
      }
#pragma GCC unroll 4
      for (int r = 0; r < Rb; ++r) {
#pragma GCC unroll 4
        for (int b = 0; b < blocks; ++b) {
          const vec weight = set1(weights[b][r][j]);
#pragma GCC unroll 4
          for (int i = 0; i < step; ++i)
            sum[r][b * step + i] = fmadd(weight, value[b * step + i], sum[r][b * step + i]);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < Rb; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c)
      store(acc + r * acc_stride + lanes * c, sum[r][c]);
  }
}

/// acc[r, 0:C lanes) = alpha[r] acc[r, :] + sum_j p[r, j] v[j, 0:C lanes) for r < Rb (with
/// `first`, acc is only written): Rb x C vectors of sums in registers, full vectors only.
template <int Rb, int C, bool Prefetch, class S>
inline void weighted_sum_block(const float* p, Index p_stride,  // (Rb, keys)
                               const RowReader<S>& v,           // (keys, C lanes)
                               Index keys, const float* alpha, bool first, float* acc,
                               Index acc_stride) {  // (Rb, C lanes)
  vec sum[static_cast<std::size_t>(Rb)][static_cast<std::size_t>(C)];
#pragma GCC unroll 4  // as in dot_block
  for (int r = 0; r < Rb; ++r) {
    const vec rescale = set1(first ? 0.0f : alpha[r]);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c)
      sum[r][c] = first ? zero() : mul(load(acc + r * acc_stride + lanes * c), rescale);
  }
  constexpr int step = RowReader<S>::step;
  static_assert(C % step == 0, "weighted_sum_block: whole blocks of a quantized row");
  for (Index j = 0; j < keys; ++j) {
    vec value[static_cast<std::size_t>(C)];
#pragma GCC unroll 4
    for (int c = 0; c < C; c += step) {
      const typename RowReader<S>::Piece piece = v.piece(j, lanes * c);
      if constexpr (Prefetch)
        v.prefetch(j, lanes * c);
#pragma GCC unroll 4
      for (int i = 0; i < step; ++i)
        value[c + i] = RowReader<S>::load(piece, i);
    }
#pragma GCC unroll 4
    for (int r = 0; r < Rb; ++r) {
      const vec weight = set1(p[r * p_stride + j]);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c)
        sum[r][c] = fmadd(weight, value[c], sum[r][c]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < Rb; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c)
      store(acc + r * acc_stride + lanes * c, sum[r][c]);
  }
}

/// A quantized row takes whole blocks (C a multiple of the reader's step): Dv is a multiple
/// of 32, so the columns left after blocks of C vectors are too.
template <class S>
inline constexpr int decode_slab_vectors =
    static_cast<int>(decode_vectors) / RowReader<S>::step* RowReader<S>::step;

template <int Rb, bool Prefetch, class S, int C = decode_slab_vectors<S>>
inline void weighted_sum_rows(const float* p, Index p_stride, const RowReader<S>& v, Index keys,
                              Index vector_dim, const float* alpha, bool first, float* acc,
                              Index acc_stride) {
  constexpr int step = RowReader<S>::step;
  Index e = 0;
  for (; e + C * lanes <= vector_dim; e += C * lanes) {
    if constexpr (is_quantized_v<S>) {
      weighted_sum_scaled_block<Rb, C, Prefetch>(p, p_stride, v.at(0, e), keys, alpha, first,
                                                 acc + e, acc_stride);
    } else {
      weighted_sum_block<Rb, C, Prefetch>(p, p_stride, v.at(0, e), keys, alpha, first, acc + e,
                                          acc_stride);
    }
  }
  if constexpr (C > step) {
    if (e < vector_dim) {
      weighted_sum_rows<Rb, Prefetch, S, C - step>(p, p_stride, v.at(0, e), keys, vector_dim - e,
                                                   alpha, first, acc + e, acc_stride);
    }
  }
}

/// acc[r, 0:width) = alpha[r] acc[r, :] + sum_j p[r, j] v[j, 0:width) (width < lanes).
template <class S>
inline void weighted_sum_tails(const float* p, Index p_stride, Index rows, const S* v,
                               Index v_stride, Index keys, Index width, const float* alpha,
                               bool first, float* acc, Index acc_stride) {
  WidenedTails<S> tails;
  tails.for_each_chunk(v, v_stride, keys, width, [&](Index j0, Index count) {
    for (Index r = 0; r < rows; ++r) {
      float* row = acc + r * acc_stride;
      vec sum = zero();
      if (j0 > 0 || (!first && alpha == nullptr))  // alpha null: added to as it is
        sum = load_first(row, width);
      else if (!first)
        sum = mul(load_first(row, width), set1(alpha[r]));
      for (Index j = 0; j < count; ++j)
        sum = fmadd(set1(p[r * p_stride + j0 + j]), load(tails.rows[j]), sum);
      store_first(row, sum, width);
    }
  });
}

/// weighted_sum_rows for the last `rows` (< decode_rows) rows, in one pass over v.
template <bool Prefetch, class S, int Rb = static_cast<int>(decode_rows) - 1>
inline void weighted_sum_rest(Index rows, const float* p, Index p_stride, const RowReader<S>& v,
                              Index keys, Index vector_dim, const float* alpha, bool first,
                              float* acc, Index acc_stride) {
  if constexpr (Rb > 0) {
    if (rows == Rb) {
      return weighted_sum_rows<Rb, Prefetch>(p, p_stride, v, keys, vector_dim, alpha, first, acc,
                                             acc_stride);
    }
    weighted_sum_rest<Prefetch, S, Rb - 1>(rows, p, p_stride, v, keys, vector_dim, alpha, first,
                                           acc, acc_stride);
  }
}

/// weighted_sum for all `rows` rows and one slab of `width` columns (vectors only),
/// decode_rows rows at a time; with `prefetch` the first pass requests the next block's slab.
template <class S>
inline void weighted_sum_slab(const float* p, Index p_stride, Index rows, const RowReader<S>& v,
                              Index keys, Index width, const float* alpha, bool first, float* acc,
                              Index acc_stride, bool prefetch) {
  constexpr int group = static_cast<int>(decode_rows);
  const auto alpha_of = [&](Index r) { return first ? nullptr : alpha + r; };
  Index r = 0;
  if (prefetch) {
    if (rows < group)
      return weighted_sum_rest<true>(rows, p, p_stride, v, keys, width, alpha, first, acc,
                                     acc_stride);
    weighted_sum_rows<group, true>(p, p_stride, v, keys, width, alpha, first, acc, acc_stride);
    r = group;
  }
  for (; r + group <= rows; r += group) {
    weighted_sum_rows<group, false>(p + r * p_stride, p_stride, v, keys, width, alpha_of(r), first,
                                    acc + r * acc_stride, acc_stride);
  }
  weighted_sum_rest<false>(rows - r, p + r * p_stride, p_stride, v, keys, width, alpha_of(r), first,
                           acc + r * acc_stride, acc_stride);
}

/// acc = diag(alpha) acc + p v, or acc = p v when alpha is null: the rows of p weight the
/// rows of v; v_stride in S (blocks for a quantized S, whose Dv is a multiple of 32).
template <class S>
inline void weighted_sum(const float* p, Index p_stride, Index rows,  // (rows, keys)
                         const S* v, Index v_stride, Index keys,      // (keys, Dv)
                         Index value_dim, const float* alpha,         // (rows) or null
                         float* acc, Index acc_stride,                // (rows, Dv)
                         const S* v_ahead,  // the next block's rows, to prefetch, or null
                         const S* v_far) {  // rows further on, for L2 (BlockRowReader), or null
  const bool first = alpha == nullptr;
  const Index vector_dim = value_dim / lanes * lanes;
  const RowReader<S> v_rows = reader_of(v, v_stride, v_ahead != nullptr ? v_ahead : v, v_far);
  const Index slab = decode_slab_vectors<S> * lanes;
  for (Index e = 0; e < vector_dim; e += slab) {
    weighted_sum_slab(p, p_stride, rows, v_rows.at(0, e), keys, std::min(slab, vector_dim - e),
                      alpha, first, acc + e, acc_stride, v_ahead != nullptr);
  }
  if constexpr (!is_quantized_v<S>) {
    if (vector_dim < value_dim) {
      weighted_sum_tails(p, p_stride, rows, v + vector_dim, v_stride, keys, value_dim - vector_dim,
                         alpha, first, acc + vector_dim, acc_stride);
    }
  }
}
