// examples/multihead.cpp: the QKV-projection tutorial with attn, then a full
// multi-head attention and a padded batch.
//
// Shapes (the tutorial's): batch B = 2, seq S = 10, hidden E = 768, H = 12 heads of
// D = 64; then the batched case B = 8, S = 512. Everything is float32, like the tutorial.
//
//   1. QKVProjection: Q, K, V = X @ Wq, X @ Wk, X @ Wv as ONE fused GEMM, (2, 10, 768) each.
//   2. Heads: zero-copy (B, H, S, D) views of the projection, and split_heads (a copy).
//   3. MultiHeadAttention on (2, 10, 768) and (8, 512, 768).
//   4. A padded batch: key_padding_mask (true = IGNORE, PyTorch MHA polarity). The padded
//      result of each sequence equals running it alone, unpadded.
//
// Pictures (attn/viz.hpp), written next to the executable or into DIR with `--out DIR`:
// multihead_heads.svg, the weights of step 3 as one heatmap per head, and
// multihead_padded.svg, the head-averaged weights of the shortest padded sequence of step 4
// with its padding keys hatched.
//
// Exits non-zero if a check fails.
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "attn/attn.hpp"
#include "attn/heads.hpp"
#include "attn/multihead.hpp"
#include "attn/projection.hpp"
#include "attn/viz.hpp"
#include "numpy_random.hpp"
#include "output_dir.hpp"

namespace {

using attn::Index;
using attn_examples::numpy_random;
using T = float;

std::string shape(std::initializer_list<Index> dims) {
  std::string s = "(";
  const char* sep = "";
  for (const Index d : dims) {
    s += sep + std::to_string(d);
    sep = ", ";
  }
  return s + ")";
}
template <int R>
std::string shape(const attn::Tensor<T, R>& t) {
  std::string s = "(";
  for (std::size_t i = 0; i < static_cast<std::size_t>(R); ++i) {
    s += (i != 0 ? ", " : "");
    s += std::to_string(t.dimension(i));
  }
  return s + ")";
}
std::string shape(const attn::HeadsView<const T>& v) {
  return shape({v.batch, v.heads, v.length, v.dim});
}

/// np.random.randn(rows, cols).astype(np.float32) * scale, from the tutorial's stream.
attn::Matrix<T> randn(numpy_random& rng, Index rows, Index cols, double scale = 1.0) {
  const attn::Matrix<double> m = rng.randn(rows, cols);
  return (m * scale).cast<T>();
}

attn::Tensor<T, 3> randn3(numpy_random& rng, Index b, Index s, Index e) {
  const attn::Matrix<double> m = rng.randn(b * s, e);
  attn::Tensor<T, 3> x(b, s, e);
  for (Index i = 0; i < x.size(); ++i)
    x.data()[i] = static_cast<T>(m.data()[i]);
  return x;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int run(const std::filesystem::path& out_dir) {
  bool ok = true;
  const Index batch = 2, seq = 10, hidden = 768, heads = 12, head_dim = hidden / heads;

  // --- 1. QKV projection ----------------------------------------------------------------
  std::cout << "== 1. QKV projection (the QKV-projection tutorial) ==\n";
  numpy_random rng(42);  // np.random.seed(42)
  // The tutorial's xavier_initialization: randn(fan_in, fan_out) * sqrt(2 / (fan_in + fan_out)).
  const double std_xavier = std::sqrt(2.0 / (hidden + hidden));
  const attn::Matrix<T> w_q = randn(rng, hidden, hidden, std_xavier);
  const attn::Matrix<T> w_k = randn(rng, hidden, hidden, std_xavier);
  const attn::Matrix<T> w_v = randn(rng, hidden, hidden, std_xavier);
  const attn::Tensor<T, 3> x = randn3(rng, batch, seq, hidden);

  // Our weights are (in x out) and applied as X @ W, as the tutorial's `X @ W_q` intends.
  // (Its einsum('bsd,hd->bsh', X, W_q) is X @ W_q.T; a PyTorch weight (out x in) goes through
  // Linear<T>::from_torch instead.)
  const attn::Vector<T> zeros = attn::Vector<T>::Zero(hidden);
  const attn::QKVProjection<T> separate(attn::Linear<T>(w_q, zeros), attn::Linear<T>(w_k, zeros),
                                        attn::Linear<T>(w_v, zeros));
  const attn::QKVProjection<T> fused = separate.fused_form();  // [Wq | Wk | Wv] (768, 2304)
  const attn::QKV<T> qkv = fused(x);                           // one GEMM (20 x 768) x (768 x 2304)
  std::cout << "input X shape: " << shape(x) << "\n"
            << "Q shape: " << shape({batch, seq, qkv.q().cols()}) << "\n"
            << "K shape: " << shape({batch, seq, qkv.k().cols()}) << "\n"
            << "V shape: " << shape({batch, seq, qkv.v().cols()}) << "\n"
            << "(one fused buffer " << shape({batch, seq, qkv.q().outerStride()})
            << "; Q, K, V are column blocks of it, no copy)\n";
  const attn::QKV<T> qkv_separate = separate(x);
  const double diff =
      (attn::Matrix<T>(qkv.q()) - attn::Matrix<T>(qkv_separate.q())).cwiseAbs().maxCoeff();
  std::cout << "fused vs separate projection, max |difference| of Q: " << diff << "\n";
  ok = ok && diff < 1e-5;

  // --- 2. heads -----------------------------------------------------------------------------
  std::cout << "\n== 2. multi-head split ==\n";
  const attn::HeadsView<const T> q_heads = qkv.q_heads(heads);  // strides only
  std::cout << "Q head view shape (batch, num_heads, seq_len, head_dim): " << shape(q_heads)
            << "  [zero-copy view of (B, S, H, D) memory]\n";
  attn::Tensor<T, 3> q3(batch, seq, hidden);
  attn::RowsMap<T>(q3.data(), batch * seq, hidden, Eigen::OuterStride<>(hidden)) = qkv.q();
  const attn::Tensor<T, 4> q_split = attn::split_heads(q3, heads);  // reshape + transpose
  std::cout << "split_heads(Q, 12) shape: " << shape(q_split) << "  [a copy]\n";
  // Mistake two of the tutorial: reshaping straight to (B, H, S, D) keeps the shape but
  // scrambles the heads.
  const std::array<Index, 4> bhsd{batch, heads, seq, head_dim};
  const attn::Tensor<T, 4> wrong = q3.reshape(bhsd);
  std::cout << "Q[0, head 1, token 0, 0]: reshape+transpose " << q_split(0, 1, 0, 0)
            << ", straight reshape " << wrong(0, 1, 0, 0) << " (wrong)\n";
  ok = ok && q_split(0, 1, 0, 0) == q_heads.head(0, 1)(0, 0);

  // --- 3. multi-head attention ------------------------------------------------------------
  std::cout << "\n== 3. MultiHeadAttention (E = 768, H = 12) ==\n";
  attn::MultiHeadAttentionConfig config;
  config.embed_dim = hidden;
  config.num_heads = heads;
  config.seed = 42;
  const attn::MultiHeadAttention<T> mha(config);
  attn::MultiHeadForwardOptions<T> with_weights;
  with_weights.need_weights = true;
  with_weights.average_attn_weights = false;
  const auto small = mha.forward(x, with_weights);
  std::cout << "batch 2, seq 10: output " << shape(small.output) << ", weights per head "
            << shape(small.weights) << "\n";
  {
    attn::HeatmapOptions picture;
    picture.title = "MultiHeadAttention weights per head (E = 768, H = 12, batch entry 0)";
    picture.cell_size = 34;
    const std::filesystem::path path = out_dir / "multihead_heads.svg";
    attn::write_attention_heads(path, small.weights, 0, picture);  // (B, H, L, S), b = 0
    std::cout << "wrote " << path.string() << ": one heatmap per head\n";
  }

  numpy_random rng_big(0);
  const attn::Tensor<T, 3> x_big = randn3(rng_big, 8, 512, hidden);
  const auto start = std::chrono::steady_clock::now();
  const auto big = mha.forward(x_big);
  const double elapsed = seconds_since(start);
  const double flops = 2.0 * 8 * 512 * hidden * (3.0 * hidden) +     // QKV GEMM
                       4.0 * 8 * heads * 512.0 * 512.0 * head_dim +  // q k^T and p v
                       2.0 * 8 * 512 * hidden * hidden;              // output projection
  std::cout << "batch 8, seq 512: input " << shape(x_big) << " -> output " << shape(big.output)
            << " in " << elapsed * 1e3 << " ms (" << flops / elapsed * 1e-9 << " GFLOP/s, "
            << attn::detail::max_threads() << " thread(s))\n";

  // --- 4. a padded batch --------------------------------------------------------------------
  std::cout << "\n== 4. padded batch with key_padding_mask (true = IGNORE) ==\n";
  const std::vector<Index> lengths{10, 7, 4};
  const Index padded = 10;
  numpy_random rng_pad(7);
  attn::Tensor<T, 3> xp = randn3(rng_pad, 3, padded, hidden);
  attn::Tensor<bool, 2> key_padding_mask(3, padded);
  for (Index b = 0; b < 3; ++b) {
    for (Index j = 0; j < padded; ++j) {
      const bool pad = j >= lengths[static_cast<std::size_t>(b)];
      key_padding_mask(b, j) = pad;  // PyTorch MHA polarity: true = this key is padding
      if (pad) {
        for (Index e = 0; e < hidden; ++e)
          xp(b, j, e) = T(1e3);  // garbage in the padding
      }
    }
  }
  attn::MultiHeadForwardOptions<T> padding;
  padding.key_padding_mask = key_padding_mask;
  padding.need_weights = true;  // averaged over heads: (B, L, S)
  const auto padded_out = mha.forward(xp, padding);
  for (Index b = 0; b < 3; ++b) {
    const Index n = lengths[static_cast<std::size_t>(b)];
    // The same sequence alone, without padding.
    attn::Tensor<T, 3> alone(1, n, hidden);
    for (Index s = 0; s < n; ++s) {
      for (Index e = 0; e < hidden; ++e)
        alone(0, s, e) = xp(b, s, e);
    }
    const auto ref = mha.forward(alone);
    double worst = 0, padded_weight = 0;
    for (Index s = 0; s < n; ++s) {
      for (Index e = 0; e < hidden; ++e) {
        worst = std::max(
            worst, static_cast<double>(std::abs(padded_out.output(b, s, e) - ref.output(0, s, e))));
      }
      for (Index j = n; j < padded; ++j) {
        padded_weight =
            std::max(padded_weight, static_cast<double>(padded_out.averaged_weights(b, s, j)));
      }
    }
    std::cout << "sequence " << b << ": length " << n << " of " << padded
              << ", max weight on padding " << padded_weight << ", max |padded - unpadded| output "
              << worst << "\n";
    ok = ok && worst < 1e-4 && padded_weight < 1e-30;
  }
  std::cout << "(key_padding_mask uses PyTorch MultiheadAttention's polarity, true = ignore;\n"
               " scaled_dot_product_attention's keep_mask is the opposite, true = attend.)\n";
  {
    // The shortest sequence's averaged weights (L, S) = (10, 10): keys >= 4 are padding.
    const Index b = 2, n = lengths[2];
    const Eigen::Map<const attn::Matrix<T>> weights(
        padded_out.averaged_weights.data() + b * padded * padded, padded, padded);
    attn::HeatmapOptions picture;
    picture.title = "Averaged weights, sequence 2: " + std::to_string(n) + " tokens + " +
                    std::to_string(padded - n) + " padding";
    picture.visible = attn::visibility_matrix(padded, padded, attn::Causal::none, {}, n);
    const std::filesystem::path path = out_dir / "multihead_padded.svg";
    attn::write_attention_heatmap(path, weights, picture);
    std::cout << "wrote " << path.string() << ": padding keys hatched, not drawn as 0.00\n";
  }

  std::cout << (ok ? "\nall checks passed\n" : "\nA CHECK FAILED\n");
  return ok ? EXIT_SUCCESS : EXIT_FAILURE;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(attn_examples::output_dir(argc, argv));
  } catch (const std::exception& e) {
    std::cerr << "multihead: " << e.what() << "\n";
    return EXIT_FAILURE;
  }
}
