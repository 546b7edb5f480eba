// attn/projection.hpp: linear layers and the Q/K/V projection of attention, with their
// backward. The umbrella of three headers:
//   attn/projection/linear.hpp        Linear<T> (y = x W + b, W stored (in, out); from_torch
//                                     for PyTorch's (out, in)) and its backward; the einsum
//                                     trap of the QKV-projection tutorial
//   attn/projection/qkv.hpp           QKVProjection<T>: Wq, Wk, Wv as blocks of one weight
//                                     buffer (fused: the (E, Dq + Dk + Dv) matrix; separate),
//                                     one bias; its result QKV<T> (zero-copy views)
//   attn/projection/qkv_backward.hpp  QKVProjection's backward: dx and the parameter
//                                     gradients in MultiHeadAttention's state_dict names
#pragma once

#include "attn/projection/linear.hpp"
#include "attn/projection/qkv.hpp"
#include "attn/projection/qkv_backward.hpp"

#if defined(ATTN_COMPILED)  // compiled once in attn::compiled (attn/instances.hpp)
#include "attn/instances.hpp"
ATTN_PROJECTION_CLASSES(ATTN_EXTERN_CLASS)
#endif
