// Ring attention over packed sequences (RingOptions::cu_seqlens_q, cu_seqlens_k): the token
// streams split across the ranks, every option per sequence; forward and backward equal each
// sequence's single-process call and the long double reference within twice the plain
// loops' error, sequences crossing rank boundaries and empty ones included.
#include <catch2/catch.hpp>

#include <map>
#include <string>
#include <vector>

#include <attn/attention_backward.hpp>
#include <attn/distributed/ring.hpp>
#include <attn/distributed/ring_backward.hpp>

#include "distributed/support.hpp"

namespace {

using attn::Index;
using attn::distributed::SequenceSplit;
using attn::distributed::token_runs;
using namespace attn_dist_test;

/// Rows [first, first + n) of a (1, H, T, X) tensor.
attn::Tensor<float, 4> rows_of(const attn::Tensor<float, 4>& x, Index first, Index n) {
  attn::Tensor<float, 4> r(1, x.dimension(1), n, x.dimension(3));
  for (Index h = 0; h < x.dimension(1); ++h)
    for (Index i = 0; i < n; ++i)
      for (Index e = 0; e < x.dimension(3); ++e)
        r(0, h, i, e) = x(0, h, first + i, e);
  return r;
}

/// Each sequence's (1, H, n_b, X) values written back at its rows of a (1, H, T, X) stream.
template <class V>
void place(std::vector<V>& stream, const std::vector<V>& part, Index heads, Index tokens,
           Index first, Index n, Index width) {
  for (Index h = 0; h < heads; ++h)
    for (Index i = 0; i < n; ++i)
      for (Index e = 0; e < width; ++e)
        stream[static_cast<std::size_t>((h * tokens + first + i) * width + e)] =
            part[static_cast<std::size_t>((h * n + i) * width + e)];
}

struct Expected {
  std::vector<long double> truth;
  std::vector<float> plain, single;
};

void check_packed(const std::string& name, const std::vector<Index>& cu_q,
                  const std::vector<Index>& cu_k, const attn::AttentionOptions<float>& o,
                  SequenceSplit split) {
  const int P = comm_size(), rank = comm_rank();
  const Index Hq = 4, Hkv = 2, D = 8, Dv = 6, Tq = cu_q.back(), Tk = cu_k.back();
  const auto q = random_tensor<float>(1, Hq, Tq, D, 41);
  const auto k = random_tensor<float>(1, Hkv, Tk, D, 42);
  const auto v = random_tensor<float>(1, Hkv, Tk, Dv, 43);
  const auto dout = random_tensor<float>(1, Hq, Tq, Dv, 44);
  const auto q_runs = token_runs(split, Tq, P, rank), k_runs = token_runs(split, Tk, P, rank);
  attn::distributed::RingOptions ring{split};
  ring.cu_seqlens_q = cu_q;
  ring.cu_seqlens_k = cu_k;
  ring.query_chunk = 4;
  const auto lq = local_rows(q, q_runs), lk = local_rows(k, k_runs), lv = local_rows(v, k_runs);
  const auto forward = attn::distributed::ring_attention<float>(lq, lk, lv, o, ring, MPI_COMM_WORLD,
                                                                attn::Return::logsumexp);
  const auto grads = attn::distributed::ring_attention_backward<float>(
      lq, lk, lv, forward.out, forward.logsumexp, local_rows(dout, q_runs), o, ring,
      MPI_COMM_WORLD);
  // Every sequence alone, by one process and by the reference.
  std::map<std::string, Expected> e;
  const auto sized = [&](const char* what, Index heads, Index tokens, Index width) {
    Expected& x = e[what];
    x.truth.assign(static_cast<std::size_t>(heads * tokens * width), 0.0L);
    x.plain.assign(x.truth.size(), 0.0f);
    x.single.assign(x.truth.size(), 0.0f);
  };
  sized("out", Hq, Tq, Dv);
  sized("lse", Hq, Tq, 1);
  sized("dq", Hq, Tq, D);
  sized("dk", Hkv, Tk, D);
  sized("dv", Hkv, Tk, Dv);
  for (std::size_t b = 0; b + 1 < cu_q.size(); ++b) {
    const Index q0 = cu_q[b], nq = cu_q[b + 1] - q0, k0 = cu_k[b], nk = cu_k[b + 1] - k0;
    const auto qs = rows_of(q, q0, nq), ks = rows_of(k, k0, nk), vs = rows_of(v, k0, nk);
    const auto ds = rows_of(dout, q0, nq);
    const auto one = attn::scaled_dot_product_attention(qs, ks, vs, o, attn::Return::logsumexp);
    const auto g =
        attn::scaled_dot_product_attention_backward(qs, ks, vs, one.out, one.logsumexp, ds, o);
    const ref::Problem p = reference_problem(o, 1, Hq, Hkv, nq, nk, D, Dv);
    const auto qe = as_long_double(qs), ke = as_long_double(ks), ve = as_long_double(vs),
               de = as_long_double(ds);
    const auto truth = ref::attention<long double>(p, qe, ke, ve);
    const auto plain = ref::attention<float>(p, qe, ke, ve);
    const auto truth_g = ref::gradients<long double>(p, qe, ke, ve, de);
    const auto plain_g = ref::gradients<float>(p, qe, ke, ve, de);
    const auto put = [&](const char* what, const auto& t, const auto& pl, const auto& si,
                         Index heads, Index tokens, Index first, Index n, Index width) {
      place(e[what].truth, t, heads, tokens, first, n, width);
      place(e[what].plain, pl, heads, tokens, first, n, width);
      place(e[what].single, as_vector(si), heads, tokens, first, n, width);
    };
    put("out", truth.out, plain.out, one.out, Hq, Tq, q0, nq, Dv);
    put("lse", truth.lse, plain.lse, one.logsumexp, Hq, Tq, q0, nq, 1);
    put("dq", truth_g.dq, plain_g.dq, g.dq, Hq, Tq, q0, nq, D);
    put("dk", truth_g.dk, plain_g.dk, g.dk, Hkv, Tk, k0, nk, D);
    put("dv", truth_g.dv, plain_g.dv, g.dv, Hkv, Tk, k0, nk, Dv);
  }
  INFO(name << ", " << attn::distributed::split_name(split) << ", rank " << rank << " of " << P);
  const auto check = [&](const char* what, const auto& actual, Index heads, Index tokens,
                         Index width, const auto& runs) {
    const Expected& x = e[what];
    const double bound = error_bound<float>(max_error(x.plain, x.truth));
    const double error =
        max_error(as_vector(actual), local_values(x.truth, 1, heads, tokens, width, runs));
    const double from_single =
        max_error(as_vector(actual), local_values(x.single, 1, heads, tokens, width, runs));
    INFO(what << ": error " << error << ", against one process " << from_single << ", bound "
              << bound);
    CHECK(error <= bound);
    CHECK(from_single <= bound);
  };
  check("out", forward.out, Hq, Tq, Dv, q_runs);
  check("lse", forward.logsumexp, Hq, Tq, 1, q_runs);
  check("dq", grads.dq, Hq, Tq, D, q_runs);
  check("dk", grads.dk, Hkv, Tk, D, k_runs);
  check("dv", grads.dv, Hkv, Tk, Dv, k_runs);
}

}  // namespace

TEST_CASE("ring attention over packed sequences equals each sequence alone",
          "[distributed][ring][packed]") {
  for (const SequenceSplit split : {SequenceSplit::contiguous, SequenceSplit::zigzag}) {
    attn::AttentionOptions<float> o;
    o.causal = attn::Causal::top_left;
    check_packed("self, causal, an empty sequence", {0, 13, 13, 40, 47}, {0, 13, 13, 40, 47}, o,
                 split);
    o.causal = attn::Causal::bottom_right;
    check_packed("cross lengths, causal bottom-right", {0, 5, 20, 23}, {0, 17, 30, 41}, o, split);
    attn::AttentionOptions<float> w;
    w.window = {3, 2};
    w.sink_tokens = 2;
    w.sinks = {0.2f, -0.1f, 0.0f, 0.4f};
    check_packed("window, sink tokens, learned sinks", {0, 19, 31}, {0, 19, 31}, w, split);
  }
}

TEST_CASE("packed ring attention: offsets that do not fit are refused by every rank",
          "[distributed][ring][packed][errors]") {
  const int P = comm_size(), rank = comm_rank();
  const auto runs = token_runs(SequenceSplit::contiguous, 20, P, rank);
  const auto x = local_rows(random_tensor<float>(1, 2, 20, 8, 45), runs);
  attn::distributed::RingOptions ring{SequenceSplit::contiguous};
  ring.cu_seqlens_q = {0, 7, 19};
  ring.cu_seqlens_k = {0, 7, 19};
  CHECK_THROWS_WITH(attn::distributed::ring_attention<float>(x, x, x, {}, ring, MPI_COMM_WORLD),
                    Catch::Contains("ring_attention: ring.cu_seqlens_q is [0, 7, 19]: its last "
                                    "entry must equal the number of tokens, 20"));
  if (P < 2)
    return;
  ring.cu_seqlens_q = {0, 7, 20};
  ring.cu_seqlens_k = {0, rank == 1 ? Index(8) : Index(7), 20};
  CHECK_THROWS_WITH(attn::distributed::ring_attention<float>(x, x, x, {}, ring, MPI_COMM_WORLD),
                    Catch::Contains("ring.cu_seqlens_k[b] is 7 on rank 0 but 8 on rank 1"));
}
