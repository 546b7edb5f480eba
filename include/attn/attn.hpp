// attn/attn.hpp: the whole public API but the heatmaps and the safetensors files, which are
// included on their own: attn/viz.hpp needs floating-point std::to_chars (GCC 11, clang 14
// with libstdc++ 11), attn/safetensors.hpp needs nlohmann/json (CMake: attn::safetensors);
// the rest of attn only C++17 and Eigen.
#pragma once

#include "attn/attention.hpp"
#include "attn/attention_backward.hpp"
#include "attn/block_mask.hpp"
#include "attn/config.hpp"
#include "attn/cpu.hpp"
#include "attn/hadamard.hpp"
#include "attn/heads.hpp"
#include "attn/init.hpp"
#include "attn/kv_cache.hpp"
#include "attn/linear_attention.hpp"
#include "attn/mask.hpp"
#include "attn/merge.hpp"
#include "attn/mod_gallery.hpp"
#include "attn/mods.hpp"
#include "attn/multihead.hpp"
#include "attn/options.hpp"
#include "attn/paged_kv_cache.hpp"
#include "attn/plan.hpp"
#include "attn/precision.hpp"
#include "attn/problem.hpp"
#include "attn/projection.hpp"
#include "attn/quantized.hpp"
#include "attn/rope.hpp"
#include "attn/score_modifiers.hpp"
#include "attn/shared_prefix.hpp"
#include "attn/softmax.hpp"
#include "attn/tensor.hpp"
