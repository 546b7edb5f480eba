// attn/multihead/training.hpp: MultiHeadAttention's training: forward_train (the forward's
// output and the context backward needs), backward and backward_into (the input gradients and
// every parameter's gradient, keyed as state_dict()). The backward runs the forward's passes
// in reverse over the same projection layout (attn/multihead/layout.hpp): out_proj's Linear
// backward, the attention's backward into dq, dk, dv views of a buffer laid out as the
// forward's, the rotary rotation turned back, then QKVProjection::backward_into
// (docs/training.md#multi-head-attention). Members of the class in
// attn/multihead/module.hpp; include attn/multihead.hpp.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "attn/attention_backward.hpp"
#include "attn/config.hpp"
#include "attn/multihead/arguments.hpp"
#include "attn/multihead/layout.hpp"
#include "attn/multihead/module.hpp"
#include "attn/projection.hpp"
#include "attn/tensor.hpp"

namespace attn {

// The context keeps copies of the inputs, the workspace (projections, attention output,
// masks) and the log-sum-exp, so that nothing of the caller's must outlive the call.
template <class T>
MultiHeadAttentionTrainingOutput<T> MultiHeadAttention<T>::forward_train(
    const Tensor<T, 3>& query,  // (B, L, E)
    const Tensor<T, 3>& key,    // (B, S, kdim)
    const Tensor<T, 3>& value,  // (B, S, vdim)
    const MultiHeadForwardOptions<T>& options) const {
  constexpr const char* function = "MultiHeadAttention::forward_train";
  if (options.need_weights) {
    detail::throw_invalid_argument(
        function,
        "need_weights must be false: the attention weights are not differentiated "
        "(call forward() for them)");
  }
  if (options.attention.score_mod) {
    detail::throw_invalid_argument(
        function, "options.attention.score_mod is set: a score_mod is forward only (no backward)");
  }
  MultiHeadAttentionTrainingOutput<T> train;
  MultiHeadAttentionContext<T>& c = train.context;
  MultiHeadAttentionOutput<T> result;
  const AttentionOptions<C> attention =
      forward_impl(function, query, key, value, options, result, c.workspace, &c.logsumexp);
  train.output = std::move(result.output);
  c.self_attention = is_self(query, key, value);
  c.query = query;
  if (!c.self_attention) {
    c.key = key;
    c.value = value;
  }
  c.attention = attention;  // the keep-mask and bias point into c.workspace: dropped here
  c.attention.keep_mask = {};
  c.attention.bias = {};
  c.module = this;
  return train;
}

template <class T>
MultiHeadAttentionGradients<T> MultiHeadAttention<T>::backward(
    const MultiHeadAttentionContext<T>& context, const Tensor<T, 3>& doutput) const {  // (B, L, E)
  MultiHeadAttentionGradients<T> grads;
  backward_impl(context, doutput, grads);
  return grads;
}

// Accumulating: the names and shapes checked first, the sums rounded once to T.
template <class T>
void MultiHeadAttention<T>::backward_into(const MultiHeadAttentionContext<T>& context,
                                          const Tensor<T, 3>& doutput,  // (B, L, E)
                                          MultiHeadAttentionGradients<T>& grads,
                                          bool accumulate) const {
  constexpr const char* function = "MultiHeadAttention::backward_into";
  if (!accumulate) {
    backward_impl(context, doutput, grads);
    return;
  }
  const StateDict<T> names = state_dict();
  for (const auto& [name, t] : names) {
    const auto it = grads.parameters.find(name);
    if (it == grads.parameters.end() || it->second.shape != t.shape ||
        it->second.data.size() != t.data.size()) {
      detail::throw_invalid_argument(
          function, "accumulate is true but grads.parameters has no " + shape_of(t.shape) + " \"" +
                        name + "\": accumulate into the gradients of an earlier call");
    }
  }
  if (grads.parameters.size() != names.size()) {
    detail::throw_invalid_argument(function,
                                   "accumulate is true but grads.parameters has names "
                                   "state_dict() does not have");
  }
  if (grads.dsinks.size() != context.attention.sinks.size()) {
    detail::throw_invalid_argument(
        function, "accumulate is true but grads.dsinks has " + std::to_string(grads.dsinks.size()) +
                      " entries and the forward had " +
                      std::to_string(context.attention.sinks.size()) + " sinks");
  }
  StateDict<T> previous = std::move(grads.parameters);
  const std::vector<C> previous_dsinks = grads.dsinks;
  try {
    backward_impl(context, doutput, grads);
  } catch (...) {  // a throw leaves the accumulated gradients as they were
    grads.parameters = std::move(previous);
    throw;
  }
  for (auto& [name, t] : grads.parameters) {
    const std::vector<T>& old = previous.at(name).data;
    for (std::size_t i = 0; i < t.data.size(); ++i)
      t.data[i] = static_cast<T>(t.data[i] + old[i]);
  }
  for (std::size_t h = 0; h < grads.dsinks.size(); ++h)
    grads.dsinks[h] += previous_dsinks[h];
}

template <class T>
auto MultiHeadAttention<T>::backward_attention_options(const MultiHeadAttentionContext<T>& context)
    -> AttentionOptions<C> {
  const MultiHeadWorkspace<T>& ws = context.workspace;
  AttentionOptions<C> attention = context.attention;
  if (ws.keep.size() > 0) {
    attention.keep_mask = Broadcast<bool>(
        ws.keep.data(),
        {ws.keep.dimension(0), ws.keep.dimension(1), ws.keep.dimension(2), ws.keep.dimension(3)});
  }
  if (ws.bias.size() > 0) {
    attention.bias = Broadcast<C>(ws.bias.data(), {ws.bias.dimension(0), ws.bias.dimension(1),
                                                   ws.bias.dimension(2), ws.bias.dimension(3)});
  }
  return attention;
}

// One call over all rows when no row was appended (self-attention: the one-GEMM fused path),
// else one per sequence (the appended rows have no input).
template <class T>
void MultiHeadAttention<T>::in_projection_backward(
    const MultiHeadAttentionContext<T>& context, const detail::ProjectionLayout& layout,
    const Matrix<T>& d_qkv,  // (B*(L + extra), E + 2*Ekv), or k | v (B*S', 2*Ekv)
    const Matrix<T>& d_q,    // cross: (B*L, E); self: empty
    MultiHeadAttentionGradients<T>& grads, QKVProjectionGradients<T>& in_grads) const {
  const bool self = layout.self;
  const Index batch = layout.batch, q_length = layout.q_length, k_length = layout.k_length;
  const Tensor<T, 3>& query = context.query;
  const Tensor<T, 3>& key = self ? query : context.key;
  const Tensor<T, 3>& value = self ? query : context.value;
  const Index e = config_.embed_dim, ekv = kv_width(), tokens = batch * q_length;
  grads.dquery.resize(batch, q_length, e);
  if (!self) {
    grads.dkey.resize(batch, k_length, config_.kdim);
    grads.dvalue.resize(batch, k_length, config_.vdim);
  }
  const T* dq_data = layout.q_buffer(d_qkv.data(), d_q.data());
  const Index parts = layout.extra == 0 ? 1 : batch;  // row ranges of one call
  const Index q_rows = layout.extra == 0 ? tokens : q_length,
              k_rows = layout.extra == 0 ? batch * k_length : k_length;
  for (Index part = 0; part < parts; ++part) {
    const auto rows = [&](const Tensor<T, 3>& x, Index length, Index count) {
      const Index w = x.dimension(2);
      return ConstRowsMap<T>(x.data() + part * length * w, count, w, Eigen::OuterStride<>(w));
    };
    const auto grad_rows = [&](Tensor<T, 3>& g, Index length, Index count) {
      const Index w = g.dimension(2);
      return RowsMap<T>(g.data() + part * length * w, count, w, Eigen::OuterStride<>(w));
    };
    // A gradient block: `cols` columns of rows `stride` apart, `rows_per` rows a sequence.
    const auto d_rows = [&](const T* base, Index rows_per, Index stride, Index count, Index cols) {
      return ConstRowsMap<T>(base + part * rows_per * stride, count, cols,
                             Eigen::OuterStride<>(stride));
    };
    const T* dkv_data = d_qkv.data();
    const ConstRowsMap<T> dq_r =
        d_rows(dq_data, layout.q_rows_per_batch, layout.q_stride, q_rows, e);
    const ConstRowsMap<T> dk_r =
        d_rows(layout.k_block(dkv_data), layout.kv_rows_per_batch, layout.kv_stride, k_rows, ekv);
    const ConstRowsMap<T> dv_r =
        d_rows(layout.v_block(dkv_data), layout.kv_rows_per_batch, layout.kv_stride, k_rows, ekv);
    const bool accumulate = part > 0;
    RowsMap<T> dx_q = grad_rows(grads.dquery, q_length, q_rows);
    if (self) {
      const ConstRowsMap<T> x = rows(query, q_length, q_rows);
      in_proj_.backward_into(x, x, x, dq_r, dk_r, dv_r, &dx_q, &dx_q, &dx_q, in_grads, accumulate);
    } else {
      RowsMap<T> dx_k = grad_rows(grads.dkey, k_length, k_rows);
      RowsMap<T> dx_v = grad_rows(grads.dvalue, k_length, k_rows);
      in_proj_.backward_into(rows(query, q_length, q_rows), rows(key, k_length, k_rows),
                             rows(value, k_length, k_rows), dq_r, dk_r, dv_r, &dx_q, &dx_k, &dx_v,
                             in_grads, accumulate);
    }
  }
}

template <class T>
void MultiHeadAttention<T>::backward_impl(const MultiHeadAttentionContext<T>& context,
                                          const Tensor<T, 3>& doutput,  // (B, L, E)
                                          MultiHeadAttentionGradients<T>& grads) const {
  constexpr const char* function = "MultiHeadAttention::backward";
  if (context.empty()) {
    detail::throw_invalid_argument(function,
                                   "the context is empty: pass the context forward_train filled");
  }
  if (context.module != this) {
    detail::throw_invalid_argument(
        function,
        "the context comes from another module (or from this one before it was "
        "copied or moved): pass the context of this module's forward_train");
  }
  const Tensor<T, 3>& query = context.query;
  const bool self = context.self_attention;
  const Tensor<T, 3>& key = self ? query : context.key;
  const Index batch = query.dimension(0), q_length = query.dimension(1);
  const Index e = config_.embed_dim, ekv = kv_width(), d = head_dim(), heads = config_.num_heads;
  if (doutput.dimension(0) != batch || doutput.dimension(1) != q_length ||
      doutput.dimension(2) != e) {
    detail::throw_invalid_argument(
        function, "doutput is " + shape3(doutput) + " but the forward's output is " +
                      detail::shape_string({batch, q_length, e}) + " (B, L, E)");
  }
  const MultiHeadWorkspace<T>& ws = context.workspace;
  const Index tokens = batch * q_length;

  // out_proj: its parameter gradients and d_attn (B*L, E) = (B, L, H, D).
  Matrix<T> d_attn(tokens, e), out_w_grad;
  Vector<T> out_b_grad;
  RowsMap<T> d_attn_rows(d_attn.data(), tokens, e, Eigen::OuterStride<>(e));
  out_proj_.backward_into(ConstRowsMap<T>(ws.attn.data(), tokens, e, Eigen::OuterStride<>(e)),
                          ConstRowsMap<T>(doutput.data(), tokens, e, Eigen::OuterStride<>(e)),
                          &d_attn_rows, out_w_grad, out_b_grad);

  // The attention's gradients, laid out as the forward's projection buffers (the q, k, v
  // gradients are column blocks of one buffer for self-attention).
  const detail::ProjectionLayout layout =
      projection_layout(self, batch, q_length, key.dimension(1));
  Matrix<T> d_qkv = Matrix<T>::Zero(layout.kv_buffer_rows(), layout.kv_stride);  // k | v (q)
  Matrix<T> d_q;                                                                 // cross: q
  if (!self)
    d_q.resize(tokens, e);
  const T* kv_buffer = (self ? ws.qkv : ws.kv).data();
  const HeadsView<const T> qv = layout.q_view(layout.q_buffer(kv_buffer, ws.q.data()));
  const HeadsView<const T> kv = layout.k_view(kv_buffer), vv = layout.v_view(kv_buffer);
  const HeadsView<T> dqv = layout.q_view(layout.q_buffer(d_qkv.data(), d_q.data()));
  const HeadsView<T> dkv = layout.k_view(d_qkv.data()), dvv = layout.v_view(d_qkv.data());
  const AttentionOptions<C> attention = backward_attention_options(context);
  AttentionGradientViews<T> attention_grads{dqv, dkv, dvv};
  std::vector<C> dsinks(attention.sinks.size(), C(0));
  if (!dsinks.empty())
    attention_grads.dsinks.emplace(dsinks.data(), static_cast<Index>(dsinks.size()));
  scaled_dot_product_attention_backward_into<T>(
      qv, kv, vv, blhd_view(static_cast<const T*>(ws.attn.data()), batch, q_length, heads, d),
      bhl_view(context.logsumexp),
      blhd_view(static_cast<const T*>(d_attn.data()), batch, q_length, heads, d), attention_grads,
      attention);
  if (has_rotary()) {  // the transpose of the forward's rotation, at the same positions
    rotary_.apply_backward(dqv);
    rotary_.apply_backward(dkv);
  }

  // The appended rows: bias_k / bias_v collect their rows' gradients; zero rows have none.
  grads.dsinks = std::move(dsinks);
  StateDict<T>& p = grads.parameters;
  p.clear();
  const auto put = [&](const std::string& name, std::vector<Index> shape, const T* data) {
    Index count = 1;
    for (const Index dim : shape)
      count *= dim;
    p[name] = {std::move(shape), std::vector<T>(data, data + count)};
  };
  if (config_.add_bias_kv) {
    Vector<T> bk = Vector<T>::Zero(ekv), bv = Vector<T>::Zero(ekv);
    for (Index b = 0; b < batch; ++b) {
      const T* row = layout.appended_row(static_cast<const T*>(d_qkv.data()), b, 0);
      bk += Eigen::Map<const Vector<T>>(row, ekv);
      bv += Eigen::Map<const Vector<T>>(row + ekv, ekv);
    }
    put("bias_k", {1, 1, ekv}, bk.data());
    put("bias_v", {1, 1, ekv}, bv.data());
  }

  // in_proj: the input gradients and the in_proj_* gradients.
  QKVProjectionGradients<T> in_grads;
  in_projection_backward(context, layout, d_qkv, d_q, grads, in_grads);
  const auto put_matrix = [&](const std::string& name, const Matrix<T>& m) {  // (out, in)
    put(name, {m.rows(), m.cols()}, m.data());
  };
  if (in_proj_.is_fused()) {
    put_matrix("in_proj_weight", in_grads.din_proj_weight);
  } else {
    put_matrix("q_proj_weight", in_grads.dq_proj_weight);
    put_matrix("k_proj_weight", in_grads.dk_proj_weight);
    put_matrix("v_proj_weight", in_grads.dv_proj_weight);
  }
  if (config_.bias) {
    put("in_proj_bias", {e + 2 * ekv}, in_grads.din_proj_bias.data());
    put("out_proj.bias", {e}, out_b_grad.data());
  }
  put_matrix("out_proj.weight", out_w_grad);
}

}  // namespace attn
