// MLA's latent cache and absorbed projections (attn/latent_cache.hpp, attn/mla.hpp):
//   - the absorbed path through the library (mla_absorb_queries, LatentCache::attend,
//     mla_project_output) against the un-absorbed truth in long double, which materialises
//     every head's keys [c w_uk[h]^T ; k_rope] and values c w_uv[h] and runs ordinary
//     attention over H heads (support/reference.hpp, no attn code), at DeepSeek-V2-Lite's
//     sizes (H 16, C 512, R 64, P 128, Dv 128), Lq 1 to 8, ragged sequences in pages of 64
//     and of 100 filled in a shuffled order, float, half and q8_0, decode and flash;
//   - the cache against attention over one contiguous buffer whose V is a column view of K;
//   - the projections against plain loops, kv_b_proj's split;
//   - fork, truncate, the window ring, rotary keys on append, NaN, and every refusal.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <attn/attention.hpp>
#include <attn/latent_cache.hpp>
#include <attn/mla.hpp>
#include <attn/quantized.hpp>
#include <attn/rope.hpp>

#include "support/heads.hpp"
#include "support/masked_problem.hpp"
#include "support/reference.hpp"

namespace {

using attn::Index;
using attn_test::Heads;
namespace reference = attn_test::reference;

constexpr std::size_t at(Index i) {
  return static_cast<std::size_t>(i);
}

/// DeepSeek-V2-Lite's attention: 16 heads, a latent of 512, rotary keys of 64, the heads'
/// keys 128 + 64 and values 128; its scale 1 / sqrt(128 + 64).
struct Sizes {
  Index heads = 16, latent = 512, rope = 64, nope = 128, value = 128;
  float scale() const { return 1.0F / std::sqrt(static_cast<float>(nope + rope)); }
};

/// Rows [first, first + count) of sequence b of x, as a batch of one (a view of x's memory).
template <class T>
attn::HeadsView<const T> rows_of(const Heads<T>& x, Index b, Index first, Index count) {
  attn::HeadsView<const T> view = x.cview();
  view.data += b * view.batch_stride + first * view.row_stride;
  view.batch = 1;
  view.length = count;
  return view;
}

/// (H, rows, cols) of N(0, 1 / rows): products with N(0, 1) rows stay near N(0, 1).
attn::Tensor<float, 3> random_weights(Index heads, Index rows, Index cols, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0F, 1.0F / std::sqrt(static_cast<float>(rows)));
  attn::Tensor<float, 3> w(heads, rows, cols);
  for (Index i = 0; i < w.size(); ++i)
    w.data()[i] = normal(rng);
  return w;
}

attn::TensorMap<const float, 3> map(const attn::Tensor<float, 3>& w) {
  return {w.data(), w.dimension(0), w.dimension(1), w.dimension(2)};
}

/// The values a cache of S holds for float rows of `row` values: rounded to 16 bits, or
/// quantized to blocks and read back.
template <class S>
Heads<float> stored(const Heads<float>& x) {
  Heads<float> r = x;
  if constexpr (attn::is_16bit_scalar_v<S>) {
    for (float& e : r.data)
      e = static_cast<float>(static_cast<S>(e));
  } else if constexpr (attn::is_quantized_v<S>) {
    std::vector<S> blocks(at(x.d / attn::quantized_block_values));
    for (std::size_t first = 0; first < r.data.size(); first += at(x.d)) {
      attn::quantize_blocks(r.data.data() + first, x.d, blocks.data());
      attn::dequantize_blocks(blocks.data(), x.d / attn::quantized_block_values,
                              r.data.data() + first);
    }
  }
  return r;
}

/// The tokens of B ragged sequences and the heads' up-projections.
struct Model {
  Sizes z;
  std::vector<Index> lengths;   // (B)
  Index longest = 0;            //
  Heads<float> c, k_rope;       // (B, 1, longest, C), (B, 1, longest, R)
  attn::Tensor<float, 3> w_uk;  // (H, P, C)
  attn::Tensor<float, 3> w_uv;  // (H, C, Dv)
  Index batch() const { return static_cast<Index>(lengths.size()); }
};

Model make_model(const Sizes& z, std::vector<Index> lengths, std::mt19937& rng) {
  const auto batch = static_cast<Index>(lengths.size());
  const Index longest = *std::max_element(lengths.begin(), lengths.end());
  return {z,
          std::move(lengths),
          longest,
          attn_test::random_heads<float>(batch, 1, longest, z.latent, rng),
          attn_test::random_heads<float>(batch, 1, longest, z.rope, rng),
          random_weights(z.heads, z.nope, z.latent, rng),
          random_weights(z.heads, z.latent, z.value, rng)};
}

/// Every head's keys (B, H, longest, P + R) and values (B, H, longest, Dv) in long double,
/// from the latents and rotary keys as a cache holds them: K = [c w_uk[h]^T ; k_rope],
/// V = c w_uv[h]. The un-absorbed model, by plain loops.
struct Unabsorbed {
  std::vector<long double> k, v;
};

Unabsorbed materialise(const Model& m, const Heads<float>& c, const Heads<float>& k_rope) {
  const Sizes& z = m.z;
  const Index dim = z.nope + z.rope;
  Unabsorbed r{std::vector<long double>(at(m.batch() * z.heads * m.longest * dim)),
               std::vector<long double>(at(m.batch() * z.heads * m.longest * z.value))};
  std::vector<long double> row(at(z.latent));
  for (Index b = 0; b < m.batch(); ++b) {
    for (Index j = 0; j < m.lengths[at(b)]; ++j) {
      const float* cj = c.data.data() + (b * m.longest + j) * z.latent;
      for (Index x = 0; x < z.latent; ++x)
        row[at(x)] = cj[x];
      for (Index h = 0; h < z.heads; ++h) {
        long double* kj = r.k.data() + ((b * z.heads + h) * m.longest + j) * dim;
        long double* vj = r.v.data() + ((b * z.heads + h) * m.longest + j) * z.value;
        for (Index p = 0; p < z.nope; ++p) {
          const float* w = m.w_uk.data() + (h * z.nope + p) * z.latent;
          long double sum = 0;
          for (Index x = 0; x < z.latent; ++x)
            sum += row[at(x)] * w[x];
          kj[p] = sum;
        }
        for (Index e = 0; e < z.rope; ++e)
          kj[z.nope + e] = k_rope.data[at((b * m.longest + j) * z.rope + e)];
        for (Index e = 0; e < z.value; ++e) {
          long double sum = 0;
          for (Index x = 0; x < z.latent; ++x)
            sum += row[at(x)] * m.w_uv.data()[(h * z.latent + x) * z.value + e];
          vj[e] = sum;
        }
      }
    }
  }
  return r;
}

/// The reference's problem: the bottom-right causal mask at each sequence's length.
reference::Problem problem_of(const Model& m, Index q_length, Index kv_heads, Index dim,
                              Index value_dim) {
  reference::Problem p;
  p.batch = m.batch();
  p.q_heads = m.z.heads;
  p.kv_heads = kv_heads;
  p.q_length = q_length;
  p.k_length = m.longest;
  p.dim = dim;
  p.value_dim = value_dim;
  p.scale = static_cast<long double>(m.z.scale());
  p.causal = reference::Causal::bottom_right;
  p.key_lengths = m.lengths;
  return p;
}

/// The truth: ordinary attention over H heads of the materialised keys and values, for the
/// queries [q_nope ; q_rope] (B, H, Lq, P + R); out (B, H, Lq, Dv), lse (B, H, Lq).
reference::Result<long double> unabsorbed_truth(const Model& m, const Unabsorbed& kv,
                                                const Heads<float>& q_nope,
                                                const Heads<float>& q_rope) {
  const Sizes& z = m.z;
  const Index dim = z.nope + z.rope, rows = m.batch() * z.heads * q_nope.l;
  std::vector<long double> q(at(rows * dim));
  for (Index r = 0; r < rows; ++r) {
    for (Index e = 0; e < z.nope; ++e)
      q[at(r * dim + e)] = q_nope.data[at(r * z.nope + e)];
    for (Index e = 0; e < z.rope; ++e)
      q[at(r * dim + z.nope + e)] = q_rope.data[at(r * z.rope + e)];
  }
  return reference::attention<long double>(problem_of(m, q_nope.l, z.heads, dim, z.value), q, kv.k,
                                           kv.v);
}

/// A plain implementation of the absorbed path in float, the baseline of the error bound:
/// q_latent and out by sequential float loops, the attention of reference::attention<float>
/// over the stored rows [c ; k_rope] with V = c; out (B, H, Lq, Dv), lse (B, H, Lq).
reference::Result<float> plain_absorbed(const Model& m, const Heads<float>& c,
                                        const Heads<float>& k_rope, const Heads<float>& q_nope,
                                        const Heads<float>& q_rope) {
  const Sizes& z = m.z;
  const Index dim = z.latent + z.rope, rows = m.batch() * z.heads * q_nope.l;
  std::vector<long double> q(at(rows * dim));
  for (Index r = 0; r < rows; ++r) {
    const Index h = (r / q_nope.l) % z.heads;
    for (Index x = 0; x < z.latent; ++x) {
      float sum = 0;
      for (Index p = 0; p < z.nope; ++p)
        sum += q_nope.data[at(r * z.nope + p)] * m.w_uk.data()[(h * z.nope + p) * z.latent + x];
      q[at(r * dim + x)] = sum;
    }
    for (Index e = 0; e < z.rope; ++e)
      q[at(r * dim + z.latent + e)] = q_rope.data[at(r * z.rope + e)];
  }
  std::vector<long double> k(at(m.batch() * m.longest * dim)),
      v(at(m.batch() * m.longest * z.latent));
  for (Index t = 0; t < m.batch() * m.longest; ++t) {
    for (Index x = 0; x < z.latent; ++x)
      k[at(t * dim + x)] = v[at(t * z.latent + x)] = c.data[at(t * z.latent + x)];
    for (Index e = 0; e < z.rope; ++e)
      k[at(t * dim + z.latent + e)] = k_rope.data[at(t * z.rope + e)];
  }
  reference::Result<float> attended =
      reference::attention<float>(problem_of(m, q_nope.l, 1, dim, z.latent), q, k, v);
  const std::vector<float> o_latent = std::move(attended.out);
  std::vector<float> out(at(rows * z.value));
  for (Index r = 0; r < rows; ++r) {
    const Index h = (r / q_nope.l) % z.heads;
    for (Index e = 0; e < z.value; ++e) {
      float sum = 0;
      for (Index x = 0; x < z.latent; ++x)
        sum += o_latent[at(r * z.latent + x)] * m.w_uv.data()[(h * z.latent + x) * z.value + e];
      out[at(r * z.value + e)] = sum;
    }
  }
  attended.out = std::move(out);
  return attended;
}

/// A latent cache holding the model's tokens, appended in chunks of 1 to 90 tokens with the
/// sequences taking turns at random and a filler sequence grown and removed between them,
/// so that each sequence's pages come from all over the pool.
template <class S>
struct Filled {
  attn::LatentCache<S> cache;
  std::vector<Index> ids;  // the id of batch row b
};

template <class S>
Filled<S> fill(const Model& m, Index page_size, std::mt19937& rng) {
  Filled<S> r{attn::LatentCache<S>(m.z.latent, m.z.rope, page_size, 2), {}};
  for (Index b = 0; b < m.batch(); ++b)
    r.ids.push_back(r.cache.add_sequence());
  const Index filler = r.cache.add_sequence();
  const Heads<float> filler_c = attn_test::random_heads<float>(1, 1, 90, m.z.latent, rng);
  const Heads<float> filler_rope = attn_test::random_heads<float>(1, 1, 90, m.z.rope, rng);
  std::vector<Index> done(m.lengths.size(), 0);
  std::uniform_int_distribution<Index> chunk(1, 90);
  for (;;) {
    std::vector<Index> open;
    for (Index b = 0; b < m.batch(); ++b) {
      if (done[at(b)] < m.lengths[at(b)])
        open.push_back(b);
    }
    if (open.empty())
      break;
    const Index b = open[std::uniform_int_distribution<std::size_t>(0, open.size() - 1)(rng)];
    const Index first = done[at(b)], n = std::min(chunk(rng), m.lengths[at(b)] - first);
    r.cache.append({r.ids[at(b)]}, rows_of(m.c, b, first, n), rows_of(m.k_rope, b, first, n));
    done[at(b)] += n;
    const Index f = chunk(rng);
    r.cache.append({filler}, rows_of(filler_c, 0, 0, f), rows_of(filler_rope, 0, 0, f));
    if (chunk(rng) < 30) {
      r.cache.remove(filler);
      REQUIRE(r.cache.add_sequence() == filler);
    }
  }
  r.cache.remove(filler);
  return r;
}

attn::AttentionOptions<float> mla_options(const Sizes& z,
                                          attn::Algorithm algorithm = attn::Algorithm::automatic) {
  attn::AttentionOptions<float> options;
  options.scale = z.scale();
  options.algorithm = algorithm;
  return options;
}

/// What the absorbed path gives: out (B, H, Lq, Dv) and the log-sum-exp (B, H, Lq) of
/// LatentCache::attend.
struct Absorbed {
  Heads<float> out;
  std::vector<float> lse;
};

/// The absorbed path through the library.
template <class S>
Absorbed absorbed(const Model& m, const Filled<S>& filled, const Heads<float>& q_nope,
                  const Heads<float>& q_rope, attn::Algorithm algorithm) {
  const Sizes& z = m.z;
  const Index batch = m.batch(), q_length = q_nope.l;
  Heads<float> q_latent(batch, z.heads, q_length, z.latent + z.rope);
  Heads<float> o_latent(batch, z.heads, q_length, z.latent);
  Absorbed r{Heads<float>(batch, z.heads, q_length, z.value),
             std::vector<float>(at(batch * z.heads * q_length))};
  attn::mla_absorb_queries_into<float>(q_nope.cview(), q_rope.cview(), map(m.w_uk),
                                       q_latent.view());
  attn::AttentionOutputViews<float> outputs(o_latent.view());
  outputs.logsumexp = attn::bhl_view(r.lse.data(), batch, z.heads, q_length);
  filled.cache.attend_into(filled.ids, q_latent.cview(), outputs, mla_options(z, algorithm));
  attn::mla_project_output_into<float>(o_latent.cview(), map(m.w_uv), r.out.view());
  return r;
}

/// The absorbed path in format S, pages of 64 and 100, against the un-absorbed truth for
/// Lq = 1 to 8, its output and its log-sum-exp: within twice the error of the plain float
/// implementation of the absorbed path (FlashAttention's rule, support/masked_problem.hpp:
/// error_bound), both computed from the rows as the cache stores them.
template <class S>
void check_against_unabsorbed(const std::vector<attn::Algorithm>& algorithms) {
  std::mt19937 rng(3201);
  const Sizes z;
  const Model m = make_model(z, {130, 70, 9}, rng);
  const Heads<float> c = stored<S>(m.c), k_rope = stored<S>(m.k_rope);
  const Unabsorbed kv = materialise(m, c, k_rope);
  std::vector<Filled<S>> caches;
  for (const Index page_size : {Index(64), Index(100)})
    caches.push_back(fill<S>(m, page_size, rng));
  for (Index q_length = 1; q_length <= 8; ++q_length) {
    const Heads<float> q_nope = attn_test::random_heads<float>(3, z.heads, q_length, z.nope, rng);
    const Heads<float> q_rope = attn_test::random_heads<float>(3, z.heads, q_length, z.rope, rng);
    const reference::Result<long double> truth = unabsorbed_truth(m, kv, q_nope, q_rope);
    const reference::Result<float> plain = plain_absorbed(m, c, k_rope, q_nope, q_rope);
    const double plain_error = attn_test::max_error(plain.out, truth.out);
    const double plain_lse_error = attn_test::max_error(plain.lse, truth.lse);
    const double bound = attn_test::error_bound<float>(plain_error);
    const double lse_bound = attn_test::error_bound<float>(plain_lse_error);
    for (const Filled<S>& filled : caches) {
      for (const attn::Algorithm algorithm : algorithms) {
        const Absorbed got = absorbed(m, filled, q_nope, q_rope, algorithm);
        const double error = attn_test::max_error(got.out.data, truth.out);
        const double lse_error = attn_test::max_error(got.lse, truth.lse);
        INFO("Lq " << q_length << ", pages of " << filled.cache.page_size() << ", "
                   << attn::algorithm_name(algorithm));
        CAPTURE(error, plain_error, bound, lse_error, plain_lse_error, lse_bound);
        CHECK(error <= bound);
        CHECK(lse_error <= lse_bound);
      }
    }
  }
}

}  // namespace

TEST_CASE("MLA: the absorbed path equals the un-absorbed heads, float", "[mla][isa]") {
  check_against_unabsorbed<float>({attn::Algorithm::automatic, attn::Algorithm::flash});
}

TEST_CASE("MLA: the absorbed path equals the un-absorbed heads, half and q8_0", "[mla][isa]") {
  SECTION("half") {
    check_against_unabsorbed<Eigen::half>({attn::Algorithm::automatic});
  }
  SECTION("q8_0") {
    check_against_unabsorbed<attn::BlockQ8_0>({attn::Algorithm::automatic});
  }
}

namespace {

/// One contiguous buffer (B, 1, longest, C + R) of the rows [c ; k_rope], stored as S.
template <class S>
std::vector<S> contiguous_rows(const Model& m) {
  const Index dim = m.z.latent + m.z.rope;
  std::vector<S> rows(at(m.batch() * m.longest * dim));
  for (Index t = 0; t < m.batch() * m.longest; ++t) {
    for (Index x = 0; x < m.z.latent; ++x)
      rows[at(t * dim + x)] = static_cast<S>(m.c.data[at(t * m.z.latent + x)]);
    for (Index e = 0; e < m.z.rope; ++e)
      rows[at(t * dim + m.z.latent + e)] = static_cast<S>(m.k_rope.data[at(t * m.z.rope + e)]);
  }
  return rows;
}

/// Largest |a - b| / (1 + |b|); NaN counts as infinity.
double relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i]));
    if (std::isnan(d))
      return std::numeric_limits<double>::infinity();
    worst = std::max(worst, d / (1.0 + std::abs(static_cast<double>(b[i]))));
  }
  return worst;
}

/// The latent cache against scaled_dot_product_attention over one contiguous buffer whose V
/// is the first C columns of K (an overlapping k and v, which the checks accept): bit for bit
/// with pages of 64 under decode and for any page size under flash, within rounding otherwise.
template <class S>
void check_against_contiguous() {
  std::mt19937 rng(3202);
  const Sizes z;
  const Model m = make_model(z, {300, 129, 64}, rng);
  const Index dim = z.latent + z.rope;
  const std::vector<S> rows = contiguous_rows<S>(m);
  const attn::HeadsView<const S> k =
      attn::bhld_view(rows.data(), m.batch(), Index(1), m.longest, dim);
  attn::HeadsView<const S> v = k;
  v.dim = z.latent;  // the first C columns of the same rows: no copy
  for (const Index page_size : {Index(64), Index(100)}) {
    const Filled<S> filled = fill<S>(m, page_size, rng);
    for (const Index q_length : {Index(1), Index(4)}) {
      const Heads<float> q = attn_test::random_heads<float>(3, z.heads, q_length, dim, rng);
      for (const attn::Algorithm algorithm : {attn::Algorithm::decode, attn::Algorithm::flash}) {
        Heads<float> paged(3, z.heads, q_length, z.latent), contiguous = paged;
        attn::AttentionOptions<float> options = mla_options(z, algorithm);
        filled.cache.attend_into(filled.ids, q.cview(), paged.view(), options);
        options.causal = attn::Causal::bottom_right;
        options.key_lengths = m.lengths;
        attn::scaled_dot_product_attention_into<float, S>(q.cview(), k, v, contiguous.view(),
                                                          options);
        INFO("pages of " << page_size << ", Lq " << q_length << ", "
                         << attn::algorithm_name(algorithm));
        if (page_size % attn::decode_key_block == 0 || algorithm == attn::Algorithm::flash)
          CHECK(paged.data == contiguous.data);
        else
          CHECK(relative_difference(paged.data, contiguous.data) < 1e-5);
      }
    }
  }
}

}  // namespace

TEST_CASE("latent cache: pages read in place equal one contiguous buffer with V a view of K",
          "[mla][isa]") {
  SECTION("float") {
    check_against_contiguous<float>();
  }
  SECTION("half") {
    check_against_contiguous<Eigen::half>();
  }
}

namespace {

/// |x - the long double product| <= K eps sum |a_k b_k|: the bound of a float sum of K
/// products (recursive summation, FMA or not, any order of blocks).
template <class T>
void check_products(const char* what, const std::vector<long double>& expected,
                    const std::vector<long double>& magnitude, Index terms,
                    const std::vector<T>& actual) {
  const long double eps = std::numeric_limits<T>::epsilon();
  double worst = 0;
  bool within = true;
  for (std::size_t i = 0; i < expected.size(); ++i) {
    const long double error = std::abs(static_cast<long double>(actual[i]) - expected[i]);
    within = within && error <= static_cast<long double>(terms) * eps * magnitude[i];
    worst = std::max(worst, static_cast<double>(error));
  }
  INFO(what << ": worst error " << worst);
  CHECK(within);
}

template <class T>
void check_projections() {
  std::mt19937 rng(3203);
  const Index batch = 2, heads = 3, q_length = 5, nope = 24, latent = 40, rope = 8, value = 12;
  // (B, Lq, H, ...) layouts, as projections produce them: strided head views.
  const Heads<T> q_nope_tokens = attn_test::random_heads<T>(batch, q_length, heads, nope, rng);
  const Heads<T> q_rope_tokens = attn_test::random_heads<T>(batch, q_length, heads, rope, rng);
  const attn::HeadsView<const T> q_nope =
      attn::blhd_view(q_nope_tokens.data.data(), batch, q_length, heads, nope);
  const attn::HeadsView<const T> q_rope =
      attn::blhd_view(q_rope_tokens.data.data(), batch, q_length, heads, rope);
  attn::Tensor<T, 3> w_uk(heads, nope, latent), w_uv(heads, latent, value);
  std::normal_distribution<double> normal;
  for (Index i = 0; i < w_uk.size(); ++i)
    w_uk.data()[i] = static_cast<T>(normal(rng));
  for (Index i = 0; i < w_uv.size(); ++i)
    w_uv.data()[i] = static_cast<T>(normal(rng));
  const attn::TensorMap<const T, 3> uk(w_uk.data(), heads, nope, latent);
  const attn::TensorMap<const T, 3> uv(w_uv.data(), heads, latent, value);
  for (const bool rope_in_place : {false, true}) {
    std::vector<T> latent_tokens(at(batch * q_length * heads * (latent + rope)), T(9));
    const attn::HeadsView<T> q_latent =
        attn::blhd_view(latent_tokens.data(), batch, q_length, heads, latent + rope);
    attn::HeadsView<const T> rope_source = q_rope;
    if (rope_in_place) {  // q_rope written into q_latent's last R columns beforehand
      for (Index b = 0; b < batch; ++b) {
        for (Index h = 0; h < heads; ++h)
          q_latent.head(b, h).rightCols(rope) = q_rope.head(b, h);
      }
      rope_source = q_latent;
      rope_source.data += latent;
      rope_source.dim = rope;
    }
    attn::mla_absorb_queries_into<T>(q_nope, rope_source, uk, q_latent);
    std::vector<long double> expected, magnitude;
    std::vector<T> actual;
    for (Index b = 0; b < batch; ++b) {
      for (Index h = 0; h < heads; ++h) {
        for (Index i = 0; i < q_length; ++i) {
          for (Index x = 0; x < latent; ++x) {
            long double sum = 0, size = 0;
            for (Index p = 0; p < nope; ++p) {
              const long double term = static_cast<long double>(q_nope.head(b, h)(i, p)) *
                                       static_cast<long double>(w_uk(h, p, x));
              sum += term;
              size += std::abs(term);
            }
            expected.push_back(sum);
            magnitude.push_back(size);
            actual.push_back(q_latent.head(b, h)(i, x));
          }
          for (Index e = 0; e < rope; ++e)
            CHECK(q_latent.head(b, h)(i, latent + e) == q_rope.head(b, h)(i, e));
        }
      }
    }
    INFO("q_rope in place: " << rope_in_place);
    check_products("q_latent", expected, magnitude, nope, actual);
  }
  // out = o_latent w_uv[h], o_latent a column block of a wider buffer.
  const Heads<T> wide = attn_test::random_heads<T>(batch, heads, q_length, latent + 7, rng);
  attn::HeadsView<const T> o_latent = wide.cview();
  o_latent.dim = latent;
  Heads<T> out(batch, heads, q_length, value);
  attn::mla_project_output_into<T>(o_latent, uv, out.view());
  std::vector<long double> expected, magnitude;
  for (Index b = 0; b < batch; ++b) {
    for (Index h = 0; h < heads; ++h) {
      for (Index i = 0; i < q_length; ++i) {
        for (Index e = 0; e < value; ++e) {
          long double sum = 0, size = 0;
          for (Index x = 0; x < latent; ++x) {
            const long double term = static_cast<long double>(o_latent.head(b, h)(i, x)) *
                                     static_cast<long double>(w_uv(h, x, e));
            sum += term;
            size += std::abs(term);
          }
          expected.push_back(sum);
          magnitude.push_back(size);
        }
      }
    }
  }
  check_products("out", expected, magnitude, latent, out.data);
  // The value forms give the same bits as the views.
  attn::Tensor<T, 4> nope_tensor(batch, heads, q_length, nope),
      rope_tensor(batch, heads, q_length, rope);
  for (Index b = 0; b < batch; ++b) {
    for (Index h = 0; h < heads; ++h) {
      for (Index i = 0; i < q_length; ++i) {
        for (Index p = 0; p < nope; ++p)
          nope_tensor(b, h, i, p) = q_nope.head(b, h)(i, p);
        for (Index e = 0; e < rope; ++e)
          rope_tensor(b, h, i, e) = q_rope.head(b, h)(i, e);
      }
    }
  }
  const attn::Tensor<T, 4> absorbed = attn::mla_absorb_queries(nope_tensor, rope_tensor, w_uk);
  std::vector<T> from_views(at(batch * heads * q_length * (latent + rope)));
  attn::mla_absorb_queries_into<T>(
      attn::bhld_view(nope_tensor), attn::bhld_view(rope_tensor), uk,
      attn::bhld_view(from_views.data(), batch, heads, q_length, latent + rope));
  CHECK(std::equal(from_views.begin(), from_views.end(), absorbed.data()));
}

}  // namespace

TEST_CASE("mla_absorb_queries and mla_project_output equal plain loops on strided views",
          "[mla][isa]") {
  SECTION("float") {
    check_projections<float>();
  }
  SECTION("double") {
    check_projections<double>();
  }
}

TEST_CASE("mla_weights_from_kv_b_proj splits DeepSeek's kv_b_proj per head", "[mla]") {
  const Index heads = 3, nope = 4, value = 5, latent = 6;
  attn::Matrix<float> kv_b_proj(heads * (nope + value), latent);
  for (Index i = 0; i < kv_b_proj.size(); ++i)
    kv_b_proj.data()[i] = static_cast<float>(i);
  const attn::MlaWeights<float> w = attn::mla_weights_from_kv_b_proj(kv_b_proj, heads, nope, value);
  REQUIRE(w.w_uk.dimension(0) == heads);
  REQUIRE(w.w_uk.dimension(1) == nope);
  REQUIRE(w.w_uk.dimension(2) == latent);
  REQUIRE(w.w_uv.dimension(1) == latent);
  REQUIRE(w.w_uv.dimension(2) == value);
  bool same = true;
  for (Index h = 0; h < heads; ++h) {
    for (Index x = 0; x < latent; ++x) {
      // torch: kv = c @ kv_b_proj.T viewed (H, P + Dv): head h's keys, then its values.
      for (Index p = 0; p < nope; ++p)
        same = same && w.w_uk(h, p, x) == kv_b_proj(h * (nope + value) + p, x);
      for (Index e = 0; e < value; ++e)
        same = same && w.w_uv(h, x, e) == kv_b_proj(h * (nope + value) + nope + e, x);
    }
  }
  CHECK(same);
  CHECK_THROWS_WITH(attn::mla_weights_from_kv_b_proj(kv_b_proj, heads, nope, value + 1),
                    Catch::Contains("mla_weights_from_kv_b_proj") &&
                        Catch::Contains("kv_b_proj is [27, 6]") && Catch::Contains("Dv = 6"));
  CHECK_THROWS_WITH(attn::mla_weights_from_kv_b_proj(kv_b_proj, 0, nope, value),
                    Catch::Contains("mla_weights_from_kv_b_proj") && Catch::Contains("H = 0"));
  CHECK_THROWS_WITH(attn::mla_weights_from_kv_b_proj(kv_b_proj, heads, 0, nope + value),
                    Catch::Contains("P = 0"));
  const attn::Matrix<float> no_columns(heads * (nope + value), 0);
  CHECK_THROWS_WITH(attn::mla_weights_from_kv_b_proj(no_columns, heads, nope, value),
                    Catch::Contains("kv_b_proj is [27, 0]") && Catch::Contains("C positive"));
}

namespace {

/// Small latents for the bookkeeping tests: C 64, R 32, 4 heads.
struct Small {
  Index latent = 64, rope = 32, heads = 4;
  Index dim() const { return latent + rope; }
};

/// o_latent (1, H, Lq, C) of `id` for q (1, H, Lq, C + R) under decode.
template <class S>
Heads<float> attend_one(const attn::LatentCache<S>& cache, Index id, const Heads<float>& q,
                        attn::AttentionOptions<float> options = {}) {
  Heads<float> out(1, q.h, q.l, cache.latent_dim());
  if (!options.scale)
    options.scale = 0.125F;
  options.algorithm = attn::Algorithm::decode;
  cache.attend_into({id}, q.cview(), out.view(), options);
  return out;
}

/// A cache of one sequence holding the given chunks of (c, k_rope) rows, appended in order.
attn::LatentCache<float> alone(
    const Small& s, Index page_size,
    const std::vector<std::pair<attn::HeadsView<const float>, attn::HeadsView<const float>>>&
        chunks) {
  attn::LatentCache<float> cache(s.latent, s.rope, page_size);
  const Index id = cache.add_sequence();
  for (const auto& [c, k_rope] : chunks)
    cache.append({id}, c, k_rope);
  return cache;
}

}  // namespace

TEST_CASE("latent cache: fork shares pages, each child equals a cache of its own tokens", "[mla]") {
  std::mt19937 rng(3204);
  const Small s;
  const Heads<float> c = attn_test::random_heads<float>(1, 1, 160, s.latent, rng);
  const Heads<float> r = attn_test::random_heads<float>(1, 1, 160, s.rope, rng);
  const Heads<float> c_a = attn_test::random_heads<float>(1, 1, 30, s.latent, rng);
  const Heads<float> r_a = attn_test::random_heads<float>(1, 1, 30, s.rope, rng);
  const Heads<float> c_b = attn_test::random_heads<float>(1, 1, 5, s.latent, rng);
  const Heads<float> r_b = attn_test::random_heads<float>(1, 1, 5, s.rope, rng);
  attn::LatentCache<float> cache(s.latent, s.rope, 64);
  const Index parent = cache.add_sequence();
  cache.append({parent}, c.cview(), r.cview());  // 2.5 pages
  const Index child = cache.fork(parent);
  const std::vector<Index> shared = cache.block_table(parent);
  REQUIRE(cache.block_table(child) == shared);
  cache.append({parent}, c_a.cview(), r_a.cview());
  cache.append({child}, c_b.cview(), r_b.cview());
  CHECK(cache.block_table(parent)[1] == shared[1]);  // full pages stay shared
  CHECK(cache.block_table(parent)[2] != shared[2]);  // the last one was copied on write
  CHECK(cache.references(shared[1]) == 2);
  const Heads<float> q = attn_test::random_heads<float>(1, s.heads, 2, s.dim(), rng);
  CHECK(attend_one(cache, parent, q).data ==
        attend_one(alone(s, 64, {{c.cview(), r.cview()}, {c_a.cview(), r_a.cview()}}), 0, q).data);
  CHECK(attend_one(cache, child, q).data ==
        attend_one(alone(s, 64, {{c.cview(), r.cview()}, {c_b.cview(), r_b.cview()}}), 0, q).data);
  cache.remove(parent);
  cache.remove(child);
  CHECK(cache.free_pages() == cache.pages());
}

TEST_CASE("latent cache: truncate equals a cache never appended past n", "[mla]") {
  std::mt19937 rng(3205);
  const Small s;
  const Index total = 200;
  const Heads<float> c = attn_test::random_heads<float>(1, 1, total, s.latent, rng);
  const Heads<float> r = attn_test::random_heads<float>(1, 1, total, s.rope, rng);
  const Heads<float> c2 = attn_test::random_heads<float>(1, 1, 20, s.latent, rng);
  const Heads<float> r2 = attn_test::random_heads<float>(1, 1, 20, s.rope, rng);
  for (const Index n : {Index(1), Index(64), Index(150), total}) {
    attn::LatentCache<float> cache(s.latent, s.rope, 64);
    const Index id = cache.add_sequence();
    cache.append({id}, c.cview(), r.cview());
    const Index twin = cache.fork(id);
    cache.truncate(id, n);
    cache.append({id}, c2.cview(), r2.cview());
    const Heads<float> q = attn_test::random_heads<float>(1, s.heads, 1, s.dim(), rng);
    INFO("n " << n);
    CHECK(cache.length(id) == n + 20);
    CHECK(attend_one(cache, id, q).data ==
          attend_one(
              alone(s, 64, {{rows_of(c, 0, 0, n), rows_of(r, 0, 0, n)}, {c2.cview(), r2.cview()}}),
              0, q)
              .data);
    CHECK(attend_one(cache, twin, q).data ==
          attend_one(alone(s, 64, {{c.cview(), r.cview()}}), 0, q).data);
  }
}

TEST_CASE("latent cache: the sliding-window ring equals the full cache with the window", "[mla]") {
  std::mt19937 rng(3206);
  const Small s;
  const Index window = 100, steps = 400;
  const Heads<float> c = attn_test::random_heads<float>(1, 1, steps, s.latent, rng);
  const Heads<float> r = attn_test::random_heads<float>(1, 1, steps, s.rope, rng);
  attn::LatentCache<float> ring(s.latent, s.rope, 64), full(s.latent, s.rope, 64);
  const Index id = ring.add_sequence();
  REQUIRE(full.add_sequence() == id);
  attn::AttentionOptions<float> options;
  options.window = {window, 0};
  Index most_pages = 0;
  bool same = true;
  for (Index t = 0; t < steps; ++t) {
    ring.append({id}, rows_of(c, 0, t, 1), rows_of(r, 0, t, 1));
    full.append({id}, rows_of(c, 0, t, 1), rows_of(r, 0, t, 1));
    const Heads<float> q = attn_test::random_heads<float>(1, s.heads, 1, s.dim(), rng);
    same = same && attend_one(ring, id, q, options).data == attend_one(full, id, q, options).data;
    ring.release_outside_window(id, window);
    most_pages = std::max(most_pages, ring.pages() - ring.free_pages());
  }
  CHECK(same);
  CHECK(most_pages <= 3);  // 101 keys span at most 3 pages of 64
  const Heads<float> q = attn_test::random_heads<float>(1, s.heads, 1, s.dim(), rng);
  Heads<float> out(1, s.heads, 1, s.latent);
  std::fill(out.data.begin(), out.data.end(), 7.0F);
  options.scale = 0.125F;
  options.window = {2 * window, 0};
  CHECK_THROWS_WITH(ring.attend_into({id}, q.cview(), out.view(), options),
                    Catch::Contains("LatentCache::attend") && Catch::Contains("released"));
  CHECK(std::all_of(out.data.begin(), out.data.end(), [](float e) { return e == 7.0F; }));
}

TEST_CASE("latent cache: rotary keys turned on append at each token's position", "[mla]") {
  std::mt19937 rng(3207);
  const Small s;
  attn::RopeConfig config;
  config.dim = s.rope;
  config.max_positions = 512;
  config.pairing = attn::RopePairing::interleaved;  // DeepSeek's checkpoints pair neighbours
  const attn::RotaryEmbedding<float> rotary(config);
  const Heads<float> c = attn_test::random_heads<float>(2, 1, 90, s.latent, rng);
  const Heads<float> r = attn_test::random_heads<float>(2, 1, 90, s.rope, rng);
  const std::vector<Index> first{50, 90};  // ragged: how many rows each sequence takes
  attn::LatentCache<float> turning(s.latent, s.rope, 32), turned(s.latent, s.rope, 32);
  const std::vector<Index> ids{turning.add_sequence(), turning.add_sequence()};
  REQUIRE(turned.add_sequence() == ids[0]);
  REQUIRE(turned.add_sequence() == ids[1]);
  // By hand: token t of sequence b turned at position t (its count before the chunk + row).
  Heads<float> r_turned = r;
  rotary.apply(r_turned.view(), std::vector<Index>{0, 0});
  turning.append(ids, c.cview(), r.cview(), rotary, first);
  turned.append(ids, c.cview(), r_turned.cview(), first);
  // The second chunk: rows [50, 90) of sequence 0 at positions 50 + t.
  turning.append({ids[0]}, rows_of(c, 0, 50, 40), rows_of(r, 0, 50, 40), rotary);
  turned.append({ids[0]}, rows_of(c, 0, 50, 40), rows_of(r_turned, 0, 50, 40));
  CHECK(turning.length(ids[0]) == 90);
  const Heads<float> q = attn_test::random_heads<float>(1, s.heads, 1, s.dim(), rng);
  for (const Index id : ids)
    CHECK(attend_one(turning, id, q).data == attend_one(turned, id, q).data);
}

TEST_CASE("latent cache: attend_all sees every cached token; the value form equals the view form",
          "[mla]") {
  std::mt19937 rng(3208);
  const Small s;
  const Heads<float> c = attn_test::random_heads<float>(1, 1, 70, s.latent, rng);
  const Heads<float> r = attn_test::random_heads<float>(1, 1, 70, s.rope, rng);
  attn::LatentCache<float> cache(s.latent, s.rope, 64);
  const Index id = cache.add_sequence();
  cache.append({id}, c.cview(), r.cview());
  // Every query of attend_all sees all 70 tokens: the same as the last query of a causal call.
  const Heads<float> q = attn_test::random_heads<float>(1, s.heads, 3, s.dim(), rng);
  Heads<float> all(1, s.heads, 3, s.latent);
  attn::AttentionOptions<float> options;
  options.scale = 0.125F;
  options.algorithm = attn::Algorithm::decode;
  cache.attend_all_into({id}, q.cview(), all.view(), options);
  for (Index i = 0; i < 3; ++i) {
    Heads<float> qi(1, s.heads, 1, s.dim());
    for (Index h = 0; h < s.heads; ++h)
      qi.view().head(0, h) = q.cview().head(0, h).middleRows(i, 1);
    const Heads<float> one = attend_one(cache, id, qi, options);
    for (Index h = 0; h < s.heads; ++h)
      CHECK(one.cview().head(0, h) == all.cview().head(0, h).middleRows(i, 1));
  }
  attn::Tensor<float, 4> q_tensor(1, s.heads, 3, s.dim());
  std::copy(q.data.begin(), q.data.end(), q_tensor.data());
  const attn::Tensor<float, 4> value_form = cache.attend({id}, q_tensor, options);
  Heads<float> view_form(1, s.heads, 3, s.latent);
  cache.attend_into({id}, q.cview(), view_form.view(), options);
  CHECK(std::equal(view_form.data.begin(), view_form.data.end(), value_form.data()));
}

TEST_CASE("latent cache: NaN in a token or a query propagates to what sees it", "[mla]") {
  std::mt19937 rng(3209);
  const Small s;
  const Index nope = 16, value = 8;
  // NaN in the rotary key of the last token (in K only): the query that sees it (the second,
  // at position 39) is NaN, the one that does not (position 38) stays finite. NaN in the
  // latent of a token both see (a key and a value): both rows NaN (docs/errors.md: a NaN
  // in a latent of a hidden token is a NaN in a hidden value row, unspecified).
  for (const bool in_latent : {false, true}) {
    Heads<float> c = attn_test::random_heads<float>(1, 1, 40, s.latent, rng);
    Heads<float> r = attn_test::random_heads<float>(1, 1, 40, s.rope, rng);
    if (in_latent)
      c.data[5] = std::numeric_limits<float>::quiet_NaN();  // token 0
    else
      r.data[at(39 * s.rope + 5)] = std::numeric_limits<float>::quiet_NaN();  // token 39
    attn::LatentCache<float> cache(s.latent, s.rope, 16);
    const Index id = cache.add_sequence();
    cache.append({id}, c.cview(), r.cview());
    const Heads<float> q = attn_test::random_heads<float>(1, s.heads, 2, s.dim(), rng);
    const Heads<float> out = attend_one(cache, id, q);
    INFO("NaN in the " << (in_latent ? "latent of token 0" : "rotary key of token 39"));
    for (Index h = 0; h < s.heads; ++h) {
      if (in_latent)
        CHECK(out.cview().head(0, h).row(0).array().isNaN().all());
      else
        CHECK(out.cview().head(0, h).row(0).allFinite());
      CHECK(out.cview().head(0, h).row(1).array().isNaN().all());
    }
  }
  // A NaN in q_nope reaches every latent column of its row, and the output of its head.
  Heads<float> q_nope = attn_test::random_heads<float>(1, s.heads, 1, nope, rng);
  const Heads<float> q_rope = attn_test::random_heads<float>(1, s.heads, 1, s.rope, rng);
  q_nope.data[3] = std::numeric_limits<float>::quiet_NaN();  // head 0
  const attn::Tensor<float, 3> w_uk = random_weights(s.heads, nope, s.latent, rng);
  const attn::Tensor<float, 3> w_uv = random_weights(s.heads, s.latent, value, rng);
  Heads<float> q_latent(1, s.heads, 1, s.dim()), o_latent(1, s.heads, 1, s.latent);
  Heads<float> projected(1, s.heads, 1, value);
  attn::mla_absorb_queries_into<float>(q_nope.cview(), q_rope.cview(), map(w_uk), q_latent.view());
  CHECK(q_latent.cview().head(0, 0).leftCols(s.latent).array().isNaN().all());
  CHECK(q_latent.cview().head(0, 1).allFinite());
  Heads<float> o(1, s.heads, 1, s.latent);
  std::fill(o.data.begin(), o.data.end(), 0.5F);
  o.data[at(s.latent + 2)] = std::numeric_limits<float>::quiet_NaN();  // head 1
  attn::mla_project_output_into<float>(o.cview(), map(w_uv), projected.view());
  CHECK(projected.cview().head(0, 1).array().isNaN().all());
  CHECK(projected.cview().head(0, 0).allFinite());
}

TEST_CASE("latent cache: (C + R) values stored per token, no copy of V", "[mla]") {
  // DeepSeek's C = 512, R = 64: 576 values a token, in each format's bytes.
  const Index values = 576, blocks = 576 / 32;
  CHECK(attn::LatentCache<float>::bytes_per_token(512, 64) == values * 4);
  CHECK(attn::LatentCache<double>::bytes_per_token(512, 64) == values * 8);
  CHECK(attn::LatentCache<Eigen::half>::bytes_per_token(512, 64) == values * 2);
  CHECK(attn::LatentCache<Eigen::bfloat16>::bytes_per_token(512, 64) == values * 2);
  CHECK(attn::LatentCache<attn::BlockQ8_0>::bytes_per_token(512, 64) == blocks * 34);
  CHECK(attn::LatentCache<attn::BlockQ4_0>::bytes_per_token(512, 64) == blocks * 18);
  // What the constructor refuses, bytes_per_token refuses too, by name.
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(attn::LatentCache<float>::bytes_per_token(0, 64),
                    Contains("LatentCache::bytes_per_token") && Contains("[0, 64]"));
  CHECK_THROWS_WITH(attn::LatentCache<float>::bytes_per_token(512, -1),
                    Contains("LatentCache::bytes_per_token") && Contains("R >= 0"));
  CHECK_THROWS_WITH(attn::LatentCache<attn::BlockQ8_0>::bytes_per_token(500, 64),
                    Contains("LatentCache::bytes_per_token") && Contains("multiples of 32"));
  CHECK_THROWS_WITH(attn::LatentCache<attn::BlockQ4_0>::bytes_per_token(512, 48),
                    Contains("multiples of 32"));
  CHECK_THROWS_WITH(attn::LatentCache<attn::BlockQ4_0>(512, 48, 64),
                    Contains("LatentCache") && Contains("multiples of 32"));
  CHECK(attn::LatentCache<float>::bytes_per_token(500, 48) == 548 * 4);  // any C, R unquantized
  // The pool grows by whole pages of P tokens: 1000 tokens in pages of 64 take 16 pages.
  std::mt19937 rng(3210);
  attn::LatentCache<Eigen::half> cache(512, 64, 64, 16, false);
  const Index id = cache.add_sequence();
  const Heads<float> c = attn_test::random_heads<float>(1, 1, 1000, 512, rng);
  const Heads<float> r = attn_test::random_heads<float>(1, 1, 1000, 64, rng);
  cache.append({id}, c.cview(), r.cview());
  CHECK(cache.pages() == 16);
  CHECK(cache.free_pages() == 0);
  CHECK(cache.bytes_per_token() == 1152);
  CHECK(cache.dim() == 576);
  CHECK(cache.value_dim() == 512);
}

TEST_CASE("latent cache: quantized formats and R = 0", "[mla]") {
  std::mt19937 rng(3211);
  // q4_0 latents, pages of 48: the same as a float cache of the values the blocks hold.
  const Small s;
  const Heads<float> c = attn_test::random_heads<float>(1, 1, 150, s.latent, rng);
  const Heads<float> r = attn_test::random_heads<float>(1, 1, 150, s.rope, rng);
  attn::LatentCache<attn::BlockQ4_0> q4(s.latent, s.rope, 48);
  attn::LatentCache<float> dequantized(s.latent, s.rope, 48);
  q4.append({q4.add_sequence()}, c.cview(), r.cview());
  dequantized.append({dequantized.add_sequence()}, stored<attn::BlockQ4_0>(c).cview(),
                     stored<attn::BlockQ4_0>(r).cview());
  const Heads<float> q = attn_test::random_heads<float>(1, s.heads, 2, s.dim(), rng);
  CHECK(relative_difference(attend_one(q4, 0, q).data, attend_one(dequantized, 0, q).data) < 1e-6);
  // R = 0: keys and values are the same rows, attention with K = V = c.
  attn::LatentCache<float> plain(s.latent, 0, 16);
  const Index id = plain.add_sequence();
  const Heads<float> none(1, 1, 150, 0);
  plain.append({id}, c.cview(), none.cview());
  const Heads<float> q0 = attn_test::random_heads<float>(1, s.heads, 1, s.latent, rng);
  Heads<float> expected(1, s.heads, 1, s.latent);
  attn::AttentionOptions<float> options;
  options.scale = 0.125F;
  options.algorithm = attn::Algorithm::decode;
  attn::scaled_dot_product_attention_into<float>(q0.cview(), c.cview(), c.cview(), expected.view(),
                                                 options);
  const Heads<float> got = attend_one(plain, id, q0, options);
  CHECK(relative_difference(got.data, expected.data) < 1e-6);
}

TEST_CASE("latent cache refuses bad input and leaves itself and the outputs unchanged",
          "[mla][errors]") {
  std::mt19937 rng(3212);
  using Cache = attn::LatentCache<float>;
  CHECK_THROWS_WITH(Cache(0, 64, 16),
                    Catch::Contains("LatentCache") && Catch::Contains("(C, R) is [0, 64]"));
  CHECK_THROWS_WITH(Cache(64, -1, 16), Catch::Contains("LatentCache"));
  CHECK_THROWS_WITH(Cache(64, 32, 0),
                    Catch::Contains("LatentCache") && Catch::Contains("page_size 0"));
  CHECK_THROWS_WITH(Cache(64, 32, 16, -1),
                    Catch::Contains("LatentCache") && Catch::Contains("pages -1"));
  CHECK_THROWS_WITH(attn::LatentCache<attn::BlockQ8_0>(500, 64, 16),
                    Catch::Contains("LatentCache") && Catch::Contains("multiple") &&
                        Catch::Contains("[500, 64]"));
  CHECK_THROWS_WITH(attn::LatentCache<attn::BlockQ4_0>(512, 48, 16), Catch::Contains("[512, 48]"));
  const Small s;
  Cache cache(s.latent, s.rope, 16, 2, false);
  const Index id = cache.add_sequence();
  const Heads<float> c = attn_test::random_heads<float>(1, 1, 40, s.latent, rng);
  const Heads<float> r = attn_test::random_heads<float>(1, 1, 40, s.rope, rng);
  cache.append({id}, rows_of(c, 0, 0, 20), rows_of(r, 0, 0, 20));
  const std::vector<Index> table = cache.block_table(id);
  const Heads<float> probe = attn_test::random_heads<float>(1, s.heads, 1, s.dim(), rng);
  const std::vector<float> before = attend_one(cache, id, probe).data;
  const auto unchanged = [&] {
    CHECK(cache.length(id) == 20);
    CHECK(cache.block_table(id) == table);
    CHECK(cache.free_pages() == 0);
    CHECK(cache.sequences() == std::vector<Index>{id});
    CHECK(attend_one(cache, id, probe).data == before);
  };
  // The bookkeeping.
  CHECK_THROWS_WITH(cache.fork(5), Catch::Contains("LatentCache::fork") &&
                                       Catch::Contains("sequence 5 is not in the cache"));
  CHECK_THROWS_WITH(cache.truncate(id, 21), Catch::Contains("LatentCache::truncate") &&
                                                Catch::Contains("cannot truncate it to 21"));
  CHECK_THROWS_WITH(cache.remove(3), Catch::Contains("LatentCache::remove"));
  CHECK_THROWS_WITH(cache.release_outside_window(id, -1),
                    Catch::Contains("LatentCache::release_outside_window"));
  CHECK_THROWS_WITH(cache.references(2), Catch::Contains("LatentCache::references") &&
                                             Catch::Contains("outside the pool of 2"));
  // append: the pool is full (2 pages of 16 hold the 20 tokens) and may not grow.
  CHECK_THROWS_WITH(cache.append({id}, rows_of(c, 0, 20, 20), rows_of(r, 0, 20, 20)),
                    Catch::Contains("LatentCache::append") && Catch::Contains("allow_growth"));
  CHECK_THROWS_WITH(cache.append({id, id}, rows_of(c, 0, 0, 1), rows_of(r, 0, 0, 1)),
                    Catch::Contains("sequences has 2 ids but the batch size is 1"));
  CHECK_THROWS_WITH(
      cache.append({7}, rows_of(c, 0, 0, 1), rows_of(r, 0, 0, 1)),
      Catch::Contains("LatentCache::append") && Catch::Contains("sequence 7 is not in the cache"));
  const Heads<float> two_heads = attn_test::random_heads<float>(1, 2, 1, s.latent, rng);
  const Heads<float> two_rope = attn_test::random_heads<float>(1, 2, 1, s.rope, rng);
  CHECK_THROWS_WITH(cache.append({id}, two_heads.cview(), two_rope.cview()),
                    Catch::Contains("latent is [1, 2, 1, 64]") && Catch::Contains("one head"));
  const Heads<float> wide = attn_test::random_heads<float>(1, 1, 1, s.latent + 1, rng);
  CHECK_THROWS_WITH(cache.append({id}, wide.cview(), rows_of(r, 0, 0, 1)),
                    Catch::Contains("latent is [1, 1, 1, 65]") &&
                        Catch::Contains("(C, R) is [64, 32]") &&
                        Catch::Contains("head dims differ"));
  CHECK_THROWS_WITH(cache.append({id}, rows_of(c, 0, 0, 1), rows_of(c, 0, 0, 1)),
                    Catch::Contains("rope is [1, 1, 1, 64]"));
  CHECK_THROWS_WITH(cache.append({id}, rows_of(c, 0, 0, 2), rows_of(r, 0, 0, 1)),
                    Catch::Contains("lengths differ"));
  const Heads<float> r2 = attn_test::random_heads<float>(2, 1, 1, s.rope, rng);
  CHECK_THROWS_WITH(cache.append({id}, rows_of(c, 0, 0, 1), r2.cview()),
                    Catch::Contains("batch sizes differ"));
  CHECK_THROWS_WITH(cache.append({id}, rows_of(c, 0, 0, 1), rows_of(r, 0, 0, 1), {2}),
                    Catch::Contains("counts[0] is 2"));
  CHECK_THROWS_WITH(cache.append({id}, rows_of(c, 0, 0, 1), rows_of(r, 0, 0, 1), {1, 1}),
                    Catch::Contains("counts has 2 entries"));
  attn::RopeConfig config;
  config.dim = s.rope;
  config.max_positions = 21;  // positions [0, 21): token 20 fits, token 21 does not
  const attn::RotaryEmbedding<float> rotary(config);
  CHECK_THROWS_WITH(cache.append({id}, rows_of(c, 0, 0, 2), rows_of(r, 0, 0, 2), rotary),
                    Catch::Contains("LatentCache::append") && Catch::Contains("[20, 22)"));
  config.dim = s.rope + 2;
  CHECK_THROWS_WITH(cache.append({id}, rows_of(c, 0, 0, 1), rows_of(r, 0, 0, 1),
                                 attn::RotaryEmbedding<float>(config)),
                    Catch::Contains("head dim is 34") && Catch::Contains("R = 32"));
  CHECK_THROWS_WITH(
      cache.append({id}, rows_of(c, 0, 0, 1), rows_of(r, 0, 0, 1), attn::RotaryEmbedding<float>()),
      Catch::Contains("empty"));
  unchanged();
  // attend: the scale, shapes, ids, the cache's own mask options, weights, algorithms.
  const Heads<float> q = attn_test::random_heads<float>(1, s.heads, 1, s.dim(), rng);
  Heads<float> out(1, s.heads, 1, s.latent);
  std::fill(out.data.begin(), out.data.end(), 3.0F);
  attn::AttentionOptions<float> options;
  CHECK_THROWS_WITH(cache.attend_into({id}, q.cview(), out.view(), options),
                    Catch::Contains("LatentCache::attend") &&
                        Catch::Contains("options.scale is unset") &&
                        Catch::Contains("1 / sqrt(96)"));
  options.scale = 0.125F;
  CHECK_THROWS_WITH(cache.attend_into({9}, q.cview(), out.view(), options),
                    Catch::Contains("LatentCache::attend") && Catch::Contains("sequence 9"));
  const Heads<float> q_narrow = attn_test::random_heads<float>(1, s.heads, 1, s.latent, rng);
  CHECK_THROWS_WITH(cache.attend_into({id}, q_narrow.cview(), out.view(), options),
                    Catch::Contains("q is [1, 4, 1, 64]") &&
                        Catch::Contains("[c ; k_rope] (cached) is [1, 1, 20, 96]"));
  Heads<float> out_wide(1, s.heads, 1, s.dim());
  CHECK_THROWS_WITH(cache.attend_into({id}, q.cview(), out_wide.view(), options),
                    Catch::Contains("out is [1, 4, 1, 96] but must be [1, 4, 1, 64]"));
  const Heads<float> q_long = attn_test::random_heads<float>(1, s.heads, 21, s.dim(), rng);
  Heads<float> out_long(1, s.heads, 21, s.latent);
  CHECK_THROWS_WITH(cache.attend_into({id}, q_long.cview(), out_long.view(), options),
                    Catch::Contains("holds only 20 tokens"));
  attn::AttentionOptions<float> causal = options;
  causal.causal = attn::Causal::top_left;
  CHECK_THROWS_WITH(cache.attend_into({id}, q.cview(), out.view(), causal),
                    Catch::Contains("options.causal"));
  attn::AttentionOptions<float> naive = options;
  naive.algorithm = attn::Algorithm::naive;
  CHECK_THROWS_WITH(cache.attend_into({id}, q.cview(), out.view(), naive),
                    Catch::Contains("decode or the flash kernel"));
  Heads<float> weights(1, s.heads, 1, 20);
  attn::AttentionOutputViews<float> with_weights(out.view());
  with_weights.weights = weights.view();
  CHECK_THROWS_WITH(cache.attend_into({id}, q.cview(), with_weights, options),
                    Catch::Contains("weights are not available from a paged cache"));
  std::vector<float> lse(at(s.heads * 2), 4.0F);  // (1, H, 2) for a (1, H, 1) q
  attn::AttentionOutputViews<float> with_lse(out.view());
  with_lse.logsumexp = attn::bhl_view(lse.data(), Index(1), s.heads, Index(2));
  CHECK_THROWS_WITH(cache.attend_into({id}, q.cview(), with_lse, options),
                    Catch::Contains("LatentCache::attend") &&
                        Catch::Contains("logsumexp is [1, 4, 2] but must be [1, 4, 1]"));
  CHECK(std::all_of(lse.begin(), lse.end(), [](float e) { return e == 4.0F; }));
  CHECK_THROWS_WITH(cache.attend_all_into({id}, q.cview(), out.view(), causal),
                    Catch::Contains("LatentCache::attend_all") &&
                        Catch::Contains("every query sees every cached token"));
  // out inside q's memory, one element in: neither q itself nor apart from it.
  Heads<float> q_buffer = q;
  const attn::HeadsView<float> out_in_q =
      attn::bhld_view(q_buffer.data.data() + 1, Index(1), s.heads, Index(1), s.latent);
  CHECK_THROWS_WITH(cache.attend_into({id}, q_buffer.cview(), out_in_q, options),
                    Catch::Contains("out overlaps q"));
  CHECK(q_buffer.data == q.data);
  // The same id twice, in append and in attend.
  const Heads<float> c_two = attn_test::random_heads<float>(2, 1, 1, s.latent, rng);
  const Heads<float> r_two = attn_test::random_heads<float>(2, 1, 1, s.rope, rng);
  CHECK_THROWS_WITH(
      cache.append({id, id}, c_two.cview(), r_two.cview()),
      Catch::Contains("LatentCache::append") && Catch::Contains("sequence 0 is listed twice"));
  const Heads<float> q_two = attn_test::random_heads<float>(2, s.heads, 1, s.dim(), rng);
  Heads<float> out_two(2, s.heads, 1, s.latent);
  CHECK_THROWS_WITH(
      cache.attend_into({id, id}, q_two.cview(), out_two.view(), options),
      Catch::Contains("LatentCache::attend") && Catch::Contains("sequence 0 is listed twice"));
  CHECK(std::all_of(out.data.begin(), out.data.end(), [](float e) { return e == 3.0F; }));
  unchanged();
}

TEST_CASE("the absorbed projections refuse bad input and write nothing", "[mla][errors]") {
  std::mt19937 rng(3213);
  const Index heads = 2, nope = 8, latent = 16, rope = 4, value = 6;
  const Heads<float> q_nope = attn_test::random_heads<float>(1, heads, 3, nope, rng);
  const Heads<float> q_rope = attn_test::random_heads<float>(1, heads, 3, rope, rng);
  const attn::Tensor<float, 3> w_uk = random_weights(heads, nope, latent, rng);
  const attn::Tensor<float, 3> w_uv = random_weights(heads, latent, value, rng);
  Heads<float> q_latent(1, heads, 3, latent + rope);
  std::fill(q_latent.data.begin(), q_latent.data.end(), 5.0F);
  const auto untouched = [](const Heads<float>& x, float e) {
    return std::all_of(x.data.begin(), x.data.end(), [e](float y) { return y == e; });
  };
  const auto absorb = [&](const Heads<float>& n, const Heads<float>& r,
                          const attn::Tensor<float, 3>& w, attn::HeadsView<float> to) {
    attn::mla_absorb_queries_into<float>(n.cview(), r.cview(), map(w), to);
  };
  const Heads<float> q_rope_short = attn_test::random_heads<float>(1, heads, 2, rope, rng);
  CHECK_THROWS_WITH(absorb(q_nope, q_rope_short, w_uk, q_latent.view()),
                    Catch::Contains("mla_absorb_queries") &&
                        Catch::Contains("q_rope is [1, 2, 2, 4]") &&
                        Catch::Contains("one (B, H, Lq)"));
  const attn::Tensor<float, 3> w_three = random_weights(3, nope, latent, rng);
  CHECK_THROWS_WITH(absorb(q_nope, q_rope, w_three, q_latent.view()),
                    Catch::Contains("w_uk is [3, 8, 16] (H, P, C)"));
  const attn::Tensor<float, 3> w_deep = random_weights(heads, nope + 1, latent, rng);
  CHECK_THROWS_WITH(absorb(q_nope, q_rope, w_deep, q_latent.view()),
                    Catch::Contains("with q_nope's H and P"));
  Heads<float> q_latent_small(1, heads, 3, latent);
  CHECK_THROWS_WITH(absorb(q_nope, q_rope, w_uk, q_latent_small.view()),
                    Catch::Contains("q_latent is [1, 2, 3, 16] but must be [1, 2, 3, 20]"));
  // q_latent overlapping an input: q_nope (the first 8 columns of q_latent's memory), w_uk.
  attn::HeadsView<const float> inside = q_latent.cview();
  inside.dim = nope;
  CHECK_THROWS_WITH(
      attn::mla_absorb_queries_into<float>(inside, q_rope.cview(), map(w_uk), q_latent.view()),
      Catch::Contains("q_latent overlaps q_nope"));
  attn::Tensor<float, 3> w_alias(heads, nope, latent);
  const attn::HeadsView<float> over_w =
      attn::bhld_view(w_alias.data(), Index(1), heads, Index(3), latent + rope);
  CHECK_THROWS_WITH(absorb(q_nope, q_rope, w_alias, over_w),
                    Catch::Contains("q_latent overlaps w_uk"));
  const std::vector<Index> offsets{0, 3};
  const attn::HeadsView<const float> packed = attn::packed_view(
      attn::blhd_view(q_nope.data.data(), Index(1), Index(3), heads, nope), offsets);
  CHECK_THROWS_WITH(
      attn::mla_absorb_queries_into<float>(packed, q_rope.cview(), map(w_uk), q_latent.view()),
      Catch::Contains("q_nope is a packed or paged view"));
  const attn::HeadsView<const float> rope_packed = attn::packed_view(
      attn::blhd_view(q_rope.data.data(), Index(1), Index(3), heads, rope), offsets);
  CHECK_THROWS_WITH(
      attn::mla_absorb_queries_into<float>(q_nope.cview(), rope_packed, map(w_uk), q_latent.view()),
      Catch::Contains("q_rope is a packed or paged view"));
  std::vector<float> latent_tokens(at(3 * heads * (latent + rope)), 5.0F);
  const attn::HeadsView<float> latent_packed = attn::packed_view(
      attn::blhd_view(latent_tokens.data(), Index(1), Index(3), heads, latent + rope), offsets);
  CHECK_THROWS_WITH(attn::mla_absorb_queries_into<float>(q_nope.cview(), q_rope.cview(), map(w_uk),
                                                         latent_packed),
                    Catch::Contains("q_latent is a packed or paged view"));
  CHECK(std::all_of(latent_tokens.begin(), latent_tokens.end(), [](float e) { return e == 5.0F; }));
  // q_rope inside q_latent but not its last R columns: its first R columns.
  attn::HeadsView<const float> rope_misplaced = q_latent.cview();
  rope_misplaced.dim = rope;
  CHECK_THROWS_WITH(attn::mla_absorb_queries_into<float>(q_nope.cview(), rope_misplaced, map(w_uk),
                                                         q_latent.view()),
                    Catch::Contains("q_latent overlaps q_rope"));
  CHECK(untouched(q_latent, 5.0F));
  // mla_project_output.
  const Heads<float> o_latent = attn_test::random_heads<float>(1, heads, 3, latent, rng);
  Heads<float> out(1, heads, 3, value);
  std::fill(out.data.begin(), out.data.end(), 6.0F);
  const attn::Tensor<float, 3> w_uv_wrong = random_weights(heads, latent + 1, value, rng);
  CHECK_THROWS_WITH(
      attn::mla_project_output_into<float>(o_latent.cview(), map(w_uv_wrong), out.view()),
      Catch::Contains("mla_project_output") && Catch::Contains("w_uv is [2, 17, 6] (H, C, Dv)"));
  Heads<float> out_wrong(1, heads, 3, value + 1);
  CHECK_THROWS_WITH(
      attn::mla_project_output_into<float>(o_latent.cview(), map(w_uv), out_wrong.view()),
      Catch::Contains("out is [1, 2, 3, 7] but must be [1, 2, 3, 6]"));
  Heads<float> shared(1, heads, 3, latent);
  attn::HeadsView<float> out_inside = shared.view();
  out_inside.dim = value;
  CHECK_THROWS_WITH(attn::mla_project_output_into<float>(shared.cview(), map(w_uv), out_inside),
                    Catch::Contains("out overlaps o_latent"));
  attn::Tensor<float, 3> w_uv_alias = w_uv;
  const attn::HeadsView<float> over_w_uv =
      attn::bhld_view(w_uv_alias.data(), Index(1), heads, Index(3), value);
  CHECK_THROWS_WITH(
      attn::mla_project_output_into<float>(o_latent.cview(), map(w_uv_alias), over_w_uv),
      Catch::Contains("out overlaps w_uv"));
  const attn::Tensor<float, 3> w_uv_heads = random_weights(heads + 1, latent, value, rng);
  CHECK_THROWS_WITH(
      attn::mla_project_output_into<float>(o_latent.cview(), map(w_uv_heads), out.view()),
      Catch::Contains("w_uv is [3, 16, 6] (H, C, Dv)") &&
          Catch::Contains("must have o_latent's H and C"));
  const attn::HeadsView<const float> o_packed = attn::packed_view(
      attn::blhd_view(o_latent.data.data(), Index(1), Index(3), heads, latent), offsets);
  CHECK_THROWS_WITH(attn::mla_project_output_into<float>(o_packed, map(w_uv), out.view()),
                    Catch::Contains("mla_project_output") &&
                        Catch::Contains("o_latent is a packed or paged view"));
  const attn::HeadsView<float> out_packed = attn::packed_view(
      attn::blhd_view(out.data.data(), Index(1), Index(3), heads, value), offsets);
  CHECK_THROWS_WITH(attn::mla_project_output_into<float>(o_latent.cview(), map(w_uv), out_packed),
                    Catch::Contains("out is a packed or paged view"));
  CHECK(untouched(out, 6.0F));
}
