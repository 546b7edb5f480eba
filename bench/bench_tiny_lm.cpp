// bench/bench_tiny_lm.cpp: the tiny language model of examples/tiny_lm (docs/tiny_lm.md),
// prefill and greedy decoding with the KV cache, one thread.
//
// Families:
//   tiny_lm_prefill/L      a prompt of L tokens in one step (the cache empty before):
//                          items_per_second = prefill tokens/s
//   tiny_lm_decode/C       16 single-token steps after a context of C tokens (the context's
//                          cache is built outside the timing, copied before each batch of
//                          16): items_per_second = decode tokens/s. "KV_bytes" is the rate
//                          of the keys and values those steps must read (every layer, both
//                          K and V, Hkv heads of D floats per cached token), to compare with
//                          "bytes" of the streaming probe below in the same run: the share of
//                          the memory bandwidth a step's K/V reads use.
//   bandwidth/threads:1    the sum of a 512 MiB float array, one pass per iteration
// The model's weights are read from the committed file (ATTN_TINY_LM_MODEL, compiled in).
//
//   build/dev/bench/bench_tiny_lm
// ATTN_BENCH_SMOKE=1 (ctest) shrinks every size.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../examples/tiny_lm/model.hpp"
#include "common.hpp"

#ifndef ATTN_TINY_LM_MODEL
#define ATTN_TINY_LM_MODEL "examples/tiny_lm/tiny_lm.safetensors"
#endif

namespace {

using attn::Index;
using attn_bench::set_threads;
using attn_bench::smoke;

const tiny_lm::Model& model() {
  static const tiny_lm::Model m{attn::SafetensorsFile(ATTN_TINY_LM_MODEL)};
  return m;
}

/// Tokens from the training text's alphabet: the same bytes whatever the length.
std::vector<int> text_tokens(Index n) {
  const std::string text =
      "Decoding is memory-bound: every call streams K and V once and does few FLOPs. ";
  std::vector<int> tokens;
  for (Index t = 0; t < n; ++t)
    tokens.push_back(static_cast<unsigned char>(text[static_cast<std::size_t>(t) % text.size()]));
  return tokens;
}

void BM_tiny_lm_prefill(benchmark::State& state) {
  set_threads(1);
  const std::vector<int> prompt = text_tokens(state.range(0));
  for (auto _ : state) {
    tiny_lm::Model::State s = model().new_state(state.range(0));
    const tiny_lm::Matrix logits = model().step(s, prompt);
    benchmark::DoNotOptimize(logits.data());
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * state.range(0));
}

void BM_tiny_lm_decode(benchmark::State& state) {
  set_threads(1);
  const Index context = state.range(0), steps = 16;
  const tiny_lm::Config& c = model().config();
  tiny_lm::Model::State prefilled = model().new_state(context + steps);
  const tiny_lm::Matrix first = model().step(prefilled, text_tokens(context));
  const int start = tiny_lm::Model::argmax(first.row(first.rows() - 1));
  for (auto _ : state) {
    state.PauseTiming();
    tiny_lm::Model::State s = prefilled;  // the same context for every batch
    state.ResumeTiming();
    int next = start;
    for (Index t = 0; t < steps; ++t) {
      const tiny_lm::Matrix logits = model().step(s, {next});
      next = tiny_lm::Model::argmax(logits.row(0));
    }
    benchmark::DoNotOptimize(next);
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * steps);
  // Step t reads the K and V of context + t + 1 tokens in every layer.
  double bytes = 0;
  for (Index t = 0; t < steps; ++t) {
    bytes += static_cast<double>(c.layers * 2 * c.kv_heads * c.head_dim() * (context + t + 1)) *
             sizeof(float);
  }
  state.counters["KV_bytes"] = benchmark::Counter(
      bytes, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1024);
  state.counters["weights_bytes"] = static_cast<double>(model().parameters()) * sizeof(float);
}

void register_all() {
  const std::vector<std::int64_t> prompts =
      smoke() ? std::vector<std::int64_t>{18} : std::vector<std::int64_t>{18, 128, 512};
  for (const std::int64_t l : prompts) {
    benchmark::RegisterBenchmark("tiny_lm_prefill", BM_tiny_lm_prefill)
        ->Arg(l)
        ->Unit(benchmark::kMicrosecond);
  }
  const std::vector<std::int64_t> contexts =
      smoke() ? std::vector<std::int64_t>{18} : std::vector<std::int64_t>{18, 256, 1000};
  for (const std::int64_t context : contexts) {
    benchmark::RegisterBenchmark("tiny_lm_decode", BM_tiny_lm_decode)
        ->Arg(context)
        ->Unit(benchmark::kMicrosecond);
  }
  benchmark::RegisterBenchmark("bandwidth", attn_bench::BM_bandwidth)
      ->ArgNames({"threads"})
      ->Arg(1)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
}

}  // namespace

int main(int argc, char** argv) {
  return attn_bench::run(argc, argv, register_all);
}
