// Test support: the library's heavy templates, instantiated once for the whole test binary.
//
// attn is header-only, so every test file that calls attention would compile the kernels of
// every instruction set again for each scalar it uses: most of the suite's build time. The
// explicit instantiation definitions in tests/instances/*.cpp compile them once; this header
// declares them `extern`, so the test files that include it only call them. The code is
// the headers' own, compiled with the tests' flags; only where it is compiled changes.
//
// ATTN_TEST_INSTANCES(X) lists every instantiation: X is `extern` for the declarations,
// which every file including this header sees (the instance files too, so that no part
// compiles another's templates again), and empty for the definitions, one part per file of
// tests/instances/. An instantiation missing from the list still works: the test file then
// compiles it itself.
#pragma once

#include <Eigen/Core>

#include <attn/attention.hpp>
#include <attn/attention_backward.hpp>
#include <attn/kernels/decode.hpp>
#include <attn/kv_cache.hpp>
#include <attn/linear_attention.hpp>
#include <attn/multihead.hpp>
#include <attn/projection.hpp>

#define ATTN_TEST_ATTENTION_INTO(TQ, TKV, TO)                                                 \
  template void attn::detail::attention_into<TQ, TKV, TO>(                                    \
      const attn::HeadsView<const TQ>&, const attn::HeadsView<const TKV>&,                    \
      const attn::HeadsView<const TKV>&, const attn::HeadsView<TO>&,                          \
      const attn::AttentionOptions<attn::compute_scalar_t<TQ>>&, attn::compute_scalar_t<TQ>*, \
      attn::compute_scalar_t<TQ>*)

#define ATTN_TEST_VARLEN_INTO(TQ, TKV, TO)                                 \
  template void attn::detail::varlen_attention_into<TQ, TKV, TO>(          \
      const attn::HeadsView<const TQ>&, const attn::HeadsView<const TKV>&, \
      const attn::HeadsView<const TKV>&, const attn::HeadsView<TO>&,       \
      const std::vector<attn::Index>&, const std::vector<attn::Index>&,    \
      const attn::AttentionOptions<attn::compute_scalar_t<TQ>>&, attn::compute_scalar_t<TQ>*)

#define ATTN_TEST_DECODE(T, S)                                                                   \
  template void attn::detail::decode_attention<T, S>(                                            \
      const attn::KernelPlan&, const attn::HeadsView<const T>&, const attn::HeadsView<const S>&, \
      const attn::HeadsView<const S>&, const attn::HeadsView<T>&, const attn::Mask<T>&, T,       \
      const attn::detail::RowValues<T>&)

#define ATTN_TEST_LINEAR(T)                                             \
  template void attn::linear_attention_into<T>(                         \
      const attn::HeadsView<const T>&, const attn::HeadsView<const T>&, \
      const attn::HeadsView<const T>&, const attn::HeadsView<T>&,       \
      const attn::LinearAttentionOptions<T>&)

#define ATTN_TEST_BACKWARD(S)                                                               \
  template void attn::detail::attention_backward_into<S>(                                   \
      const attn::HeadsView<const S>&, const attn::HeadsView<const S>&,                     \
      const attn::HeadsView<const S>&, const attn::HeadsView<const S>&,                     \
      const attn::compute_scalar_t<S>*, const attn::HeadsView<const S>&,                    \
      const attn::HeadsView<S>&, const attn::HeadsView<S>&, const attn::HeadsView<S>&,      \
      const attn::AttentionOptions<attn::compute_scalar_t<S>>&, attn::compute_scalar_t<S>*, \
      attn::compute_scalar_t<S>*)

#define ATTN_TEST_VARLEN_BACKWARD(S)                                                   \
  template void attn::detail::varlen_attention_backward_into<S>(                       \
      const attn::HeadsView<const S>&, const attn::HeadsView<const S>&,                \
      const attn::HeadsView<const S>&, const attn::HeadsView<const S>&,                \
      const attn::compute_scalar_t<S>*, const attn::HeadsView<const S>&,               \
      const attn::HeadsView<S>&, const attn::HeadsView<S>&, const attn::HeadsView<S>&, \
      const std::vector<attn::Index>&, const std::vector<attn::Index>&,                \
      const attn::AttentionOptions<attn::compute_scalar_t<S>>&, attn::compute_scalar_t<S>*)

// tests/instances/float_kernels.cpp: every instantiation that runs the float vector kernels,
// in one unit. Their building blocks (kernels/simd/tile_products.inl) are inline functions,
// compiled again by every unit that reaches them, so three units (float, 16-bit, backward)
// compiled them three times (docs/testing.md, "The CI tree").
//
// float, the scalar of every instruction set's vector kernels.
#define ATTN_TEST_INSTANCES_FLOAT(X)               \
  X ATTN_TEST_ATTENTION_INTO(float, float, float); \
  X ATTN_TEST_VARLEN_INTO(float, float, float);    \
  X ATTN_TEST_DECODE(float, float);

// tests/instances/attention_double.cpp: double, which runs the generic kernels only, forward
// and backward.
#define ATTN_TEST_INSTANCES_DOUBLE(X)                 \
  X ATTN_TEST_ATTENTION_INTO(double, double, double); \
  X ATTN_TEST_VARLEN_INTO(double, double, double);    \
  X ATTN_TEST_DECODE(double, double);                 \
  X ATTN_TEST_BACKWARD(double);                       \
  X ATTN_TEST_VARLEN_BACKWARD(double);

// tests/instances/float_kernels.cpp: 16-bit storage, alone and mixed with float.
#define ATTN_TEST_INSTANCES_16BIT(X)                                             \
  X ATTN_TEST_ATTENTION_INTO(float, Eigen::half, float);                         \
  X ATTN_TEST_ATTENTION_INTO(float, Eigen::bfloat16, float);                     \
  X ATTN_TEST_ATTENTION_INTO(Eigen::half, Eigen::half, Eigen::half);             \
  X ATTN_TEST_VARLEN_INTO(Eigen::half, Eigen::half, Eigen::half);                \
  X ATTN_TEST_VARLEN_INTO(Eigen::bfloat16, Eigen::bfloat16, Eigen::bfloat16);    \
  X ATTN_TEST_ATTENTION_INTO(Eigen::bfloat16, Eigen::bfloat16, Eigen::bfloat16); \
  X ATTN_TEST_ATTENTION_INTO(Eigen::half, Eigen::half, float);                   \
  X ATTN_TEST_ATTENTION_INTO(Eigen::bfloat16, Eigen::bfloat16, float);           \
  X ATTN_TEST_DECODE(float, Eigen::half);                                        \
  X ATTN_TEST_DECODE(float, Eigen::bfloat16);

// tests/instances/layers.cpp: the layers and linear attention.
#define ATTN_TEST_INSTANCES_LAYERS(X)                         \
  X template class attn::Linear<float>;                       \
  X template class attn::Linear<double>;                      \
  X template class attn::Linear<Eigen::half>;                 \
  X template class attn::Linear<Eigen::bfloat16>;             \
  X template class attn::QKVProjection<float>;                \
  X template class attn::QKVProjection<double>;               \
  X template class attn::QKVProjection<Eigen::half>;          \
  X template class attn::QKVProjection<Eigen::bfloat16>;      \
  X template class attn::MultiHeadAttention<float>;           \
  X template class attn::MultiHeadAttention<double>;          \
  X template class attn::MultiHeadAttention<Eigen::half>;     \
  X template class attn::MultiHeadAttention<Eigen::bfloat16>; \
  X template class attn::KVCache<float>;                      \
  X template class attn::KVCache<double>;                     \
  X template class attn::KVCache<Eigen::half>;                \
  X template class attn::KVCache<Eigen::bfloat16>;            \
  X ATTN_TEST_LINEAR(float);                                  \
  X ATTN_TEST_LINEAR(double);

// tests/instances/float_kernels.cpp: the gradients of attention computed in float.
#define ATTN_TEST_INSTANCES_BACKWARD(X)  \
  X ATTN_TEST_BACKWARD(float);           \
  X ATTN_TEST_BACKWARD(Eigen::half);     \
  X ATTN_TEST_BACKWARD(Eigen::bfloat16); \
  X ATTN_TEST_VARLEN_BACKWARD(float);

#define ATTN_TEST_INSTANCES(X)  \
  ATTN_TEST_INSTANCES_FLOAT(X)  \
  ATTN_TEST_INSTANCES_DOUBLE(X) \
  ATTN_TEST_INSTANCES_16BIT(X)  \
  ATTN_TEST_INSTANCES_LAYERS(X) \
  ATTN_TEST_INSTANCES_BACKWARD(X)

ATTN_TEST_INSTANCES(extern)
