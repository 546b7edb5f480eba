// examples/tiny_lm/model.hpp: the tiny language model of examples/tiny_lm/train.py, in C++.
//
// A decoder-only transformer over bytes (docs/tiny_lm.md):
//
//   x = embed[tokens]                                        (L, E)
//   per layer:  x += attention(rms_norm(x) * attn_norm)       attn::MultiHeadAttention with
//                                                             config.rotary (RoPE on q and
//                                                             k), grouped-query heads, causal
//               n = rms_norm(x) * mlp_norm
//               x += down(silu(gate(n)) * up(n))              gated SiLU MLP
//   logits = (rms_norm(x) * norm) lm_head^T                   (L, V)
//
// rms_norm(x) = x / sqrt(mean(x^2) + eps), no biases anywhere. The attention comes from the
// library (the projections, RoPE, the causal kernels and the KV cache), and so do the MLP's
// and the output head's products (attn::Linear); the rest is written out here on Eigen.
// Every step is row by row or a product on attn's GEMM, whose outputs are each one FMA
// chain in a fixed order whatever the number of rows (AVX2 and AVX-512; attn/kernels/gemm.hpp):
// a token's logits do not depend on the other tokens of the call, which is what lets a
// server batch sequences (examples/tiny_lm/serving.hpp) and get the tokens each gets alone.
// Weights are read from the safetensors file the training script writes: the
// hyper-parameters from its __metadata__, each layer's attention by attn::load_safetensors
// under "layers.<i>.attn.".
#pragma once

#include <cmath>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <Eigen/Core>

#include <attn/kv_cache.hpp>
#include <attn/multihead.hpp>
#include <attn/projection.hpp>
#include <attn/rope.hpp>
#include <attn/safetensors_multihead.hpp>
#include <attn/tensor.hpp>

namespace tiny_lm {

using attn::Index;
using Matrix = attn::Matrix<float>;  // row-major
using Vector = attn::Vector<float>;

/// The hyper-parameters, as the training script writes them into __metadata__.
struct Config {
  Index vocab_size = 0, embed_dim = 0, layers = 0, heads = 0, kv_heads = 0, hidden_dim = 0;
  Index max_positions = 0;
  double rope_base = 0, norm_eps = 0;

  Index head_dim() const { return embed_dim / heads; }

  static Config from_metadata(const std::map<std::string, std::string>& metadata) {
    const auto get = [&](const std::string& key) -> const std::string& {
      const auto it = metadata.find(key);
      if (it == metadata.end())
        throw std::invalid_argument("tiny_lm::Config: the file's metadata has no \"" + key + "\"");
      return it->second;
    };
    const auto integer = [&](const std::string& key) {
      const std::string& s = get(key);
      std::size_t used = 0;
      const long long v = std::stoll(s, &used);
      if (used != s.size() || v < 1)
        throw std::invalid_argument("tiny_lm::Config: metadata \"" + key + "\" is \"" + s +
                                    "\": it must be a positive integer");
      return static_cast<Index>(v);
    };
    const auto real = [&](const std::string& key) {
      const std::string& s = get(key);
      std::size_t used = 0;
      const double v = std::stod(s, &used);
      if (used != s.size() || !(v > 0) || !std::isfinite(v))
        throw std::invalid_argument("tiny_lm::Config: metadata \"" + key + "\" is \"" + s +
                                    "\": it must be a positive number");
      return v;
    };
    Config c;
    c.vocab_size = integer("vocab_size");
    c.embed_dim = integer("embed_dim");
    c.layers = integer("layers");
    c.heads = integer("heads");
    c.kv_heads = integer("kv_heads");
    c.hidden_dim = integer("hidden_dim");
    c.max_positions = integer("max_positions");
    c.rope_base = real("rope_base");
    c.norm_eps = real("norm_eps");
    if (get("rope_pairing") != "half_split")
      throw std::invalid_argument("tiny_lm::Config: rope_pairing is \"" + get("rope_pairing") +
                                  "\" but the model is trained with half_split");
    return c;
  }
};

/// The weights and the forward passes. Thread-compatible: const calls may run concurrently,
/// each with its own State.
class Model {
 public:
  /// The per-sequence decoding state: one KV cache per layer (RoPE-rotated keys, and
  /// values), its keys stored as SK and its values as SV (any KVCache format: float, half,
  /// bfloat16, attn::BlockQ8_0, attn::BlockQ4_0).
  template <class SK = float, class SV = SK>
  struct CacheState {
    std::vector<attn::KVCache<SK, SV>> caches;
    Index length() const { return caches.empty() ? 0 : caches.front().lengths().front(); }
  };
  using State = CacheState<float>;

  explicit Model(const attn::SafetensorsFile& file)
      : config_(Config::from_metadata(file.metadata())) {
    const Config& c = config_;
    embed_ = matrix(file, "embed.weight", c.vocab_size, c.embed_dim);
    lm_head_ = linear(file, "lm_head.weight", c.vocab_size, c.embed_dim);
    norm_ = vector(file, "norm.weight", c.embed_dim);
    attn::MultiHeadAttentionConfig mc;
    mc.embed_dim = c.embed_dim;
    mc.num_heads = c.heads;
    mc.num_kv_heads = c.kv_heads;
    mc.bias = false;
    attn::RopeConfig rope;
    rope.base = c.rope_base;
    rope.pairing = attn::RopePairing::half_split;
    rope.max_positions = c.max_positions;
    mc.rotary = rope;
    for (Index i = 0; i < c.layers; ++i) {
      const std::string p = "layers." + std::to_string(i) + ".";
      Layer layer{attn::MultiHeadAttention<float>(mc),
                  vector(file, p + "attn_norm.weight", c.embed_dim),
                  vector(file, p + "mlp_norm.weight", c.embed_dim),
                  linear(file, p + "mlp.gate.weight", c.hidden_dim, c.embed_dim),
                  linear(file, p + "mlp.up.weight", c.hidden_dim, c.embed_dim),
                  linear(file, p + "mlp.down.weight", c.embed_dim, c.hidden_dim)};
      attn::load_safetensors(layer.attention, file, p + "attn.");
      layers_.push_back(std::move(layer));
    }
  }

  const Config& config() const { return config_; }
  /// The number of weights.
  Index parameters() const {
    Index n = embed_.size() + lm_head_.weight().size() + norm_.size();
    for (const Layer& l : layers_) {
      n += l.attention.in_proj().fused_weight().size() + l.attention.out_proj().weight().size() +
           l.attn_norm.size() + l.mlp_norm.size() + l.gate.weight().size() + l.up.weight().size() +
           l.down.weight().size();
    }
    return n;
  }

  /// The whole sequence at once, no cache: tokens (L) -> logits (L, V), causal.
  Matrix forward(const std::vector<int>& tokens) const {
    check_tokens("tiny_lm::Model::forward", tokens, 0);
    attn::MultiHeadForwardOptions<float> causal;
    causal.is_causal = true;
    return run(tokens, [&](std::size_t, const Attention& attention, const Matrix& n) {
      return attention.forward(as_batch(n), causal).output;  // (1, L, E)
    });
  }

  /// The model over `tokens` (n) with `attention(i, module, x)` standing for layer i's
  /// attention: given the layer's module and its normalised input x (n, E), it returns the
  /// attention's output, n rows of E values (a tensor (1, n, E) or (n, E)). forward, step
  /// and the paged step of examples/tiny_lm/serving.hpp differ only there. -> logits (n, V).
  template <class AttentionFn>
  Matrix run(const std::vector<int>& tokens, const AttentionFn& attention) const {
    const auto length = static_cast<Index>(tokens.size());
    Matrix x = embed(tokens);
    for (std::size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      const auto a = attention(i, layer.attention, rms_norm(x, layer.attn_norm));
      x += Eigen::Map<const Matrix>(a.data(), length, config_.embed_dim);
      mlp(layer, x);
    }
    return logits(x);
  }

  /// An empty state with room for `capacity` tokens (it grows beyond, up to max_positions),
  /// its caches in the formats SK (keys) and SV (values), optionally Hadamard-rotated
  /// (docs/quantized-cache.md).
  template <class SK = float, class SV = SK>
  CacheState<SK, SV> new_state(Index capacity = 0,
                               attn::KVRotation rotation = attn::KVRotation::none) const {
    CacheState<SK, SV> s;
    for (Index i = 0; i < config_.layers; ++i) {
      s.caches.emplace_back(1, config_.kv_heads, config_.head_dim(), config_.head_dim(), capacity,
                            true, rotation);
    }
    return s;
  }

  /// Appends `tokens` (n) to the sequence of `state` (a prompt, or one token per decode step)
  /// and returns their logits (n, V): token t sees the cached tokens and tokens[0..t].
  template <class SK, class SV>
  Matrix step(CacheState<SK, SV>& state, const std::vector<int>& tokens) const {
    check_tokens("tiny_lm::Model::step", tokens, state.length());
    if (static_cast<Index>(state.caches.size()) != config_.layers)
      throw std::invalid_argument(
          "tiny_lm::Model::step: the state is not this model's "
          "(make it with new_state)");
    return run(tokens, [&](std::size_t i, const Attention& attention, const Matrix& n) {
      return attention.forward_incremental(as_batch(n), state.caches[i]);  // (1, n, E)
    });
  }

  /// Greedy decoding: the prompt in one step, then `steps` tokens, each the argmax of the
  /// previous logits (the lowest index on a tie), fed back one at a time.
  std::vector<int> generate(const std::vector<int>& prompt, Index steps) const {
    State state = new_state(static_cast<Index>(prompt.size()) + steps);
    Matrix last = step(state, prompt);
    std::vector<int> out;
    for (Index s = 0; s < steps; ++s) {
      const int next = argmax(last.row(last.rows() - 1));
      out.push_back(next);
      if (s + 1 < steps)
        last = step(state, {next});
    }
    return out;
  }

  /// Throws unless every token is in the vocabulary and `held` + their number fits
  /// max_positions; `function` names the caller.
  void check_tokens(const char* function, const std::vector<int>& tokens, Index held) const {
    for (std::size_t t = 0; t < tokens.size(); ++t) {
      if (tokens[t] < 0 || tokens[t] >= config_.vocab_size) {
        throw std::invalid_argument(std::string(function) + ": tokens[" + std::to_string(t) +
                                    "] is " + std::to_string(tokens[t]) +
                                    ": the vocabulary is [0, " +
                                    std::to_string(config_.vocab_size) + ")");
      }
    }
    if (held + static_cast<Index>(tokens.size()) > config_.max_positions) {
      throw std::invalid_argument(std::string(function) + ": " + std::to_string(held) + " + " +
                                  std::to_string(tokens.size()) +
                                  " tokens exceed the model's max_positions " +
                                  std::to_string(config_.max_positions));
    }
  }

  template <class Row>
  static int argmax(const Row& row) {
    Index best = 0;
    for (Index j = 1; j < row.size(); ++j) {
      if (row(j) > row(best))
        best = j;
    }
    return static_cast<int>(best);
  }

 private:
  using Attention = attn::MultiHeadAttention<float>;
  using Linear = attn::Linear<float>;

  struct Layer {
    Attention attention;         // in_proj (E + 2 Ekv, E), out_proj (E, E), RoPE
    Vector attn_norm, mlp_norm;  // (E)
    Linear gate, up, down;       // (E, F), (E, F), (F, E): attn's (in, out)
  };

  static Matrix matrix(const attn::SafetensorsFile& file, const std::string& name, Index rows,
                       Index cols) {
    const attn::Tensor<float, 2> t = file.read<float, 2>(name);
    if (t.dimension(0) != rows || t.dimension(1) != cols) {
      throw std::invalid_argument("tiny_lm::Model: tensor \"" + name + "\" is " +
                                  attn::detail::shape_string({t.dimension(0), t.dimension(1)}) +
                                  " but the metadata make it " +
                                  attn::detail::shape_string({rows, cols}));
    }
    return Eigen::Map<const Matrix>(t.data(), rows, cols);
  }

  /// A bias-free layer from torch's (out, in) weight.
  static Linear linear(const attn::SafetensorsFile& file, const std::string& name, Index out,
                       Index in) {
    return Linear::from_torch(matrix(file, name, out, in));
  }

  static Vector vector(const attn::SafetensorsFile& file, const std::string& name, Index size) {
    const attn::Tensor<float, 1> t = file.read<float, 1>(name);
    if (t.dimension(0) != size) {
      throw std::invalid_argument("tiny_lm::Model: tensor \"" + name + "\" is " +
                                  attn::detail::shape_string({t.dimension(0)}) +
                                  " but the metadata make it " +
                                  attn::detail::shape_string({size}));
    }
    return Eigen::Map<const Vector>(t.data(), size);
  }

  Matrix embed(const std::vector<int>& tokens) const {  // -> (L, E)
    Matrix x(static_cast<Index>(tokens.size()), config_.embed_dim);
    for (std::size_t t = 0; t < tokens.size(); ++t)
      x.row(static_cast<Index>(t)) = embed_.row(tokens[t]);
    return x;
  }

  Matrix rms_norm(const Matrix& x, const Vector& weight) const {  // (L, E) -> (L, E)
    Matrix out(x.rows(), x.cols());
    for (Index r = 0; r < x.rows(); ++r) {
      const double mean_square =
          static_cast<double>(x.row(r).squaredNorm()) / static_cast<double>(x.cols());
      const auto inv = static_cast<float>(1.0 / std::sqrt(mean_square + config_.norm_eps));
      out.row(r) = (x.row(r) * inv).cwiseProduct(weight.transpose());
    }
    return out;
  }

  static attn::Tensor<float, 3> as_batch(const Matrix& x) {  // (L, E) -> (1, L, E)
    attn::Tensor<float, 3> t(1, x.rows(), x.cols());
    Eigen::Map<Matrix>(t.data(), x.rows(), x.cols()) = x;
    return t;
  }

  void mlp(const Layer& layer, Matrix& x) const {  // x (L, E) += down(silu(gate n) * up n)
    const Matrix n = rms_norm(x, layer.mlp_norm);
    const Matrix g = layer.gate(n);  // (L, F)
    const Matrix u = layer.up(n);
    const Matrix h = g.unaryExpr([](float v) { return v / (1.0f + std::exp(-v)); }).cwiseProduct(u);
    x += layer.down(h);
  }

  Matrix logits(const Matrix& x) const {  // (L, E) -> (L, V)
    return lm_head_(rms_norm(x, norm_));
  }

  Config config_;
  Matrix embed_;    // (V, E)
  Linear lm_head_;  // (E, V)
  Vector norm_;     // (E)
  std::vector<Layer> layers_;
};

}  // namespace tiny_lm
