// examples/walkthrough.cpp: the NumPy self-attention tutorial, step by step with attn.
//
// The tutorial draws np.random.seed(42); X = randn(3, 4); Wq, Wk, Wv = randn(4, 3) (in
// that order), then computes Q, K, V, the scores Q K^T, scales them by 1/sqrt(d_k), takes
// a row softmax and multiplies by V; it then masks with `scores - 1e9 * (1 - mask)`. We
// replay every stage in double (the tutorial is float64) with the same random numbers,
// check the library's one-call API against the step-by-step result, and then show
// numerically what the tutorial gets wrong, and what float16 storage costs.
//
// Shapes: L = 3 tokens, E = d_model = 4, D = d_k = 3, Dv = d_v = 3.
//
// It writes the tutorial's seaborn heatmap as SVG (attn/viz.hpp) next to the executable, or
// into DIR with `--out DIR`: attention_weights.svg (step 5) and attention_weights_causal.svg
// (step 8, hidden keys hatched).
//
// Exits non-zero if the random numbers are not NumPy's or the one-call API and the
// step-by-step computation disagree.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <random>
#include <string>

#include <Eigen/Core>

#include "attn/attn.hpp"
#include "attn/viz.hpp"
#include "numpy_random.hpp"
#include "output_dir.hpp"

namespace {

using attn::Index;
using Mat = attn::Matrix<double>;

void heading(const std::string& title) {
  std::cout << "\n== " << title << " ==\n";
}

void print(const std::string& name, const Mat& m) {
  std::cout << name << "  (" << m.rows() << " x " << m.cols() << ")\n";
  for (Index r = 0; r < m.rows(); ++r) {
    std::cout << "  [";
    for (Index c = 0; c < m.cols(); ++c) {
      std::cout << std::setw(11) << m(r, c);
    }
    std::cout << " ]\n";
  }
}

// Largest |a - b| over all entries; both (R, C).
double max_abs_diff(const Mat& a, const Mat& b) {
  return (a - b).cwiseAbs().maxCoeff();
}

// phi(x) = elu(x) + 1 = x + 1 for x > 0, exp(x) otherwise: a positive feature map.
Mat elu_plus_one(const Mat& x) {
  return x.unaryExpr([](double v) { return v > 0.0 ? v + 1.0 : std::exp(v); });
}

// Writes weights (L, L) as the tutorial's heatmap (Token1..TokenL, Key on x, Query on y).
void write_heatmap(const std::filesystem::path& path, const Mat& weights, const std::string& title,
                   const attn::Matrix<bool>& visible) {
  attn::HeatmapOptions options;
  options.title = title;
  for (Index i = 0; i < weights.rows(); ++i)
    options.query_labels.push_back("Token" + std::to_string(i + 1));
  options.key_labels = options.query_labels;
  options.visible = visible;  // empty: every cell visible
  attn::write_attention_heatmap(path, weights, options);
  std::cout << "wrote " << path.string() << "\n";
}

// The walkthrough; pictures go to out_dir. Returns false if a check failed.
bool run(const std::filesystem::path& out_dir) {
  std::cout << std::fixed << std::setprecision(6);
  bool ok = true;

  // ---------------------------------------------------------------------------------
  heading("0. Random numbers: np.random.seed(42)");
  constexpr std::uint32_t seed = 42;
  attn_examples::numpy_random rng(seed);
  const Mat X = rng.randn(3, 4);   // (L, E)   the 3 token embeddings
  const Mat Wq = rng.randn(4, 3);  // (E, D)   drawn after X, then Wk, then Wv,
  const Mat Wk = rng.randn(4, 3);  // (E, D)   exactly as the tutorial does
  const Mat Wv = rng.randn(4, 3);  // (E, Dv)
  // NumPy prints np.random.seed(42); np.random.randn(48)[[0, 47]] as these two values;
  // the whole stream is checked against NumPy in tests/test_walkthrough.cpp.
  const bool same_as_numpy = X(0, 0) == 0.4967141530112327 && Wv(3, 2) == 1.0571222262189157;
  std::cout << "seed " << seed << ": attn_examples::numpy_random replays NumPy's legacy\n"
            << "MT19937 + polar-method stream, so X, Wq, Wk, Wv below are the very numbers\n"
            << "np.random.seed(42); np.random.randn(...) gives the tutorial (first and last\n"
            << "draw match NumPy bit for bit: " << (same_as_numpy ? "yes" : "NO") << ").\n";
  ok = ok && same_as_numpy;

  heading("1. Input X and the projection weights");
  print("X", X);
  print("Wq", Wq);
  print("Wk", Wk);
  print("Wv", Wv);

  heading("2. Queries, keys, values: Q = X Wq, K = X Wk, V = X Wv");
  // Our weights are (in, out) and applied as X W, like the tutorial (PyTorch stores W^T).
  const Mat Q = X * Wq;  // (L, D)
  const Mat K = X * Wk;  // (L, D)   Q and K must share D: they are dotted together
  const Mat V = X * Wv;  // (L, Dv)
  print("Q", Q);
  print("K", K);
  print("V", V);

  heading("3. Raw scores Q K^T");
  const Mat scores = Q * K.transpose();  // (L, L)  scores(i, j) = q_i . k_j
  print("scores", scores);

  heading("4. Scaled scores Q K^T / sqrt(d_k)");
  // Without the scale, the dot products grow like sqrt(d_k) and the softmax saturates.
  const double scale = 1.0 / std::sqrt(static_cast<double>(Q.cols()));
  const Mat scaled = scale * scores;  // (L, L)
  std::cout << "scale = 1/sqrt(" << Q.cols() << ") = " << scale << "\n";
  print("scaled scores", scaled);

  heading("5. Attention weights: attn::softmax_rows(scaled scores)");
  const Mat weights = attn::softmax_rows(scaled);  // (L, L)  row i: how much query i reads key j
  print("weights", weights);
  const Eigen::VectorXd row_sums = weights.rowwise().sum();  // (L)
  for (Index i = 0; i < row_sums.size(); ++i) {
    std::cout << "  row " << i << " sums to " << row_sums(i) << "\n";
  }
  // The tutorial draws a seaborn heatmap here; a text one says the same.
  std::cout << "heatmap (rows = queries, columns = keys; darker = more weight):\n";
  const std::string shades = " .:-=+*#%@";
  for (Index i = 0; i < weights.rows(); ++i) {
    std::cout << "  token " << i + 1 << " |";
    for (Index j = 0; j < weights.cols(); ++j) {
      const auto level = static_cast<std::string::size_type>(std::lround(weights(i, j) * 9.0));
      std::cout << ' ' << std::string(3, shades[level]);
    }
    std::cout << " |\n";
  }

  // ... and attn::write_attention_heatmap draws the tutorial's picture itself.
  write_heatmap(out_dir / "attention_weights.svg", weights, "Attention weights", {});

  heading("6. Output = weights V");
  const Mat output = weights * V;  // (L, Dv)  row i: a weighted average of the rows of V
  print("output", output);

  // ---------------------------------------------------------------------------------
  heading("7. Causal mask (top-left: query i sees keys j <= i)");
  // The library's description of the mask, for one head: (B, H, Lq, Lk) = (1, 1, 3, 3).
  attn::VisibilityOptions top_left;
  top_left.causal = attn::Causal::top_left;
  const attn::Mask causal("walkthrough", 1, 1, 3, 3, top_left);
  std::cout << "visible keys (1 = may attend), the tutorial's np.tril(np.ones((3, 3))):\n";
  for (Index i = 0; i < 3; ++i) {
    std::cout << "  [";
    for (Index j = 0; j < 3; ++j) {
      std::cout << ' ' << (causal.visible(0, 0, i, j) ? 1 : 0);
    }
    std::cout << " ]\n";
  }
  // Step by step: hidden keys become -inf (not -1e9), so softmax gives them exactly 0.
  Mat causal_scores = scaled;              // (L, L)
  causal.hide(0, 0, 0, 0, causal_scores);  // hidden -> -inf
  print("masked scaled scores", causal_scores);
  const Mat causal_weights = attn::softmax_rows(causal_scores);  // (L, L)
  const Mat causal_output = causal_weights * V;                  // (L, Dv)
  print("causal weights (step by step)", causal_weights);
  print("causal output (step by step)", causal_output);

  heading("8. The same through the one-call API");
  // attn::scaled_dot_product_attention(Q, K, V, options, attn::Return::weights): the scale
  // defaults to 1/sqrt(D); the result holds out (Lq, Dv) and the (Lq, Lk) softmax.
  attn::AttentionOptions<double> options;
  const auto api = attn::scaled_dot_product_attention(Q, K, V, options, attn::Return::weights);
  const Mat& api_output = api.out;       // (L, Dv)
  const Mat& api_weights = api.weights;  // (L, L)
  options.causal = attn::Causal::top_left;
  const auto causal_api =
      attn::scaled_dot_product_attention(Q, K, V, options, attn::Return::weights);
  const Mat& api_causal_output = causal_api.out;       // (L, Dv)
  const Mat& api_causal_weights = causal_api.weights;  // (L, L)
  print("causal weights (one call)", api_causal_weights);
  print("causal output (one call)", api_causal_output);
  // The heatmap of the causal weights: hidden keys are drawn hatched and empty, not as 0.00.
  write_heatmap(out_dir / "attention_weights_causal.svg", api_causal_weights,
                "Causal attention weights (top-left)",
                attn::visibility_matrix(3, 3, attn::Causal::top_left));
  const double differences[] = {max_abs_diff(api_weights, weights),
                                max_abs_diff(api_output, output),
                                max_abs_diff(api_causal_weights, causal_weights),
                                max_abs_diff(api_causal_output, causal_output)};
  const char* const what[] = {"weights", "output", "causal weights", "causal output"};
  std::cout << std::scientific << std::setprecision(2);
  for (int n = 0; n < 4; ++n) {
    const bool agrees = differences[n] <= 1e-12;
    std::cout << "  max |one call - step by step|, " << what[n] << ": " << differences[n]
              << (agrees ? "" : "  > 1e-12: MISMATCH") << "\n";
    ok = ok && agrees;
  }
  std::cout << std::fixed << std::setprecision(6);

  // ---------------------------------------------------------------------------------
  heading("9. What the tutorial gets wrong");

  std::cout << "\n(a) A query that may see no key at all (row 0 fully masked)\n";
  // The tutorial's 1/0 mask with row 0 all zero, applied its way: scores - 1e9 * (1 - mask).
  Mat mask01 = Mat::Ones(3, 3);  // (L, L)
  mask01.row(0).setZero();
  const Mat tutorial_scores = scaled - 1e9 * (Mat::Ones(3, 3) - mask01);  // (L, L)
  const Mat tutorial_weights = attn::softmax_rows(tutorial_scores);       // (L, L)
  // In float32, -1e9 swallows the scores (the spacing of floats near 1e9 is 64).
  const attn::Matrix<float> ones_f = attn::Matrix<float>::Ones(3, 3);  // (L, L)
  const attn::Matrix<float> tutorial_scores_f =
      scaled.cast<float>() - 1e9F * (ones_f - mask01.cast<float>());
  const attn::Matrix<float> tutorial_weights_f = attn::softmax_rows(tutorial_scores_f);
  std::cout
      << "tutorial, float64, row 0: " << tutorial_weights.row(0)
      << "\n  = the UNMASKED weights of row 0 (max difference " << std::scientific
      << std::setprecision(1) << max_abs_diff(tutorial_weights.topRows(1), weights.topRows(1))
      << std::fixed << std::setprecision(6)
      << "): softmax ignores a shift\n    shared by the whole row, so the mask does nothing\n";
  std::cout << "tutorial, float32, row 0: " << tutorial_weights_f.row(0)
            << "\n  = uniform 1/3: every score rounds to -1e9, so all keys look alike\n";
  // The library: a boolean keep-mask (true = may attend), row 0 all false.
  attn::Matrix<bool> keep(3, 3);  // (L, L)
  keep.setConstant(true);
  keep.row(0).setConstant(false);
  attn::AttentionOptions<double> masked_options;
  masked_options.keep_mask = keep;  // a view: `keep` must outlive the call
  const auto masked =
      attn::scaled_dot_product_attention(Q, K, V, masked_options, attn::Return::weights);
  const Mat& masked_weights = masked.weights;  // (L, L)
  const Mat& masked_output = masked.out;       // (L, Dv)
  std::cout << "attn, row 0 weights: " << masked_weights.row(0)
            << "\nattn, row 0 output:  " << masked_output.row(0)
            << "\n  = zeros: a query that sees nothing attends to nothing (FlashAttention's\n"
            << "    convention), instead of averaging keys it was told to ignore\n";

  std::cout << "\n(b) -1e9 in float16\n";
  // float16's largest finite value is 65504, so -1e9 is not representable.
  const Eigen::half minus_1e9(-1e9);
  const Eigen::half one(1.0F);
  const Eigen::half visible_penalty = Eigen::half(1e9) * (one - one);  // 1e9 * (1 - mask), mask = 1
  const auto show = [](Eigen::half h) {  // "nan" rather than the C library's "-nan"
    return std::isnan(static_cast<float>(h)) ? std::string("nan")
                                             : std::to_string(static_cast<float>(h));
  };
  std::cout << "largest float16:                    "
            << show(Eigen::NumTraits<Eigen::half>::highest())
            << "\nEigen::half(-1e9):                  " << show(minus_1e9)
            << "\nfloat16 1e9 * (1 - 1), visible key: " << show(visible_penalty)
            << "\n  so in float16 arithmetic `scores - 1e9 * (1 - mask)` turns every VISIBLE\n"
            << "  score into NaN (inf * 0) and the whole softmax into NaN. (NumPy 1.x hides it\n"
            << "  by promoting the float16 scores to float32; PyTorch's masked_fill(-1e9) on a\n"
            << "  half tensor raises an overflow error.) attn never uses a finite stand-in: a\n"
            << "  hidden key is set to -inf or skipped, which gives it weight exactly 0 in\n"
            << "  every precision, and a row with no visible key is defined to be zero.\n";

  std::cout << "\n(c) The tutorial's linear_attention is not normalised over the keys\n";
  // Tutorial: KV = K^T V; Z = 1 / (sum(Q, axis=1) + 1e-8); out = Z * (Q KV).
  // Z only sums each query's own features, so the implied weights Z_i q_i . k_j neither
  // stay positive nor sum to 1 over the keys.
  const Mat KV = K.transpose() * V;                                        // (D, Dv)
  const Eigen::VectorXd Z = (Q.rowwise().sum().array() + 1e-8).inverse();  // (L)
  const Mat tutorial_linear = Z.asDiagonal() * (Q * KV);                   // (L, Dv)
  const Eigen::VectorXd tutorial_row_sums = Z.asDiagonal() * (Q * K.transpose()).rowwise().sum();
  // Linear attention proper (Katharopoulos et al.): a positive feature map phi = elu + 1
  // and the normaliser phi(q_i) . sum_j phi(k_j), so the weights are positive and sum to 1.
  const Mat phi_q = elu_plus_one(Q);                                                     // (L, D)
  const Mat phi_k = elu_plus_one(K);                                                     // (L, D)
  const Mat phi_kv = phi_k.transpose() * V;                                              // (D, Dv)
  const Eigen::VectorXd k_sum = phi_k.colwise().sum().transpose();                       // (D)
  const Eigen::VectorXd normaliser = (phi_q * k_sum).array() + 1e-6;                     // (L)
  const Mat correct_linear = normaliser.cwiseInverse().asDiagonal() * (phi_q * phi_kv);  // (L, Dv)
  const Eigen::VectorXd correct_row_sums =
      normaliser.cwiseInverse().asDiagonal() * (phi_q * phi_k.transpose()).rowwise().sum();
  print("tutorial linear_attention output", tutorial_linear);
  std::cout << "  its implied weights sum to " << tutorial_row_sums.transpose()
            << " per query\n  (row 1 lies far outside the range of V's entries: not an average)\n";
  print("phi(q_i) (phi(K)^T V) / (phi(q_i) . sum_j phi(k_j)), phi = elu + 1", correct_linear);
  std::cout << "  its implied weights sum to " << correct_row_sums.transpose()
            << " per query (1 - the 1e-6 guard)\n"
            << "attn::linear_attention (attn/linear_attention.hpp) computes the normalised form.\n";

  std::cout << "\n(d) float16 (section 10's X.astype(np.float16)): storage, not arithmetic\n";
  // One head of 256 tokens, D = 64, stored in half. attn widens to float for the products
  // and the softmax and accumulates in float; doing the arithmetic in half instead (Eigen's
  // half GEMM, a half softmax) rounds every partial sum to 11 bits.
  {
    const Index length = 256, dim = 64;
    std::mt19937 half_rng(0);
    std::normal_distribution<float> normal(0.0F, 1.0F);
    attn::Matrix<Eigen::half> qh(length, dim), kh(length, dim), vh(length, dim);  // (L, D)
    for (attn::Matrix<Eigen::half>* m : {&qh, &kh, &vh}) {
      for (Index i = 0; i < m->size(); ++i)
        m->data()[i] = Eigen::half(normal(half_rng));
    }
    // float64 reference on the same half values
    const Mat reference = attn::scaled_dot_product_attention(
        Mat(qh.cast<double>()), Mat(kh.cast<double>()), Mat(vh.cast<double>()));
    const attn::Matrix<Eigen::half> ours = attn::scaled_dot_product_attention(qh, kh, vh);
    // everything in half arithmetic
    const Eigen::half half_scale(1.0F / 8.0F);
    attn::Matrix<Eigen::half> half_scores = (qh * kh.transpose()) * half_scale;  // (L, L)
    for (Index i = 0; i < length; ++i) {
      const Eigen::half row_max = half_scores.row(i).maxCoeff();
      for (Index j = 0; j < length; ++j)
        half_scores(i, j) = Eigen::half(std::exp(static_cast<float>(half_scores(i, j) - row_max)));
      const Eigen::half row_sum = half_scores.row(i).sum();
      half_scores.row(i) /= row_sum;
    }
    const attn::Matrix<Eigen::half> all_half = half_scores * vh;  // (L, D)
    const double ours_error = (ours.cast<double>() - reference).cwiseAbs().maxCoeff();
    const double half_error = (all_half.cast<double>() - reference).cwiseAbs().maxCoeff();
    std::cout << std::scientific << std::setprecision(2)
              << "max |error| vs float64, half storage + float arithmetic (attn): " << ours_error
              << "\nmax |error| vs float64, half arithmetic throughout:             " << half_error
              << std::fixed << std::setprecision(6)
              << "\n  (half rounds outputs below 1 by up to 2.4e-4: attn's error is that rounding\n"
              << "  alone, since it rounds the float result once)\n";
    ok = ok && ours_error < 2e-3 && ours_error < half_error;
  }

  std::cout << "\n"
            << (ok ? "walkthrough: all checks passed" : "walkthrough: CHECKS FAILED") << "\n";
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(attn_examples::output_dir(argc, argv)) ? EXIT_SUCCESS : EXIT_FAILURE;
  } catch (const std::exception& e) {
    std::cerr << "walkthrough: " << e.what() << "\n";
    return EXIT_FAILURE;
  }
}
