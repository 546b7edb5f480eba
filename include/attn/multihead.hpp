// attn/multihead.hpp: multi-head attention, numerically equal to torch.nn.MultiheadAttention
// (batch_first=True, eval mode) for the same weights, plus grouped-query attention.
//
// Shape legend:
//   B batch   L query length   S key/value length   S' = S + add_bias_kv + add_zero_attn
//   E embed_dim   H num_heads   Hkv num_kv_heads   D = E / H   Ekv = Hkv * D
//   kdim / vdim   input widths of key and value (default E)
//
// Data flow of one call (no transposes, no copies between the GEMMs):
//   pass 1  projections into (B, L, H, D) / (B, S', Hkv, D) buffers. Self-attention with
//           kdim = vdim = E is ONE GEMM (B*L, E) x (E, E + 2*Ekv) into a (B, L, E + 2*Ekv)
//           buffer; q, k and v are column blocks of it.
//   pass 2  scaled_dot_product_attention_into reads q, k, v through strided (B, H, L, D)
//           head views and writes (B, L, H, D) = (B, L, E) directly (heads merged for free).
//   pass 3  output projection: one GEMM (B*L, E) x (E, E).
//
// !!! MASK POLARITY !!!  MultiHeadAttention keeps PyTorch *MultiheadAttention*'s polarity:
//   key_padding_mask  (B, S)             bool, TRUE = IGNORE this key (padding)
//   attn_mask         (L, S) or (B*H, L, S)  bool, TRUE = NOT ALLOWED to attend
// That is the OPPOSITE of scaled_dot_product_attention's AttentionOptions::keep_mask
// (true = may attend, PyTorch SDPA's polarity). Ported code passes its masks unchanged.
//   float_attn_mask   (L, S) or (B*H, L, S)  float, ADDED to the scores (-inf hides a key)
//   is_causal         top-left causal: query i sees keys j <= i (keys appended by
//                     add_bias_kv / add_zero_attn stay visible, as torch pads its mask)
// A (B*H, L, S) mask is indexed [b * H + h] as in PyTorch.
// A query row that sees no key outputs zeros (the library's rule; torch returns NaN).
//
// Weight layouts (PyTorch state_dict names, (out x in) as in torch):
//   in_proj_weight (E + 2*Ekv, E), in_proj_bias (E + 2*Ekv)    when kdim = vdim = E
//   q_proj_weight (E, E), k_proj_weight (Ekv, kdim), v_proj_weight (Ekv, vdim)   otherwise
//   bias_k, bias_v (1, 1, Ekv)   with add_bias_kv
//   out_proj.weight (E, E), out_proj.bias (E)
// With Hkv = H (the default) Ekv = E and these are exactly torch's shapes.
//
// Rotary position embeddings (config.rotary, off by default; attn/rope.hpp): q and k are
// rotated after the input projection, before the attention, which torch's module does not
// do (Llama-style models do). forward: query token i at position i, key j at position j;
// forward_packed: positions restart at 0 in every sequence; forward_incremental: the new
// keys are rotated once at lengths[b] + t as they enter the cache, the queries at the same
// positions. Not combinable with add_bias_kv or add_zero_attn (those rows have no position).
//
// Training: forward_train returns the output and a MultiHeadAttentionContext (the inputs,
// the projections, the attention output before out_proj, its log-sum-exp, the masks);
// backward(context, d_output) returns the input gradients and every parameter's gradient
// keyed as state_dict() (docs/training.md#multi-head-attention).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "attn/attention.hpp"
#include "attn/attention_backward.hpp"
#include "attn/config.hpp"
#include "attn/heads.hpp"
#include "attn/init.hpp"
#include "attn/kv_cache.hpp"
#include "attn/mask.hpp"
#include "attn/multihead/arguments.hpp"
#include "attn/precision.hpp"
#include "attn/projection.hpp"
#include "attn/rope.hpp"
#include "attn/tensor.hpp"

namespace attn {

/// Multi-head attention (batch first), torch.nn.MultiheadAttention's numbers.
template <class T>
class MultiHeadAttention {
  using C = compute_scalar_t<T>;  // the arithmetic's scalar: float for 16-bit T

 public:
  /// Fresh weights like PyTorch: xavier_uniform on the input projections (the stacked
  /// (E, E + 2*Ekv) weight when kdim = vdim = E), U(-1/sqrt(E), 1/sqrt(E)) on the output
  /// projection (torch's Linear default), zero biases, bias_k / bias_v ~ N(0, 1/Ekv).
  explicit MultiHeadAttention(const MultiHeadAttentionConfig& config) : config_(config) {
    validate_config();
    const Index e = config_.embed_dim, ekv = kv_width();
    std::mt19937_64 engine(config_.seed);
    const auto zeros = [&](Index n) {
      return config_.bias ? Vector<T>(Vector<T>::Zero(n)) : Vector<T>();
    };
    if (is_same_embed_dim()) {
      in_proj_ = QKVProjection<T>::fused(xavier_uniform<T>(e, e + 2 * ekv, engine),
                                         zeros(e + 2 * ekv), e, ekv, ekv);
    } else {
      Matrix<T> wq = xavier_uniform<T>(e, e, engine);
      Matrix<T> wk = xavier_uniform<T>(config_.kdim, ekv, engine);
      Matrix<T> wv = xavier_uniform<T>(config_.vdim, ekv, engine);
      in_proj_ =
          QKVProjection<T>(Linear<T>(std::move(wq), zeros(e)), Linear<T>(std::move(wk), zeros(ekv)),
                           Linear<T>(std::move(wv), zeros(ekv)));
    }
    out_proj_ =
        Linear<T>(he_uniform<T>(e, e, engine, FanMode::fan_in, std::sqrt(1.0 / 3.0)), zeros(e));
    if (config_.add_bias_kv) {
      bias_k_ = he_normal<T>(1, ekv, engine, FanMode::fan_out, 1.0).transpose();
      bias_v_ = he_normal<T>(1, ekv, engine, FanMode::fan_out, 1.0).transpose();
    }
  }

  /// Built from PyTorch state_dict tensors (see load_state_dict).
  static MultiHeadAttention from_state_dict(const MultiHeadAttentionConfig& config,
                                            const StateDict<T>& state) {
    MultiHeadAttention m(config);
    m.load_state_dict(state);
    return m;
  }

  /// Loads PyTorch's state_dict layout (names and (out x in) shapes at the top of this
  /// file). Strict like torch's load_state_dict: a missing or unexpected name, or a wrong
  /// shape, throws.
  void load_state_dict(const StateDict<T>& state) {
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
            function, "\"" + name + "\" is " + shape_of(t.shape) + " but must be " +
                          shape_of(shape) + " (embed_dim " + std::to_string(e) + ", num_heads " +
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
      return Vector<T>(
          Eigen::Map<const Vector<T>>(t.data.data(), static_cast<Index>(t.data.size())));
    };

    QKVProjection<T> in_proj;
    Vector<T> in_bias;
    if (config_.bias)
      in_bias = as_vector(get("in_proj_bias", {e + 2 * ekv}));
    if (is_same_embed_dim()) {
      in_proj = QKVProjection<T>::fused_from_torch(
          as_matrix(get("in_proj_weight", {e + 2 * ekv, e})), in_bias, e, ekv, ekv);
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

  /// The weights in PyTorch's state_dict layout (the inverse of load_state_dict).
  StateDict<T> state_dict() const {
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

  const MultiHeadAttentionConfig& config() const { return config_; }
  Index embed_dim() const { return config_.embed_dim; }
  Index num_heads() const { return config_.num_heads; }
  Index num_kv_heads() const { return config_.num_kv_heads; }
  Index head_dim() const { return config_.embed_dim / config_.num_heads; }
  /// Ekv = Hkv * D, the width of the projected keys and values.
  Index kv_width() const { return config_.num_kv_heads * head_dim(); }
  /// Whether kdim = vdim = E (torch's _qkv_same_embed_dim: one in_proj_weight).
  bool is_same_embed_dim() const {
    return config_.kdim == config_.embed_dim && config_.vdim == config_.embed_dim;
  }
  const QKVProjection<T>& in_proj() const { return in_proj_; }
  const Linear<T>& out_proj() const { return out_proj_; }
  const Vector<T>& bias_k() const { return bias_k_; }  ///< (Ekv) or empty
  const Vector<T>& bias_v() const { return bias_v_; }  ///< (Ekv) or empty
  /// Whether q and k are rotated (config.rotary was set).
  bool has_rotary() const { return config_.rotary.has_value(); }
  /// The rotary table of config.rotary (default-constructed, empty, without one).
  const RotaryEmbedding<C>& rotary() const { return rotary_; }

  /// Self-attention: query = key = value = x (B, L, E); takes the one-GEMM fused path.
  MultiHeadAttentionOutput<T> forward(const Tensor<T, 3>& x,
                                      const MultiHeadForwardOptions<T>& options = {}) const {
    return forward(x, x, x, options);
  }

  /// query (B, L, E), key (B, S, kdim), value (B, S, vdim) -> output (B, L, E) and, with
  /// options.need_weights, the attention weights. Passing the same tensor three times is
  /// self-attention (one fused QKV GEMM when kdim = vdim = E).
  MultiHeadAttentionOutput<T> forward(const Tensor<T, 3>& query, const Tensor<T, 3>& key,
                                      const Tensor<T, 3>& value,
                                      const MultiHeadForwardOptions<T>& options = {}) const {
    MultiHeadAttentionOutput<T> result;
    MultiHeadWorkspace<T> workspace;
    forward_into(query, key, value, options, result, workspace);
    return result;
  }

  /// Incremental self-attention for autoregressive decoding: projects the Lnew new tokens
  /// x_new (B, Lnew, E) (one fused GEMM), appends their keys and values to `cache` (created
  /// as KVCache<S>(B, Hkv, D, D, capacity); S may be half or bfloat16 for a float module),
  /// attends with the bottom-right causal mask against everything cached (so the new
  /// tokens see the earlier ones and each other causally), then the output projection.
  /// Returns (B, Lnew, E). Feeding a sequence in any chunks gives the causal forward() of
  /// the whole sequence. `attention` may add a window, ALiBi slopes or a softcap; causal
  /// and key_lengths come from the cache. Needs kdim = vdim = E and neither add_bias_kv
  /// nor add_zero_attn. A half or bfloat16 module (T 16-bit, arithmetic in float) takes a
  /// float, half or bfloat16 cache; like forward(), it rounds the projections and the
  /// attention output to T once each.
  template <class S>
  Tensor<T, 3> forward_incremental(const Tensor<T, 3>& x_new,  // (B, Lnew, E)
                                   KVCache<S>& cache,
                                   const AttentionOptions<C>& attention = {}) const {
    static_assert(std::is_same_v<C, typename KVCache<S>::compute_type>,
                  "MultiHeadAttention::forward_incremental: the cache must compute in T's "
                  "arithmetic scalar (a double cache for double; float, half or bfloat16 "
                  "otherwise)");
    constexpr const char* function = "MultiHeadAttention::forward_incremental";
    const Index batch = x_new.dimension(0), length = x_new.dimension(1);
    const Index e = config_.embed_dim, ekv = kv_width(), d = head_dim();
    const Index heads = config_.num_heads, kv_heads = config_.num_kv_heads;
    if (!is_same_embed_dim() || config_.add_bias_kv || config_.add_zero_attn) {
      detail::throw_invalid_argument(
          function, "needs kdim = vdim = embed_dim and neither add_bias_kv nor add_zero_attn");
    }
    if (x_new.dimension(2) != e) {
      detail::throw_invalid_argument(function, "x_new is " + shape3(x_new) + " but embed_dim is " +
                                                   std::to_string(e) + ": widths differ");
    }
    if (cache.batch() != batch || cache.kv_heads() != kv_heads || cache.dim() != d ||
        cache.value_dim() != d) {
      detail::throw_invalid_argument(
          function, "x_new is " + shape3(x_new) + " but the cache is (B, Hkv, D, Dv) = " +
                        detail::shape_string(
                            {cache.batch(), cache.kv_heads(), cache.dim(), cache.value_dim()}) +
                        ": it must be " + detail::shape_string({batch, kv_heads, d, d}));
    }
    if (attention.causal != Causal::none || !attention.key_lengths.empty() ||
        !attention.query_lengths.empty()) {
      detail::throw_invalid_argument(
          function,
          "attention.causal, attention.key_lengths and attention.query_lengths must be unset: "
          "the cache applies the bottom-right causal mask and its own lengths");
    }
    const std::vector<Index> positions = cache.lengths();  // (B) of the first new token
    if (has_rotary()) {
      for (Index b = 0; b < batch; ++b) {
        const Index first = positions[static_cast<std::size_t>(b)];
        if (length > 0 && first > rotary_.max_positions() - length) {
          detail::throw_invalid_argument(
              function, "sequence " + std::to_string(b) + " holds " + std::to_string(first) +
                            " tokens: its " + std::to_string(length) +
                            " new tokens need rotary positions [" + std::to_string(first) + ", " +
                            std::to_string(first + length) + ") but the table holds [0, " +
                            std::to_string(rotary_.max_positions()) +
                            ") (config.rotary->max_positions)");
        }
      }
    }
    // pass 1: q | k | v of the new tokens, one GEMM into (B, Lnew, E + 2*Ekv).
    const Index width = e + 2 * ekv;
    Matrix<T> qkv(batch * length, width);
    project_rows(x_new, in_proj_.fused_weight(), in_proj_.bq(), qkv.data(), length, width);
    const HeadsView<const T> new_keys =
        strided(column(qkv.data(), e), batch, length, kv_heads, d, length, width);
    const HeadsView<const T> new_values =
        strided(column(qkv.data(), e + ekv), batch, length, kv_heads, d, length, width);
    if (has_rotary())
      cache.append(new_keys, new_values, rotary_);  // rotated once, on their way in
    else
      cache.append(new_keys, new_values);
    // pass 2: attention against the whole cache, written as (B, Lnew, H, D) = (B, Lnew, E).
    Matrix<T> merged(batch * length, e);
    if constexpr (std::is_same_v<T, C>) {
      if (has_rotary())
        rotary_.apply(strided(qkv.data(), batch, length, heads, d, length, width), positions);
      cache.attend_into(
          strided(static_cast<const T*>(qkv.data()), batch, length, heads, d, length, width),
          blhd_view(merged.data(), batch, length, heads, d), attention);
    } else {  // 16-bit T: the queries widened (exactly), the output rounded to T once
      Matrix<C> q_wide(batch * length, e), merged_wide(batch * length, e);
      const Isa isa = plan_isa<C>();
      for (Index r = 0; r < batch * length; ++r)
        detail::widen(isa, qkv.row(r).data(), q_wide.row(r).data(), e);
      if (has_rotary())  // rotated in float, not rounded to T again
        rotary_.apply(strided(q_wide.data(), batch, length, heads, d, length, e), positions);
      cache.attend_into(
          strided(static_cast<const C*>(q_wide.data()), batch, length, heads, d, length, e),
          blhd_view(merged_wide.data(), batch, length, heads, d), attention);
      merged = merged_wide.template cast<T>();
    }
    // pass 3: output projection.
    Tensor<T, 3> output(batch, length, e);
    out_proj_.apply_into(ConstRowsMap<T>(merged.data(), batch * length, e, Eigen::OuterStride<>(e)),
                         RowsMap<T>(output.data(), batch * length, e, Eigen::OuterStride<>(e)));
    return output;
  }

  /// Self-attention over packed sequences: x (T, E) holds B sequences one after another,
  /// sequence b being rows [cu_seqlens[b], cu_seqlens[b + 1]) (FlashAttention's
  /// convention). One fused QKV GEMM over all T rows, attention per sequence through
  /// packed views (packed_view(); no token sees another sequence's), one output
  /// GEMM. Returns (T, E). Sequence b's rows equal forward() of that sequence alone (with the
  /// same `attention` options: e.g. Causal::top_left for forward()'s is_causal). `attention`
  /// may set causal, window, sink tokens, ALiBi, softcap, sinks, scale and the kernel; no
  /// keep-mask, bias or lengths. Needs kdim = vdim = E and neither add_bias_kv nor
  /// add_zero_attn.
  Tensor<T, 2> forward_packed(const Tensor<T, 2>& x,                 // (T, E)
                              const std::vector<Index>& cu_seqlens,  // (B + 1)
                              const AttentionOptions<C>& attention = {}) const {
    constexpr const char* function = "MultiHeadAttention::forward_packed";
    const Index tokens = x.dimension(0);
    const Index e = config_.embed_dim, ekv = kv_width(), d = head_dim();
    const Index heads = config_.num_heads, kv_heads = config_.num_kv_heads;
    if (!is_same_embed_dim() || config_.add_bias_kv || config_.add_zero_attn) {
      detail::throw_invalid_argument(
          function, "needs kdim = vdim = embed_dim and neither add_bias_kv nor add_zero_attn");
    }
    if (x.dimension(1) != e) {
      detail::throw_invalid_argument(
          function, "x is " + detail::shape_string({tokens, x.dimension(1)}) +
                        " but embed_dim is " + std::to_string(e) + ": widths differ");
    }
    detail::check_sequence_offsets(function, "cu_seqlens", cu_seqlens, tokens);
    if (has_rotary()) {  // checked here: the rotation runs before the attention checks them
      for (std::size_t b = 0; b + 1 < cu_seqlens.size(); ++b) {
        const Index n = cu_seqlens[b + 1] - cu_seqlens[b];
        if (n > rotary_.max_positions()) {
          detail::throw_invalid_argument(
              function, "sequence " + std::to_string(b) + " has " + std::to_string(n) +
                            " tokens but the rotary table holds positions [0, " +
                            std::to_string(rotary_.max_positions()) +
                            ") (config.rotary->max_positions)");
        }
      }
    }
    const Index width = e + 2 * ekv;
    Matrix<T> qkv(tokens, width);  // (T, E + 2*Ekv): q | k | v of every token
    detail::linear_into<T>(ConstRowsMap<T>(x.data(), tokens, e, Eigen::OuterStride<>(e)),
                           in_proj_.fused_weight(), in_proj_.bq(),
                           RowsMap<T>(qkv.data(), tokens, width, Eigen::OuterStride<>(width)));
    Matrix<T> merged(tokens, e);                       // (T, H, D) = (T, E)
    const auto packed = [&](const T* data, Index h) {  // h heads of every token
      return detail::unchecked_packed_view(HeadsView<const T>{data, 1, h, tokens, d, 0, d, width},
                                           cu_seqlens);
    };
    if (has_rotary()) {  // each sequence's tokens at positions 0, 1, ... of their own
      for (const Index offset : {Index(0), e}) {
        rotary_.apply(detail::unchecked_packed_view(
            HeadsView<T>{column(qkv.data(), offset), 1, offset == 0 ? heads : kv_heads, tokens, d,
                         0, d, width},
            cu_seqlens));
      }
    }
    scaled_dot_product_attention_into<T>(
        packed(qkv.data(), heads), packed(column(qkv.data(), e), kv_heads),
        packed(column(qkv.data(), e + ekv), kv_heads),
        detail::unchecked_packed_view(blhd_view(merged.data(), 1, tokens, heads, d), cu_seqlens),
        attention);
    Tensor<T, 2> output(tokens, e);
    out_proj_.apply_into(ConstRowsMap<T>(merged.data(), tokens, e, Eigen::OuterStride<>(e)),
                         RowsMap<T>(output.data(), tokens, e, Eigen::OuterStride<>(e)));
    return output;
  }

  /// Same, into `result` with the scratch buffers of `workspace`: no allocation when the
  /// shapes repeat.
  void forward_into(const Tensor<T, 3>& query,  // (B, L, E)
                    const Tensor<T, 3>& key,    // (B, S, kdim)
                    const Tensor<T, 3>& value,  // (B, S, vdim)
                    const MultiHeadForwardOptions<T>& options, MultiHeadAttentionOutput<T>& result,
                    MultiHeadWorkspace<T>& workspace) const {
    forward_impl("MultiHeadAttention::forward", query, key, value, options, result, workspace,
                 nullptr);
  }

  /// Self-attention forward for training: forward(x, options)'s output and the context
  /// backward() needs (see MultiHeadAttentionContext for what it holds and its memory).
  MultiHeadAttentionTrainingOutput<T> forward_train(
      const Tensor<T, 3>& x,  // (B, L, E)
      const MultiHeadForwardOptions<T>& options = {}) const {
    return forward_train(x, x, x, options);
  }

  /// Forward for training: query (B, L, E), key (B, S, kdim), value (B, S, vdim), the same
  /// tensor three times for self-attention. The output equals forward()'s; the context
  /// keeps copies of the inputs and masks, so they need not outlive the call. need_weights
  /// must be false (the weights are not differentiated).
  MultiHeadAttentionTrainingOutput<T> forward_train(
      const Tensor<T, 3>& query,  // (B, L, E)
      const Tensor<T, 3>& key,    // (B, S, kdim)
      const Tensor<T, 3>& value,  // (B, S, vdim)
      const MultiHeadForwardOptions<T>& options = {}) const {
    constexpr const char* function = "MultiHeadAttention::forward_train";
    if (options.need_weights) {
      detail::throw_invalid_argument(
          function,
          "need_weights must be false: the attention weights are not differentiated "
          "(call forward() for them)");
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
    c.causal = attention.causal;
    c.dropout_p = options.dropout_p;
    c.dropout_seed = options.dropout_seed;
    c.module = this;
    return train;
  }

  /// The backward of forward_train: from its context and d_output = dL/d output (B, L, E),
  /// the gradients of the inputs (d_query, and d_key, d_value unless self-attention) and of
  /// every parameter, keyed as state_dict() (torch's .grad). Differentiates every forward
  /// option: masks, is_causal, add_bias_kv (bias_k, bias_v get gradients), add_zero_attn,
  /// grouped-query heads, rotary (the gradients rotated back), dropout (the same mask).
  MultiHeadAttentionGradients<T> backward(const MultiHeadAttentionContext<T>& context,
                                          const Tensor<T, 3>& d_output) const {  // (B, L, E)
    MultiHeadAttentionGradients<T> grads;
    backward_impl(context, d_output, grads);
    return grads;
  }

  /// backward() into `grads`. accumulate = false overwrites it; true adds the parameter
  /// gradients to those already in grads.parameters (torch's .grad over several backward
  /// calls: micro-batches, a module applied twice), which must then have state_dict()'s
  /// names and shapes. The input gradients are always overwritten (they belong to this call).
  void backward_into(const MultiHeadAttentionContext<T>& context,
                     const Tensor<T, 3>& d_output,  // (B, L, E)
                     MultiHeadAttentionGradients<T>& grads, bool accumulate = false) const {
    constexpr const char* function = "MultiHeadAttention::backward_into";
    if (!accumulate) {
      backward_impl(context, d_output, grads);
      return;
    }
    const StateDict<T> names = state_dict();
    for (const auto& [name, t] : names) {
      const auto it = grads.parameters.find(name);
      if (it == grads.parameters.end() || it->second.shape != t.shape ||
          it->second.data.size() != t.data.size()) {
        detail::throw_invalid_argument(
            function, "accumulate is true but grads.parameters has no " + shape_of(t.shape) +
                          " \"" + name + "\": accumulate into the gradients of an earlier call");
      }
    }
    if (grads.parameters.size() != names.size()) {
      detail::throw_invalid_argument(function,
                                     "accumulate is true but grads.parameters has names "
                                     "state_dict() does not have");
    }
    StateDict<T> previous = std::move(grads.parameters);
    backward_impl(context, d_output, grads);
    for (auto& [name, t] : grads.parameters) {
      const std::vector<T>& old = previous.at(name).data;
      for (std::size_t i = 0; i < t.data.size(); ++i)
        t.data[i] = static_cast<T>(t.data[i] + old[i]);
    }
  }

 private:
  bool is_self(const Tensor<T, 3>& query, const Tensor<T, 3>& key,
               const Tensor<T, 3>& value) const {
    return query.data() == key.data() && query.data() == value.data() &&
           query.dimension(1) == key.dimension(1) && in_proj_.is_fused();
  }

  /// forward_into's body. With `logsumexp` (training) it is filled (B, H, L), and every mask
  /// is copied into the workspace (the backward reads them after the caller's are gone).
  /// Returns the attention options used (pointing into the workspace and the masks).
  AttentionOptions<C> forward_impl(const char* function, const Tensor<T, 3>& query,
                                   const Tensor<T, 3>& key, const Tensor<T, 3>& value,
                                   const MultiHeadForwardOptions<T>& options,
                                   MultiHeadAttentionOutput<T>& result,
                                   MultiHeadWorkspace<T>& workspace,
                                   Tensor<C, 3>* logsumexp) const {
    check_inputs(function, query, key, value, options);
    if (has_rotary() && std::max(query.dimension(1), key.dimension(1)) > rotary_.max_positions()) {
      detail::throw_invalid_argument(function, "query is " + shape3(query) + " and key is " +
                                                   shape3(key) +
                                                   " but the rotary table holds positions [0, " +
                                                   std::to_string(rotary_.max_positions()) +
                                                   ") (config.rotary->max_positions)");
    }
    const Index batch = query.dimension(0), q_length = query.dimension(1),
                k_length = key.dimension(1);
    const Index extra = Index(config_.add_bias_kv) + Index(config_.add_zero_attn);
    const Index kv_length = k_length + extra;  // S'
    const Index e = config_.embed_dim, ekv = kv_width(), d = head_dim();
    const Index heads = config_.num_heads, kv_heads = config_.num_kv_heads;

    // pass 1: projections straight into (B, L, H, D) / (B, S', Hkv, D) memory.
    HeadsView<T> qv, kv, vv;  // into the workspace (the rotation writes them)
    const bool self = is_self(query, key, value);
    if (self) {
      // One buffer (B, L + extra, E + 2*Ekv): q | k | v column blocks.
      const Index width = e + 2 * ekv, rows_per_batch = q_length + extra;
      workspace.qkv.resize(batch * rows_per_batch, width);
      project_rows(query, in_proj_.fused_weight(), in_proj_.bq(), workspace.qkv.data(),
                   rows_per_batch, width);
      fill_extra_rows(column(workspace.qkv.data(), e), batch, k_length, rows_per_batch, width);
      qv = strided(workspace.qkv.data(), batch, q_length, heads, d, rows_per_batch, width);
      kv = strided(column(workspace.qkv.data(), e), batch, kv_length, kv_heads, d, rows_per_batch,
                   width);
      vv = strided(column(workspace.qkv.data(), e + ekv), batch, kv_length, kv_heads, d,
                   rows_per_batch, width);
    } else {
      workspace.q.resize(batch * q_length, e);
      project_rows(query, in_proj_.wq(), in_proj_.bq(), workspace.q.data(), q_length, e);
      const Index width = 2 * ekv;
      workspace.kv.resize(batch * kv_length, width);
      if (key.data() == value.data() && key.dimensions() == value.dimensions() &&
          in_proj_.is_fused()) {
        // k and v from one input: one GEMM with the adjacent [Wk | Wv] column blocks.
        const ConstRowsMap<T> w = in_proj_.fused_weight();
        const ConstRowsMap<T> wkv(w.data() + e, w.rows(), width, Eigen::OuterStride<>(w.cols()));
        project_rows(key, wkv, in_proj_.bk(), workspace.kv.data(), kv_length, width);
      } else {
        project_rows(key, in_proj_.wk(), in_proj_.bk(), workspace.kv.data(), kv_length, width);
        project_rows(value, in_proj_.wv(), in_proj_.bv(), column(workspace.kv.data(), ekv),
                     kv_length, width);
      }
      fill_extra_rows(workspace.kv.data(), batch, k_length, kv_length, width);
      qv = strided(workspace.q.data(), batch, q_length, heads, d, q_length, e);
      kv = strided(workspace.kv.data(), batch, kv_length, kv_heads, d, kv_length, width);
      vv = strided(column(workspace.kv.data(), ekv), batch, kv_length, kv_heads, d, kv_length,
                   width);
    }

    if (has_rotary()) {  // q at positions [0, L), k at [0, S); the views' memory is ours
      rotary_.apply(qv);
      rotary_.apply(kv);
    }

    // Masks, translated to the SDPA conventions (keep-mask: true = may attend).
    AttentionOptions<C> attention;
    build_masks(options, batch, q_length, k_length, kv_length, workspace, attention,
                logsumexp != nullptr);
    attention.dropout_p = static_cast<C>(options.dropout_p);
    attention.dropout_seed = options.dropout_seed;

    // pass 2: attention, written as (B, L, H, D) = (B, L, E).
    workspace.attn.resize(batch * q_length, e);
    const HeadsView<T> out = blhd_view(workspace.attn.data(), batch, q_length, heads, d);
    C* weights = nullptr;  // in the compute scalar; 16-bit results are rounded afterwards
    if (options.need_weights) {
      if constexpr (std::is_same_v<T, C>) {
        Tensor<C, 4>& w = options.average_attn_weights ? workspace.head_weights : result.weights;
        w.resize(batch, heads, q_length, kv_length);
        weights = w.data();
      } else {
        workspace.head_weights.resize(batch, heads, q_length, kv_length);
        weights = workspace.head_weights.data();
      }
    }
    C* lse = nullptr;
    if (logsumexp != nullptr) {
      logsumexp->resize(batch, heads, q_length);
      lse = logsumexp->data();
    }
    scaled_dot_product_attention_into<T>(qv, kv, vv, out, attention, weights, lse);
    if (!options.need_weights || options.average_attn_weights) {
      result.weights = Tensor<T, 4>();
    } else if constexpr (!std::is_same_v<T, C>) {
      result.weights = workspace.head_weights.template cast<T>();
    }
    if (options.need_weights && options.average_attn_weights) {
      result.averaged_weights.resize(batch, q_length, kv_length);
      const Index plane = q_length * kv_length;
      Vector<C> avg(plane);
      for (Index b = 0; b < batch; ++b) {
        avg.setZero();
        for (Index h = 0; h < heads; ++h) {
          avg += Eigen::Map<const Vector<C>>(weights + (b * heads + h) * plane, plane);
        }
        avg /= static_cast<C>(heads);
        Eigen::Map<Vector<T>>(result.averaged_weights.data() + b * plane, plane) =
            avg.template cast<T>();
      }
    } else {
      result.averaged_weights = Tensor<T, 3>();
    }

    // pass 3: output projection, one GEMM.
    result.output.resize(batch, q_length, e);
    out_proj_.apply_into(
        ConstRowsMap<T>(workspace.attn.data(), batch * q_length, e, Eigen::OuterStride<>(e)),
        RowsMap<T>(result.output.data(), batch * q_length, e, Eigen::OuterStride<>(e)));
    return attention;
  }

  /// Where backward_impl keeps the attention's gradients: the forward's projection-buffer
  /// layout (self-attention: the q | k | v column blocks of one buffer of `width` columns,
  /// `rows_per_batch` rows a sequence; cross-attention: k | v, and dq apart).
  struct GradientLayout {
    bool self;
    Index batch, q_length, k_length;
    Index extra;  ///< rows appended to k and v (add_bias_kv, add_zero_attn)
    Index rows_per_batch, width, kv_col;
  };

  /// The options of the attention's backward: the forward's masks (kept in its workspace),
  /// causal flag and dropout.
  static AttentionOptions<C> backward_attention_options(
      const MultiHeadAttentionContext<T>& context) {
    const MultiHeadWorkspace<T>& ws = context.workspace;
    AttentionOptions<C> attention;
    attention.causal = context.causal;
    if (ws.keep.size() > 0) {
      attention.keep_mask = Broadcast<bool>(
          ws.keep.data(),
          {ws.keep.dimension(0), ws.keep.dimension(1), ws.keep.dimension(2), ws.keep.dimension(3)});
    }
    if (ws.bias.size() > 0) {
      attention.bias = Broadcast<C>(ws.bias.data(), {ws.bias.dimension(0), ws.bias.dimension(1),
                                                     ws.bias.dimension(2), ws.bias.dimension(3)});
    }
    attention.dropout_p = static_cast<C>(context.dropout_p);
    attention.dropout_seed = context.dropout_seed;
    return attention;
  }

  /// in_proj's backward: grads.d_query (and d_key, d_value) and in_grads from the attention's
  /// gradients d_qkv (and d_q) in `layout`. One call over all rows when no row was appended
  /// (self-attention: the one-GEMM fused path), else one per sequence.
  void in_projection_backward(const MultiHeadAttentionContext<T>& context,
                              const GradientLayout& layout, const Matrix<T>& d_qkv,
                              const Matrix<T>& d_q, MultiHeadAttentionGradients<T>& grads,
                              QKVProjectionGradients<T>& in_grads) const {
    const auto [self, batch, q_length, k_length, extra, rows_per_batch, width, kv_col] = layout;
    const Tensor<T, 3>& query = context.query;
    const Tensor<T, 3>& key = self ? query : context.key;
    const Tensor<T, 3>& value = self ? query : context.value;
    const Index e = config_.embed_dim, ekv = kv_width(), tokens = batch * q_length;
    grads.d_query.resize(batch, q_length, e);
    if (!self) {
      grads.d_key.resize(batch, k_length, config_.kdim);
      grads.d_value.resize(batch, k_length, config_.vdim);
    }
    const T* dq_data = self ? d_qkv.data() : d_q.data();
    const Index dq_stride = self ? width : e, dq_rows_per_batch = self ? rows_per_batch : q_length;
    const Index parts = extra == 0 ? 1 : batch;  // row ranges of one call
    const Index q_rows = extra == 0 ? tokens : q_length,
                k_rows = extra == 0 ? batch * k_length : k_length;
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
      const auto d_rows = [&](const T* base, Index rows_per, Index stride, Index count,
                              Index cols) {
        return ConstRowsMap<T>(base + part * rows_per * stride, count, cols,
                               Eigen::OuterStride<>(stride));
      };
      const T* dkv_data = d_qkv.data();
      const ConstRowsMap<T> dq_r = d_rows(dq_data, dq_rows_per_batch, dq_stride, q_rows, e);
      const ConstRowsMap<T> dk_r =
          d_rows(column(dkv_data, kv_col), rows_per_batch, width, k_rows, ekv);
      const ConstRowsMap<T> dv_r =
          d_rows(column(dkv_data, kv_col + ekv), rows_per_batch, width, k_rows, ekv);
      const bool accumulate = part > 0;
      RowsMap<T> dx_q = grad_rows(grads.d_query, q_length, q_rows);
      if (self) {
        const ConstRowsMap<T> x = rows(query, q_length, q_rows);
        in_proj_.backward_into(x, x, x, dq_r, dk_r, dv_r, &dx_q, &dx_q, &dx_q, in_grads,
                               accumulate);
      } else {
        RowsMap<T> dx_k = grad_rows(grads.d_key, k_length, k_rows);
        RowsMap<T> dx_v = grad_rows(grads.d_value, k_length, k_rows);
        in_proj_.backward_into(rows(query, q_length, q_rows), rows(key, k_length, k_rows),
                               rows(value, k_length, k_rows), dq_r, dk_r, dv_r, &dx_q, &dx_k, &dx_v,
                               in_grads, accumulate);
      }
    }
  }

  void backward_impl(const MultiHeadAttentionContext<T>& context,
                     const Tensor<T, 3>& d_output,  // (B, L, E)
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
    const Index batch = query.dimension(0), q_length = query.dimension(1),
                k_length = key.dimension(1);
    const Index extra = Index(config_.add_bias_kv) + Index(config_.add_zero_attn);
    const Index kv_length = k_length + extra;  // S'
    const Index e = config_.embed_dim, ekv = kv_width(), d = head_dim();
    const Index heads = config_.num_heads, kv_heads = config_.num_kv_heads;
    if (d_output.dimension(0) != batch || d_output.dimension(1) != q_length ||
        d_output.dimension(2) != e) {
      detail::throw_invalid_argument(
          function, "d_output is " + shape3(d_output) + " but the forward's output is " +
                        detail::shape_string({batch, q_length, e}) + " (B, L, E)");
    }
    const MultiHeadWorkspace<T>& ws = context.workspace;
    const Index tokens = batch * q_length;

    // out_proj: its parameter gradients and d_attn (B*L, E) = (B, L, H, D).
    Matrix<T> d_attn(tokens, e), out_w_grad;
    Vector<T> out_b_grad;
    RowsMap<T> d_attn_rows(d_attn.data(), tokens, e, Eigen::OuterStride<>(e));
    out_proj_.backward_into(ConstRowsMap<T>(ws.attn.data(), tokens, e, Eigen::OuterStride<>(e)),
                            ConstRowsMap<T>(d_output.data(), tokens, e, Eigen::OuterStride<>(e)),
                            &d_attn_rows, out_w_grad, out_b_grad);

    // The attention's gradients, laid out as the forward's projection buffers (the q, k, v
    // gradients are column blocks of one buffer for self-attention).
    const Index width = self ? e + 2 * ekv : 2 * ekv;
    const Index rows_per_batch = self ? q_length + extra : kv_length;  // of the k | v rows
    Matrix<T> d_qkv = Matrix<T>::Zero(batch * rows_per_batch, width);  // k | v (and q if self)
    Matrix<T> d_q;                                                     // cross: (B*L, E)
    HeadsView<const T> qv, kv, vv;
    HeadsView<T> dqv, dkv, dvv;
    const Index kv_col = self ? e : 0;
    if (self) {
      qv = strided(static_cast<const T*>(ws.qkv.data()), batch, q_length, heads, d, rows_per_batch,
                   width);
      dqv = strided(d_qkv.data(), batch, q_length, heads, d, rows_per_batch, width);
    } else {
      d_q.resize(tokens, e);
      qv = strided(static_cast<const T*>(ws.q.data()), batch, q_length, heads, d, q_length, e);
      dqv = strided(d_q.data(), batch, q_length, heads, d, q_length, e);
    }
    const T* kv_data = self ? ws.qkv.data() : ws.kv.data();
    kv = strided(column(kv_data, kv_col), batch, kv_length, kv_heads, d, rows_per_batch, width);
    vv = strided(column(kv_data, kv_col + ekv), batch, kv_length, kv_heads, d, rows_per_batch,
                 width);
    dkv =
        strided(column(d_qkv.data(), kv_col), batch, kv_length, kv_heads, d, rows_per_batch, width);
    dvv = strided(column(d_qkv.data(), kv_col + ekv), batch, kv_length, kv_heads, d, rows_per_batch,
                  width);
    const AttentionOptions<C> attention = backward_attention_options(context);
    scaled_dot_product_attention_backward_into<T>(
        qv, kv, vv, blhd_view(static_cast<const T*>(ws.attn.data()), batch, q_length, heads, d),
        context.logsumexp.data(),
        blhd_view(static_cast<const T*>(d_attn.data()), batch, q_length, heads, d), dqv, dkv, dvv,
        attention);
    if (has_rotary()) {  // the transpose of the forward's rotation, at the same positions
      rotary_.apply_backward(dqv);
      rotary_.apply_backward(dkv);
    }

    // The appended rows: bias_k / bias_v collect their rows' gradients; zero rows have none.
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
        const T* row = d_qkv.data() + (b * rows_per_batch + k_length) * width + kv_col;
        bk += Eigen::Map<const Vector<T>>(row, ekv);
        bv += Eigen::Map<const Vector<T>>(row + ekv, ekv);
      }
      put("bias_k", {1, 1, ekv}, bk.data());
      put("bias_v", {1, 1, ekv}, bv.data());
    }

    // in_proj: the input gradients and the in_proj_* gradients.
    QKVProjectionGradients<T> in_grads;
    in_projection_backward(context,
                           {self, batch, q_length, k_length, extra, rows_per_batch, width, kv_col},
                           d_qkv, d_q, grads, in_grads);
    const auto put_matrix = [&](const std::string& name, const Matrix<T>& m) {  // (out, in)
      put(name, {m.rows(), m.cols()}, m.data());
    };
    if (in_proj_.is_fused()) {
      put_matrix("in_proj_weight", in_grads.in_proj_weight);
    } else {
      put_matrix("q_proj_weight", in_grads.q_proj_weight);
      put_matrix("k_proj_weight", in_grads.k_proj_weight);
      put_matrix("v_proj_weight", in_grads.v_proj_weight);
    }
    if (config_.bias) {
      put("in_proj_bias", {e + 2 * ekv}, in_grads.in_proj_bias.data());
      put("out_proj.bias", {e}, out_b_grad.data());
    }
    put_matrix("out_proj.weight", out_w_grad);
  }

  static std::string shape_of(const std::vector<Index>& shape) {
    return detail::list_string(shape);
  }
  static std::string shape3(const Tensor<T, 3>& t) {
    return detail::shape_string({t.dimension(0), t.dimension(1), t.dimension(2)});
  }

  void validate_config() {
    constexpr const char* function = "MultiHeadAttention";
    MultiHeadAttentionConfig& c = config_;
    if (c.embed_dim < 1) {
      detail::throw_invalid_argument(
          function, "embed_dim " + std::to_string(c.embed_dim) + " must be positive");
    }
    if (c.num_heads < 1) {
      detail::throw_invalid_argument(
          function, "num_heads " + std::to_string(c.num_heads) + " must be positive");
    }
    if (c.embed_dim % c.num_heads != 0) {
      detail::throw_invalid_argument(function, "embed_dim " + std::to_string(c.embed_dim) +
                                                   " is not divisible by num_heads " +
                                                   std::to_string(c.num_heads));
    }
    if (c.num_kv_heads == 0)
      c.num_kv_heads = c.num_heads;
    if (c.num_kv_heads < 1 || c.num_heads % c.num_kv_heads != 0) {
      detail::throw_invalid_argument(function, "num_heads " + std::to_string(c.num_heads) +
                                                   " is not a multiple of num_kv_heads " +
                                                   std::to_string(c.num_kv_heads));
    }
    if (c.kdim == 0)
      c.kdim = c.embed_dim;
    if (c.vdim == 0)
      c.vdim = c.embed_dim;
    if (c.kdim < 1 || c.vdim < 1) {
      detail::throw_invalid_argument(function, "kdim " + std::to_string(c.kdim) + " and vdim " +
                                                   std::to_string(c.vdim) + " must be positive");
    }
    if (c.rotary) {
      const Index d = c.embed_dim / c.num_heads;
      if (c.rotary->dim == 0)
        c.rotary->dim = d;
      if (c.rotary->dim != d) {
        detail::throw_invalid_argument(
            function, "rotary->dim " + std::to_string(c.rotary->dim) +
                          " differs from the head dim " + std::to_string(d) + " (embed_dim " +
                          std::to_string(c.embed_dim) + " / num_heads " +
                          std::to_string(c.num_heads) + "; 0 means the head dim)");
      }
      if (c.add_bias_kv || c.add_zero_attn) {
        detail::throw_invalid_argument(function,
                                       "rotary cannot be combined with add_bias_kv or "
                                       "add_zero_attn: the appended key rows have no position");
      }
      try {
        rotary_ = RotaryEmbedding<C>(*c.rotary);
      } catch (const std::invalid_argument& error) {  // RopeConfig's own checks
        detail::throw_invalid_argument(function, std::string("rotary: ") + error.what());
      }
    }
  }

  void check_inputs(const char* function, const Tensor<T, 3>& query, const Tensor<T, 3>& key,
                    const Tensor<T, 3>& value, const MultiHeadForwardOptions<T>& options) const {
    const auto shapes = [&] {
      return "query is " + shape3(query) + ", key is " + shape3(key) + ", value is " +
             shape3(value);
    };
    if (query.dimension(0) != key.dimension(0) || query.dimension(0) != value.dimension(0)) {
      detail::throw_invalid_argument(function, shapes() + ": batch sizes differ");
    }
    if (key.dimension(1) != value.dimension(1)) {
      detail::throw_invalid_argument(function, shapes() + ": key and value lengths differ");
    }
    if (query.dimension(2) != config_.embed_dim || key.dimension(2) != config_.kdim ||
        value.dimension(2) != config_.vdim) {
      detail::throw_invalid_argument(
          function, shapes() + " but (embed_dim, kdim, vdim) is " +
                        detail::shape_string({config_.embed_dim, config_.kdim, config_.vdim}) +
                        ": widths differ");
    }
    if (!(options.dropout_p >= 0 && options.dropout_p < 1)) {
      detail::throw_invalid_argument(
          function,
          "dropout_p is " + detail::number_string(options.dropout_p) + ": must lie in [0, 1)");
    }
    const Index batch = query.dimension(0), q_length = query.dimension(1),
                k_length = key.dimension(1);
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

  template <class U, class Shapes>
  void check_attn_mask(const char* function, const char* name, const MaskArg<U>& m, Index batch,
                       Index q_length, Index k_length, const Shapes& shapes) const {
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

  /// The column block at `offset` of a buffer; an empty buffer's null data stays null
  /// (no arithmetic on a null pointer, e.g. for L = 0).
  template <class U>
  static U* column(U* data, Index offset) {
    return data == nullptr ? data : data + offset;
  }

  template <class U>
  static HeadsView<U> strided(U* data, Index batch, Index length, Index heads, Index dim,
                              Index rows_per_batch, Index row_stride) {
    return {data, batch, heads, length, dim, rows_per_batch * row_stride, dim, row_stride};
  }

  /// y[b*rows_per_batch + s, 0:out) = x[b, s, :] * w + bias, rows `row_stride` apart. One
  /// GEMM over all B*S rows when rows_per_batch == S, else one per batch entry (the rows in
  /// between hold the appended bias_k / zero-attn keys).
  template <class W>
  static void project_rows(const Tensor<T, 3>& x, const W& w, const T* bias, T* y,
                           Index rows_per_batch, Index row_stride) {
    const Index batch = x.dimension(0), length = x.dimension(1), in = x.dimension(2);
    const ConstRowsMap<T> weight(w.data(), w.rows(), w.cols(),
                                 Eigen::OuterStride<>(w.outerStride()));
    if (rows_per_batch == length) {
      detail::linear_into<T>(
          detail::rows_of(x), weight, bias,
          RowsMap<T>(y, batch * length, w.cols(), Eigen::OuterStride<>(row_stride)));
      return;
    }
    for (Index b = 0; b < batch; ++b) {
      detail::linear_into<T>(
          ConstRowsMap<T>(x.data() + b * length * in, length, in, Eigen::OuterStride<>(in)), weight,
          bias,
          RowsMap<T>(y + b * rows_per_batch * row_stride, length, w.cols(),
                     Eigen::OuterStride<>(row_stride)));
    }
  }

  /// Writes the appended key/value rows (bias_k / bias_v, then zeros) after the S projected
  /// rows of each batch entry. `kv` points at the k block; v follows at + Ekv.
  void fill_extra_rows(T* kv, Index batch, Index k_length, Index rows_per_batch,
                       Index row_stride) const {
    const Index ekv = kv_width();
    for (Index b = 0; b < batch; ++b) {
      Index row = b * rows_per_batch + k_length;
      if (config_.add_bias_kv) {
        Eigen::Map<Vector<T>>(kv + row * row_stride, ekv) = bias_k_;
        Eigen::Map<Vector<T>>(kv + row * row_stride + ekv, ekv) = bias_v_;
        ++row;
      }
      if (config_.add_zero_attn) {
        Eigen::Map<Vector<T>>(kv + row * row_stride, 2 * ekv).setZero();
      }
    }
  }

  /// Translates the MHA masks (true = ignore / not allowed) into AttentionOptions (keep-mask
  /// true = may attend, additive bias). Appended keys (j >= S) are never masked.
  void build_masks(const MultiHeadForwardOptions<T>& options, Index batch, Index q_length,
                   Index k_length, Index kv_length, MultiHeadWorkspace<T>& ws,
                   AttentionOptions<C>& attention, bool copy_masks) const {
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

  MultiHeadAttentionConfig config_;
  QKVProjection<T> in_proj_;   // fused (E, E + 2*Ekv) or separate Wq, Wk, Wv
  Linear<T> out_proj_;         // (E, E)
  Vector<T> bias_k_, bias_v_;  // (Ekv) with add_bias_kv
  RotaryEmbedding<C> rotary_;  // config_.rotary's table, or empty
};

}  // namespace attn

#if defined(ATTN_COMPILED)  // compiled once in attn::compiled (attn/instances.hpp)
#include "attn/instances.hpp"
ATTN_MULTIHEAD_CLASSES(ATTN_EXTERN_CLASS)
#endif
