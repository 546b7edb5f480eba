// attn/kernels/simd/backward_products.inl: the tile products of the flash backward, written
// once on the vector primitives of the namespace that includes this file (simd/avx2.hpp,
// simd/avx512.hpp). No include guard and no #include: simd/tile_products.hpp includes it once
// per vector instruction set (simd/foreach_isa.hpp), after tile_products.inl and
// decode_products.inl, whose scores_rows and weighted_sum_tails it uses.

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
