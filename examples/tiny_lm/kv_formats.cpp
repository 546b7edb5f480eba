// tiny_lm_kv_formats: how much each KV-cache format costs the tiny language model
// (examples/tiny_lm) in quality, on text it was not trained on.
//
//   tiny_lm_kv_formats [--model FILE] [--text FILE]... [--windows N] [--json FILE]
//
// The text (by default a few of the repository's C++ sources under tests/ and bench/; the
// model was trained on README.md, docs/ and include/ only) is cut into windows of
// max_positions bytes. Each window is fed through the model in chunks of 64 tokens (chunked
// prefill: every chunk is appended to the caches, then attends to everything before it),
// once with float caches and once per format below, keys and values each float, half,
// q8_0 or q4_0, with and without Hadamard rotation. Against the float run, at every
// position: how often the argmax next byte is the same (agreement), the mean KL divergence
// of the next-byte distributions KL(float || format) in nats, and the change of the mean
// loss (cross entropy of the true next byte, nats per byte). docs/quantized-cache.md shows
// the committed results (results/tiny_lm_kv_formats.json, written by --json).
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <iterator>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <attn/quantized.hpp>

#include "divergence.hpp"
#include "model.hpp"

#ifndef ATTN_TINY_LM_MODEL
#define ATTN_TINY_LM_MODEL "examples/tiny_lm/tiny_lm.safetensors"
#endif
#ifndef ATTN_SOURCE_DIR
#define ATTN_SOURCE_DIR "."
#endif

namespace {

using tiny_lm::Index;
using tiny_lm::Matrix;

constexpr Index chunk = 64;  // tokens per prefill step

// The logits (L, V) of one window, fed in chunks through caches of formats SK and SV.
template <class SK, class SV>
Matrix window_logits(const tiny_lm::Model& model, const std::vector<int>& window,
                     attn::KVRotation rotation) {
  const Index length = static_cast<Index>(window.size());
  auto state = model.new_state<SK, SV>(length, rotation);
  Matrix logits(length, model.config().vocab_size);
  for (Index begin = 0; begin < length; begin += chunk) {
    const Index n = std::min(chunk, length - begin);
    const std::vector<int> part(window.begin() + begin, window.begin() + begin + n);
    logits.middleRows(begin, n) = model.step(state, part);
  }
  return logits;
}

struct Format {
  std::string keys, values;
  attn::KVRotation rotation;
  double bytes_per_value_k, bytes_per_value_v;
  Matrix (*logits)(const tiny_lm::Model&, const std::vector<int>&, attn::KVRotation);
};

struct Score {
  tiny_lm::Divergence divergence;  // against the float cache
  double loss = 0;                 // sum over positions of -log p(next byte)
};

// Adds the comparison of one window's log-probabilities (L, V) against the float run's: every
// position but the last, which has no next byte.
void score_window(const Eigen::MatrixXd& exact, const Eigen::MatrixXd& approx,
                  const std::vector<int>& window, Score& s) {
  s.divergence.add(exact, approx, exact.rows() - 1);
  for (Index t = 0; t + 1 < exact.rows(); ++t)
    s.loss -= approx(t, window[static_cast<std::size_t>(t + 1)]);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw std::runtime_error("cannot read " + path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

const char* rotation_name(attn::KVRotation r) {
  return r == attn::KVRotation::hadamard ? "hadamard" : "none";
}

}  // namespace

int main(int argc, char* argv[]) {
  std::string model_path = ATTN_TINY_LM_MODEL, json_path;
  std::vector<std::string> texts;
  long windows = 16;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if ((arg == "--model" || arg == "--text" || arg == "--windows" || arg == "--json") &&
        i + 1 < argc) {
      const std::string value = argv[++i];
      if (arg == "--model")
        model_path = value;
      else if (arg == "--text")
        texts.push_back(value);
      else if (arg == "--json")
        json_path = value;
      else
        windows = std::strtol(value.c_str(), nullptr, 10);
    } else {
      std::cerr << "usage: tiny_lm_kv_formats [--model FILE] [--text FILE]... [--windows N] "
                   "[--json FILE]\n";
      return 2;
    }
  }
  if (texts.empty()) {
    for (const char* name :
         {"tests/test_decode.cpp", "tests/test_quantized.cpp", "bench/bench_decode.cpp"})
      texts.push_back(std::string(ATTN_SOURCE_DIR) + "/" + name);
  }
  if (windows < 1) {
    std::cerr << "tiny_lm_kv_formats: --windows must be positive\n";
    return 2;
  }
#if ATTN_HAS_OPENMP
  omp_set_num_threads(1);
#endif
  try {
    const attn::SafetensorsFile file(model_path);
    const tiny_lm::Model model(file);
    const Index window_length = model.config().max_positions;

    std::string text;
    for (const std::string& path : texts)
      text += read_file(path);
    std::vector<std::vector<int>> cut;
    for (std::size_t at = 0; at + static_cast<std::size_t>(window_length) <= text.size() &&
                             static_cast<long>(cut.size()) < windows;
         at += static_cast<std::size_t>(window_length)) {
      std::vector<int> w;
      for (Index t = 0; t < window_length; ++t)
        w.push_back(static_cast<unsigned char>(text[at + static_cast<std::size_t>(t)]));
      cut.push_back(std::move(w));
    }
    if (cut.empty())
      throw std::runtime_error("the text is shorter than one window");

    using attn::BlockQ4_0;
    using attn::BlockQ8_0;
    using half = Eigen::half;
    const double q8 = sizeof(BlockQ8_0) / 32.0, q4 = sizeof(BlockQ4_0) / 32.0;
    const auto none = attn::KVRotation::none, hadamard = attn::KVRotation::hadamard;
    const std::vector<Format> formats = {
        {"float", "float", hadamard, 4, 4, &window_logits<float, float>},
        {"half", "half", none, 2, 2, &window_logits<half, half>},
        {"half", "q8_0", none, 2, q8, &window_logits<half, BlockQ8_0>},
        {"q8_0", "half", none, q8, 2, &window_logits<BlockQ8_0, half>},
        {"q8_0", "q8_0", none, q8, q8, &window_logits<BlockQ8_0, BlockQ8_0>},
        {"q8_0", "q8_0", hadamard, q8, q8, &window_logits<BlockQ8_0, BlockQ8_0>},
        {"q8_0", "q4_0", none, q8, q4, &window_logits<BlockQ8_0, BlockQ4_0>},
        {"q8_0", "q4_0", hadamard, q8, q4, &window_logits<BlockQ8_0, BlockQ4_0>},
        {"q4_0", "q8_0", none, q4, q8, &window_logits<BlockQ4_0, BlockQ8_0>},
        {"q4_0", "q4_0", none, q4, q4, &window_logits<BlockQ4_0, BlockQ4_0>},
        {"q4_0", "q4_0", hadamard, q4, q4, &window_logits<BlockQ4_0, BlockQ4_0>},
    };

    std::vector<Score> scores(formats.size());
    double float_loss = 0;
    for (const std::vector<int>& w : cut) {
      const Eigen::MatrixXd exact =
          tiny_lm::log_softmax_rows(window_logits<float, float>(model, w, none));
      for (Index t = 0; t + 1 < exact.rows(); ++t)
        float_loss -= exact(t, w[static_cast<std::size_t>(t + 1)]);
      for (std::size_t f = 0; f < formats.size(); ++f)
        score_window(exact,
                     tiny_lm::log_softmax_rows(formats[f].logits(model, w, formats[f].rotation)), w,
                     scores[f]);
    }
    const auto positions = static_cast<double>(scores.front().divergence.positions);
    float_loss /= positions;

    std::cout << "model " << model_path << " (head dim " << model.config().head_dim() << ", "
              << model.config().kv_heads << " kv heads, " << model.config().layers << " layers); "
              << cut.size() << " windows of " << window_length << " held-out bytes, "
              << scores.front().divergence.positions << " predictions\n"
              << "float cache: loss " << std::fixed << std::setprecision(4) << float_loss
              << " nats/byte\n\n"
              << "K      V      rotation  bytes/value  agreement  KL (nats)   loss change\n";
    std::ostringstream json;
    json << "{\"trained_on_sha256\": \"" << file.metadata().at("trained_on_sha256")
         << "\", \"windows\": " << cut.size() << ", \"window\": " << window_length
         << ", \"chunk\": " << chunk << ", \"predictions\": " << scores.front().divergence.positions
         << ", \"float_loss\": " << std::setprecision(6) << float_loss << ",\n \"formats\": [";
    for (std::size_t f = 0; f < formats.size(); ++f) {
      const Format& fm = formats[f];
      const Score& s = scores[f];
      const double agreement = s.divergence.mean_agreement(), kl = s.divergence.mean_kl();
      const double loss_change = s.loss / positions - float_loss;
      const double bytes = (fm.bytes_per_value_k + fm.bytes_per_value_v) / 2;
      std::cout << std::left << std::setw(7) << fm.keys << std::setw(7) << fm.values
                << std::setw(10) << rotation_name(fm.rotation) << std::right << std::setprecision(4)
                << std::setw(11) << bytes << std::setw(11) << std::setprecision(4) << agreement
                << std::scientific << std::setprecision(2) << std::setw(12) << kl << std::setw(14)
                << std::showpos << loss_change << std::noshowpos << std::fixed << "\n";
      json << (f ? ",\n  " : "\n  ") << "{\"keys\": \"" << fm.keys << "\", \"values\": \""
           << fm.values << "\", \"rotation\": \"" << rotation_name(fm.rotation)
           << "\", \"bytes_per_value\": " << std::setprecision(6) << bytes
           << ", \"agreement\": " << agreement << ", \"kl\": " << std::scientific
           << std::setprecision(6) << kl << ", \"loss_change\": " << loss_change << std::fixed
           << "}";
    }
    json << "]}\n";
    if (!json_path.empty()) {
      std::ofstream out(json_path);
      out << json.str();
      if (!out)
        throw std::runtime_error("cannot write " + json_path);
    }
  } catch (const std::exception& e) {
    std::cerr << "tiny_lm_kv_formats: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
