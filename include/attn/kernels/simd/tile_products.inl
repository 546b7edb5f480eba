// attn/kernels/simd/tile_products.inl: the tile products of the flash and decode kernels,
// written once on the vector primitives of the namespace that includes this file
// (simd/avx2.hpp, simd/avx512.hpp: vec, lanes, load, store, fmadd, exp_shifted, the block
// sizes, ...). No include guard and no #include: simd/tile_products.hpp includes it once per
// vector instruction set (simd/foreach_isa.hpp), inside attn::detail::avx2 and ::avx512
// within their target regions.
//
// Flash keeps the queries of a tile along the vector lanes (kernels/online_softmax.inl):
//
//   qt   (D, W)    scale * q tile^T, W = the query tile rounded up to whole vectors
//   st   (Bk, W)   scores^T, then probabilities^T, of one key tile
//   ot   (Dv, W)   unnormalised output^T
//   k    (Bk, D)   read in place, not transposed, not packed: each k[j, d] is broadcast
//   v    (Bk, Dv)  read in place, each v[j, e] broadcast the same way
//
// so st = k qt and ot += v^T st are products whose vector operand is a row of qt or st and
// whose scalar operand is one element of a k or v row; the softmax reduces over keys, down
// the columns of st, as elementwise max/add of vectors of queries.
//
// Decode keeps its few queries on the rows (s (R, Bk), acc (R, Dv)) and reduces each
// q . k dot product along D, with k and v widened in registers as they are read.
//
// exp_shifted (in the primitives) computes exp(d), d = x - shift <= 0: n = round(d log2 e),
// r = d - n ln 2 in two parts (Cody-Waite, so r is exact to float precision), exp(d) =
// 2^n p(r) with p the degree-6 minimax polynomial of exp on |r| <= ln(2)/2 (relative error
// 1.9e-9); 13 vector operations per vector. Results below the smallest normal float (d <
// -87, and -inf) are exactly 0: producing a subnormal costs a microcode assist of about 150
// cycles per vector on Intel cores, and a probability below 1.2e-38 beside the row's
// maximum of 1 changes nothing. NaN stays NaN.

/// Query columns are padded to whole vectors.
inline Index padded(Index n) {
  return (n + lanes - 1) / lanes * lanes;
}

// --- Flash: queries along the lanes -----------------------------------------------------

/// qt[d, 0:width) = scale * q[0:rows, d], zeros in columns [rows, width).
inline void pack_queries(const float* q, Index q_stride,  // (rows, D)
                         Index rows, Index dim, float scale, float* qt, Index qt_stride,
                         Index width) {  // (D, width)
  const vec scale_vector = set1(scale);
  Index r0 = 0;
  if (q_stride <= (Index{1} << 26)) {  // 32-bit gather offsets
    for (; r0 + lanes <= rows; r0 += lanes) {
      const float* column = q + r0 * q_stride;
      for (Index d = 0; d < dim; ++d)
        store(qt + d * qt_stride + r0, mul(gather_strided(column + d, q_stride), scale_vector));
    }
  }
  for (Index d = 0; d < dim; ++d) {
    for (Index r = r0; r < rows; ++r)
      qt[d * qt_stride + r] = scale * q[r * q_stride + d];
    std::fill(qt + d * qt_stride + rows, qt + d * qt_stride + width, 0.0f);
  }
}

/// The elementwise max of x[0], ..., x[N - 1], as a balanced tree (depth log2 N): R - 1
/// dependent maxes in a chain are a large share of a scores call at D = 64.
template <std::size_t N>
inline vec max_tree(const vec* x) {
  if constexpr (N == 1)
    return x[0];
  else
    return maximum(max_tree<N / 2>(x), max_tree<N - N / 2>(x + N / 2));
}

/// st[r, 0:C lanes) = sum_d k[r, d] * qt[d, 0:C lanes) for r < R: an (R x C vectors) register
/// block (`accumulating`: st[r, :] += that sum, in the same order; `k_transposed`: k[r, d] is
/// read at k[d * k_stride + r], a column of a row-major (D, R) block). With `column_max`, also
/// column_max = max(column_max, max_r st[r, :]) while the block is still in registers.
template <std::size_t R, std::size_t C, bool accumulating = false, bool k_transposed = false>
inline void scores_block(const float* k, Index k_stride,    // (R, D) rows of k
                         const float* qt, Index qt_stride,  // (D, C lanes) columns of qt
                         Index dim, float* st, Index st_stride,
                         float* column_max) {  // (C lanes) or null
  vec acc[R][C];
#pragma GCC unroll 16
  for (std::size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (std::size_t c = 0; c < C; ++c) {
      acc[r][c] = accumulating
                      ? load(st + static_cast<Index>(r) * st_stride + lanes * static_cast<Index>(c))
                      : zero();
    }
  }
  // unrolled by 4: at D = 64 a call is only ~800 cycles, so its loop overhead and exit count
#pragma GCC unroll 4
  for (Index d = 0; d < dim; ++d) {
    vec q[C];
#pragma GCC unroll 4
    for (std::size_t c = 0; c < C; ++c)
      q[c] = load(qt + d * qt_stride + lanes * static_cast<Index>(c));
#pragma GCC unroll 16
    for (std::size_t r = 0; r < R; ++r) {
      const vec key = set1(k_transposed ? k[d * k_stride + static_cast<Index>(r)]
                                        : k[static_cast<Index>(r) * k_stride + d]);
#pragma GCC unroll 4
      for (std::size_t c = 0; c < C; ++c)
        acc[r][c] = fmadd(key, q[c], acc[r][c]);
    }
  }
#pragma GCC unroll 16
  for (std::size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (std::size_t c = 0; c < C; ++c)
      store(st + static_cast<Index>(r) * st_stride + lanes * static_cast<Index>(c), acc[r][c]);
  }
  if (column_max != nullptr) {
#pragma GCC unroll 4
    for (std::size_t c = 0; c < C; ++c) {
      vec column[R];
#pragma GCC unroll 16
      for (std::size_t r = 0; r < R; ++r)
        column[r] = acc[r][c];
      float* running = column_max + lanes * static_cast<Index>(c);
      store(running, maximum(max_tree<R>(column), load(running)));
    }
  }
}

/// scores_block for `rows` (1 .. R) keys.
template <std::size_t C, std::size_t R = static_cast<std::size_t>(score_rows),
          bool accumulating = false, bool k_transposed = false>
inline void scores_rows(Index rows, const float* k, Index k_stride, const float* qt,
                        Index qt_stride, Index dim, float* st, Index st_stride, float* column_max) {
  if constexpr (R > 0) {
    if (rows == static_cast<Index>(R)) {
      return scores_block<R, C, accumulating, k_transposed>(k, k_stride, qt, qt_stride, dim, st,
                                                            st_stride, column_max);
    }
    scores_rows<C, R - 1, accumulating, k_transposed>(rows, k, k_stride, qt, qt_stride, dim, st,
                                                      st_stride, column_max);
  }
}

/// st[0:keys, 0:width) = k[0:keys] qt; with `column_max`, column_max[0:width) = the column
/// maxima of st (computed while the blocks are in registers).
inline void scores(const float* k, Index k_stride,  // (keys, D)
                   Index keys, const float* qt,     // (D, width)
                   Index qt_stride, Index dim, Index width, float* st,
                   Index st_stride,      // (keys, width)
                   float* column_max) {  // (width) or null
  if (column_max != nullptr)
    std::fill(column_max, column_max + width, -std::numeric_limits<float>::infinity());
  constexpr Index block_width = score_vectors * lanes;
  for (Index j = 0; j < keys; j += score_rows) {
    const Index rows = std::min(score_rows, keys - j);
    const float* k_rows = k + j * k_stride;
    float* st_rows = st + j * st_stride;
    Index c0 = 0;
    for (; c0 + block_width <= width; c0 += block_width) {
      scores_rows<static_cast<std::size_t>(score_vectors)>(
          rows, k_rows, k_stride, qt + c0, qt_stride, dim, st_rows + c0, st_stride,
          column_max != nullptr ? column_max + c0 : nullptr);
    }
    for (; c0 < width; c0 += lanes) {
      scores_rows<1>(rows, k_rows, k_stride, qt + c0, qt_stride, dim, st_rows + c0, st_stride,
                     column_max != nullptr ? column_max + c0 : nullptr);
    }
  }
}

/// column_max[0:width) = the column maxima of st[0:keys, 0:width), four chains per vector so
/// that the max latency overlaps.
inline void column_maxima(const float* st, Index st_stride, Index keys, Index width,
                          float* column_max) {
  for (Index c0 = 0; c0 < width; c0 += lanes) {
    vec m[4];
    for (vec& x : m)
      x = set1(-std::numeric_limits<float>::infinity());
    const float* column = st + c0;
    Index j = 0;
    for (; j + 4 <= keys; j += 4) {
#pragma GCC unroll 4
      for (std::size_t u = 0; u < 4; ++u)
        m[u] = maximum(load(column + (j + static_cast<Index>(u)) * st_stride), m[u]);
    }
    for (; j < keys; ++j)
      m[0] = maximum(load(column + j * st_stride), m[0]);
    store(column_max + c0, maximum(maximum(m[0], m[1]), maximum(m[2], m[3])));
  }
}

/// st[j, c] = -inf for every key j outside [lo[c], hi[c]) (tile-relative): the causal limit,
/// the window and the key length, a vector of queries at a time; and column_max = the column
/// maxima of the result, in the same pass.
inline void hide_outside_intervals(float* st, Index st_stride, Index keys,  // (keys, width)
                                   Index width, const std::int32_t* lo,
                                   const std::int32_t* hi,  // (width) each
                                   float* column_max) {     // (width)
  for (Index c0 = 0; c0 < width; c0 += lanes) {
    const ivec first = load_indices(lo + c0);
    const ivec last = load_indices(hi + c0);
    vec m[2] = {set1(-std::numeric_limits<float>::infinity()),
                set1(-std::numeric_limits<float>::infinity())};
    for (Index j = 0; j < keys; ++j) {
      float* at = st + j * st_stride + c0;
      const vec score = hide_outside(load(at), static_cast<std::int32_t>(j), first, last);
      store(at, score);
      m[j & 1] = maximum(score, m[j & 1]);
    }
    store(column_max + c0, maximum(m[0], m[1]));
  }
}

/// st[j, c] = exp(st[j, c] - shift[c]) in place and sums[c] = sum_j st[j, c], for c < width.
inline void exp_columns(float* st, Index st_stride, Index keys, Index width,  // (keys, width)
                        const float* shift, float* sums) {                    // (width) each
  for (Index c0 = 0; c0 < width; c0 += lanes) {
    const vec s = load(shift + c0);
    float* column = st + c0;
    vec sum0 = zero(), sum1 = zero();
    Index j = 0;
    for (; j + 1 < keys; j += 2) {  // two chains: the adds do not wait for each other
      const vec p0 = exp_shifted(load(column + j * st_stride), s);
      const vec p1 = exp_shifted(load(column + (j + 1) * st_stride), s);
      store(column + j * st_stride, p0);
      store(column + (j + 1) * st_stride, p1);
      sum0 = add(sum0, p0);
      sum1 = add(sum1, p1);
    }
    if (j < keys) {
      const vec p0 = exp_shifted(load(column + j * st_stride), s);
      store(column + j * st_stride, p0);
      sum0 = add(sum0, p0);
    }
    store(sums + c0, add(sum0, sum1));
  }
}

/// out[i] = exp(x[i] - shift[i]) for i < n (x[i] <= shift[i], or NaN).
inline void exp_difference(const float* x, const float* shift, float* out, Index n) {
  Index i = 0;
  for (; i + lanes <= n; i += lanes)
    store(out + i, exp_shifted(load(x + i), load(shift + i)));
  if (i < n)
    store_first(out + i, exp_shifted(load_first(x + i, n - i), load_first(shift + i, n - i)),
                n - i);
}

/// ot[e, 0:C lanes) = alpha * ot[e, :] + sum_j v[j, e] * pt[j, :] for e < R: an (R x C
/// vectors) register block of the transposed output. With `first`, the old ot is neither read
/// nor rescaled (it may be uninitialised); with alpha null, it is accumulated into as it is.
template <std::size_t R, std::size_t C>
inline void values_block(const float* pt, Index pt_stride,          // (keys, C lanes) of st
                         const float* v, Index v_stride,            // (keys, R) block of v
                         Index keys, const float* alpha,            // (C lanes) or null
                         bool first, float* ot, Index ot_stride) {  // (R, C lanes) of ot
  vec acc[R][C];
  if (first) {
#pragma GCC unroll 16
    for (std::size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (std::size_t c = 0; c < C; ++c)
        acc[r][c] = zero();
    }
  } else {
    vec rescale[C];
#pragma GCC unroll 4
    for (std::size_t c = 0; c < C; ++c)
      rescale[c] = alpha != nullptr ? load(alpha + lanes * static_cast<Index>(c)) : set1(1.0f);
#pragma GCC unroll 16
    for (std::size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (std::size_t c = 0; c < C; ++c) {
        const float* from = ot + static_cast<Index>(r) * ot_stride + lanes * static_cast<Index>(c);
        acc[r][c] = mul(rescale[c], load(from));
      }
    }
  }
#pragma GCC unroll 4  // as in scores_block
  for (Index j = 0; j < keys; ++j) {
    vec p[C];
#pragma GCC unroll 4
    for (std::size_t c = 0; c < C; ++c)
      p[c] = load(pt + j * pt_stride + lanes * static_cast<Index>(c));
#pragma GCC unroll 16
    for (std::size_t r = 0; r < R; ++r) {
      const vec value = set1(v[j * v_stride + static_cast<Index>(r)]);
#pragma GCC unroll 4
      for (std::size_t c = 0; c < C; ++c)
        acc[r][c] = fmadd(value, p[c], acc[r][c]);
    }
  }
#pragma GCC unroll 16
  for (std::size_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (std::size_t c = 0; c < C; ++c)
      store(ot + static_cast<Index>(r) * ot_stride + lanes * static_cast<Index>(c), acc[r][c]);
  }
}

/// values_block for `rows` (1 .. R) value dims and `vectors` (1 .. C) vectors of queries.
template <std::size_t C = static_cast<std::size_t>(value_vectors),
          std::size_t R = static_cast<std::size_t>(value_rows)>
inline void values_rows(Index vectors, Index rows, const float* pt, Index pt_stride, const float* v,
                        Index v_stride, Index keys, const float* alpha, bool first, float* ot,
                        Index ot_stride) {
  if constexpr (C > 0 && R > 0) {
    if (vectors < static_cast<Index>(C)) {
      return values_rows<C - 1, R>(vectors, rows, pt, pt_stride, v, v_stride, keys, alpha, first,
                                   ot, ot_stride);
    }
    if (rows == static_cast<Index>(R))
      return values_block<R, C>(pt, pt_stride, v, v_stride, keys, alpha, first, ot, ot_stride);
    values_rows<C, R - 1>(vectors, rows, pt, pt_stride, v, v_stride, keys, alpha, first, ot,
                          ot_stride);
  }
}

/// Keys per pass of ot += v^T p over all the blocks of ot: the chunks of st (32 KiB at 128
/// queries) and of v (16 KiB at Dv = 64) stay near L1 while ot's blocks pass over them.
inline constexpr Index value_keys = 64;

/// ot[0:Dv, 0:width) = alpha * ot + v[0:keys]^T st[0:keys]; alpha null: ot = v^T st (the
/// row's first visible tile; the old ot is not read).
inline void accumulate(const float* st, Index st_stride, Index keys, Index width,  // (keys, width)
                       const float* v, Index v_stride, Index value_dim,            // (keys, Dv)
                       const float* alpha,                                         // (width)
                       float* ot, Index ot_stride) {                               // (Dv, width)
  constexpr Index block_width = value_vectors * lanes;
  for (Index c0 = 0; c0 < keys; c0 += value_keys) {
    const Index chunk = std::min(value_keys, keys - c0);
    const bool first = alpha == nullptr && c0 == 0;
    const float* pt = st + c0 * st_stride;
    const float* v_rows = v + c0 * v_stride;
    for (Index q0 = 0; q0 < width; q0 += block_width) {
      const Index vectors = std::min(value_vectors, (width - q0) / lanes);
      const float* rescale = c0 == 0 && alpha != nullptr ? alpha + q0 : nullptr;
      for (Index e = 0; e < value_dim; e += value_rows) {
        values_rows(vectors, std::min(value_rows, value_dim - e), pt + q0, st_stride, v_rows + e,
                    v_stride, chunk, rescale, first, ot + e * ot_stride + q0, ot_stride);
      }
    }
  }
}

// --- Widening ---------------------------------------------------------------------------

/// dst[0:n) = src[0:n) as float (exact for half and bfloat16).
template <class S>
inline void widen(const S* src, float* dst, Index n) {
  const Index vector_end = n / lanes * lanes;
  for (Index i = 0; i < vector_end; i += lanes)
    store(dst + i, load_widened(src + i));
  for (Index i = vector_end; i < n; ++i)
    dst[i] = static_cast<float>(src[i]);
}

// --- Decode: queries along the rows, K and V widened in registers -----------------------

/// Rows this far ahead of the one being read are requested from memory: blocks of K and V
/// alternate, a 256-byte row crosses a page every 16 rows, and the hardware prefetcher alone
/// lets the loads wait. The distance was chosen by measurement (docs/performance.md,
/// "Tuning choices").
inline constexpr Index prefetch_keys = 32;

template <class S>
inline void prefetch_element(const S* row, Index offset) {
  prefetch(reinterpret_cast<std::uintptr_t>(row) + static_cast<std::uintptr_t>(offset) * sizeof(S));
}

/// s[r, j] = q[r, 0:dim) . k[j, 0:dim) for r < Rb, j < Kb, dim a multiple of lanes: Rb x Kb
/// dot products in registers. (Nothing else in the loop: a call or a branch to a tail path
/// makes GCC keep the accumulators on the stack.)
template <int Rb, int Kb, class S>
inline void dot_block(const float* q, Index q_stride,  // (Rb, dim)
                      const S* k, Index k_stride,      // (Kb, dim)
                      Index dim, float* s, Index s_stride) {
  static_assert(Kb == 1 || Kb == 4, "dot_block: 1 or 4 keys");
  vec acc[static_cast<std::size_t>(Rb)][static_cast<std::size_t>(Kb)];
// Unrolled by pragmas: GCC's -O2 keeps a loop over R rolled and acc in memory otherwise.
#pragma GCC unroll 4
  for (int r = 0; r < Rb; ++r) {
#pragma GCC unroll 4
    for (int j = 0; j < Kb; ++j)
      acc[r][j] = zero();
  }
  for (Index d = 0; d < dim; d += lanes) {
    vec key[static_cast<std::size_t>(Kb)];
#pragma GCC unroll 4
    for (int j = 0; j < Kb; ++j) {
      key[j] = load_widened(k + j * k_stride + d);
      prefetch_element(k, (j + prefetch_keys) * k_stride + d);
    }
#pragma GCC unroll 4
    for (int r = 0; r < Rb; ++r) {
      const vec query = load(q + r * q_stride + d);
#pragma GCC unroll 4
      for (int j = 0; j < Kb; ++j)
        acc[r][j] = fmadd(query, key[j], acc[r][j]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < Rb; ++r) {
    if constexpr (Kb == 4)
      sum_each4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], s + r * s_stride);
    else
      s[r * s_stride] = reduce_add(acc[r][0]);
  }
}

template <int Rb, class S>
inline void dot_rows(const float* q, Index q_stride, const S* k, Index k_stride, Index keys,
                     Index dim, float* s, Index s_stride) {
  Index j = 0;
  for (; j + 4 <= keys; j += 4)
    dot_block<Rb, 4>(q, q_stride, k + j * k_stride, k_stride, dim, s + j, s_stride);
  for (; j < keys; ++j)
    dot_block<Rb, 1>(q, q_stride, k + j * k_stride, k_stride, dim, s + j, s_stride);
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

/// dot_rows for the last `rows` (< decode_rows) rows, in one pass over k.
template <class S, int Rb = static_cast<int>(decode_rows) - 1>
inline void dot_rest(Index rows, const float* q, Index q_stride, const S* k, Index k_stride,
                     Index keys, Index dim, float* s, Index s_stride) {
  if constexpr (Rb > 0) {
    if (rows == Rb)
      return dot_rows<Rb>(q, q_stride, k, k_stride, keys, dim, s, s_stride);
    dot_rest<S, Rb - 1>(rows, q, q_stride, k, k_stride, keys, dim, s, s_stride);
  }
}

/// s = q k^T: s[r, j] = q[r] . k[j] for r < rows, j < keys.
template <class S>
inline void dot_scores(const float* q, Index q_stride, Index rows,  // (rows, D)
                       const S* k, Index k_stride, Index keys,      // (keys, D)
                       Index dim, float* s, Index s_stride) {       // (rows, keys)
  const Index vector_dim = dim / lanes * lanes;
  Index r = 0;
  for (; r + decode_rows <= rows; r += decode_rows) {
    dot_rows<static_cast<int>(decode_rows)>(q + r * q_stride, q_stride, k, k_stride, keys,
                                            vector_dim, s + r * s_stride, s_stride);
  }
  dot_rest(rows - r, q + r * q_stride, q_stride, k, k_stride, keys, vector_dim, s + r * s_stride,
           s_stride);
  if (vector_dim < dim)
    dot_tails(q + vector_dim, q_stride, rows, k + vector_dim, k_stride, keys, dim - vector_dim, s,
              s_stride);
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

/// acc[r, 0:C lanes) = alpha[r] acc[r, :] + sum_j p[r, j] v[j, 0:C lanes) for r < Rb (with
/// `first`, acc is only written): Rb x C vectors of sums in registers, full vectors only.
template <int Rb, int C, class S>
inline void weighted_sum_block(const float* p, Index p_stride,  // (Rb, keys)
                               const S* v, Index v_stride,      // (keys, C lanes)
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
  for (Index j = 0; j < keys; ++j) {
    vec value[static_cast<std::size_t>(C)];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      value[c] = load_widened(v + j * v_stride + lanes * c);
      prefetch_element(v, (j + prefetch_keys) * v_stride + lanes * c);
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

template <int Rb, class S, int C = static_cast<int>(decode_vectors)>
inline void weighted_sum_rows(const float* p, Index p_stride, const S* v, Index v_stride,
                              Index keys, Index vector_dim, const float* alpha, bool first,
                              float* acc, Index acc_stride) {
  Index e = 0;
  for (; e + C * lanes <= vector_dim; e += C * lanes)
    weighted_sum_block<Rb, C>(p, p_stride, v + e, v_stride, keys, alpha, first, acc + e,
                              acc_stride);
  if constexpr (C > 1) {
    if (e < vector_dim) {
      weighted_sum_rows<Rb, S, C - 1>(p, p_stride, v + e, v_stride, keys, vector_dim - e, alpha,
                                      first, acc + e, acc_stride);
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
template <class S, int Rb = static_cast<int>(decode_rows) - 1>
inline void weighted_sum_rest(Index rows, const float* p, Index p_stride, const S* v,
                              Index v_stride, Index keys, Index vector_dim, const float* alpha,
                              bool first, float* acc, Index acc_stride) {
  if constexpr (Rb > 0) {
    if (rows == Rb) {
      return weighted_sum_rows<Rb>(p, p_stride, v, v_stride, keys, vector_dim, alpha, first, acc,
                                   acc_stride);
    }
    weighted_sum_rest<S, Rb - 1>(rows, p, p_stride, v, v_stride, keys, vector_dim, alpha, first,
                                 acc, acc_stride);
  }
}

/// acc = diag(alpha) acc + p v, or acc = p v when alpha is null: the rows of p weight the
/// rows of v.
template <class S>
inline void weighted_sum(const float* p, Index p_stride, Index rows,  // (rows, keys)
                         const S* v, Index v_stride, Index keys,      // (keys, Dv)
                         Index value_dim, const float* alpha,         // (rows) or null
                         float* acc, Index acc_stride) {              // (rows, Dv)
  const bool first = alpha == nullptr;
  const Index vector_dim = value_dim / lanes * lanes;
  Index r = 0;
  for (; r + decode_rows <= rows; r += decode_rows) {
    weighted_sum_rows<static_cast<int>(decode_rows)>(p + r * p_stride, p_stride, v, v_stride, keys,
                                                     vector_dim, first ? nullptr : alpha + r, first,
                                                     acc + r * acc_stride, acc_stride);
  }
  weighted_sum_rest(rows - r, p + r * p_stride, p_stride, v, v_stride, keys, vector_dim,
                    first ? nullptr : alpha + r, first, acc + r * acc_stride, acc_stride);
  if (vector_dim < value_dim) {
    weighted_sum_tails(p, p_stride, rows, v + vector_dim, v_stride, keys, value_dim - vector_dim,
                       alpha, first, acc + vector_dim, acc_stride);
  }
}

// --- Flash backward ----------------------------------------------------------------------

/// c[0:rows, 0:cols) += a[0:rows, 0:depth) b[0:depth, 0:cols): the rows of a weight the rows
/// of b (dq += ds k); with `a_transposed`, a is read as the transpose of a row-major
/// (depth, rows) block, a[r, d] at a[d * a_stride + r] (dk += ds^T q, dv += p^T dout). The
/// scores register blocks, b read in place and each a[r, d] broadcast; columns outside, so
/// that a (depth x 2 vectors) block of b stays in L1 while every row block of c uses it. The
/// columns past the last whole vector: weighted_sum_tails, or plain loops when transposed.
/// Each element is summed in the order d = 0, 1, ... onto its old value.
template <bool a_transposed = false>
inline void add_product(const float* a, Index a_stride, Index rows,   // (rows, depth)
                        const float* b, Index b_stride, Index depth,  // (depth, cols)
                        Index cols, float* c, Index c_stride) {       // (rows, cols)
  constexpr Index block_width = score_vectors * lanes;
  constexpr auto block_vectors = static_cast<std::size_t>(score_vectors);
  constexpr auto block_rows = static_cast<std::size_t>(score_rows);
  const Index vector_cols = cols / lanes * lanes;
  const auto a_rows = [&](Index r) { return a_transposed ? a + r : a + r * a_stride; };
  for (Index c0 = 0; c0 < vector_cols; c0 += block_width) {
    const bool whole = c0 + block_width <= vector_cols;
    for (Index r = 0; r < rows; r += score_rows) {
      const Index n = std::min(score_rows, rows - r);
      float* c_block = c + r * c_stride + c0;
      if (whole) {
        scores_rows<block_vectors, block_rows, true, a_transposed>(
            n, a_rows(r), a_stride, b + c0, b_stride, depth, c_block, c_stride, nullptr);
      } else {
        for (Index c1 = 0; c0 + c1 < vector_cols; c1 += lanes) {
          scores_rows<1, block_rows, true, a_transposed>(n, a_rows(r), a_stride, b + c0 + c1,
                                                         b_stride, depth, c_block + c1, c_stride,
                                                         nullptr);
        }
      }
    }
  }
  if (vector_cols == cols)
    return;
  if constexpr (a_transposed) {
    for (Index r = 0; r < rows; ++r) {
      for (Index e = vector_cols; e < cols; ++e) {
        float sum = c[r * c_stride + e];
        for (Index d = 0; d < depth; ++d)
          sum += a[d * a_stride + r] * b[d * b_stride + e];
        c[r * c_stride + e] = sum;
      }
    }
  } else {
    weighted_sum_tails(a, a_stride, rows, b + vector_cols, b_stride, depth, cols - vector_cols,
                       static_cast<const float*>(nullptr), false, c + vector_cols, c_stride);
  }
}

/// ds[c] = scale * (p[c] * (ds[c] - delta)) for c < width (a multiple of lanes), or with the
/// dropout factors f, scale * (p[c] * (f[c] * ds[c] - delta)): one row of score gradients.
/// In vectors here, since GCC's -O2 does not vectorise the plain loop (it would need a
/// runtime aliasing check).
inline void score_gradient_row(const float* p, const float* f, float delta, float scale,
                               Index width, float* ds) {
  const vec minus_delta = set1(-delta), scale_vector = set1(scale);
  for (Index c = 0; c < width; c += lanes) {
    vec x = load(ds + c);
    if (f != nullptr)
      x = mul(load(f + c), x);
    store(ds + c, mul(scale_vector, mul(load(p + c), add(x, minus_delta))));
  }
}

/// f[c] = the dropout factor of key j0 + c of the row whose key is `row` (1 / (1 - p) when
/// kept, 0 when dropped: Dropout::factors_for_row's bits) for c < keys, 0 for keys <= c <
/// width (a multiple of lanes); pf[c] = p[c] * f[c]. The hashes in vectors: the plain loop
/// vectorises at -O3 only.
inline void dropout_row(const Dropout<float>& dropout, std::uint32_t row, Index j0, Index keys,
                        Index width, const float* p, float* f, float* pf) {
  constexpr std::uint32_t step = Dropout<float>::key_step;
  const vec scale = set1(dropout.scale());
  const std::uint32_t threshold = dropout.threshold();
  for (Index c = 0; c < width; c += lanes) {
    const std::uint32_t first = row + static_cast<std::uint32_t>(j0 + c) * step;
    const vec factor = where_at_least(mix32(counters(first, step)), threshold, scale);
    store(f + c, factor);
    store(pf + c, mul(load(p + c), factor));
  }
  std::fill(f + keys, f + width, 0.0f);
  std::fill(pf + keys, pf + width, 0.0f);
}

/// ds[e] *= 1 - tanh^2(raw[e] / cap) for e < n (a multiple of lanes): the derivative of
/// cap tanh(s / cap), as 4 u / (1 + u)^2 with u = exp(-2 |raw| / cap) in (0, 1] (no tanh,
/// and no cancellation where tanh is near 1; 0 where u is below the smallest normal float).
inline void softcap_derivative(const float* raw, Index n, float cap, float* ds) {
  const vec factor = set1(-2.0f / cap), one = set1(1.0f), four = set1(4.0f);
  for (Index e = 0; e < n; e += lanes) {
    const vec u = exp_shifted(mul(factor, absolute(load(raw + e))), zero());
    const vec sum = add(one, u);
    store(ds + e, mul(load(ds + e), divide(mul(four, u), mul(sum, sum))));
  }
}
