// Same bits, compiled or header-only: one program, built twice from this source (tests/
// CMakeLists.txt): once on attn::compiled (ATTN_COMPILED: the kernels and layers from the
// library) and once on attn::attn alone (everything compiled here), both with the library's
// EIGEN_MAX_ALIGN_BYTES. For every instruction set this CPU has it prints one hash of the
// bits of every public entry point's results over many shapes, options and storage types;
// ctest (same_bits.cmake) requires the two programs to print the same lines.
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <attn/attn.hpp>

using attn::Index;

namespace {

std::uint64_t hash = 0;

template <class T>
void mix(const T* data, Index n) {
  const auto* bytes = reinterpret_cast<const unsigned char*>(data);
  for (Index i = 0; i < n * static_cast<Index>(sizeof(T)); ++i) {
    hash ^= bytes[i];
    hash *= 1099511628211ull;
  }
}
template <class M>
void mix(const M& m) {
  mix(m.data(), static_cast<Index>(m.size()));
}

template <class T, std::size_t R>
attn::Tensor<T, static_cast<int>(R)> random(const std::array<Index, R>& dims, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  attn::Tensor<T, static_cast<int>(R)> t(dims);
  for (Index n = 0; n < t.size(); ++n)
    t.data()[n] = static_cast<T>(normal(rng));
  return t;
}

template <class T>
attn::Tensor<T, 4> heads(Index b, Index h, Index l, Index d, std::uint32_t seed) {
  return random<T, 4>({b, h, l, d}, seed);
}

template <class C>
std::vector<attn::AttentionOptions<C>> option_sets() {
  std::vector<attn::AttentionOptions<C>> sets(5);
  sets[1].causal = attn::Causal::top_left;
  sets[2].causal = attn::Causal::bottom_right;
  sets[2].softcap = C(5);
  sets[2].window = attn::Window{9, 0};
  sets[3].score_mod = attn::ScoreMod<C>([](C s, Index, Index h, Index i, Index j) {
    return s - C(0.05) * static_cast<C>(h + 1) * static_cast<C>(i > j ? i - j : j - i);
  });
  sets[3].mask_mod =
      attn::MaskMod([](Index, Index, Index i, Index j) { return (3 * i + j) % 5 != 1; });
  sets[4].sinks = std::vector<C>{C(0.5), C(-1), C(2), C(0)};
  sets[4].alibi_slopes = attn::alibi_slopes<C>(4);
  return sets;
}

/// Every algorithm of the forward on (B, H, L, D) tensors, with its log-sum-exp.
template <class TQ, class TKV>
void forward(std::uint32_t seed) {
  using C = attn::compute_scalar_t<TQ>;
  for (const Index lq : {1, 7, 70, 200}) {
    for (const Index lk : {5, 64, 300}) {
      // (q and k/v in declarations of their own: one `auto` of two types is ill-formed)
      const auto q = heads<TQ>(2, 4, lq, 24, seed);
      const auto k = heads<TKV>(2, 2, lk, 24, seed + 1), v = heads<TKV>(2, 2, lk, 20, seed + 2);
      for (attn::AttentionOptions<C> o : option_sets<C>()) {
        for (const auto algorithm :
             {attn::Algorithm::automatic, attn::Algorithm::naive, attn::Algorithm::chunked,
              attn::Algorithm::flash, attn::Algorithm::decode}) {
          o.algorithm = algorithm;
          const auto r = attn::scaled_dot_product_attention(q, k, v, o, attn::Return::logsumexp);
          mix(r.out);
          mix(r.logsumexp);
        }
      }
    }
  }
}

/// The gradients, padded and packed.
template <class T>
void backward(std::uint32_t seed) {
  using C = attn::compute_scalar_t<T>;
  for (const Index l : {17, 150}) {
    const auto q = heads<T>(1, 4, l, 16, seed), k = heads<T>(1, 2, l + 9, 16, seed + 1),
               v = heads<T>(1, 2, l + 9, 12, seed + 2), dout = heads<T>(1, 4, l, 12, seed + 3);
    for (attn::AttentionOptions<C> o : option_sets<C>()) {
      o.score_mod = {};  // forward only
      for (const auto algorithm : {attn::Algorithm::naive, attn::Algorithm::flash}) {
        o.algorithm = algorithm;
        const auto result = attn::scaled_dot_product_attention(q, k, v, o, attn::Return::logsumexp);
        const auto& out = result.out;
        const auto& lse = result.logsumexp;
        const auto g = attn::scaled_dot_product_attention_backward(
            q, k, v, out, lse, dout, o,
            o.sinks.empty() ? attn::Return::nothing_else : attn::Return::dsinks);
        mix(g.dq);
        mix(g.dk);
        mix(g.dv);
        mix(g.dsinks);
      }
    }
  }
  const std::vector<Index> cu_q{0, 30, 31, 90}, cu_k{0, 40, 41, 120};
  const auto q = random<T, 3>({90, 4, 16}, seed + 4), k = random<T, 3>({120, 2, 16}, seed + 5),
             v = random<T, 3>({120, 2, 12}, seed + 6), dout = random<T, 3>({90, 4, 12}, seed + 7);
  attn::AttentionOptions<C> o;
  o.causal = attn::Causal::bottom_right;
  using attn::packed_view;
  attn::Tensor<C, 2> lse(4, 90);      // (Hq, Tq)
  attn::Tensor<T, 3> out(90, 4, 12);  // (Tq, Hq, Dv)
  attn::scaled_dot_product_attention_into<T>(
      packed_view(q, cu_q), packed_view(k, cu_k), packed_view(v, cu_k),
      attn::AttentionOutputViews{packed_view(out, cu_q), packed_view(lse, cu_q)}, o);
  mix(out);
  mix(lse);
  attn::Tensor<T, 3> dq(q.dimensions()), dk(k.dimensions()), dv(v.dimensions());
  attn::scaled_dot_product_attention_backward_into<T>(
      packed_view(q, cu_q), packed_view(k, cu_k), packed_view(v, cu_k),
      packed_view(std::as_const(out), cu_q), packed_view(std::as_const(lse), cu_q),
      packed_view(dout, cu_q),
      {packed_view(dq, cu_q), packed_view(dk, cu_k), packed_view(dv, cu_k)}, o);
  mix(dq);
  mix(dk);
  mix(dv);
}

template <class T>
void layers(std::uint32_t seed) {
  using C = attn::compute_scalar_t<T>;
  // One head as matrices.
  const attn::Matrix<T> qm = attn::Matrix<float>::Random(33, 16).cast<T>(),
                        km = attn::Matrix<float>::Random(50, 16).cast<T>(),
                        vm = attn::Matrix<float>::Random(50, 8).cast<T>();
  mix(attn::scaled_dot_product_attention(qm, km, vm));
  // Linear and its backward, QKVProjection.
  const attn::Linear<T> linear(16, 24, true, seed);
  const attn::Matrix<T> x = attn::Matrix<float>::Random(77, 16).cast<T>();
  const attn::Matrix<T> y = linear(x);
  mix(y);
  const auto lg = linear.backward(x, y);
  mix(lg.dx);
  // MultiHeadAttention: forward, training forward and backward, incremental decoding.
  attn::MultiHeadAttentionConfig config;
  config.embed_dim = 32;
  config.num_heads = 4;
  config.num_kv_heads = 2;
  config.seed = seed;
  attn::RopeConfig rope;
  rope.dim = 8;
  config.rotary = rope;
  const attn::MultiHeadAttention<T> mha(config);
  const auto xs = random<T, 3>({2, 40, 32}, seed + 1);
  mix(mha.forward(xs).output);
  const auto trained = mha.forward_train(xs);
  const auto grads = mha.backward(trained.context, xs);
  mix(grads.dquery);
  for (const auto& [name, p] : grads.parameters)
    mix(p.data.data(), static_cast<Index>(p.data.size()));
  attn::KVCache<T> cache(2, 2, 8, 8, 4);
  for (Index t = 0; t < 40; t += 13) {
    const Index n = std::min<Index>(13, 40 - t);
    attn::Tensor<T, 3> chunk =
        xs.slice(std::array<Index, 3>{0, t, 0}, std::array<Index, 3>{2, n, 32});
    mix(mha.forward_incremental(chunk, cache));
  }
  // RoPE on its own.
  attn::RopeConfig rc;
  rc.dim = 24;
  const attn::RotaryEmbedding<C> rotary(rc);
  auto r = heads<T>(2, 3, 30, 24, seed + 2);
  rotary.apply(r);
  mix(r);
}

template <class T>
void linear_attention(std::uint32_t seed) {
  const auto q = heads<T>(2, 4, 50, 16, seed), k = heads<T>(2, 2, 60, 16, seed + 1),
             v = heads<T>(2, 2, 60, 12, seed + 2), dout = heads<T>(2, 4, 50, 12, seed + 3);
  for (const auto causal : {attn::Causal::none, attn::Causal::bottom_right}) {
    attn::LinearAttentionOptions<T> o;
    o.causal = causal;
    mix(attn::linear_attention(q, k, v, o));
    const auto g = attn::linear_attention_backward(q, k, v, dout, o);
    mix(g.dq);
    mix(g.dk);
    mix(g.dv);
  }
}

/// A KVCache<SK, SV> (quantized blocks, mixed formats), plain and Hadamard-rotated, grown by
/// appends: a prompt of 17 queries (flash) and a token (decode) attended with fp32 and with
/// int8 products (ComputePrecision::int8, where the CPU has them).
template <class SK, class SV>
void cache(std::uint32_t seed) {
  for (const auto rotation : {attn::KVRotation::none, attn::KVRotation::hadamard}) {
    attn::KVCache<SK, SV> kv(2, 2, 64, 32, 8, true, rotation);
    for (const Index n : {40, 17, 1}) {
      kv.append(heads<float>(2, 2, n, 64, seed), heads<float>(2, 2, n, 32, seed + 1));
      const auto q = heads<float>(2, 4, n, 64, seed + 2);
      for (const auto compute : {attn::ComputePrecision::fp32, attn::ComputePrecision::int8}) {
        attn::AttentionOptions<float> o;
        o.compute = compute;
        mix(kv.attend(q, o));
      }
      seed += 3;
    }
  }
}

void hash_every_isa() {
  for (const attn::Isa isa : attn::all_isas) {
    if (!attn::isa_supported(isa))
      continue;
    const attn::ScopedIsa forced(isa);
    hash = 1469598103934665603ull;
    forward<float, float>(1);
    forward<float, Eigen::half>(2);
    forward<float, Eigen::bfloat16>(3);
    forward<Eigen::half, Eigen::half>(4);
    forward<double, double>(5);
    backward<float>(6);
    backward<Eigen::bfloat16>(7);
    backward<double>(8);
    layers<float>(9);
    layers<Eigen::half>(10);
    layers<double>(11);
    linear_attention<float>(12);
    linear_attention<double>(13);
    cache<attn::BlockQ8_0, attn::BlockQ8_0>(14);
    cache<attn::BlockQ4_0, attn::BlockQ4_0>(15);
    cache<attn::BlockQ8_0, attn::BlockQ4_0>(16);
    cache<Eigen::half, attn::BlockQ8_0>(17);
    cache<attn::BlockQ8_0, Eigen::half>(18);
    std::printf("%s %016llx\n", attn::isa_name(isa), static_cast<unsigned long long>(hash));
  }
}

}  // namespace

int main() {
  try {
    hash_every_isa();
  } catch (const std::exception& error) {  // a refusal is a failure, not a hash
    std::fprintf(stderr, "same_bits: %s\n", error.what());
    return 1;
  }
  return 0;
}
