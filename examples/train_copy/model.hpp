// examples/train_copy/model.hpp: a two-layer attention model trained from scratch to copy a
// sequence, with MultiHeadAttention's backward, a hand-written cross-entropy and Adam.
//
// The task: N symbols in [0, V), a separator (token V), the same N symbols again. The model
// reads the sequence without its last token and predicts every next token; the loss is the
// mean cross-entropy over the N predictions of the second copy (docs/training.md):
//
//   x = tok_emb[tokens] + pos_emb[t]                         (B, L, E), L = 2N
//   x = x + attention_l(x)   for each layer                   attn::MultiHeadAttention, causal
//   logits = x readout.weight^T + readout.bias                (B, L, V + 1)
//
// Parameters are kept in torch's names ("tok_emb.weight", "layers.0.in_proj_weight", ...,
// "readout.bias") and layouts, so that examples/train_copy/train_copy.py builds the same
// model in PyTorch. Both draw the initial weights and the batches from SplitMix64 in the
// order documented there; the test [train] compares the first losses.
#pragma once

#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <Eigen/Core>

#include <attn/multihead.hpp>
#include <attn/tensor.hpp>

namespace train_copy {

using attn::Index;
using T = double;  // float64, as the PyTorch twin, so that the losses agree to rounding
using Params = attn::StateDict<T>;
using RowMatrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatrixMap = Eigen::Map<RowMatrix>;
using ConstMatrixMap = Eigen::Map<const RowMatrix>;

struct Config {
  Index symbols = 16;  ///< V: token values [0, V); V is the separator
  Index length = 8;    ///< N: the sequence to copy
  Index embed_dim = 32;
  Index num_heads = 4;
  Index layers = 2;
  Index batch = 16;
  double lr = 0.01;  ///< Adam, PyTorch's update rule
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  std::uint64_t seed = 2026;
};

/// SplitMix64, the generator both sides share.
class SplitMix64 {
 public:
  explicit SplitMix64(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    state_ += 0x9E3779B97F4A7C15ULL;
    std::uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  /// Uniform in [-a, a): exact in double, as in the Python twin.
  double uniform(double a) {
    return a * (2.0 * static_cast<double>(next() >> 11) * 0x1.0p-53 - 1.0);
  }

 private:
  std::uint64_t state_;
};

inline attn::StateTensor<T> uniform_tensor(SplitMix64& rng, std::vector<Index> shape, double a) {
  Index n = 1;
  for (const Index d : shape)
    n *= d;
  attn::StateTensor<T> t{std::move(shape), std::vector<T>(static_cast<std::size_t>(n))};
  for (T& x : t.data)
    x = a == 0 ? 0.0 : rng.uniform(a);
  return t;
}

/// One batch (B, 2N + 1), row-major: a, separator, a.
inline std::vector<Index> make_batch(const Config& c, SplitMix64& rng) {
  const Index row = 2 * c.length + 1;
  std::vector<Index> tokens(static_cast<std::size_t>(c.batch * row));
  for (Index b = 0; b < c.batch; ++b) {
    Index* r = tokens.data() + b * row;
    for (Index i = 0; i < c.length; ++i)
      r[i] = static_cast<Index>(rng.next() % static_cast<std::uint64_t>(c.symbols));
    r[c.length] = c.symbols;
    for (Index i = 0; i < c.length; ++i)
      r[c.length + 1 + i] = r[i];
  }
  return tokens;
}

struct StepResult {
  double loss = 0;      ///< mean cross-entropy over the B * N predictions
  double accuracy = 0;  ///< share of those predictions whose argmax is right
  Params grads;         ///< keyed as Model::params
};

class Model {
 public:
  /// The initial weights, drawn from `rng` in the documented order.
  Model(const Config& config, SplitMix64& rng) : config_(config) {
    const Index v = config.symbols + 1, e = config.embed_dim, l = 2 * config.length;
    params_["tok_emb.weight"] = uniform_tensor(rng, {v, e}, 1.0);
    params_["pos_emb.weight"] = uniform_tensor(rng, {l, e}, 1.0);
    attn::MultiHeadAttentionConfig mc;
    mc.embed_dim = e;
    mc.num_heads = config.num_heads;
    for (Index i = 0; i < config.layers; ++i) {
      const std::string p = layer_prefix(i);
      params_[p + "in_proj_weight"] =
          uniform_tensor(rng, {3 * e, e}, std::sqrt(6.0 / static_cast<double>(4 * e)));
      params_[p + "in_proj_bias"] = uniform_tensor(rng, {3 * e}, 0.0);
      params_[p + "out_proj.weight"] =
          uniform_tensor(rng, {e, e}, 1.0 / std::sqrt(static_cast<double>(e)));
      params_[p + "out_proj.bias"] = uniform_tensor(rng, {e}, 0.0);
      layers_.emplace_back(mc);
    }
    params_["readout.weight"] =
        uniform_tensor(rng, {v, e}, 1.0 / std::sqrt(static_cast<double>(e)));
    params_["readout.bias"] = uniform_tensor(rng, {v}, 0.0);
    load_layers();
  }
  Model(const Model&) = delete;  // the layers' contexts refer to them by address
  Model& operator=(const Model&) = delete;

  const Config& config() const { return config_; }
  Params& params() { return params_; }
  /// Copies params() into the attention layers (after an optimiser step).
  void load_layers() {
    for (Index i = 0; i < config_.layers; ++i) {
      const std::string p = layer_prefix(i);
      Params sub;
      for (const auto& [name, t] : params_) {
        if (name.rfind(p, 0) == 0)
          sub[name.substr(p.size())] = t;
      }
      layers_[static_cast<std::size_t>(i)].load_state_dict(sub);
    }
  }

  /// Loss and accuracy of a batch (B, 2N + 1); with `gradients`, every parameter's too.
  StepResult run(const std::vector<Index>& tokens, bool gradients) const {
    const Index bsz = config_.batch, n = config_.length, l = 2 * n, e = config_.embed_dim;
    const Index v = config_.symbols + 1, row = l + 1, rows = bsz * l;
    const ConstMatrixMap tok = matrix("tok_emb.weight"), pos = matrix("pos_emb.weight");
    attn::Tensor<T, 3> x(bsz, l, e);  // (B, L, E)
    MatrixMap xr(x.data(), rows, e);
    for (Index b = 0; b < bsz; ++b) {
      for (Index t = 0; t < l; ++t)
        xr.row(b * l + t) = tok.row(tokens[static_cast<std::size_t>(b * row + t)]) + pos.row(t);
    }
    attn::MultiHeadForwardOptions<T> options;
    options.is_causal = true;
    std::vector<attn::MultiHeadAttentionContext<T>> contexts;
    for (const attn::MultiHeadAttention<T>& layer : layers_) {
      attn::MultiHeadAttentionTrainingOutput<T> out = layer.forward_train(x, options);
      x += out.output;  // residual
      contexts.push_back(std::move(out.context));
    }
    const ConstMatrixMap w = matrix("readout.weight");  // (V, E)
    const Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>> bias(
        params_.at("readout.bias").data.data(), v);
    const RowMatrix hidden = ConstMatrixMap(x.data(), rows, e);
    RowMatrix logits = hidden * w.transpose();  // (B*L, V)
    logits.rowwise() += bias;

    // Cross-entropy over the second copy's positions t in [N, 2N): target tokens[t + 1].
    StepResult result;
    RowMatrix dlogits = RowMatrix::Zero(rows, v);
    const double count = static_cast<double>(bsz * n);
    Index correct = 0;
    for (Index b = 0; b < bsz; ++b) {
      for (Index t = n; t < l; ++t) {
        const Index r = b * l + t;
        const Index target = tokens[static_cast<std::size_t>(b * row + t + 1)];
        Index best = 0;
        const double top = logits.row(r).maxCoeff(&best);
        const Eigen::Array<T, 1, Eigen::Dynamic> p = (logits.row(r).array() - top).exp();
        const double sum = p.sum();
        result.loss -= (logits(r, target) - top - std::log(sum)) / count;
        correct += best == target ? 1 : 0;
        dlogits.row(r) = (p / (sum * count)).matrix();
        dlogits(r, target) -= 1.0 / count;
      }
    }
    result.accuracy = static_cast<double>(correct) / count;
    if (!gradients)
      return result;

    Params& g = result.grads;
    const auto put = [&](const std::string& name, const RowMatrix& m) {
      g[name] = {params_.at(name).shape, std::vector<T>(m.data(), m.data() + m.size())};
    };
    put("readout.weight", dlogits.transpose() * hidden);
    put("readout.bias", dlogits.colwise().sum());
    attn::Tensor<T, 3> dx(bsz, l, e);
    MatrixMap(dx.data(), rows, e) = dlogits * w;
    for (Index i = config_.layers - 1; i >= 0; --i) {
      const attn::MultiHeadAttention<T>& layer = layers_[static_cast<std::size_t>(i)];
      attn::MultiHeadAttentionGradients<T> lg =
          layer.backward(contexts[static_cast<std::size_t>(i)], dx);
      dx += lg.dquery;  // the residual path plus the attention's
      for (auto& [name, t] : lg.parameters)
        g[layer_prefix(i) + name] = std::move(t);
    }
    RowMatrix dtok = RowMatrix::Zero(v, e), dpos = RowMatrix::Zero(l, e);
    const MatrixMap dxr(dx.data(), rows, e);
    for (Index b = 0; b < bsz; ++b) {
      for (Index t = 0; t < l; ++t) {
        dtok.row(tokens[static_cast<std::size_t>(b * row + t)]) += dxr.row(b * l + t);
        dpos.row(t) += dxr.row(b * l + t);
      }
    }
    put("tok_emb.weight", dtok);
    put("pos_emb.weight", dpos);
    return result;
  }

 private:
  static std::string layer_prefix(Index i) { return "layers." + std::to_string(i) + "."; }
  ConstMatrixMap matrix(const std::string& name) const {
    const attn::StateTensor<T>& t = params_.at(name);
    return ConstMatrixMap(t.data.data(), t.shape[0], t.shape[1]);
  }

  Config config_;
  Params params_;
  std::vector<attn::MultiHeadAttention<T>> layers_;
};

/// Adam with PyTorch's update rule (torch.optim.Adam, no weight decay):
///   m = b1 m + (1 - b1) g,  v = b2 v + (1 - b2) g^2,
///   p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
class Adam {
 public:
  explicit Adam(const Config& config) : config_(config) {}
  void step(Params& params, const Params& grads) {
    ++t_;
    const double c1 = 1.0 - std::pow(config_.beta1, static_cast<double>(t_));
    const double c2 = std::sqrt(1.0 - std::pow(config_.beta2, static_cast<double>(t_)));
    for (auto& [name, p] : params) {
      const std::vector<T>& g = grads.at(name).data;
      std::vector<T>& m = m_[name];
      std::vector<T>& v = v_[name];
      m.resize(g.size(), 0.0);
      v.resize(g.size(), 0.0);
      for (std::size_t i = 0; i < g.size(); ++i) {
        m[i] = config_.beta1 * m[i] + (1.0 - config_.beta1) * g[i];
        v[i] = config_.beta2 * v[i] + (1.0 - config_.beta2) * g[i] * g[i];
        p.data[i] -= config_.lr / c1 * m[i] / (std::sqrt(v[i]) / c2 + config_.eps);
      }
    }
  }

 private:
  Config config_;
  long t_ = 0;
  std::map<std::string, std::vector<T>> m_, v_;
};

}  // namespace train_copy
