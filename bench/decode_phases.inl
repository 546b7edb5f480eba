// bench/decode_phases.inl: the three phases of decode's work on one key block, as calls of the
// functions of `simd` (attn::detail::avx2 or attn::detail::avx512, kernels/simd/
// decode_products.inl). No include guard and no #include: bench_decode_phases.cpp includes it
// once per instruction set, inside a namespace that defines `simd`, `Index`, `block_keys`
// and `dim`.

struct Phases {
  static constexpr attn::Isa isa = simd::isa;

  /// s = q k^T: q (rows, D), k (64, D) stored as S with `stride` S per row, s (rows, 64).
  template <class S>
  static void scores(const float* q, Index rows, const S* k, Index stride, float* s) {
    simd::dot_scores(q, dim, rows, k, stride, block_keys, dim, s, block_keys, k);
  }

  /// acc = diag(alpha) acc + p v: p (rows, 64), v (64, D) as S, acc (rows, D).
  template <class S>
  static void values(const float* p, Index rows, const S* v, Index stride, const float* alpha,
                     float* acc) {
    simd::weighted_sum(p, block_keys, rows, v, stride, block_keys, dim, alpha, acc, dim, v,
                       static_cast<const S*>(nullptr));
  }

  /// s = exp(s - max of its row), maxima and sums per row: s (rows, 64).
  static void softmax(float* s, Index rows, float* maxima, float* sums) {
    simd::row_maxima(s, block_keys, rows, block_keys, maxima);
    simd::exp_rows(s, block_keys, rows, block_keys, maxima, sums);
  }
};
