// bench/stream_compute.inl: the loop of bench_decode's stream_compute probe, written once on
// the vector primitives of `simd` (attn/kernels/simd/avx512.hpp or avx2.hpp). No include guard
// and no #include: bench_decode.cpp includes it once per instruction set, inside a target
// region and a namespace that defines `simd`.
//
// Blocks of stream_block_bytes alternate between the arrays a and b; every 64-byte line of a
// block is widened (16 or 8 int8 to float) and fed to `Fmas` FMAs over 8 accumulators, and
// the same line of the array's next block is prefetched into L1, as decode's quantized readers
// prefetch the next block of keys.

template <int Fmas>
float stream_compute(const std::int8_t* a, const std::int8_t* b, std::size_t bytes) {
  simd::vec acc[8] = {simd::zero(), simd::zero(), simd::zero(), simd::zero(),
                      simd::zero(), simd::zero(), simd::zero(), simd::zero()};
  const simd::vec c = simd::set1(1.0001f);
  for (std::size_t block = 0; block < bytes; block += stream_block_bytes) {
    for (const std::int8_t* array : {a, b}) {
      const std::int8_t* rows = array + block;
      const std::size_t end = std::min(stream_block_bytes, bytes - block);
      for (std::size_t line = 0; line < end; line += 64) {
        simd::prefetch_to_l1(reinterpret_cast<std::uintptr_t>(rows + line + stream_block_bytes));
        const simd::vec x = simd::load_int8_widened(rows + line);
#pragma GCC unroll 32
        for (int f = 0; f < Fmas; ++f)
          acc[f % 8] = simd::fmadd(x, c, acc[f % 8]);
        if constexpr (Fmas == 0)  // the loads still feed a sum
          acc[0] = simd::add(acc[0], x);
      }
    }
  }
  simd::vec sum = simd::zero();
  for (const simd::vec& x : acc)
    sum = simd::add(sum, x);
  return simd::reduce_add(sum);
}
