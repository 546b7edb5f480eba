// bench/distributed/ring_vs_single.cpp: ring attention on P ranks of one thread each against
// the single-process call with P threads, on the same machine, in one run.
//
//   mpirun -np 2 build/dev/bench/bench_distributed_ring [--json results/distributed.json]
//          [--lengths 8192,32768] [--repetitions 3] [--query-chunk 512]
//
// Problem: B 1, Hq = Hkv = 8, D = Dv = 128, float; causal with the zigzag split, and not
// causal with the contiguous split. For each length:
//   pass 1  the inputs: every rank builds the global q, k, v (fixed seed) and cuts its runs;
//   pass 2  a first ring (warm-up);
//   pass 3  the single-process call on rank 0 with P OpenMP threads (the other ranks sleep in
//           a polled MPI_Ibarrier, so that they leave it the cores), interleaved with pass 4;
//   pass 4  the ring, one thread a rank: wall time (the slowest rank), and on the rank that
//           computed longest (the critical path) its compute time and the time it was blocked
//           waiting for transfers; the bytes sent;
//   pass 5  the transfers alone: the same MPI_Isend / MPI_Irecv of one K/V block per step
//           with nothing to compute, whose time the ring would add if it hid nothing.
// Then the ring's rows are validated against the single-process rows (max |difference|).
// Hidden share = 1 - wait / transfers alone. Medians of the repetitions. ATTN_BENCH_SMOKE=1
// (ctest): tiny sizes, one repetition, no file.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <attn/attention.hpp>
#include <attn/distributed.hpp>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

using attn::Index;
using attn::distributed::SequenceSplit;

constexpr Index heads = 8, dim = 128;

void set_threads(int n) {
#if defined(_OPENMP)
  omp_set_num_threads(n);
#else
  (void)n;
#endif
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

double max_over_ranks(double x) {
  double worst = 0;
  MPI_Allreduce(&x, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return worst;
}

/// Waits for every rank without spinning: the ranks that wait leave the cores to rank 0.
void sleeping_barrier() {
  MPI_Request request = MPI_REQUEST_NULL;
  MPI_Ibarrier(MPI_COMM_WORLD, &request);
  int done = 0;
  while (done == 0) {
    MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (done == 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

attn::Tensor<float, 4> random_tensor(Index l, unsigned seed) {
  attn::Tensor<float, 4> t(1, heads, l, dim);
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (Index n = 0; n < t.size(); ++n)
    t.data()[n] = normal(gen);
  return t;
}

attn::Tensor<float, 4> local_rows(const attn::Tensor<float, 4>& global,
                                  const std::vector<attn::distributed::TokenRun>& runs) {
  const Index n = runs.empty() ? 0 : runs.back().local_begin + runs.back().size();
  attn::Tensor<float, 4> local(1, heads, n, dim);
  for (Index h = 0; h < heads; ++h)
    for (const auto& r : runs)
      for (Index i = 0; i < r.size(); ++i)
        for (Index e = 0; e < dim; ++e)
          local(0, h, r.local_begin + i, e) = global(0, h, r.begin + i, e);
  return local;
}

struct Record {
  Index length = 0;
  bool causal = false;
  SequenceSplit split = SequenceSplit::contiguous;
  double single_seconds = 0, ring_seconds = 0, compute_seconds = 0, wait_seconds = 0;
  double transfer_seconds = 0, max_difference = 0, flops = 0;
  long long bytes_sent = 0;
  int blocks_computed = 0;
};

/// pass 5: the ring's transfers of one length without the compute (the slowest rank's time).
double transfers_alone(const attn::distributed::detail::RingLayout& layout) {
  std::vector<float> a(static_cast<std::size_t>(layout.max_kv_elements())), b(a.size());
  attn::distributed::detail::RingTransfer<float> transfer("transfers_alone", MPI_COMM_WORLD, 300);
  MPI_Barrier(MPI_COMM_WORLD);
  const double start = MPI_Wtime();
  for (int step = 0; step + 1 < layout.ranks; ++step) {
    const int source = (layout.rank + layout.ranks - step) % layout.ranks;
    const int incoming = (source + layout.ranks - 1) % layout.ranks;
    transfer.start(a.data(), layout.kv_elements(source), layout.next(), b.data(),
                   layout.kv_elements(incoming), layout.previous(), nullptr);
    transfer.wait(nullptr);
    std::swap(a, b);
  }
  return max_over_ranks(MPI_Wtime() - start);
}

Record measure(Index length, bool causal, SequenceSplit split, int repetitions, Index query_chunk) {
  const int P = [] {
    int p = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &p);
    return p;
  }();
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  Record r;
  r.length = length;
  r.causal = causal;
  r.split = split;
  // pass 1: inputs
  const auto q = random_tensor(length, 1), k = random_tensor(length, 2),
             v = random_tensor(length, 3);
  const auto runs = attn::distributed::token_runs(split, length, P, rank);
  const auto lq = local_rows(q, runs), lk = local_rows(k, runs), lv = local_rows(v, runs);
  attn::AttentionOptions<float> options;
  options.causal = causal ? attn::Causal::top_left : attn::Causal::none;
  attn::Tensor<float, 4> out(1, heads, lq.dimension(2), dim), single(1, heads, length, dim);
  attn::distributed::RingStats stats;
  const auto ring = [&] {
    attn::distributed::ring_attention_into<float>(
        attn::bhld_view(lq), attn::bhld_view(lk), attn::bhld_view(lv), attn::bhld_view(out),
        options, {split, &stats, query_chunk}, MPI_COMM_WORLD);
  };
  // pass 2: one ring (a warm-up, and the rows to validate)
  set_threads(1);
  ring();
  // passes 3 and 4, interleaved (A/B) so that a change of the machine's load between them
  // falls on both: the single-process call with P threads on rank 0, then the ring.
  std::vector<double> single_times, wall, compute, wait;
  for (int rep = 0; rep < repetitions; ++rep) {
    if (rank == 0) {
      set_threads(P);
      const double start = MPI_Wtime();
      attn::scaled_dot_product_attention_into<float>(attn::bhld_view(q), attn::bhld_view(k),
                                                     attn::bhld_view(v), attn::bhld_view(single),
                                                     options);
      single_times.push_back(MPI_Wtime() - start);
      set_threads(1);
    }
    sleeping_barrier();
    ring();
    wall.push_back(max_over_ranks(stats.total_seconds));
    // The critical rank (the longest compute): its wait is communication the ring exposed;
    // the others' waits include waiting for it (load imbalance).
    const double mine[2] = {stats.compute_seconds, stats.wait_seconds};
    std::vector<double> all(2 * static_cast<std::size_t>(P));
    MPI_Allgather(mine, 2, MPI_DOUBLE, all.data(), 2, MPI_DOUBLE, MPI_COMM_WORLD);
    std::size_t critical = 0;
    for (std::size_t n = 1; n < static_cast<std::size_t>(P); ++n)
      critical = all[2 * n] > all[2 * critical] ? n : critical;
    compute.push_back(all[2 * critical]);
    wait.push_back(all[2 * critical + 1]);
  }
  r.single_seconds = rank == 0 ? median(single_times) : 0;
  MPI_Bcast(&r.single_seconds, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  // validate: each rank's rows of the ring against rank 0's single-process rows
  MPI_Bcast(single.data(), static_cast<int>(single.size()), MPI_FLOAT, 0, MPI_COMM_WORLD);
  double difference = 0;
  for (Index h = 0; h < heads; ++h)
    for (const auto& run : runs)
      for (Index i = 0; i < run.size(); ++i)
        for (Index e = 0; e < dim; ++e)
          difference = std::max(difference, double(std::abs(out(0, h, run.local_begin + i, e) -
                                                            single(0, h, run.begin + i, e))));
  r.max_difference = max_over_ranks(difference);
  r.ring_seconds = median(wall);
  r.compute_seconds = median(compute);
  r.wait_seconds = median(wait);
  r.bytes_sent = stats.bytes_sent;
  r.blocks_computed = stats.blocks_computed;
  // pass 5: the transfers alone
  attn::distributed::detail::RingLayout layout;
  layout.ranks = P;
  layout.rank = rank;
  layout.batch = 1;
  layout.kv_heads = heads;
  layout.dim = dim;
  layout.value_dim = dim;
  layout.k_rows.reserve(static_cast<std::size_t>(P));
  for (int s = 0; s < P; ++s)
    layout.k_rows.push_back(attn::distributed::local_length(split, length, P, s));
  std::vector<double> alone(static_cast<std::size_t>(repetitions));
  for (double& seconds : alone)
    seconds = transfers_alone(layout);
  r.transfer_seconds = median(alone);
  // The FLOPs of the whole problem (4 L^2 D H, half of it under the causal mask).
  r.flops = 4.0 * double(length) * double(length) * dim * heads * (causal ? 0.5 : 1.0);
  return r;
}

std::string json_of(const std::vector<Record>& records, int ranks, int repetitions) {
  std::ostringstream s;
  char host[256] = {};
  int host_length = 0;
  MPI_Get_processor_name(host, &host_length);
  double load[3] = {0, 0, 0};
  if (getloadavg(load, 3) < 0)
    load[0] = -1;
  const auto now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  char date[64] = {};
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%S", std::gmtime(&now));
  // "name": value pairs, strings quoted.
  const auto text = [](const std::string& x) { return R"(")" + x + R"(")"; };
  const auto pair = [&](const char* name, const auto& value) {
    std::ostringstream p;
    p << text(name) << ": " << value;
    return p.str();
  };
  s << "{\n  " << text("context") << ": {" << pair("date", text(date)) << ", "
    << pair("host_name", text(host)) << ", " << pair("ranks", ranks) << ", "
    << pair("repetitions", repetitions) << ", " << text("load_avg") << ": [" << load[0] << ", "
    << load[1] << ", " << load[2] << "], "
    << pair("problem", text("B 1, Hq = Hkv = " + std::to_string(heads) +
                            ", D = Dv = " + std::to_string(dim) + ", float"))
    << "},\n  " << text("runs") << ": [\n";
  for (std::size_t n = 0; n < records.size(); ++n) {
    const Record& r = records[n];
    s << "    {" << pair("length", r.length) << ", " << pair("causal", r.causal ? "true" : "false")
      << ", " << pair("split", text(attn::distributed::split_name(r.split))) << ", "
      << pair("single_seconds", r.single_seconds) << ", " << pair("ring_seconds", r.ring_seconds)
      << ", " << pair("ring_compute_seconds", r.compute_seconds) << ", "
      << pair("ring_wait_seconds", r.wait_seconds) << ", "
      << pair("transfers_alone_seconds", r.transfer_seconds) << ", "
      << pair("bytes_sent_per_rank", r.bytes_sent) << ", "
      << pair("blocks_computed", r.blocks_computed) << ", " << pair("flops", r.flops) << ", "
      << pair("max_difference", r.max_difference) << "}" << (n + 1 < records.size() ? "," : "")
      << "\n";
  }
  s << "  ]\n}\n";
  return s.str();
}

}  // namespace

namespace {

int run(int argc, char** argv) {
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const char* smoke = std::getenv("ATTN_BENCH_SMOKE");
  const bool is_smoke = smoke != nullptr && std::string(smoke) == "1";
  std::vector<Index> lengths = is_smoke ? std::vector<Index>{256} : std::vector<Index>{8192, 32768};
  int repetitions = is_smoke ? 1 : 3;
  Index query_chunk = attn::distributed::RingOptions{}.query_chunk;
  std::string json_path;
  for (int a = 1; a + 1 < argc; a += 2) {
    const std::string flag = argv[a], value = argv[a + 1];
    if (flag == "--json") {
      json_path = value;
    } else if (flag == "--repetitions") {
      repetitions = std::max(1, std::atoi(value.c_str()));
    } else if (flag == "--query-chunk") {
      query_chunk = std::atol(value.c_str());
    } else if (flag == "--lengths") {
      lengths.clear();
      std::stringstream list(value);
      for (std::string item; std::getline(list, item, ',');)
        lengths.push_back(std::atol(item.c_str()));
    }
  }
  std::vector<Record> records;
  for (const Index length : lengths) {
    for (const bool causal : {true, false}) {
      const SequenceSplit split = causal ? SequenceSplit::zigzag : SequenceSplit::contiguous;
      const Record r = measure(length, causal, split, repetitions, query_chunk);
      records.push_back(r);
      if (rank == 0) {
        const double hidden =
            r.transfer_seconds > 0 ? std::max(0.0, 1.0 - r.wait_seconds / r.transfer_seconds) : 1.0;
        std::printf(
            "L %6ld %-10s %-10s single (%d threads) %8.3f s | ring (%d x 1 thread) %8.3f s "
            "(%.2fx), compute %.3f s, wait %.4f s, transfers alone %.4f s: %.0f%% hidden, "
            "%.1f MB sent a rank, max |ring - single| %.2g\n",
            static_cast<long>(length), r.causal ? "causal" : "not causal",
            attn::distributed::split_name(r.split), ranks, r.single_seconds, ranks, r.ring_seconds,
            r.single_seconds / r.ring_seconds, r.compute_seconds, r.wait_seconds,
            r.transfer_seconds, 100 * hidden, double(r.bytes_sent) / 1e6, r.max_difference);
        std::fflush(stdout);
      }
    }
  }
  int status = 0;
  for (const Record& r : records)
    status |= r.max_difference > 1e-4 ? 1 : 0;  // validation: the ring computes the same thing
  if (rank == 0 && !json_path.empty()) {
    std::ofstream(json_path) << json_of(records, ranks, repetitions);
    std::printf("wrote %s\n", json_path.c_str());
  }
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int status = 1;
  try {
    status = run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_distributed_ring: %s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
  return status;
}
