// attn/multihead/arguments.hpp: what MultiHeadAttention (attn/multihead.hpp) takes and
// returns: its configuration, the forward's options (PyTorch MultiheadAttention's mask
// polarity, see attn/multihead.hpp), outputs, the training context and gradients, and the
// state dict.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "attn/config.hpp"
#include "attn/mask.hpp"
#include "attn/options.hpp"
#include "attn/precision.hpp"
#include "attn/rope.hpp"
#include "attn/tensor.hpp"

namespace attn {

/// Constructor arguments of torch.nn.MultiheadAttention, plus grouped-query attention.
struct MultiHeadAttentionConfig {
  Index embed_dim = 0;         ///< E
  Index num_heads = 1;         ///< H; must divide E
  Index num_kv_heads = 0;      ///< Hkv (grouped-query; 1 = multi-query); 0 means H
  Index kdim = 0;              ///< key input width; 0 means E
  Index vdim = 0;              ///< value input width; 0 means E
  bool bias = true;            ///< biases on the input and output projections
  bool add_bias_kv = false;    ///< append a learned key/value row (bias_k, bias_v) to k and v
  bool add_zero_attn = false;  ///< append a zero key/value row to k and v
  std::uint64_t seed = 0;      ///< seed of the default initialisation (std::mt19937_64)
  /// Rotary position embeddings on q and k (none by default: torch's module). Its dim is
  /// the head dim D = E / H (0 means D); rotary_dim, base, pairing, scaling as in RopeConfig.
  std::optional<RopeConfig> rotary;
};

/// A non-owning view of a rank-2 or rank-3 row-major tensor (a mask argument). The data
/// must outlive the call.
template <class T>
class MaskArg {
 public:
  MaskArg() = default;
  MaskArg(const T* data, std::vector<Index> shape) : data_(data), shape_(std::move(shape)) {}
  // NOLINTBEGIN(google-explicit-constructor): converting from a tensor is the intended use.
  MaskArg(const Tensor<T, 2>& t) : MaskArg(t.data(), {t.dimension(0), t.dimension(1)}) {}
  MaskArg(const Tensor<T, 3>& t)
      : MaskArg(t.data(), {t.dimension(0), t.dimension(1), t.dimension(2)}) {}
  // NOLINTEND(google-explicit-constructor)
  MaskArg(Tensor<T, 2>&&) = delete;  // a view of a temporary would dangle
  MaskArg(Tensor<T, 3>&&) = delete;

  bool empty() const { return data_ == nullptr; }
  const T* data() const { return data_; }
  const std::vector<Index>& shape() const { return shape_; }
  std::string shape_string() const { return detail::list_string(shape_); }

 private:
  const T* data_ = nullptr;
  std::vector<Index> shape_;
};

/// Everything about a forward call except the three inputs. See the MASK POLARITY note at
/// the top of attn/multihead.hpp: the bool masks here are true = IGNORE / NOT ALLOWED.
template <class T>
struct MultiHeadForwardOptions {
  MaskArg<bool> key_padding_mask;  ///< (B, S); TRUE = IGNORE the key (PyTorch MHA polarity)
  MaskArg<bool> attn_mask;         ///< (L, S) or (B*H, L, S); TRUE = NOT ALLOWED (PyTorch MHA)
  MaskArg<T> float_attn_mask;      ///< (L, S) or (B*H, L, S); added to the scores
  bool is_causal = false;          ///< top-left causal mask (query i sees keys j <= i)
  bool need_weights = false;       ///< also return the attention weights (torch's default is true)
  bool average_attn_weights = true;  ///< weights averaged over heads (B, L, S') or per head
  /// The attention's own options (attn/options.hpp), applied on top of the masks above:
  /// a window, sink tokens, ALiBi slopes, softcap, learned sinks, score_mod / mask_mod /
  /// block_mask, the scale, the kernel, and torch's `dropout` (applied whenever
  /// attention.dropout_p > 0: pass 0 for evaluation; attn/dropout.hpp's seeded rule, not
  /// torch's generator). causal (any alignment) replaces is_causal. Not keep_mask, bias,
  /// key_lengths or query_lengths: the module's masks say that (they are refused). With
  /// add_bias_kv or add_zero_attn the options that depend on key positions (causal, window,
  /// sink tokens, ALiBi, the mods) are refused: they would also see the appended keys.
  AttentionOptions<compute_scalar_t<T>> attention;
};

/// The result of a forward call.
template <class T>
struct MultiHeadAttentionOutput {
  Tensor<T, 3> output;            ///< (B, L, E)
  Tensor<T, 3> averaged_weights;  ///< need_weights && average_attn_weights: (B, L, S'),
                                  ///< the mean over heads (torch's default); else empty
  Tensor<T, 4> weights;           ///< need_weights && !average_attn_weights: (B, H, L, S')
                                  ///< per head; else empty
};

/// Scratch buffers of a forward call; reuse one across calls of the same shape to avoid
/// allocating (e.g. in a benchmark loop). Not shareable between concurrent calls.
template <class T>
struct MultiHeadWorkspace {
  Matrix<T> qkv;                        // fused self-attention: (B*(L + extra), E + 2*Ekv)
  Matrix<T> q;                          // otherwise: (B*L, E)
  Matrix<T> kv;                         // otherwise: (B*S', 2*Ekv)
  Matrix<T> attn;                       // (B*L, E) = (B, L, H, D): attention output, heads merged
  Tensor<bool, 4> keep;                 // combined keep-mask (SDPA polarity), when needed
  Tensor<compute_scalar_t<T>, 4> bias;  // padded (or widened) additive mask
  Tensor<compute_scalar_t<T>, 4> head_weights;  // (B, H, L, S'): for averaging, or 16-bit T
};

/// What MultiHeadAttention::backward needs from a forward_train call. Memory, with
/// S' = S + add_bias_kv + add_zero_attn: a copy of the inputs (B*L*E for self-attention;
/// B*(L*E + S*(kdim + vdim)) otherwise), the projections as the attention read them (after
/// the rotation): B*(L + extra)*(E + 2*Ekv) for self-attention, B*(L*E + S'*2*Ekv)
/// otherwise, the attention output before out_proj B*L*E, the log-sum-exp B*H*L in the
/// compute scalar, and the combined masks when there are masks (bool keep-mask up to
/// B*H*L*S', float mask up to B*H*L*S'). For self-attention at B*L tokens without masks
/// that is B*L*(3E + 2*Ekv) scalars plus B*H*L.
template <class T>
struct MultiHeadAttentionContext {
  const void* module = nullptr;     ///< the module whose forward_train filled it
  bool self_attention = false;      ///< query, key and value were one tensor (one gradient)
  Tensor<T, 3> query;               ///< (B, L, E), the forward's input
  Tensor<T, 3> key;                 ///< (B, S, kdim); empty for self-attention
  Tensor<T, 3> value;               ///< (B, S, vdim); empty for self-attention
  MultiHeadWorkspace<T> workspace;  ///< projections (qkv, or q and kv), attn, keep, bias
  Tensor<compute_scalar_t<T>, 3> logsumexp;  ///< (B, H, L) of the attention
  /// The attention's options as the forward used them, without the keep-mask and bias
  /// (those live in the workspace; the backward points at them again).
  AttentionOptions<compute_scalar_t<T>> attention;
  bool empty() const { return module == nullptr; }
};

/// The result of forward_train: the forward's output and what backward needs.
template <class T>
struct MultiHeadAttentionTrainingOutput {
  Tensor<T, 3> output;                   ///< (B, L, E), as forward() returns it
  MultiHeadAttentionContext<T> context;  ///< pass to backward() with dL/d output
};

/// One entry of a PyTorch-style state_dict: shape and row-major data.
template <class T>
struct StateTensor {
  std::vector<Index> shape;
  std::vector<T> data;
};

/// PyTorch state_dict layout: name -> tensor (see the weight layouts in attn/multihead.hpp).
template <class T>
using StateDict = std::map<std::string, StateTensor<T>>;

/// The gradients MultiHeadAttention::backward returns.
template <class T>
struct MultiHeadAttentionGradients {
  Tensor<T, 3> dquery;  ///< (B, L, E); self-attention: the sum of the q, k and v paths
  Tensor<T, 3> dkey;    ///< (B, S, kdim); empty for self-attention
  Tensor<T, 3> dvalue;  ///< (B, S, vdim); empty for self-attention
  /// The parameters' gradients keyed and shaped exactly as state_dict() (torch's .grad of
  /// each parameter): in_proj_weight or q/k/v_proj_weight, in_proj_bias, bias_k, bias_v,
  /// out_proj.weight, out_proj.bias, as the module has them.
  StateDict<T> parameters;
  /// (H) the gradient of options.attention.sinks when the forward had sinks; else empty.
  std::vector<compute_scalar_t<T>> dsinks;
};

}  // namespace attn
