// tiny_lm: loads the small byte-level language model trained by examples/tiny_lm/train.py
// from its safetensors file, prefills a prompt, then generates greedily with the KV cache
// (rotated keys, grouped-query heads) and prints the text and the tokens per second, on
// one thread.
//
//   tiny_lm [--model FILE] [--prompt TEXT] [--tokens N]
//
// The model defaults to the committed examples/tiny_lm/tiny_lm.safetensors (its path is
// compiled in as ATTN_TINY_LM_MODEL). docs/tiny_lm.md describes the model.
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "model.hpp"

#ifndef ATTN_TINY_LM_MODEL
#define ATTN_TINY_LM_MODEL "examples/tiny_lm/tiny_lm.safetensors"
#endif

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char* argv[]) {
  std::string path = ATTN_TINY_LM_MODEL;
  std::string prompt = "template <class T>";
  long steps = 200;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if ((arg == "--model" || arg == "--prompt" || arg == "--tokens") && i + 1 < argc) {
      const std::string value = argv[++i];
      if (arg == "--model")
        path = value;
      else if (arg == "--prompt")
        prompt = value;
      else
        steps = std::strtol(value.c_str(), nullptr, 10);
    } else {
      std::cerr << "usage: tiny_lm [--model FILE] [--prompt TEXT] [--tokens N]\n";
      return 2;
    }
  }
#if ATTN_HAS_OPENMP
  omp_set_num_threads(1);  // a step is tens of microseconds: too little work to share
#endif
  try {
    const attn::SafetensorsFile file(path);
    const tiny_lm::Model model(file);
    const tiny_lm::Config& c = model.config();
    std::cout << "model " << path << ": " << model.parameters() << " weights, " << c.layers
              << " layers, E " << c.embed_dim << ", " << c.heads << " query heads sharing "
              << c.kv_heads << (c.kv_heads == 1 ? " key/value head" : " key/value heads") << " of "
              << c.head_dim() << ", MLP " << c.hidden_dim << ", trained "
              << file.metadata().at("training_seconds") << " s to loss "
              << file.metadata().at("final_loss") << "\n";
    if (prompt.empty() || steps < 1) {
      std::cerr << "tiny_lm: the prompt must not be empty and --tokens must be positive\n";
      return 2;
    }
    std::vector<int> tokens;
    for (const char ch : prompt)
      tokens.push_back(static_cast<unsigned char>(ch));

    {  // one untimed prefill first: the first call pays for page faults and cold caches
      tiny_lm::Model::State warm = model.new_state();
      model.step(warm, tokens);
    }
    tiny_lm::Model::State state =
        model.new_state(static_cast<tiny_lm::Index>(tokens.size()) + steps);
    const auto start = std::chrono::steady_clock::now();
    tiny_lm::Matrix logits = model.step(state, tokens);  // prefill: the whole prompt at once
    const double prefill = seconds_since(start);
    std::string text;
    long decoded = 0;  // model calls after the prefill: the first token comes from its logits
    const auto decode_start = std::chrono::steady_clock::now();
    for (long s = 0; s < steps; ++s) {
      const int next = tiny_lm::Model::argmax(logits.row(logits.rows() - 1));
      text.push_back(static_cast<char>(next));
      if (s + 1 < steps) {
        logits = model.step(state, {next});  // one token, against the cache
        ++decoded;
      }
    }
    const double decode = seconds_since(decode_start);
    std::cout << "\n" << prompt << text << "\n\n";
    std::cout << "prefill: " << tokens.size() << " tokens in " << prefill * 1e3 << " ms ("
              << static_cast<double>(tokens.size()) / prefill << " tokens/s)\n";
    if (decoded > 0) {
      std::cout << "decode:  " << decoded << " tokens in " << decode * 1e3 << " ms ("
                << static_cast<double>(decoded) / decode << " tokens/s)\n";
    }
  } catch (const std::exception& e) {
    std::cerr << "tiny_lm: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
