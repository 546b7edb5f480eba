// tiny_lm_serve: continuous batching over the tiny language model (examples/tiny_lm) with
// the paged KV cache, checked token for token against each sequence run alone.
//
//   tiny_lm_serve [--model FILE] [--requests N] [--max-tokens N] [--page-size P]
//                 [--max-running N] [--seed S] [--repetitions R] [--json FILE]
//
// A seeded schedule of N requests arrives over the steps (gaps of 0 to 4 steps). Every
// prompt is one shared system prompt followed by a short text of its own; the system prompt
// is prefilled once into a sequence that every request forks (its pages shared, never
// copied: prefix caching). A request asks for 1, 2 or 4 samples: its sequence is forked
// after its prompt, once per further sample, and each sample draws its tokens from the
// temperature-0.8 distribution with a generator of its own (seeded by the request and the
// sample), so the continuations differ. A sample ends at a newline or after its request's
// token budget (drawn in [N/4, N] for --max-tokens N); its sequence is removed and its pages
// go back to the pool. Requests join whenever the running samples leave room (--max-running).
//
// Each step: one batched forward prefills the texts of the requests admitted in it (ragged:
// each its own length), then one batched forward feeds every running sample its last token.
// The two are separate calls so that prefill and decode are timed apart; the layer takes
// both in one (MultiHeadAttention::forward_incremental's packed overload). Reports the
// tokens per second of each, the pool's pages in use over time beside what the same
// sequences would hold without shared pages, and the peak resident set. With --repetitions R
// the whole serving runs R times (the same tokens each time, or exit status 1) and the
// times are the medians.
//
// Then every sample is run again alone, on the contiguous KVCache through Model::step (the
// system prompt, its text, its tokens one by one: the same steps), and its tokens and the
// bits of every logits row it sampled from are compared. They must be equal (exit status 1
// otherwise) when the page size is a multiple of 64 and the products run on attn's AVX2 or
// AVX-512 kernels (docs/tiny_lm.md, "Serving"); elsewhere the comparison is reported only.
// One thread, like tiny_lm.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <iterator>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <attn/cpu.hpp>

#include "model.hpp"
#include "serving.hpp"

#ifndef ATTN_TINY_LM_MODEL
#define ATTN_TINY_LM_MODEL "examples/tiny_lm/tiny_lm.safetensors"
#endif

namespace {

using tiny_lm::Index;
using tiny_lm::Matrix;
using Clock = std::chrono::steady_clock;

constexpr int end_byte = '\n';
constexpr double temperature = 0.8;

const char* const system_prompt =
    "// attn: attention for C++17 on Eigen. Shapes: q (B, Hq, Lq, D), k and v (B, Hkv, Lk, D);\n"
    "// every public function checks its inputs and names the offending shapes.\n"
    "#pragma once\n\n#include <attn/attention.hpp>\n\nnamespace attn {\n\n";

const char* const texts[] = {
    "/// The ",   "template <class T>\n", "inline Index ", "struct ",
    "/// Throws", "  const Index ",       "// The cache ", "void ",
};

struct Request {
  int id = 0;
  Index arrival = 0;  // the step it arrives at
  std::string text;   // after the system prompt
  int samples = 1;
  Index max_new = 0;  // tokens per sample at most
};

/// The seeded schedule: arrivals 0 to 4 steps apart, a text, 1, 2 or 4 samples, a budget.
std::vector<Request> schedule(int count, Index max_tokens, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const auto below = [&](std::uint64_t n) { return static_cast<int>(rng() % n); };
  std::vector<Request> requests;
  Index at = 0;
  for (int r = 0; r < count; ++r) {
    Request q;
    q.id = r;
    at += below(5);
    q.arrival = at;
    q.text = texts[below(std::size(texts))];
    const int kind = below(20);
    q.samples = kind < 12 ? 1 : kind < 17 ? 2 : 4;
    q.max_new = std::max<Index>(
        1, max_tokens / 4 + below(static_cast<std::uint64_t>(max_tokens - max_tokens / 4 + 1)));
    requests.push_back(q);
  }
  return requests;
}

std::vector<int> bytes(const std::string& s) {
  std::vector<int> t;
  for (const char c : s)
    t.push_back(static_cast<unsigned char>(c));
  return t;
}

/// One sample's generation: its generator, its tokens, and a hash of the bits of every
/// logits row it drew from (FNV-1a), by which two runs' logits are compared.
struct Sample {
  int request = 0, index = 0;
  Index max_new = 0;
  std::mt19937_64 rng;
  std::vector<int> tokens;
  std::uint64_t logits_hash = 14695981039346656037ULL;
  Index id = -1;  // its sequence in the paged state

  Sample(const Request& r, int k, std::uint64_t seed)
      : request(r.id), index(k), max_new(r.max_new) {
    std::seed_seq s{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(r.id),
                    static_cast<std::uint32_t>(k)};
    rng.seed(s);
  }

  /// Draws the next token from logits (V) at `temperature`; true when the sample is done.
  bool take(const float* logits, Index vocabulary) {
    for (Index j = 0; j < vocabulary; ++j) {
      std::uint32_t bits = 0;
      std::memcpy(&bits, &logits[j], sizeof bits);
      logits_hash = (logits_hash ^ bits) * 1099511628211ULL;
    }
    const float top = *std::max_element(logits, logits + vocabulary);
    std::vector<double> weight(static_cast<std::size_t>(vocabulary));
    double total = 0;
    for (Index j = 0; j < vocabulary; ++j) {
      total += std::exp((static_cast<double>(logits[j]) - top) / temperature);
      weight[static_cast<std::size_t>(j)] = total;
    }
    const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53 * total;
    const auto token =
        static_cast<int>(std::upper_bound(weight.begin(), weight.end(), u) - weight.begin());
    tokens.push_back(std::min(token, static_cast<int>(vocabulary) - 1));
    return tokens.back() == end_byte || static_cast<Index>(tokens.size()) >= max_new;
  }
};

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  const std::size_t n = x.size();
  return n % 2 == 1 ? x[n / 2] : (x[n / 2 - 1] + x[n / 2]) / 2;
}

long max_rss_kib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss;  // KiB on Linux
}

struct Point {
  Index step, running, in_use, unshared, pool;
};

struct Served {
  std::vector<Sample> finished;
  std::vector<Point> timeline;
  Index prefill_tokens = 0, decode_tokens = 0, decode_steps = 0, steps = 0;
  double prefill_seconds = 0, decode_seconds = 0, wall_seconds = 0, pool_bytes = 0;
  long peak_rss_kib = 0;
};

/// The server: admissions, batched prefill, batched decode, removals, step by step.
Served serve(const tiny_lm::Model& model, const std::vector<Request>& requests, Index page_size,
             Index max_running, std::uint64_t seed) {
  const Index vocabulary = model.config().vocab_size;
  tiny_lm::PagedState<float> state(model, page_size);
  Served out;
  const auto wall = Clock::now();
  // The shared prompt, once.
  const std::vector<int> system = bytes(system_prompt);
  const Index shared = state.add_sequence();
  auto start = Clock::now();
  tiny_lm::step(model, state, {shared}, {system});
  out.prefill_seconds += seconds_since(start);
  out.prefill_tokens += static_cast<Index>(system.size());

  std::vector<Sample> running;
  std::size_t next = 0;  // the first request not yet admitted
  for (Index step = 0; next < requests.size() || !running.empty(); ++step) {
    // Admissions, in arrival order, while the running samples leave room.
    std::vector<const Request*> admitted;
    std::vector<Index> ids;
    std::vector<std::vector<int>> prompts;
    Index room = max_running - static_cast<Index>(running.size());
    while (next < requests.size() && requests[next].arrival <= step &&
           requests[next].samples <= room) {
      admitted.push_back(&requests[next]);
      room -= requests[next].samples;
      ids.push_back(state.fork(shared));  // the system prompt's pages, shared
      prompts.push_back(bytes(requests[next].text));
      ++next;
    }
    if (!admitted.empty()) {  // one forward over every admitted request's own text
      start = Clock::now();
      const Matrix logits = tiny_lm::step(model, state, ids, prompts);
      out.prefill_seconds += seconds_since(start);
      Index row = -1;
      for (std::size_t a = 0; a < admitted.size(); ++a) {
        row += static_cast<Index>(prompts[a].size());  // the prompt's last token
        std::vector<Index> forks{ids[a]};              // n > 1: forked after the prompt
        for (int k = 1; k < admitted[a]->samples; ++k)
          forks.push_back(state.fork(ids[a]));
        for (int k = 0; k < admitted[a]->samples; ++k) {
          Sample s(*admitted[a], k, seed);
          s.id = forks[static_cast<std::size_t>(k)];
          if (s.take(logits.row(row).data(), vocabulary)) {
            state.remove(s.id);
            out.finished.push_back(std::move(s));
          } else {
            running.push_back(std::move(s));
          }
        }
        out.prefill_tokens += static_cast<Index>(prompts[a].size());
      }
    }
    if (!running.empty()) {  // one forward: the last token of every running sample
      std::vector<Index> decode_ids;
      std::vector<std::vector<int>> last;
      for (const Sample& s : running) {
        decode_ids.push_back(s.id);
        last.push_back({s.tokens.back()});
      }
      start = Clock::now();
      const Matrix logits = tiny_lm::step(model, state, decode_ids, last);
      out.decode_seconds += seconds_since(start);
      out.decode_tokens += static_cast<Index>(running.size());
      ++out.decode_steps;
      std::vector<Sample> still;
      for (std::size_t b = 0; b < running.size(); ++b) {
        if (running[b].take(logits.row(static_cast<Index>(b)).data(), vocabulary)) {
          state.remove(running[b].id);  // its pages back to the pool
          out.finished.push_back(std::move(running[b]));
        } else {
          still.push_back(std::move(running[b]));
        }
      }
      running = std::move(still);
    }
    Index unshared = (state.length(shared) + page_size - 1) / page_size;
    for (const Sample& s : running)
      unshared += (state.length(s.id) + page_size - 1) / page_size;
    out.timeline.push_back(
        {step, static_cast<Index>(running.size()), state.pages_in_use(), unshared, state.pages()});
    out.steps = step + 1;
  }
  out.wall_seconds = seconds_since(wall);
  out.pool_bytes = state.pool_bytes();
  out.peak_rss_kib = max_rss_kib();
  return out;
}

/// The sample run alone on the contiguous cache, in the server's steps; adds the decode
/// time and tokens of this run to `seconds` and `tokens`.
Sample alone(const tiny_lm::Model& model, const Request& request, int k, std::uint64_t seed,
             double& seconds, Index& tokens) {
  const Index vocabulary = model.config().vocab_size;
  tiny_lm::Model::State state = model.new_state();
  model.step(state, bytes(system_prompt));
  Matrix logits = model.step(state, bytes(request.text));
  Sample s(request, k, seed);
  bool done = s.take(logits.row(logits.rows() - 1).data(), vocabulary);
  const auto start = Clock::now();
  while (!done) {
    logits = model.step(state, {s.tokens.back()});
    ++tokens;
    done = s.take(logits.row(0).data(), vocabulary);
  }
  seconds += seconds_since(start);
  return s;
}

std::string printable(const std::vector<int>& tokens) {
  std::string s;
  for (const int t : tokens)
    s += t == end_byte ? std::string("\\n") : std::string(1, static_cast<char>(t));
  return s;
}

struct Options {
  std::string model = ATTN_TINY_LM_MODEL, json;
  long requests = 48, max_tokens = 96, page_size = 64, max_running = 32;
  long seed = 1, repetitions = 1;
};

/// The options of the command line; false (after a message) when they are malformed.
bool parse(int argc, char* argv[], Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool valued = arg == "--model" || arg == "--json" || arg == "--requests" ||
                        arg == "--max-tokens" || arg == "--page-size" || arg == "--max-running" ||
                        arg == "--seed" || arg == "--repetitions";
    if (!valued || i + 1 == argc) {
      std::cerr << "usage: tiny_lm_serve [--model FILE] [--requests N] [--max-tokens N] "
                   "[--page-size P] [--max-running N] [--seed S] [--repetitions R] "
                   "[--json FILE]\n";
      return false;
    }
    const std::string value = argv[++i];
    const long number = std::strtol(value.c_str(), nullptr, 10);
    if (arg == "--model")
      o.model = value;
    else if (arg == "--json")
      o.json = value;
    else if (arg == "--requests")
      o.requests = number;
    else if (arg == "--max-tokens")
      o.max_tokens = number;
    else if (arg == "--page-size")
      o.page_size = number;
    else if (arg == "--max-running")
      o.max_running = number;
    else if (arg == "--repetitions")
      o.repetitions = number;
    else
      o.seed = number;
  }
  if (o.requests < 1 || o.max_tokens < 1 || o.page_size < 1 || o.max_running < 4 || o.seed < 0 ||
      o.repetitions < 1) {
    std::cerr << "tiny_lm_serve: --requests, --max-tokens, --page-size and --repetitions must "
                 "be positive, --max-running at least 4 (a request's samples), --seed >= 0\n";
    return false;
  }
  return true;
}

/// The serving, `repetitions` times: the first run's samples and pages, the medians of the
/// times. Throws if a repetition samples other tokens.
Served serve_repeated(const tiny_lm::Model& model, const std::vector<Request>& requests,
                      const Options& o) {
  const auto seed = static_cast<std::uint64_t>(o.seed);
  Served served = serve(model, requests, o.page_size, o.max_running, seed);
  if (o.repetitions == 1)
    return served;
  std::vector<double> prefill{served.prefill_seconds}, decode{served.decode_seconds},
      wall{served.wall_seconds};
  for (long r = 1; r < o.repetitions; ++r) {
    const Served again = serve(model, requests, o.page_size, o.max_running, seed);
    bool same = again.finished.size() == served.finished.size();
    for (std::size_t i = 0; same && i < again.finished.size(); ++i)
      same = again.finished[i].tokens == served.finished[i].tokens;
    if (!same)
      throw std::runtime_error("repetition " + std::to_string(r) + " sampled other tokens");
    prefill.push_back(again.prefill_seconds);
    decode.push_back(again.decode_seconds);
    wall.push_back(again.wall_seconds);
  }
  served.prefill_seconds = median(prefill);
  served.decode_seconds = median(decode);
  served.wall_seconds = median(wall);
  served.peak_rss_kib = max_rss_kib();
  return served;
}

/// What the report says: the comparison with the contiguous cache and the peaks.
struct Summary {
  Index samples = 0, generated = 0, same_tokens = 0, same_logits = 0;
  Index alone_tokens = 0;
  double alone_seconds = 0;
  bool exact_expected = false;
  Index peak_in_use = 0, peak_unshared = 0, peak_running = 0, pool = 0;

  bool equal() const { return same_tokens == samples && same_logits == samples; }
};

/// Runs every sample again alone on the contiguous cache and compares; the peaks.
Summary summarize(const tiny_lm::Model& model, const std::vector<Request>& requests,
                  const Served& served, const Options& o) {
  Summary s;
  for (const Sample& sample : served.finished) {
    const Sample ref =
        alone(model, requests[static_cast<std::size_t>(sample.request)], sample.index,
              static_cast<std::uint64_t>(o.seed), s.alone_seconds, s.alone_tokens);
    s.same_tokens += ref.tokens == sample.tokens ? 1 : 0;
    s.same_logits += ref.logits_hash == sample.logits_hash ? 1 : 0;
    s.generated += static_cast<Index>(sample.tokens.size());
  }
  s.samples = static_cast<Index>(served.finished.size());
  s.exact_expected = o.page_size % 64 == 0 && attn::active_isa() != attn::Isa::generic;
  for (const Point& p : served.timeline) {
    s.peak_in_use = std::max(s.peak_in_use, p.in_use);
    s.peak_unshared = std::max(s.peak_unshared, p.unshared);
    s.peak_running = std::max(s.peak_running, p.running);
  }
  s.pool = served.timeline.empty() ? 0 : served.timeline.back().pool;
  return s;
}

void print_report(const std::vector<Request>& requests, const Served& served, const Summary& s,
                  const Options& o) {
  const double prefill_rate = static_cast<double>(served.prefill_tokens) / served.prefill_seconds;
  const double decode_rate = static_cast<double>(served.decode_tokens) / served.decode_seconds;
  const double alone_rate =
      s.alone_tokens > 0 ? static_cast<double>(s.alone_tokens) / s.alone_seconds : 0.0;
  std::cout << std::fixed << std::setprecision(1) << "model " << o.model << "\n"
            << requests.size() << " requests, " << s.samples << " samples ("
            << requests.back().arrival + 1 << " steps of arrivals), system prompt of "
            << std::strlen(system_prompt) << " tokens shared by fork, pages of " << o.page_size
            << " tokens, at most " << o.max_running << " running samples; "
            << attn::isa_name(attn::active_isa()) << ", one thread"
            << (o.repetitions > 1 ? "; times: medians of " + std::to_string(o.repetitions) + " runs"
                                  : std::string())
            << "\n\n";
  // Some of the finished samples of requests with several.
  int shown = 0;
  for (const Sample& sample : served.finished) {
    const Request& r = requests[static_cast<std::size_t>(sample.request)];
    if (r.samples > 1 && shown < 6) {
      std::cout << "  request " << std::setw(2) << sample.request << " sample " << sample.index
                << ": " << printable(bytes(r.text)) << "|" << printable(sample.tokens) << "\n";
      ++shown;
    }
  }
  std::cout << "\nsteps:   " << served.steps << " (" << served.decode_steps
            << " batched decode forwards, " << std::setprecision(1)
            << static_cast<double>(served.decode_tokens) /
                   static_cast<double>(std::max<Index>(served.decode_steps, 1))
            << " samples each on average, at most " << s.peak_running << ")\n"
            << "prefill: " << served.prefill_tokens << " tokens in " << std::setprecision(2)
            << served.prefill_seconds * 1e3 << " ms (" << std::setprecision(0) << prefill_rate
            << " tokens/s)\n"
            << "decode:  " << served.decode_tokens << " tokens in " << std::setprecision(2)
            << served.decode_seconds * 1e3 << " ms (" << std::setprecision(0) << decode_rate
            << " tokens/s; one sequence at a time on the contiguous cache: " << alone_rate
            << " tokens/s)\n"
            << "all:     " << s.generated << " sampled tokens in " << std::setprecision(2)
            << served.wall_seconds * 1e3 << " ms of serving (" << std::setprecision(0)
            << static_cast<double>(s.generated) / served.wall_seconds
            << " tokens/s, sampling and scheduling included)\n"
            << "pages:   at most " << s.peak_in_use << " in use of a pool of " << s.pool << " ("
            << std::setprecision(1) << served.pool_bytes / 1024.0
            << " KiB over the 4 layers); the same sequences without shared pages would hold "
            << s.peak_unshared << "\n"
            << "peak RSS " << served.peak_rss_kib << " KiB\n\n"
            << "pages in use over the steps (step: running samples, pages in use / without "
               "sharing / pool):\n";
  const std::size_t every = std::max<std::size_t>(1, served.timeline.size() / 12);
  for (std::size_t i = 0; i < served.timeline.size(); i += every) {
    const Point& p = served.timeline[i];
    std::cout << "  " << std::setw(4) << p.step << ": " << std::setw(3) << p.running << ", "
              << std::setw(4) << p.in_use << " / " << std::setw(4) << p.unshared << " / "
              << std::setw(4) << p.pool << "\n";
  }
  std::cout << "\nalone on the contiguous cache: " << s.same_tokens << " of " << s.samples
            << " samples give the same tokens, " << s.same_logits << " the same logits bit for bit"
            << (s.exact_expected ? " (both required)"
                                 : " (not required: pages of a multiple of 64 on attn's AVX2 or "
                                   "AVX-512 kernels are)")
            << "\n";
}

void write_json(const std::vector<Request>& requests, const Served& served, const Summary& s,
                const Options& o) {
  std::ostringstream json;
  json << std::setprecision(6) << "{\"requests\": " << requests.size()
       << ", \"samples\": " << s.samples << ", \"page_size\": " << o.page_size
       << ", \"max_running\": " << o.max_running << ", \"max_tokens\": " << o.max_tokens
       << ", \"seed\": " << o.seed << ", \"repetitions\": " << o.repetitions
       << ", \"system_prompt_tokens\": " << std::strlen(system_prompt) << R"(, "isa": ")"
       << attn::isa_name(attn::active_isa()) << R"(", "threads": 1)"
       << ",\n \"steps\": " << served.steps << ", \"decode_steps\": " << served.decode_steps
       << ", \"peak_running\": " << s.peak_running
       << ",\n \"prefill\": {\"tokens\": " << served.prefill_tokens
       << ", \"seconds\": " << served.prefill_seconds
       << "},\n \"decode\": {\"tokens\": " << served.decode_tokens
       << ", \"seconds\": " << served.decode_seconds
       << "},\n \"alone_decode\": {\"tokens\": " << s.alone_tokens
       << ", \"seconds\": " << s.alone_seconds << "},\n \"generated_tokens\": " << s.generated
       << ", \"wall_seconds\": " << served.wall_seconds << ",\n \"pages\": {\"pool\": " << s.pool
       << ", \"peak_in_use\": " << s.peak_in_use << ", \"peak_unshared\": " << s.peak_unshared
       << ", \"pool_bytes\": " << served.pool_bytes
       << "}, \"peak_rss_kib\": " << served.peak_rss_kib
       << ",\n \"check\": {\"samples\": " << s.samples << ", \"same_tokens\": " << s.same_tokens
       << ", \"same_logits\": " << s.same_logits
       << ", \"exact_expected\": " << (s.exact_expected ? "true" : "false")
       << "},\n \"timeline\": [";
  for (std::size_t i = 0; i < served.timeline.size(); ++i) {
    const Point& p = served.timeline[i];
    json << (i > 0 ? ", " : "") << "[" << p.step << ", " << p.running << ", " << p.in_use << ", "
         << p.unshared << ", " << p.pool << "]";
  }
  json << "]}\n";
  std::ofstream file_out(o.json);
  file_out << json.str();
  if (!file_out)
    throw std::runtime_error("cannot write " + o.json);
}

}  // namespace

int main(int argc, char* argv[]) {
  Options o;
  if (!parse(argc, argv, o))
    return 2;
#if ATTN_HAS_OPENMP
  omp_set_num_threads(1);  // like tiny_lm: a step of a few sequences is too little to share
#endif
  try {
    const attn::SafetensorsFile file(o.model);
    const tiny_lm::Model model(file);
    const std::vector<Request> requests =
        schedule(static_cast<int>(o.requests), o.max_tokens, static_cast<std::uint64_t>(o.seed));
    const Served served = serve_repeated(model, requests, o);
    const Summary summary = summarize(model, requests, served, o);
    print_report(requests, served, summary, o);
    if (!o.json.empty())
      write_json(requests, served, summary, o);
    if (summary.exact_expected && !summary.equal()) {
      std::cerr << "tiny_lm_serve: a sample differs from its run alone\n";
      return 1;
    }
  } catch (const std::exception& e) {
    std::cerr << "tiny_lm_serve: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
