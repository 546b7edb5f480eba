// attn/instances.hpp: the instantiations attn::compiled contains, the public list.
//
// attn is header-only (attn::attn): every translation unit that calls it compiles what it
// calls, the kernels of every instruction set included. attn::compiled (CMake; src/) compiles
// the list below once, and defines ATTN_COMPILED for its users: each header then ends by
// declaring its part of the list `extern`, so that a user's unit compiles only the thin front
// of a call (views, the checks of the rank-4 and matrix overloads) and calls into the
// library. A combination outside the list still works: it compiles inline, as header-only.
// The sources are the same either way, so are the results, bit for bit (tests/same_bits/).
//
// Storage combinations (q, k and v, out; the arithmetic in float for 16-bit storage):
//   float; double; half and bfloat16 K/V with float q and out; half and bfloat16 everywhere;
//   half and bfloat16 q, k, v with float out; for decoding and KVCache, q8_0 and q4_0 K and V
//   (any pair), half K with q8_0 or q4_0 V and q8_0 K with half V (llama.cpp's users are told to
//   keep K the more precise).
//
// Each list is an X-macro: X(...) receives one function template specialization (as the
// expression that names it) or, for the _CLASSES lists, one class template specialization.
#pragma once

#include <Eigen/Core>

#include "attn/config.hpp"

/// An explicit instantiation declaration (extern) or definition of the function named.
#define ATTN_EXTERN_INSTANCE(...) extern template decltype(__VA_ARGS__) __VA_ARGS__;
#define ATTN_DEFINE_INSTANCE(...) template decltype(__VA_ARGS__) __VA_ARGS__;
/// The same for a class template specialization.
#define ATTN_EXTERN_CLASS(...) extern template class __VA_ARGS__;
#define ATTN_DEFINE_CLASS(...) template class __VA_ARGS__;

// --- The kernels' entry points (kernels/dispatch.hpp's tables) ------------------------------
// Of a vector instruction set's namespace NS (attn::detail::avx2, attn::detail::avx512): float.
#define ATTN_VECTOR_KERNEL_INSTANCES(X, NS)                    \
  X(NS::flash_tile<float, float>)                              \
  X(NS::flash_tile<float, Eigen::half>)                        \
  X(NS::flash_tile<float, Eigen::bfloat16>)                    \
  X(NS::flash_tile<float, attn::BlockQ8_0, attn::BlockQ8_0>)   \
  X(NS::flash_tile<float, attn::BlockQ8_0, attn::BlockQ4_0>)   \
  X(NS::flash_tile<float, attn::BlockQ4_0, attn::BlockQ8_0>)   \
  X(NS::flash_tile<float, attn::BlockQ4_0, attn::BlockQ4_0>)   \
  X(NS::flash_tile<float, Eigen::half, attn::BlockQ8_0>)       \
  X(NS::flash_tile<float, Eigen::half, attn::BlockQ4_0>)       \
  X(NS::flash_tile<float, attn::BlockQ8_0, Eigen::half>)       \
  X(NS::decode_split<float, float, float>)                     \
  X(NS::decode_split<float, Eigen::half, Eigen::half>)         \
  X(NS::decode_split<float, Eigen::bfloat16, Eigen::bfloat16>) \
  X(NS::decode_split<float, attn::BlockQ8_0, attn::BlockQ8_0>) \
  X(NS::decode_split<float, attn::BlockQ8_0, attn::BlockQ4_0>) \
  X(NS::decode_split<float, attn::BlockQ4_0, attn::BlockQ8_0>) \
  X(NS::decode_split<float, attn::BlockQ4_0, attn::BlockQ4_0>) \
  X(NS::decode_split<float, Eigen::half, attn::BlockQ8_0>)     \
  X(NS::decode_split<float, Eigen::half, attn::BlockQ4_0>)     \
  X(NS::decode_split<float, attn::BlockQ8_0, Eigen::half>)     \
  X(NS::merge_splits<float>)                                   \
  X(NS::backward_key_tile<float>)                              \
  X(NS::rope_rows<float, float>)                               \
  X(NS::rope_rows<float, Eigen::half>)                         \
  X(NS::rope_rows<float, Eigen::bfloat16>)                     \
  X(attn::detail::gemm_of<NS::Gemm, float>)
// Of the avx512_bf16 level (kernels/bf16_tiles.hpp, kernels/bf16_backward.hpp): the flash
// tile on bf16 products, for the storage it reads, and the backward's tile step.
#define ATTN_BF16_KERNEL_INSTANCES(X)                                                    \
  X(attn::detail::avx512_bf16::flash_tile_bf16<float, float, float>)                     \
  X(attn::detail::avx512_bf16::flash_tile_bf16<float, Eigen::bfloat16, Eigen::bfloat16>) \
  X(attn::detail::avx512_bf16::backward_key_tile_bf16<float>)
// Of the avx512_vnni level (kernels/int8_decode.hpp, kernels/int8_tiles.hpp): decode's and
// flash's scores on int8 products, for the keys they read.
#define ATTN_INT8_KERNEL_INSTANCES(X)                                                      \
  X(attn::detail::avx512_vnni::decode_split_int8<float, attn::BlockQ8_0, attn::BlockQ8_0>) \
  X(attn::detail::avx512_vnni::decode_split_int8<float, attn::BlockQ8_0, attn::BlockQ4_0>) \
  X(attn::detail::avx512_vnni::decode_split_int8<float, attn::BlockQ4_0, attn::BlockQ8_0>) \
  X(attn::detail::avx512_vnni::decode_split_int8<float, attn::BlockQ4_0, attn::BlockQ4_0>) \
  X(attn::detail::avx512_vnni::decode_split_int8<float, attn::BlockQ8_0, Eigen::half>)     \
  X(attn::detail::avx512_vnni::flash_tile_int8<float, float, float>)                       \
  X(attn::detail::avx512_vnni::flash_tile_int8<float, Eigen::half, Eigen::half>)           \
  X(attn::detail::avx512_vnni::flash_tile_int8<float, Eigen::bfloat16, Eigen::bfloat16>)   \
  X(attn::detail::avx512_vnni::flash_tile_int8<float, attn::BlockQ8_0, attn::BlockQ8_0>)   \
  X(attn::detail::avx512_vnni::flash_tile_int8<float, attn::BlockQ8_0, attn::BlockQ4_0>)   \
  X(attn::detail::avx512_vnni::flash_tile_int8<float, attn::BlockQ4_0, attn::BlockQ8_0>)   \
  X(attn::detail::avx512_vnni::flash_tile_int8<float, attn::BlockQ4_0, attn::BlockQ4_0>)   \
  X(attn::detail::avx512_vnni::flash_tile_int8<float, Eigen::half, attn::BlockQ8_0>)       \
  X(attn::detail::avx512_vnni::flash_tile_int8<float, Eigen::half, attn::BlockQ4_0>)       \
  X(attn::detail::avx512_vnni::flash_tile_int8<float, attn::BlockQ8_0, Eigen::half>)
// Of the generic namespace: the same, and double.
#define ATTN_GENERIC_KERNEL_INSTANCES(X)                         \
  ATTN_VECTOR_KERNEL_INSTANCES(X, attn::detail::generic)         \
  X(attn::detail::generic::flash_tile<double, double>)           \
  X(attn::detail::generic::decode_split<double, double, double>) \
  X(attn::detail::generic::merge_splits<double>)                 \
  X(attn::detail::generic::backward_key_tile<double>)            \
  X(attn::detail::generic::rope_rows<double, double>)

// --- Attention (attn/attention.hpp, kernels/decode.hpp) -------------------------------------
#define ATTN_ATTENTION_INSTANCES(X)                                                  \
  X(attn::detail::attention_into<float, float, float>)                               \
  X(attn::detail::attention_into<double, double, double>)                            \
  X(attn::detail::attention_into<float, Eigen::half, float>)                         \
  X(attn::detail::attention_into<float, Eigen::bfloat16, float>)                     \
  X(attn::detail::attention_into<Eigen::half, Eigen::half, Eigen::half>)             \
  X(attn::detail::attention_into<Eigen::bfloat16, Eigen::bfloat16, Eigen::bfloat16>) \
  X(attn::detail::attention_into<Eigen::half, Eigen::half, float>)                   \
  X(attn::detail::attention_into<Eigen::bfloat16, Eigen::bfloat16, float>)
#define ATTN_DECODE_INSTANCES(X)                                             \
  X(attn::detail::decode_attention<float, float, float>)                     \
  X(attn::detail::decode_attention<double, double, double>)                  \
  X(attn::detail::decode_attention<float, Eigen::half, Eigen::half>)         \
  X(attn::detail::decode_attention<float, Eigen::bfloat16, Eigen::bfloat16>) \
  X(attn::detail::decode_attention<float, attn::BlockQ8_0, attn::BlockQ8_0>) \
  X(attn::detail::decode_attention<float, attn::BlockQ8_0, attn::BlockQ4_0>) \
  X(attn::detail::decode_attention<float, attn::BlockQ4_0, attn::BlockQ8_0>) \
  X(attn::detail::decode_attention<float, attn::BlockQ4_0, attn::BlockQ4_0>) \
  X(attn::detail::decode_attention<float, Eigen::half, attn::BlockQ8_0>)     \
  X(attn::detail::decode_attention<float, Eigen::half, attn::BlockQ4_0>)     \
  X(attn::detail::decode_attention<float, attn::BlockQ8_0, Eigen::half>)

// --- Gradients (attn/attention_backward.hpp, attn/linear_attention.hpp) ---------------------
#define ATTN_BACKWARD_INSTANCES(X)                      \
  X(attn::detail::attention_backward_into<float>)       \
  X(attn::detail::attention_backward_into<double>)      \
  X(attn::detail::attention_backward_into<Eigen::half>) \
  X(attn::detail::attention_backward_into<Eigen::bfloat16>)
#define ATTN_LINEAR_ATTENTION_INSTANCES(X)       \
  X(attn::linear_attention_into<float>)          \
  X(attn::linear_attention_into<double>)         \
  X(attn::linear_attention_backward_into<float>) \
  X(attn::linear_attention_backward_into<double>)
#define ATTN_LINEAR_ATTENTION_CLASSES(X) \
  X(attn::LinearAttentionState<float>)   \
  X(attn::LinearAttentionState<double>)

// --- Layers and state (attn/kv_cache.hpp, attn/rope.hpp, attn/projection.hpp,
// attn/multihead.hpp) -------------------------------------------------------------------------
#define ATTN_KV_CACHE_CLASSES(X)                     \
  X(attn::KVCache<float>)                            \
  X(attn::KVCache<double>)                           \
  X(attn::KVCache<Eigen::half>)                      \
  X(attn::KVCache<Eigen::bfloat16>)                  \
  X(attn::KVCache<attn::BlockQ8_0, attn::BlockQ8_0>) \
  X(attn::KVCache<attn::BlockQ8_0, attn::BlockQ4_0>) \
  X(attn::KVCache<attn::BlockQ4_0, attn::BlockQ4_0>) \
  X(attn::KVCache<Eigen::half, attn::BlockQ8_0>)     \
  X(attn::KVCache<Eigen::half, attn::BlockQ4_0>)     \
  X(attn::KVCache<attn::BlockQ8_0, Eigen::half>)
#define ATTN_ROPE_CLASSES(X)      \
  X(attn::RotaryEmbedding<float>) \
  X(attn::RotaryEmbedding<double>)
#define ATTN_PROJECTION_CLASSES(X)    \
  X(attn::Linear<float>)              \
  X(attn::Linear<double>)             \
  X(attn::Linear<Eigen::half>)        \
  X(attn::Linear<Eigen::bfloat16>)    \
  X(attn::QKVProjection<float>)       \
  X(attn::QKVProjection<double>)      \
  X(attn::QKVProjection<Eigen::half>) \
  X(attn::QKVProjection<Eigen::bfloat16>)
#define ATTN_MULTIHEAD_CLASSES(X)          \
  X(attn::MultiHeadAttention<float>)       \
  X(attn::MultiHeadAttention<double>)      \
  X(attn::MultiHeadAttention<Eigen::half>) \
  X(attn::MultiHeadAttention<Eigen::bfloat16>)
