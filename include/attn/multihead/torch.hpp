// attn/multihead/torch.hpp: MultiHeadAttention's PyTorch compatibility: the state dict in
// torch.nn.MultiheadAttention's names and (out x in) layouts (load and save), its mask
// polarity (key_padding_mask and attn_mask true = IGNORE / NOT ALLOWED, translated into the
// keep-mask and additive bias of scaled_dot_product_attention), and the key/value rows that
// add_bias_kv and add_zero_attn append. Members of the class in attn/multihead/module.hpp;
// include attn/multihead.hpp. The layouts and the polarity note: attn/multihead.hpp.
#pragma once

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/mask.hpp"
#include "attn/multihead/arguments.hpp"
#include "attn/multihead/layout.hpp"
#include "attn/multihead/module.hpp"
#include "attn/projection.hpp"
#include "attn/tensor.hpp"

namespace attn {

template <class T>
MultiHeadAttention<T> MultiHeadAttention<T>::from_state_dict(const MultiHeadAttentionConfig& config,
                                                             const StateDict<T>& state) {
  MultiHeadAttention m(config);
  m.load_state_dict(state);
  return m;
}

// Strict like torch's load_state_dict: every name of the layout once, each with its shape.
template <class T>
void MultiHeadAttention<T>::load_state_dict(const StateDict<T>& state) {
  constexpr const char* function = "MultiHeadAttention::load_state_dict";
  const Index e = config_.embed_dim, ekv = kv_width();
  std::vector<std::string> expected;
  const auto get = [&](const std::string& name,
                       const std::vector<Index>& shape) -> const StateTensor<T>& {
    expected.push_back(name);
    const auto it = state.find(name);
    if (it == state.end())
      detail::throw_invalid_argument(function, "missing \"" + name + "\"");
    const StateTensor<T>& t = it->second;
    Index count = 1;
    for (const Index d : t.shape)
      count *= d;
    if (t.shape != shape || static_cast<Index>(t.data.size()) != count) {
      detail::throw_invalid_argument(
          function, "\"" + name + "\" is " + shape_of(t.shape) + " but must be " + shape_of(shape) +
                        " (embed_dim " + std::to_string(e) + ", num_heads " +
                        std::to_string(config_.num_heads) + ", num_kv_heads " +
                        std::to_string(config_.num_kv_heads) + ", kdim " +
                        std::to_string(config_.kdim) + ", vdim " + std::to_string(config_.vdim) +
                        ")");
    }
    return t;
  };
  const auto as_matrix = [](const StateTensor<T>& t) {  // (out, in) torch layout
    return Eigen::Map<const Matrix<T>>(t.data.data(), t.shape[0], t.shape[1]);
  };
  const auto as_vector = [](const StateTensor<T>& t) {
    return Vector<T>(Eigen::Map<const Vector<T>>(t.data.data(), static_cast<Index>(t.data.size())));
  };

  QKVProjection<T> in_proj;
  Vector<T> in_bias;
  if (config_.bias)
    in_bias = as_vector(get("in_proj_bias", {e + 2 * ekv}));
  if (is_same_embed_dim()) {
    in_proj = QKVProjection<T>::fused_from_torch(as_matrix(get("in_proj_weight", {e + 2 * ekv, e})),
                                                 in_bias, e, ekv, ekv);
  } else {
    const auto part = [&](Index first, Index n) {
      return config_.bias ? Vector<T>(in_bias.segment(first, n)) : Vector<T>();
    };
    in_proj = QKVProjection<T>(
        Linear<T>::from_torch(as_matrix(get("q_proj_weight", {e, e})), part(0, e)),
        Linear<T>::from_torch(as_matrix(get("k_proj_weight", {ekv, config_.kdim})), part(e, ekv)),
        Linear<T>::from_torch(as_matrix(get("v_proj_weight", {ekv, config_.vdim})),
                              part(e + ekv, ekv)));
  }
  Vector<T> bias_k, bias_v;
  if (config_.add_bias_kv) {
    bias_k = as_vector(get("bias_k", {1, 1, ekv}));
    bias_v = as_vector(get("bias_v", {1, 1, ekv}));
  }
  const Matrix<T> out_w = as_matrix(get("out_proj.weight", {e, e}));
  Vector<T> out_b;
  if (config_.bias)
    out_b = as_vector(get("out_proj.bias", {e}));
  for (const auto& entry : state) {
    if (std::find(expected.begin(), expected.end(), entry.first) == expected.end()) {
      detail::throw_invalid_argument(function, "unexpected \"" + entry.first + "\"");
    }
  }
  in_proj_ = std::move(in_proj);
  bias_k_ = std::move(bias_k);
  bias_v_ = std::move(bias_v);
  out_proj_ = Linear<T>::from_torch(out_w, out_b);
}

template <class T>
StateDict<T> MultiHeadAttention<T>::state_dict() const {
  StateDict<T> s;
  const Index e = config_.embed_dim, ekv = kv_width();
  const auto put = [&](const std::string& name, std::vector<Index> shape, const T* data) {
    Index count = 1;
    for (const Index d : shape)
      count *= d;
    s[name] = {std::move(shape), std::vector<T>(data, data + count)};
  };
  const auto put_torch = [&](const std::string& name, const auto& w) {  // w (in, out)
    const Matrix<T> t = w.transpose();                                  // (out, in)
    put(name, {t.rows(), t.cols()}, t.data());
  };
  if (is_same_embed_dim()) {
    put_torch("in_proj_weight", in_proj_.fused_weight());
  } else {
    put_torch("q_proj_weight", in_proj_.wq());
    put_torch("k_proj_weight", in_proj_.wk());
    put_torch("v_proj_weight", in_proj_.wv());
  }
  if (config_.bias) {
    Vector<T> b(e + 2 * ekv);
    b << Eigen::Map<const Vector<T>>(in_proj_.bq(), e),
        Eigen::Map<const Vector<T>>(in_proj_.bk(), ekv),
        Eigen::Map<const Vector<T>>(in_proj_.bv(), ekv);
    put("in_proj_bias", {e + 2 * ekv}, b.data());
  }
  if (config_.add_bias_kv) {
    put("bias_k", {1, 1, ekv}, bias_k_.data());
    put("bias_v", {1, 1, ekv}, bias_v_.data());
  }
  put_torch("out_proj.weight", out_proj_.weight());
  if (config_.bias)
    put("out_proj.bias", {e}, out_proj_.bias().data());
  return s;
}

template <class T>
template <class Shapes>
void MultiHeadAttention<T>::check_masks(const char* function,
                                        const MultiHeadForwardOptions<T>& options, Index batch,
                                        Index q_length, Index k_length,
                                        const Shapes& shapes) const {
  const MaskArg<bool>& kpm = options.key_padding_mask;
  if (!kpm.empty() && kpm.shape() != std::vector<Index>{batch, k_length}) {
    detail::throw_invalid_argument(
        function, "key_padding_mask is " + kpm.shape_string() + " but must be " +
                      detail::shape_string({batch, k_length}) + " (B, S); " + shapes());
  }
  check_attn_mask(function, "attn_mask", options.attn_mask, batch, q_length, k_length, shapes);
  check_attn_mask(function, "float_attn_mask", options.float_attn_mask, batch, q_length, k_length,
                  shapes);
}

template <class T>
void MultiHeadAttention<T>::check_attention_options(
    const char* function, const MultiHeadForwardOptions<T>& options) const {
  const AttentionOptions<C>& a = options.attention;
  const auto refuse = [&](const char* name, const char* why) {
    detail::throw_invalid_argument(function,
                                   std::string("options.attention.") + name + " is set: " + why);
  };
  const char* use_masks = "give key_padding_mask, attn_mask or float_attn_mask instead";
  if (!a.keep_mask.empty())
    refuse("keep_mask", use_masks);
  if (!a.bias.empty())
    refuse("bias", use_masks);
  if (!a.key_lengths.empty())
    refuse("key_lengths", "give key_padding_mask instead");
  if (!a.query_lengths.empty())
    refuse("query_lengths", "the module attends every query row (mask the loss instead)");
  if (options.is_causal && a.causal != Causal::none)
    refuse("causal", "is_causal is set too: give one of them");
  if (config_.add_bias_kv || config_.add_zero_attn) {
    const char* appended =
        "add_bias_kv or add_zero_attn appends keys it would see as positions (use attn_mask)";
    if (a.causal != Causal::none)
      refuse("causal", appended);
    if (a.window.left >= 0 || a.window.right >= 0)
      refuse("window", appended);
    if (a.sink_tokens != 0)
      refuse("sink_tokens", appended);
    if (!a.alibi_slopes.empty())
      refuse("alibi_slopes", appended);
    if (a.score_mod)
      refuse("score_mod", appended);
    if (a.mask_mod)
      refuse("mask_mod", appended);
    if (!a.block_mask.empty())
      refuse("block_mask", appended);
  }
  if (!(a.dropout_p >= 0 && a.dropout_p < 1)) {
    detail::throw_invalid_argument(function,
                                   "options.attention.dropout_p is " +
                                       detail::number_string(static_cast<double>(a.dropout_p)) +
                                       ": must lie in [0, 1)");
  }
}

template <class T>
template <class U, class Shapes>
void MultiHeadAttention<T>::check_attn_mask(const char* function, const char* name,
                                            const MaskArg<U>& m, Index batch, Index q_length,
                                            Index k_length, const Shapes& shapes) const {
  if (m.empty())
    return;
  const std::vector<Index> ls{q_length, k_length};
  const std::vector<Index> bhls{batch * config_.num_heads, q_length, k_length};
  if (m.shape() != ls && m.shape() != bhls) {
    detail::throw_invalid_argument(
        function, std::string(name) + " is " + m.shape_string() + " but must be " +
                      detail::shape_string({q_length, k_length}) + " (L, S) or " +
                      detail::shape_string({batch * config_.num_heads, q_length, k_length}) +
                      " (B*H, L, S); " + shapes());
  }
}

// After the S projected rows of each sequence: bias_k | bias_v, then a zero row.
template <class T>
void MultiHeadAttention<T>::fill_extra_rows(const detail::ProjectionLayout& layout,
                                            T* kv_buffer) const {
  const Index ekv = kv_width();
  for (Index b = 0; b < layout.batch; ++b) {
    Index i = 0;
    if (config_.add_bias_kv) {
      T* row = layout.appended_row(kv_buffer, b, i++);
      Eigen::Map<Vector<T>>(row, ekv) = bias_k_;
      Eigen::Map<Vector<T>>(row + ekv, ekv) = bias_v_;
    }
    if (config_.add_zero_attn)
      Eigen::Map<Vector<T>>(layout.appended_row(kv_buffer, b, i), 2 * ekv).setZero();
  }
}

// The keep-mask combines key_padding_mask, attn_mask and (with appended keys, which the
// kernels' causal rule would hide) is_causal; the float mask is padded or widened when needed.
template <class T>
void MultiHeadAttention<T>::build_masks(const MultiHeadForwardOptions<T>& options, Index batch,
                                        Index q_length, Index k_length, Index kv_length,
                                        MultiHeadWorkspace<T>& ws, AttentionOptions<C>& attention,
                                        bool copy_masks) const {
  const Index heads = config_.num_heads;
  const bool extra = kv_length != k_length;
  const MaskArg<bool>& kpm = options.key_padding_mask;
  const MaskArg<bool>& am = options.attn_mask;
  const MaskArg<T>& fm = options.float_attn_mask;
  const bool causal_in_mask = options.is_causal && extra;
  if (options.is_causal && !extra)
    attention.causal = Causal::top_left;

  if (!kpm.empty() || !am.empty() || causal_in_mask) {
    const bool per_head = !am.empty() && am.shape().size() == 3;
    const Index mb = (!kpm.empty() || per_head) ? batch : 1;
    const Index mh = per_head ? heads : 1;
    const Index ml = (!am.empty() || causal_in_mask) ? q_length : 1;
    ws.keep.resize(mb, mh, ml, kv_length);
    for (Index b = 0; b < mb; ++b) {
      for (Index h = 0; h < mh; ++h) {
        for (Index i = 0; i < ml; ++i) {
          bool* row = ws.keep.data() + ((b * mh + h) * ml + i) * kv_length;
          const bool* a =
              am.empty() ? nullptr
                         : am.data() + ((per_head ? b * heads + h : 0) * q_length + i) * k_length;
          const bool* p = kpm.empty() ? nullptr : kpm.data() + b * k_length;
          for (Index j = 0; j < k_length; ++j) {
            row[j] =
                !(a != nullptr && a[j]) && !(p != nullptr && p[j]) && !(causal_in_mask && j > i);
          }
          for (Index j = k_length; j < kv_length; ++j)
            row[j] = true;
        }
      }
    }
    attention.keep_mask = Broadcast<bool>(ws.keep.data(), {mb, mh, ml, kv_length});
  }
  if (!fm.empty()) {
    const bool per_head = fm.shape().size() == 3;
    const Index mb = per_head ? batch : 1, mh = per_head ? heads : 1;
    bool in_place = false;
    if constexpr (std::is_same_v<T, C>) {
      if (!extra && !copy_masks) {
        // (B*H, L, S) memory is (B, H, L, S): use it in place.
        attention.bias = Broadcast<C>(fm.data(), {mb, mh, q_length, k_length});
        in_place = true;
      }
    }
    if (!in_place) {  // padded for the extra keys, or widened from 16 bits
      ws.bias.resize(mb, mh, q_length, kv_length);
      for (Index r = 0; r < mb * mh * q_length; ++r) {
        C* row = ws.bias.data() + r * kv_length;
        for (Index j = 0; j < k_length; ++j)
          row[j] = static_cast<C>(fm.data()[r * k_length + j]);
        std::fill(row + k_length, row + kv_length, C(0));
      }
      attention.bias = Broadcast<C>(ws.bias.data(), {mb, mh, q_length, kv_length});
    }
  }
}

}  // namespace attn
