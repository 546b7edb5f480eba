// The flash backward on bf16 dot products (Isa::avx512_bf16, kernels/bf16_backward.hpp), asked
// for with ComputePrecision::bf16. On that level: against the long double gradients of the same
// inputs (values of bfloat16), within twice the error of a plain float implementation that rounds
// the weights p f and the score gradients scale ds to bfloat16 before the products that read them
// (support/reference.hpp's GradientRounding), for every mask kind, dropout, tiles around the edges,
// odd D, Dv != D and grouped-query heads; float inputs rounded as they are read; bfloat16 storage
// the float result rounded once; the same bits for any thread count; NaN propagates; accuracy
// against the unrounded reference on typical inputs; Dv = 0 (zero dq and dk, NaN still
// propagates). On every other level the same calls give
// the fp32 bits.
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <attn/attention.hpp>
#include <attn/attention_backward.hpp>
#include <attn/cpu.hpp>

#include "support/bf16.hpp"
#include "support/heads.hpp"
#include "support/masked_problem.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using attn::Index;
using attn_test::bf16_level;
using attn_test::Heads;
using attn_test::max_error;
using attn_test::random_heads;
using attn_test::round_to_bf16;
using attn_test::reference::Problem;

/// x with every value rounded to bfloat16 (kept as float).
Heads<float> bf16_values(Heads<float> x) {
  for (float& e : x.data)
    e = round_to_bf16(e);
  return x;
}

/// q, k, v, dout of one problem, with the forward's out and lse (fp32 products).
struct Inputs {
  Heads<float> q, k, v, dout, out;
  std::vector<float> lse;
};

/// x.out and x.lse: the forward of x.q, x.k, x.v (fp32 products).
void run_forward(Inputs& x, const attn::AttentionOptions<float>& options) {
  attn::AttentionOptions<float> forward = options;
  forward.compute = attn::ComputePrecision::fp32;
  attn::scaled_dot_product_attention_into<float>(
      x.q.cview(), x.k.cview(), x.v.cview(),
      attn::AttentionOutputViews{x.out.view(), attn::bhl_view(x.lse.data(), x.q.b, x.q.h, x.q.l)},
      forward);
}

Inputs make_inputs(const Problem& p, const attn::AttentionOptions<float>& options,
                   std::mt19937& rng, bool representable) {
  const auto draw = [&](Index h, Index l, Index d) {
    Heads<float> x = random_heads<float>(p.batch, h, l, d, rng, 1.5);
    return representable ? bf16_values(x) : x;
  };
  Inputs x{draw(p.q_heads, p.q_length, p.dim),
           draw(p.kv_heads, p.k_length, p.dim),
           draw(p.kv_heads, p.k_length, p.value_dim),
           draw(p.q_heads, p.q_length, p.value_dim),
           Heads<float>(p.batch, p.q_heads, p.q_length, p.value_dim),
           std::vector<float>(static_cast<std::size_t>(p.batch * p.q_heads * p.q_length))};
  run_forward(x, options);
  return x;
}

struct Grads {
  std::vector<float> dq, dk, dv;
};

/// The backward of x in storage S (float, or the same values as bfloat16, which must be
/// representable), the gradients widened to float.
template <class S>
Grads backward(const Inputs& x, const attn::AttentionOptions<float>& options) {
  const Heads<S> q = x.q.cast<S>(), k = x.k.cast<S>(), v = x.v.cast<S>(), out = x.out.cast<S>(),
                 dout = x.dout.cast<S>();
  Heads<S> dq(q.b, q.h, q.l, q.d), dk(k.b, k.h, k.l, k.d), dv(v.b, v.h, v.l, v.d);
  attn::scaled_dot_product_attention_backward_into<S>(
      q.cview(), k.cview(), v.cview(), out.cview(), attn::bhl_view(x.lse.data(), q.b, q.h, q.l),
      dout.cview(), {dq.view(), dk.view(), dv.view()}, options);
  const auto widened = [](const Heads<S>& g) {
    return std::vector<float>(g.data.begin(), g.data.end());
  };
  return {widened(dq), widened(dk), widened(dv)};
}

/// One problem: the bf16 backward against the long double gradients, each within twice a
/// plain implementation's error that rounds as the kernel does (off the bf16 level: the fp32
/// bits).
void check_problem(Problem p, int kind, Index query_tile, Index key_tile, std::mt19937& rng) {
  attn_test::round_numbers_to<float>(p);
  attn_test::AttnOptions<float> o(p);
  o.options.algorithm = attn::Algorithm::flash;
  o.options.query_tile = query_tile;
  o.options.key_tile = key_tile;
  INFO(attn_test::describe(p, kind) << ", tiles " << query_tile << " x " << key_tile << ", "
                                    << attn::isa_name(attn::active_isa()));
  const Inputs x = make_inputs(p, o.options, rng, true);
  attn::AttentionOptions<float> bf16 = o.options;
  bf16.compute = attn::ComputePrecision::bf16;
  const Grads got = backward<float>(x, bf16);
  if (!bf16_level()) {
    const Grads fp32 = backward<float>(x, o.options);
    CHECK(got.dq == fp32.dq);
    CHECK(got.dk == fp32.dk);
    CHECK(got.dv == fp32.dv);
    return;
  }
  const auto qe = attn_test::exact(x.q), ke = attn_test::exact(x.k), ve = attn_test::exact(x.v),
             de = attn_test::exact(x.dout);
  const auto truth = attn_test::reference::gradients<long double>(p, qe, ke, ve, de);
  const auto to_bf16 = [](float e) { return round_to_bf16(e); };
  const auto plain = attn_test::reference::gradients<float>(p, qe, ke, ve, de, {to_bf16, to_bf16});
  const auto check = [](const char* name, const std::vector<float>& actual,
                        const std::vector<long double>& expected,
                        const std::vector<float>& rounded) {
    const double error = max_error(actual, expected);
    const double plain_error = max_error(rounded, expected);
    INFO(name << ": error " << error << ", plain bf16 error " << plain_error);
    CHECK(error <= attn_test::error_bound<float>(plain_error));
  };
  check("dq", got.dq, truth.dq, plain.dq);
  check("dk", got.dk, truth.dk, plain.dk);
  check("dv", got.dv, truth.dv, plain.dv);
}

}  // namespace

TEST_CASE("bf16 backward: within twice a plain bf16 implementation's error", "[isa][bf16]") {
  std::mt19937 rng(3401);
  struct Sizes {
    Index batch, q_heads, kv_heads, q_length, k_length, dim, value_dim, query_tile, key_tile;
  };
  // tiles around the edges: odd query tiles and rows (a pair of rows padded with zeros), odd
  // key tiles and keys, odd D and Dv, Dv != D, one query; the default tiles (at D = 128 on
  // AVX-512 128 x 256, cut by 130 rows and 300 keys)
  const Sizes sizes[] = {{2, 4, 2, 37, 91, 8, 8, 5, 7},
                         {1, 3, 1, 53, 17, 33, 24, 16, 16},
                         {1, 2, 2, 1, 40, 16, 16, 0, 0},
                         {1, 2, 1, 70, 130, 64, 40, 0, 0},
                         {1, 2, 1, 130, 300, 128, 128, 0, 0}};
  for (const Sizes& z : sizes) {
    for (int kind = 0; kind < attn_test::mask_kinds; ++kind) {
      if (z.q_length * z.k_length > 10000 && kind != 0 && kind != 2 && kind != 12)
        continue;  // the largest under three mask kinds: the reference's time grows with it
      check_problem(attn_test::masked_problem(z.batch, z.q_heads, z.kv_heads, z.q_length,
                                              z.k_length, z.dim, z.value_dim, kind, rng),
                    kind, z.query_tile, z.key_tile, rng);
    }
  }
  for (const int kind : {0, 2, 10}) {  // dropout: dv reads p f, rounded
    Problem p = attn_test::masked_problem(2, 2, 1, 45, 77, 16, 24, kind, rng);
    p.dropout_p = 0.3L;
    p.dropout_seed = 3402u + static_cast<unsigned>(kind);
    check_problem(p, kind, 16, 32, rng);
  }
}

TEST_CASE(
    "bf16 backward: float inputs are rounded as read, bfloat16 storage rounds the result once",
    "[isa][bf16]") {
  std::mt19937 rng(3403);
  // (Dv = 16 as in test_backward's 16-bit case: the rows' deltas, dout . out, are then summed
  // in the same order from the widened rows as from the float ones)
  const Problem p = attn_test::masked_problem(1, 4, 2, 75, 150, 48, 16, 1, rng);
  attn_test::AttnOptions<float> o(p);
  o.options.algorithm = attn::Algorithm::flash;
  o.options.compute = attn::ComputePrecision::bf16;
  Inputs x = make_inputs(p, o.options, rng, false);
  x.out = bf16_values(x.out);  // the same out for both storages
  const Grads from_floats = backward<float>(x, o.options);
  Inputs rounded = x;
  for (Heads<float>* h : {&rounded.q, &rounded.k, &rounded.v, &rounded.dout})
    *h = bf16_values(*h);
  const Grads from_rounded = backward<float>(rounded, o.options);
  if (bf16_level()) {  // the kernel reads float inputs as their bfloat16 roundings
    CHECK(from_floats.dq == from_rounded.dq);
    CHECK(from_floats.dk == from_rounded.dk);
    CHECK(from_floats.dv == from_rounded.dv);
  } else {
    CHECK(from_floats.dq != from_rounded.dq);
  }
  // bfloat16 storage: the float storage's gradients of the same values, each rounded once
  const Grads stored = backward<Eigen::bfloat16>(rounded, o.options);
  const auto rounded_once = [](std::vector<float> g) {
    for (float& e : g)
      e = static_cast<float>(Eigen::bfloat16(e));
    return g;
  };
  CHECK(stored.dq == rounded_once(from_rounded.dq));
  CHECK(stored.dk == rounded_once(from_rounded.dk));
  CHECK(stored.dv == rounded_once(from_rounded.dv));
}

TEST_CASE("bf16 backward: what the plan says, and fp32 wherever it does not apply", "[isa][bf16]") {
  attn::AttentionShape shape{1, 8, 8, 512, 512, 64, 64};
  shape.bf16_readable_kv = true;
  attn::AttentionOptions<float> options;
  CHECK_FALSE(attn::plan_backward<float>(shape, options).bf16_products);  // fp32 by default
  options.compute = attn::ComputePrecision::bf16;
  const attn::KernelPlan plan = attn::plan_backward<float>(shape, options);
  CHECK(plan.bf16_products == bf16_level());
  CHECK((plan.describe().find("bf16 products") != std::string::npos) == bf16_level());
  // never: half storage, the naive backward, double
  attn::AttentionShape half = shape;
  half.bf16_readable_kv = false;
  CHECK_FALSE(attn::plan_backward<float>(half, options).bf16_products);
  attn::AttentionOptions<float> naive = options;
  naive.algorithm = attn::Algorithm::naive;
  CHECK_FALSE(attn::plan_backward<float>(shape, naive).bf16_products);
  attn::AttentionOptions<double> in_double;
  in_double.compute = attn::ComputePrecision::bf16;
  CHECK_FALSE(attn::plan_backward<double>(shape, in_double).bf16_products);
  // half storage through the public call: the fp32 bits
  std::mt19937 rng(3404);
  const Problem p = attn_test::masked_problem(1, 2, 1, 40, 60, 16, 16, 2, rng);
  attn_test::AttnOptions<float> o(p);
  o.options.algorithm = attn::Algorithm::flash;
  const Inputs x = make_inputs(p, o.options, rng, true);
  const Grads fp32 = backward<Eigen::half>(x, o.options);
  o.options.compute = attn::ComputePrecision::bf16;
  const Grads asked = backward<Eigen::half>(x, o.options);
  CHECK(asked.dq == fp32.dq);
  CHECK(asked.dk == fp32.dk);
  CHECK(asked.dv == fp32.dv);
}

TEST_CASE("bf16 backward: the same bits for any thread count, and NaN propagates", "[isa][bf16]") {
  std::mt19937 rng(3405);
  const Problem p = attn_test::masked_problem(2, 4, 2, 150, 260, 64, 64, 2, rng);
  attn_test::AttnOptions<float> o(p);
  o.options.algorithm = attn::Algorithm::flash;
  o.options.query_tile = 32;
  o.options.key_tile = 64;
  o.options.compute = attn::ComputePrecision::bf16;
  Inputs x = make_inputs(p, o.options, rng, true);
#ifdef _OPENMP
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const Grads one = backward<float>(x, o.options);
  omp_set_num_threads(3);
  const Grads three = backward<float>(x, o.options);
  omp_set_num_threads(threads);
  CHECK(one.dq == three.dq);
  CHECK(one.dk == three.dk);
  CHECK(one.dv == three.dv);
#endif
  // A NaN in dout (b 0, query head 1, row 7) reaches that row's dq and the dk and dv of
  // every key the row sees (kv head 0), and nothing of the other batch.
  x.dout.data[static_cast<std::size_t>((1 * 150 + 7) * 64 + 5)] = std::nanf("");
  const Grads nan = backward<float>(x, o.options);
  CHECK(std::isnan(nan.dq[static_cast<std::size_t>((1 * 150 + 7) * 64)]));
  CHECK(std::isnan(nan.dv[static_cast<std::size_t>(0 * 64 + 5)]));  // key 0: seen by every row
  CHECK(std::isnan(nan.dk[0]));
  const auto finite_from = [](const std::vector<float>& g, std::size_t first) {
    return std::all_of(g.begin() + static_cast<std::ptrdiff_t>(first), g.end(),
                       [](float e) { return std::isfinite(e); });
  };
  CHECK(finite_from(nan.dq, static_cast<std::size_t>(4 * 150 * 64)));  // batch 1
  CHECK(finite_from(nan.dk, static_cast<std::size_t>(2 * 260 * 64)));
  CHECK(finite_from(nan.dv, static_cast<std::size_t>(2 * 260 * 64)));
}

TEST_CASE("bf16 backward: accuracy against the unrounded reference on typical inputs",
          "[isa][bf16]") {
  // Float q, k, v, dout of N(0, 1), compared with the long double gradients of the float values
  // themselves: the rounding of q, k, v, dout, p f and ds to bfloat16 is now part of the
  // error (docs/precision.md quotes these figures). Relative L1 = sum |g - r| / sum |r|.
  std::mt19937 rng(3406);
  for (const Index dim : {64, 128}) {
    Problem p = attn_test::sized_problem(1, 1, 1, 256, 512, dim, dim);
    attn::AttentionOptions<float> options;
    options.algorithm = attn::Algorithm::flash;
    Inputs x = make_inputs(p, options, rng, false);
    const auto truth = attn_test::reference::gradients<long double>(
        p, attn_test::exact(x.q), attn_test::exact(x.k), attn_test::exact(x.v),
        attn_test::exact(x.dout));
    const auto relative_l1 = [](const std::vector<float>& g, const std::vector<long double>& r) {
      long double diff = 0, sum = 0;
      for (std::size_t i = 0; i < r.size(); ++i) {
        diff += std::abs(g[i] - r[i]);
        sum += std::abs(r[i]);
      }
      return static_cast<double>(diff / sum);
    };
    const Grads fp32 = backward<float>(x, options);
    options.compute = attn::ComputePrecision::bf16;
    const Grads bf16 = backward<float>(x, options);
    const double errors[] = {relative_l1(bf16.dq, truth.dq), relative_l1(bf16.dk, truth.dk),
                             relative_l1(bf16.dv, truth.dv)};
    const double fp32_error = relative_l1(fp32.dq, truth.dq);
    INFO("D " << dim << ", " << attn::isa_name(attn::active_isa()) << ": bf16 relative L1 dq "
              << errors[0] << ", dk " << errors[1] << ", dv " << errors[2] << "; fp32 dq "
              << fp32_error);
    CHECK(fp32_error < 1e-5);
    for (const double e : errors) {
      if (bf16_level()) {
        CHECK(e < 0.03);
        CHECK(e > 100 * fp32_error);  // the bf16 path did run
      } else {
        CHECK(e < 1e-5);  // the fp32 path
      }
    }
  }
}

TEST_CASE("bf16 backward: Dv = 0 gives zero dq and dk, and NaN still propagates", "[isa][bf16]") {
  // With no values the loss cannot depend on the scores: dp and the rows' deltas are empty
  // sums, so ds = p (0 - 0) = 0 wherever p is finite, and dq = dk = 0 exactly (the closed
  // form) on every level. A NaN query makes its row's p NaN, and NaN 0 = NaN reaches that
  // row's dq and the dk of the keys it sees, as in the fp32 backward.
  std::mt19937 rng(3406);
  const Problem p = attn_test::masked_problem(1, 4, 2, 40, 70, 32, 0, 1, rng);
  attn_test::AttnOptions<float> o(p);
  o.options.algorithm = attn::Algorithm::flash;
  o.options.query_tile = 16;
  o.options.key_tile = 32;
  attn::AttentionOptions<float> bf16 = o.options;
  bf16.compute = attn::ComputePrecision::bf16;
  attn::AttentionShape shape{1, 4, 2, 40, 70, 32, 0};
  shape.bf16_readable_kv = true;  // float storage, as the public call sets it
  CHECK(attn::plan_backward<float>(shape, bf16).bf16_products == bf16_level());
  Inputs x = make_inputs(p, o.options, rng, true);
  const Grads got = backward<float>(x, bf16);
  const auto zeros = [](const std::vector<float>& g) {
    return std::all_of(g.begin(), g.end(), [](float e) { return e == 0.0f; });
  };
  CHECK(got.dq.size() == static_cast<std::size_t>(4 * 40 * 32));
  CHECK(got.dk.size() == static_cast<std::size_t>(2 * 70 * 32));
  CHECK(zeros(got.dq));
  CHECK(zeros(got.dk));
  CHECK(got.dv.empty());

  x.q.data[static_cast<std::size_t>((1 * 40 + 9) * 32 + 3)] = std::nanf("");  // head 1, row 9
  run_forward(x, o.options);                                                  // the NaN row's lse
  const Grads nan = backward<float>(x, bf16);
  const Grads fp32 = backward<float>(x, o.options);
  const auto nan_pattern = [](const std::vector<float>& g) {
    std::vector<bool> pattern(g.size());
    for (std::size_t n = 0; n < g.size(); ++n)
      pattern[n] = std::isnan(g[n]);
    return pattern;
  };
  CHECK(std::isnan(nan.dq[static_cast<std::size_t>((1 * 40 + 9) * 32)]));
  CHECK(std::isnan(nan.dk[0]));  // key 0 of kv head 0: seen by row 9 of head 1
  CHECK(nan.dq[0] == 0.0f);      // head 0, row 0: no NaN among the keys it sees
  CHECK(nan_pattern(nan.dq) == nan_pattern(fp32.dq));
  CHECK(nan_pattern(nan.dk) == nan_pattern(fp32.dk));
}
