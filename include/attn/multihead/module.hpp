// attn/multihead/module.hpp: MultiHeadAttention's core: the class, its construction and
// configuration, its accessors and the forward (forward, forward_into). The members of the
// other concerns are declared here and defined in their headers, which attn/multihead.hpp
// (the header to include) brings together:
//   attn/multihead/torch.hpp      PyTorch compatibility: state dicts, the MHA-polarity masks,
//                                 the rows add_bias_kv and add_zero_attn append
//   attn/multihead/sequences.hpp  forward_incremental on a KVCache or a PagedKVCache,
//                                 forward_packed
//   attn/multihead/training.hpp   forward_train, backward, backward_into
// Shapes, data flow and weight layouts: attn/multihead.hpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "attn/attention.hpp"
#include "attn/config.hpp"
#include "attn/init.hpp"
#include "attn/kv_cache.hpp"
#include "attn/mask.hpp"
#include "attn/multihead/arguments.hpp"
#include "attn/multihead/layout.hpp"
#include "attn/paged_kv_cache.hpp"
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
                                            const StateDict<T>& state);
  /// Loads PyTorch's state_dict layout (names and (out x in) shapes in attn/multihead.hpp).
  /// Strict like torch's load_state_dict: a missing or unexpected name, or a wrong shape,
  /// throws.
  void load_state_dict(const StateDict<T>& state);
  /// The weights in PyTorch's state_dict layout (the inverse of load_state_dict).
  StateDict<T> state_dict() const;

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

  /// Incremental self-attention for autoregressive decoding: projects the Lnew new tokens
  /// x_new (B, Lnew, E) (one fused GEMM), appends their keys and values to `cache` (created
  /// as KVCache<S, SV>(B, Hkv, D, D, capacity); S and SV may be half, bfloat16 or quantized
  /// blocks for a float module, attn/quantized.hpp),
  /// attends with the bottom-right causal mask against everything cached (so the new
  /// tokens see the earlier ones and each other causally), then the output projection.
  /// Returns (B, Lnew, E). Feeding a sequence in any chunks gives the causal forward() of
  /// the whole sequence. `attention` may add a window, ALiBi slopes or a softcap; causal
  /// and key_lengths come from the cache. Needs kdim = vdim = E and neither add_bias_kv
  /// nor add_zero_attn. A half or bfloat16 module (T 16-bit, arithmetic in float) takes a
  /// float, half or bfloat16 cache; like forward(), it rounds the projections and the
  /// attention output to T once each.
  template <class S, class SV>
  Tensor<T, 3> forward_incremental(const Tensor<T, 3>& x_new,  // (B, Lnew, E)
                                   KVCache<S, SV>& cache,
                                   const AttentionOptions<C>& attention = {}) const;

  /// forward_incremental over the sequences of a PagedKVCache<S, SV>(Hkv, D, D, page_size):
  /// batch row b of x_new (B, Lnew, E) holds the Lnew new tokens of sequence sequences[b]
  /// (distinct live ids). Each row is projected, rotated and attended as the KVCache overload
  /// does, and when the page size is a multiple of decode_key_block (64) the result equals
  /// it bit for bit (other page sizes: within rounding). Refused in `attention`, besides
  /// what the KVCache overload refuses: a keep-mask, a bias, a mask_mod or block mask, a
  /// score_mod and dropout (they are indexed by batch row, which here is a place in the
  /// call, not a sequence). Any throw leaves the cache unchanged: everything, the attention
  /// options and released pages included, is checked before the first append.
  template <class S, class SV>
  Tensor<T, 3> forward_incremental(const Tensor<T, 3>& x_new,  // (B, Lnew, E)
                                   PagedKVCache<S, SV>& cache, const std::vector<Index>& sequences,
                                   const AttentionOptions<C>& attention = {}) const;

  /// The same for new tokens of different counts (continuous batching: a prompt chunk of one
  /// sequence beside single tokens of others): x_new (T, E) packed, sequence sequences[b]'s
  /// new tokens being rows [cu_seqlens[b], cu_seqlens[b + 1]) (FlashAttention's
  /// convention; a sequence may have none). Returns (T, E). One projection GEMM and one
  /// output GEMM over all T rows; the attention runs once per distinct count, over all the
  /// sequences of that count, each sequence's exactly as if it ran alone. On attn's AVX2 and
  /// AVX-512 GEMM, whose rows do not depend on the others, a sequence's result is then the
  /// same bits as alone, whatever else the call holds (batch invariance: a server gets each
  /// request's tokens as if it were served alone); Eigen's products (the generic path and
  /// double) choose their kernels by shape, so there it is within rounding.
  template <class S, class SV>
  Tensor<T, 2> forward_incremental(const Tensor<T, 2>& x_new,  // (T, E)
                                   PagedKVCache<S, SV>& cache,
                                   const std::vector<Index>& sequences,   // (B)
                                   const std::vector<Index>& cu_seqlens,  // (B + 1)
                                   const AttentionOptions<C>& attention = {}) const;

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
                              const AttentionOptions<C>& attention = {}) const;

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
      const MultiHeadForwardOptions<T>& options = {}) const;

  /// The backward of forward_train: from its context and doutput = dL/d output (B, L, E),
  /// the gradients of the inputs (dquery, and dkey, dvalue unless self-attention) and of
  /// every parameter, keyed as state_dict() (torch's .grad). Differentiates every forward
  /// option: masks, is_causal, add_bias_kv (bias_k, bias_v get gradients), add_zero_attn,
  /// grouped-query heads, rotary (the gradients rotated back), and options.attention:
  /// dropout (the same mask), window, ALiBi, softcap, mask_mod / block_mask, learned sinks
  /// (their gradient in grads.dsinks). forward_train refuses a score_mod.
  MultiHeadAttentionGradients<T> backward(const MultiHeadAttentionContext<T>& context,
                                          const Tensor<T, 3>& doutput) const;  // (B, L, E)

  /// backward() into `grads`. accumulate = false overwrites it; true adds the parameter
  /// gradients to those already in grads.parameters (torch's .grad over several backward
  /// calls: micro-batches, a module applied twice), which must then have state_dict()'s
  /// names and shapes (and dsinks the forward's sinks count). The input gradients are always
  /// overwritten (they belong to this call). A throw leaves grads as they were.
  void backward_into(const MultiHeadAttentionContext<T>& context,
                     const Tensor<T, 3>& doutput,  // (B, L, E)
                     MultiHeadAttentionGradients<T>& grads, bool accumulate = false) const;

 private:
  bool is_self(const Tensor<T, 3>& query, const Tensor<T, 3>& key,
               const Tensor<T, 3>& value) const {
    return query.data() == key.data() && query.data() == value.data() &&
           query.dimension(1) == key.dimension(1) && in_proj_.is_fused();
  }

  /// The projection-buffer layout of a call (attn/multihead/layout.hpp): self-attention or
  /// not, B, L and S; the appended rows and the heads from the configuration.
  detail::ProjectionLayout projection_layout(bool self, Index batch, Index q_length,
                                             Index k_length) const {
    const Index extra = Index(config_.add_bias_kv) + Index(config_.add_zero_attn);
    return detail::ProjectionLayout::make(self, batch, q_length, k_length, extra, config_.num_heads,
                                          config_.num_kv_heads, head_dim());
  }

  /// forward_into's body. With `logsumexp` (training) it is filled (B, H, L), and every mask
  /// is copied into the workspace (the backward reads them after the caller's are gone).
  /// Returns the attention options used (pointing into the workspace and the masks).
  AttentionOptions<C> forward_impl(const char* function, const Tensor<T, 3>& query,  // (B, L, E)
                                   const Tensor<T, 3>& key,                          // (B, S, kdim)
                                   const Tensor<T, 3>& value,                        // (B, S, vdim)
                                   const MultiHeadForwardOptions<T>& options,
                                   MultiHeadAttentionOutput<T>& result,
                                   MultiHeadWorkspace<T>& workspace,
                                   Tensor<C, 3>* logsumexp) const {  // (B, H, L) or null
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
    const Index e = config_.embed_dim, d = head_dim(), heads = config_.num_heads;

    // pass 1: projections straight into (B, L, H, D) / (B, S', Hkv, D) memory.
    const detail::ProjectionLayout layout =
        projection_layout(is_self(query, key, value), batch, q_length, k_length);
    const Index kv_length = layout.kv_length();  // S'
    project_inputs(layout, query, key, value, workspace);
    T* kv_buffer = (layout.self ? workspace.qkv : workspace.kv).data();
    const HeadsView<T> qv = layout.q_view(layout.q_buffer(kv_buffer, workspace.q.data()));
    const HeadsView<T> kv = layout.k_view(kv_buffer), vv = layout.v_view(kv_buffer);

    // Masks, translated to the SDPA conventions (keep-mask: true = may attend).
    AttentionOptions<C> attention = options.attention;
    build_masks(options, batch, q_length, k_length, kv_length, workspace, attention,
                logsumexp != nullptr);

    // pass 2: attention, written as (B, L, H, D) = (B, L, E).
    workspace.attn.resize(batch * q_length, e);
    const HeadsView<T> out = blhd_view(workspace.attn.data(), batch, q_length, heads, d);
    AttentionOutputViews<T> outputs(out);  // weights in the compute scalar: 16-bit results
    if (options.need_weights) {            // are rounded afterwards
      if constexpr (std::is_same_v<T, C>) {
        Tensor<C, 4>& w = options.average_attn_weights ? workspace.head_weights : result.weights;
        w.resize(batch, heads, q_length, kv_length);
        outputs.weights = bhld_view(w);
      } else {
        workspace.head_weights.resize(batch, heads, q_length, kv_length);
        outputs.weights = bhld_view(workspace.head_weights);
      }
    }
    if (logsumexp != nullptr) {
      logsumexp->resize(batch, heads, q_length);
      outputs.logsumexp = bhl_view(*logsumexp);
    }
    scaled_dot_product_attention_into<T>(qv, kv, vv, outputs, attention);
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
          avg +=
              Eigen::Map<const Vector<C>>(outputs.weights->data + (b * heads + h) * plane, plane);
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

  /// Pass 1 of the forward: the projections into the workspace's buffers of `layout` (one
  /// GEMM for self-attention), the appended rows after them, q and k rotated with rotary.
  void project_inputs(const detail::ProjectionLayout& layout,
                      const Tensor<T, 3>& query,  // (B, L, E)
                      const Tensor<T, 3>& key,    // (B, S, kdim)
                      const Tensor<T, 3>& value,  // (B, S, vdim)
                      MultiHeadWorkspace<T>& workspace) const {
    const Index e = config_.embed_dim, ekv = kv_width();
    if (layout.self) {  // one buffer (B, L + extra, E + 2*Ekv): q | k | v column blocks
      workspace.qkv.resize(layout.kv_buffer_rows(), layout.kv_stride);
      project_rows(query, in_proj_.fused_weight(), in_proj_.bq(), workspace.qkv.data(),
                   layout.kv_rows_per_batch, layout.kv_stride);
    } else {
      workspace.q.resize(layout.q_buffer_rows(), e);
      project_rows(query, in_proj_.wq(), in_proj_.bq(), workspace.q.data(), layout.q_rows_per_batch,
                   layout.q_stride);
      workspace.kv.resize(layout.kv_buffer_rows(), layout.kv_stride);
      T* kv = workspace.kv.data();
      if (key.data() == value.data() && key.dimensions() == value.dimensions() &&
          in_proj_.is_fused()) {
        // k and v from one input: one GEMM with the adjacent [Wk | Wv] column blocks.
        const ConstRowsMap<T> w = in_proj_.fused_weight();
        const ConstRowsMap<T> wkv(w.data() + e, w.rows(), 2 * ekv, Eigen::OuterStride<>(w.cols()));
        project_rows(key, wkv, in_proj_.bk(), kv, layout.kv_rows_per_batch, layout.kv_stride);
      } else {
        project_rows(key, in_proj_.wk(), in_proj_.bk(), layout.k_block(kv),
                     layout.kv_rows_per_batch, layout.kv_stride);
        project_rows(value, in_proj_.wv(), in_proj_.bv(), layout.v_block(kv),
                     layout.kv_rows_per_batch, layout.kv_stride);
      }
    }
    T* kv_buffer = (layout.self ? workspace.qkv : workspace.kv).data();
    fill_extra_rows(layout, kv_buffer);
    if (has_rotary()) {  // q at positions [0, L), k at [0, S); the views' memory is ours
      rotary_.apply(layout.q_view(layout.q_buffer(kv_buffer, workspace.q.data())));
      rotary_.apply(layout.k_view(kv_buffer));
    }
  }

  // forward_incremental's parts (attn/multihead/sequences.hpp).

  /// Pass 2 of forward_incremental: the new queries q (B, H, L, D) (a (B, L, E) buffer of
  /// T; rotated in place) turned by RoPE from positions[b] on, attended by
  /// attend(q, out) with q (B, H, L, D) and out (B, L, H, D) views in C (the
  /// queries widened exactly for 16-bit T), the output written into merged (B*L, E) of T.
  template <class Attend>
  void attend_new_tokens(const HeadsView<T>& q,                // (B, H, L, D)
                         const std::vector<Index>& positions,  // (B)
                         T* merged,                            // (B*L, E)
                         const Attend& attend) const;
  /// Both PagedKVCache overloads: x (tokens, E), its rows of sequences[b] being
  /// [cu_seqlens[b], cu_seqlens[b + 1]), into y (tokens, E).
  template <class S, class SV>
  void forward_paged(const char* function, const T* x, Index tokens, PagedKVCache<S, SV>& cache,
                     const std::vector<Index>& sequences, const std::vector<Index>& cu_seqlens,
                     const AttentionOptions<C>& attention, T* y) const;

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
    check_attention_options(function, options);
    check_masks(function, options, query.dimension(0), query.dimension(1), key.dimension(1),
                shapes);
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

  // PyTorch compatibility (attn/multihead/torch.hpp).

  /// Throws unless the MHA-polarity masks of `options` fit (B, L, S) (key_padding_mask
  /// (B, S); attn_mask and float_attn_mask (L, S) or (B*H, L, S)).
  template <class Shapes>
  void check_masks(const char* function, const MultiHeadForwardOptions<T>& options, Index batch,
                   Index q_length, Index k_length, const Shapes& shapes) const;
  /// Throws if options.attention sets what the module's masks say (keep_mask, bias, lengths),
  /// causal beside is_causal, a position-dependent option beside appended keys, or a
  /// dropout_p outside [0, 1).
  void check_attention_options(const char* function,
                               const MultiHeadForwardOptions<T>& options) const;
  template <class U, class Shapes>
  void check_attn_mask(const char* function, const char* name, const MaskArg<U>& m, Index batch,
                       Index q_length, Index k_length, const Shapes& shapes) const;
  /// Writes the appended key/value rows (bias_k / bias_v, then zeros) after the S projected
  /// rows of each sequence of the k | v buffer of `layout`.
  void fill_extra_rows(const detail::ProjectionLayout& layout, T* kv_buffer) const;
  /// Translates the MHA masks (true = ignore / not allowed) into AttentionOptions (keep-mask
  /// true = may attend, additive bias). Appended keys (j >= S) are never masked.
  void build_masks(const MultiHeadForwardOptions<T>& options, Index batch, Index q_length,
                   Index k_length, Index kv_length, MultiHeadWorkspace<T>& ws,
                   AttentionOptions<C>& attention, bool copy_masks) const;

  // Training (attn/multihead/training.hpp).

  /// The options of the attention's backward: the forward's masks (kept in its workspace),
  /// causal flag and dropout.
  static AttentionOptions<C> backward_attention_options(
      const MultiHeadAttentionContext<T>& context);
  /// in_proj's backward: grads.dquery (and dkey, dvalue) and in_grads from the attention's
  /// gradients d_qkv (and d_q) in `layout`.
  void in_projection_backward(const MultiHeadAttentionContext<T>& context,
                              const detail::ProjectionLayout& layout,
                              const Matrix<T>& d_qkv,  // (B*(L + extra), E + 2*Ekv) or k | v
                              const Matrix<T>& d_q,    // cross: (B*L, E); self: empty
                              MultiHeadAttentionGradients<T>& grads,
                              QKVProjectionGradients<T>& in_grads) const;
  void backward_impl(const MultiHeadAttentionContext<T>& context,
                     const Tensor<T, 3>& doutput,  // (B, L, E)
                     MultiHeadAttentionGradients<T>& grads) const;

  MultiHeadAttentionConfig config_;
  QKVProjection<T> in_proj_;   // fused (E, E + 2*Ekv) or separate Wq, Wk, Wv
  Linear<T> out_proj_;         // (E, E)
  Vector<T> bias_k_, bias_v_;  // (Ekv) with add_bias_kv
  RotaryEmbedding<C> rotary_;  // config_.rotary's table, or empty
};

}  // namespace attn
