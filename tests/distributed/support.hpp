// The distributed tests' helpers: global problems built alike on every rank (same seed),
// each rank's runs cut from them, the long double reference and the error bound.
//
// Every rank holds the whole (small) problem: it computes the single-process call and the
// reference itself and compares its own rows, so that no test needs a gather.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <attn/attention.hpp>
#include <attn/distributed/sequence_split.hpp>

#include "support/reference.hpp"

namespace attn_dist_test {

using attn::Index;
namespace ref = attn_test::reference;

inline int comm_rank(MPI_Comm comm = MPI_COMM_WORLD) {
  int r = 0;
  MPI_Comm_rank(comm, &r);
  return r;
}

inline int comm_size(MPI_Comm comm = MPI_COMM_WORLD) {
  int p = 0;
  MPI_Comm_size(comm, &p);
  return p;
}

/// A (B, H, L, D) tensor of N(0, 1) values from `seed` (the same on every rank).
template <class T>
attn::Tensor<T, 4> random_tensor(Index b, Index h, Index l, Index d, unsigned seed) {
  attn::Tensor<T, 4> t(b, h, l, d);
  std::mt19937 gen(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (Index n = 0; n < t.size(); ++n)
    t.data()[n] = static_cast<T>(normal(gen));
  return t;
}

/// The rows of `runs` of a global (B, H, L, D) tensor, one after another.
template <class T>
attn::Tensor<T, 4> local_rows(const attn::Tensor<T, 4>& global,
                              const std::vector<attn::distributed::TokenRun>& runs) {
  Index n = 0;
  for (const auto& r : runs)
    n += r.size();
  attn::Tensor<T, 4> local(global.dimension(0), global.dimension(1), n, global.dimension(3));
  for (Index b = 0; b < global.dimension(0); ++b)
    for (Index h = 0; h < global.dimension(1); ++h)
      for (const auto& r : runs)
        for (Index i = 0; i < r.size(); ++i)
          for (Index e = 0; e < global.dimension(3); ++e)
            local(b, h, r.local_begin + i, e) = global(b, h, r.begin + i, e);
  return local;
}

/// The same for a (B, H, L) tensor.
template <class T>
attn::Tensor<T, 3> local_rows(const attn::Tensor<T, 3>& global,
                              const std::vector<attn::distributed::TokenRun>& runs) {
  Index n = 0;
  for (const auto& r : runs)
    n += r.size();
  attn::Tensor<T, 3> local(global.dimension(0), global.dimension(1), n);
  for (Index b = 0; b < global.dimension(0); ++b)
    for (Index h = 0; h < global.dimension(1); ++h)
      for (const auto& r : runs)
        for (Index i = 0; i < r.size(); ++i)
          local(b, h, r.local_begin + i) = global(b, h, r.begin + i);
  return local;
}

template <class T, int N>
std::vector<long double> as_long_double(const attn::Tensor<T, N>& t) {
  return std::vector<long double>(t.data(), t.data() + t.size());
}

template <class T, int N>
std::vector<T> as_vector(const attn::Tensor<T, N>& t) {
  return std::vector<T>(t.data(), t.data() + t.size());
}

/// A std::vector of (B, H, L, X) global values, cut to the rows of `runs`.
template <class V>
std::vector<V> local_values(const std::vector<V>& global, Index b_count, Index heads, Index length,
                            Index width, const std::vector<attn::distributed::TokenRun>& runs) {
  std::vector<V> local;
  for (Index b = 0; b < b_count; ++b)
    for (Index h = 0; h < heads; ++h)
      for (const auto& r : runs)
        for (Index i = r.begin; i < r.end; ++i)
          for (Index e = 0; e < width; ++e)
            local.push_back(
                global[static_cast<std::size_t>(((b * heads + h) * length + i) * width + e)]);
  return local;
}

/// max |actual - expected|; a mismatch of non-finite values is infinite.
template <class A, class E>
double max_error(const std::vector<A>& actual, const std::vector<E>& expected) {
  if (actual.size() != expected.size())
    return std::numeric_limits<double>::infinity();
  double worst = 0;
  for (std::size_t n = 0; n < expected.size(); ++n) {
    const long double a = actual[n], e = expected[n];
    if (!std::isfinite(e) || !std::isfinite(a)) {
      if (!(a == e || (std::isnan(a) && std::isnan(e))))
        return std::numeric_limits<double>::infinity();
      continue;
    }
    worst = std::max(worst, static_cast<double>(std::abs(a - e)));
  }
  return worst;
}

/// FlashAttention's rule, as the single-process tests use it: twice the plain loops' error
/// plus 32 eps.
template <class T>
double error_bound(double plain_error) {
  return 2 * plain_error + 32 * static_cast<double>(std::numeric_limits<T>::epsilon());
}

/// The reference's description of a problem with these options.
template <class T>
ref::Problem reference_problem(const attn::AttentionOptions<T>& o, Index B, Index Hq, Index Hkv,
                               Index Lq, Index Lk, Index D, Index Dv) {
  ref::Problem p;
  p.batch = B;
  p.q_heads = Hq;
  p.kv_heads = Hkv;
  p.q_length = Lq;
  p.k_length = Lk;
  p.dim = D;
  p.value_dim = Dv;
  if (o.scale)
    p.scale = *o.scale;
  p.causal = o.causal == attn::Causal::none       ? ref::Causal::none
             : o.causal == attn::Causal::top_left ? ref::Causal::top_left
                                                  : ref::Causal::bottom_right;
  p.window_left = o.window.left;
  p.window_right = o.window.right;
  p.key_lengths = o.key_lengths;
  p.query_lengths = o.query_lengths;
  p.sink_tokens = o.sink_tokens;
  if (o.softcap)
    p.softcap = *o.softcap;
  for (const T z : o.sinks)
    p.sinks.push_back(z);
  return p;
}

/// Whether two tensors hold the same bits.
template <class T, int N>
bool same_bits(const attn::Tensor<T, N>& a, const attn::Tensor<T, N>& b) {
  return a.size() == b.size() && std::equal(a.data(), a.data() + a.size(), b.data(), [](T x, T y) {
           return std::memcmp(&x, &y, sizeof(T)) == 0;
         });
}

}  // namespace attn_dist_test
