// The loops of support/reference.hpp, compiled once for long double, double and float.
#include "support/reference.hpp"

namespace attn_test::reference {

template <class R>
Result<R> attention(const Problem& p, const std::vector<long double>& q,
                    const std::vector<long double>& k, const std::vector<long double>& v,
                    const Rounding<R>& rounding) {
  const auto round = [](const std::function<R(R)>& f, R x) { return f ? f(x) : x; };
  const auto real = [](long double x) { return static_cast<R>(x); };
  const R scale = static_cast<R>(p.scale_or_default());
  const R minus_inf = -std::numeric_limits<R>::infinity();
  const Index group = p.q_heads / p.kv_heads;
  Result<R> r;
  r.out.assign(static_cast<std::size_t>(p.batch * p.q_heads * p.q_length * p.value_dim), R(0));
  r.lse.assign(static_cast<std::size_t>(p.batch * p.q_heads * p.q_length), minus_inf);
  r.weights.assign(static_cast<std::size_t>(p.batch * p.q_heads * p.q_length * p.k_length), R(0));
  std::vector<R> s(static_cast<std::size_t>(p.k_length));
  std::vector<bool> seen(static_cast<std::size_t>(p.k_length));
  for (Index b = 0; b < p.batch; ++b) {
    for (Index h = 0; h < p.q_heads; ++h) {
      const Index kv = b * p.kv_heads + h / group;
      for (Index i = 0; i < p.q_length; ++i) {
        const Index row = (b * p.q_heads + h) * p.q_length + i;
        R m = minus_inf;
        bool any = false, nan = false;
        for (Index j = 0; j < p.k_length; ++j) {
          seen[static_cast<std::size_t>(j)] = p.visible(b, h, i, j);
          if (!seen[static_cast<std::size_t>(j)])
            continue;
          R dot = 0;
          for (Index d = 0; d < p.dim; ++d) {
            dot += real(q[static_cast<std::size_t>(row * p.dim + d)]) *
                   real(k[static_cast<std::size_t>((kv * p.k_length + j) * p.dim + d)]);
          }
          R x = round(rounding.scores, scale * dot);
          if (p.score_mod)
            x = static_cast<R>(p.score_mod(static_cast<long double>(x), b, h, i, j));
          if (p.softcap) {
            const R cap = static_cast<R>(*p.softcap);
            x = cap * std::tanh(x / cap);
          }
          if (!p.alibi_slopes.empty()) {
            const Index c = p.diagonal(b, i);
            const Index distance = c > j ? c - j : j - c;
            x -= static_cast<R>(p.alibi_slopes[static_cast<std::size_t>(h)]) *
                 static_cast<R>(distance);
          }
          if (!p.bias.empty())
            x += static_cast<R>(p.bias.at(b, h, i, j));
          s[static_cast<std::size_t>(j)] = x;
          any = true;
          nan = nan || std::isnan(x);
          if (x > m)
            m = x;
        }
        if (nan)
          m = std::numeric_limits<R>::quiet_NaN();
        const bool with_sink = !p.sinks.empty();
        const R sink = with_sink ? static_cast<R>(p.sinks[static_cast<std::size_t>(h)]) : R(0);
        if (!any || m == minus_inf) {  // sees no key: zeros, lse -inf (the sink with one)
          if (with_sink)
            r.lse[static_cast<std::size_t>(row)] = sink;
          continue;
        }
        if (with_sink && sink > m)
          m = sink;
        R sum = with_sink ? std::exp(sink - m) : R(0);
        for (Index j = 0; j < p.k_length; ++j) {
          if (seen[static_cast<std::size_t>(j)])
            sum += std::exp(s[static_cast<std::size_t>(j)] - m);
        }
        r.lse[static_cast<std::size_t>(row)] = m + std::log(sum);
        for (Index j = 0; j < p.k_length; ++j) {
          if (!seen[static_cast<std::size_t>(j)])
            continue;
          const R w =
              round(rounding.probabilities, std::exp(s[static_cast<std::size_t>(j)] - m) / sum) *
              static_cast<R>(p.dropout_factor(b, h, i, j));
          r.weights[static_cast<std::size_t>(row * p.k_length + j)] = w;
          for (Index e = 0; e < p.value_dim; ++e) {
            r.out[static_cast<std::size_t>(row * p.value_dim + e)] +=
                w * real(v[static_cast<std::size_t>((kv * p.k_length + j) * p.value_dim + e)]);
          }
        }
        if (rounding.out) {
          for (Index e = 0; e < p.value_dim; ++e) {
            R& o = r.out[static_cast<std::size_t>(row * p.value_dim + e)];
            o = rounding.out(o);
          }
        }
      }
    }
  }
  return r;
}

template Result<long double> attention<long double>(const Problem&, const std::vector<long double>&,
                                                    const std::vector<long double>&,
                                                    const std::vector<long double>&,
                                                    const Rounding<long double>&);
template Result<double> attention<double>(const Problem&, const std::vector<long double>&,
                                          const std::vector<long double>&,
                                          const std::vector<long double>&, const Rounding<double>&);
template Result<float> attention<float>(const Problem&, const std::vector<long double>&,
                                        const std::vector<long double>&,
                                        const std::vector<long double>&, const Rounding<float>&);

template <class R>
Gradients<R> gradients(const Problem& p, const std::vector<long double>& q,
                       const std::vector<long double>& k, const std::vector<long double>& v,
                       const std::vector<long double>& dout, const GradientRounding<R>& rounding) {
  const Result<R> forward = attention<R>(p, q, k, v);  // weights after dropout: p f
  Problem undropped = p;
  undropped.dropout_p = 0;
  const std::vector<R> probabilities =
      p.dropout_p == 0 ? forward.weights : attention<R>(undropped, q, k, v).weights;
  const auto real = [](long double x) { return static_cast<R>(x); };
  const auto at = [](Index n) { return static_cast<std::size_t>(n); };
  const R scale = static_cast<R>(p.scale_or_default());
  const Index group = p.q_heads / p.kv_heads;
  Gradients<R> g;
  g.dq.assign(q.size(), R(0));
  g.dk.assign(k.size(), R(0));
  g.dv.assign(v.size(), R(0));
  g.dbias.assign(at(p.batch * p.q_heads * p.q_length * p.k_length), R(0));
  g.dsinks.assign(p.sinks.size(), R(0));
  for (Index b = 0; b < p.batch; ++b) {
    for (Index h = 0; h < p.q_heads; ++h) {
      const Index kv = b * p.kv_heads + h / group;
      for (Index i = 0; i < p.q_length; ++i) {
        const Index row = (b * p.q_heads + h) * p.q_length + i;
        R delta = 0;
        for (Index e = 0; e < p.value_dim; ++e)
          delta += real(dout[at(row * p.value_dim + e)]) * forward.out[at(row * p.value_dim + e)];
        if (!p.sinks.empty()) {
          g.dsinks[at(h)] -=
              std::exp(static_cast<R>(p.sinks[at(h)]) - forward.lse[at(row)]) * delta;
        }
        for (Index j = 0; j < p.k_length; ++j) {
          if (!p.visible(b, h, i, j))
            continue;
          const Index key = kv * p.k_length + j;
          const R w = forward.weights[at(row * p.k_length + j)];
          const R probability = probabilities[at(row * p.k_length + j)];
          const R factor_of_dropout = static_cast<R>(p.dropout_factor(b, h, i, j));
          R dp = 0;
          for (Index e = 0; e < p.value_dim; ++e)
            dp += real(dout[at(row * p.value_dim + e)]) * real(v[at(key * p.value_dim + e)]);
          const R ds = probability * (factor_of_dropout * dp - delta);
          g.dbias[at(row * p.k_length + j)] = ds;
          R factor = 1;
          if (p.softcap) {
            R dot = 0;
            for (Index d = 0; d < p.dim; ++d)
              dot += real(q[at(row * p.dim + d)]) * real(k[at(key * p.dim + d)]);
            const R t = std::tanh(scale * dot / static_cast<R>(*p.softcap));
            factor = 1 - t * t;
          }
          R dscore = scale * ds * factor;
          if (rounding.score_gradients)
            dscore = rounding.score_gradients(dscore);
          const R weight = rounding.weights ? rounding.weights(w) : w;
          for (Index d = 0; d < p.dim; ++d) {
            g.dq[at(row * p.dim + d)] += dscore * real(k[at(key * p.dim + d)]);
            g.dk[at(key * p.dim + d)] += dscore * real(q[at(row * p.dim + d)]);
          }
          for (Index e = 0; e < p.value_dim; ++e)
            g.dv[at(key * p.value_dim + e)] += weight * real(dout[at(row * p.value_dim + e)]);
        }
      }
    }
  }
  return g;
}

template Gradients<long double> gradients<long double>(const Problem&,
                                                       const std::vector<long double>&,
                                                       const std::vector<long double>&,
                                                       const std::vector<long double>&,
                                                       const std::vector<long double>&,
                                                       const GradientRounding<long double>&);
template Gradients<double> gradients<double>(const Problem&, const std::vector<long double>&,
                                             const std::vector<long double>&,
                                             const std::vector<long double>&,
                                             const std::vector<long double>&,
                                             const GradientRounding<double>&);
template Gradients<float> gradients<float>(const Problem&, const std::vector<long double>&,
                                           const std::vector<long double>&,
                                           const std::vector<long double>&,
                                           const std::vector<long double>&,
                                           const GradientRounding<float>&);

}  // namespace attn_test::reference
