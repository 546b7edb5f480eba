// Tests for attn/kernels/gemm.hpp: c = a b [+ c] [+ bias] for every instruction set this CPU
// supports, against a long double triple loop written here, over sizes around the register
// block (mr x nr) and the cache blocks (kc, mc, nc), strided views, bias and accumulate;
// bitwise independence of the thread count and of where the tiles fall. Each test case loops
// over the instruction sets itself (so none is tagged [isa]: ctest need not repeat them).
//
// Error bound: every c[i, j] is c0 (or 0) plus K products plus the bias, summed in some
// order in float, so |c - exact| <= (K + 2) eps (|c0| + sum_k |a_ik b_kj| + |bias_j|) with
// eps = FLT_EPSILON = 2^-23 (Higham's gamma_{K+2} with u = eps / 2, with room to spare).
#include <catch2/catch.hpp>

// GCC bug 105593: before GCC 13 its AVX-512 intrinsic headers trip -W(maybe-)uninitialized
// on their own `__m512 __Y = __Y;` idiom once inlined (here: Eigen's products in a
// -march=native build). Not our code; the project's CMake silences it the same way.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13 && defined(__AVX512F__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <attn/config.hpp>
#include <attn/cpu.hpp>
#include <attn/kernels/dispatch.hpp>

using attn::Index;
using attn::Isa;

namespace {

constexpr float sentinel = std::numeric_limits<float>::quiet_NaN();

/// The register block (mr, nr) of an instruction set's kernel; the generic path has no
/// fixed block, any small sizes do.
std::pair<Index, Index> register_block(Isa isa) {
#if ATTN_X86_DISPATCH
  if (isa == Isa::avx512)
    return {attn::detail::avx512::Gemm::rows, attn::detail::avx512::Gemm::columns};
  if (isa == Isa::avx2)
    return {attn::detail::avx2::Gemm::rows, attn::detail::avx2::Gemm::columns};
#endif
  (void)isa;
  return {4, 8};
}

/// Elements of a row-major (rows, cols) view with row stride ld: exactly up to the last
/// element, so that a read past it is outside the allocation (AddressSanitizer).
std::size_t extent(Index rows, Index cols, Index ld) {
  return rows == 0 || cols == 0 ? 0 : static_cast<std::size_t>((rows - 1) * ld + cols);
}

bool in_view(std::size_t at, Index cols, Index ld) {
  return static_cast<Index>(at) % ld < cols;
}

/// A problem with strided operands: padding of a and b holds NaN (a kernel that reads it
/// spoils its result), the padding of c holds NaN that must stay untouched.
struct Problem {
  Index m, n, k, lda, ldb, ldc;
  std::vector<float> a, b, c0, bias;

  Problem(Index rows, Index cols, Index depth, Index pad, unsigned seed)
      : m(rows), n(cols), k(depth), lda(depth + pad), ldb(cols + 2 * pad), ldc(cols + 3 * pad) {
    std::mt19937 engine(seed);
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    const auto fill = [&](std::vector<float>& v, Index r, Index c, Index ld) {
      v.assign(extent(r, c, ld), sentinel);
      for (std::size_t i = 0; i < v.size(); ++i) {
        if (in_view(i, c, ld))
          v[i] = uniform(engine);
      }
    };
    fill(a, m, k, lda);
    fill(b, k, n, ldb);
    fill(c0, m, n, ldc);
    fill(bias, 1, n, n);
  }
};

/// sum_k a_ik b_kj and sum_k |a_ik b_kj| in long double.
struct Reference {
  std::vector<long double> sum, magnitude;  // (m, n)

  explicit Reference(const Problem& p)
      : sum(static_cast<std::size_t>(p.m * p.n)), magnitude(sum.size()) {
    for (Index i = 0; i < p.m; ++i) {
      for (Index j = 0; j < p.n; ++j) {
        long double s = 0, s_abs = 0;
        for (Index q = 0; q < p.k; ++q) {
          const long double x =
              static_cast<long double>(p.a[static_cast<std::size_t>(i * p.lda + q)]) *
              static_cast<long double>(p.b[static_cast<std::size_t>(q * p.ldb + j)]);
          s += x;
          s_abs += std::abs(x);
        }
        sum[static_cast<std::size_t>(i * p.n + j)] = s;
        magnitude[static_cast<std::size_t>(i * p.n + j)] = s_abs;
      }
    }
  }
};

std::string describe(Isa isa, const Problem& p, bool bias, bool accumulate) {
  std::ostringstream s;
  s << attn::isa_name(isa) << ": (" << p.m << " x " << p.k << ") (" << p.k << " x " << p.n
    << "), lda " << p.lda << ", ldb " << p.ldb << ", ldc " << p.ldc << (bias ? ", bias" : "")
    << (accumulate ? ", accumulate" : "");
  return s.str();
}

/// c for one call; c starts as c0 with accumulate, else as NaN (which must not be read).
std::vector<float> run(Isa isa, const Problem& p, bool bias, bool accumulate,
                       bool parallel = true) {
  std::vector<float> c = p.c0;
  if (!accumulate)
    std::fill(c.begin(), c.end(), sentinel);
  attn::detail::gemm(isa, p.m, p.n, p.k, p.a.data(), p.lda, p.b.data(), p.ldb, c.data(), p.ldc,
                     bias ? p.bias.data() : nullptr, accumulate, parallel);
  return c;
}

bool same_bits(float x, float y) {
  std::uint32_t bx = 0, by = 0;
  std::memcpy(&bx, &x, sizeof x);
  std::memcpy(&by, &y, sizeof y);
  return bx == by;
}

/// Checks every variant (bias, accumulate) of p against the reference: the error bound on
/// the view, the padding of c untouched.
void check_problem(Isa isa, const Problem& p) {
  const Reference ref(p);
  const long double eps = std::numeric_limits<float>::epsilon();
  for (const bool bias : {false, true}) {
    for (const bool accumulate : {false, true}) {
      INFO(describe(isa, p, bias, accumulate));
      const std::vector<float> c = run(isa, p, bias, accumulate);
      REQUIRE(c.size() == p.c0.size());
      Index failures = 0, untouched_failures = 0;
      std::string first_failure;
      for (std::size_t at = 0; at < c.size(); ++at) {
        if (!in_view(at, p.n, p.ldc)) {
          untouched_failures += same_bits(c[at], p.c0[at]) ? 0 : 1;
          continue;
        }
        const Index i = static_cast<Index>(at) / p.ldc, j = static_cast<Index>(at) % p.ldc;
        const std::size_t r = static_cast<std::size_t>(i * p.n + j);
        const long double start = accumulate ? static_cast<long double>(p.c0[at]) : 0;
        const long double offset =
            bias ? static_cast<long double>(p.bias[static_cast<std::size_t>(j)]) : 0;
        const long double exact = start + ref.sum[r] + offset;
        const long double bound = static_cast<long double>(p.k + 2) * eps *
                                  (std::abs(start) + ref.magnitude[r] + std::abs(offset));
        const long double error = std::abs(static_cast<long double>(c[at]) - exact);
        if (!(error <= bound)) {  // NaN fails too
          if (failures++ == 0) {
            std::ostringstream s;
            s << "c[" << i << ", " << j << "] = " << c[at] << ", exact "
              << static_cast<double>(exact) << ", error " << static_cast<double>(error)
              << " > bound " << static_cast<double>(bound);
            first_failure = s.str();
          }
        }
      }
      INFO(first_failure);
      CHECK(failures == 0);
      CHECK(untouched_failures == 0);
    }
  }
}

std::vector<Isa> supported_isas() {
  std::vector<Isa> isas;
  for (const Isa isa : attn::all_isas) {
    if (attn::isa_supported(isa))
      isas.push_back(isa);
  }
  return isas;
}

}  // namespace

TEST_CASE("gemm matches a long double loop around the register block", "[gemm]") {
  const std::vector<Isa> isas = supported_isas();
  REQUIRE(!isas.empty());
  for (const Isa isa : isas) {
    const auto [mr, nr] = register_block(isa);
    const std::vector<Index> rows{0, 1, 3, mr - 1, mr, mr + 1, 2 * mr + 3};
    const std::vector<Index> cols{0, 1, 3, nr - 1, nr, nr + 1, 2 * nr + 3};
    unsigned seed = 1;
    for (const Index m : rows) {
      for (const Index n : cols) {
        for (const Index k : {0, 1, 3, 17}) {
          check_problem(isa, Problem(m, n, k, k % 2 == 0 ? 0 : 5, seed++));
        }
      }
    }
  }
}

TEST_CASE("gemm matches a long double loop around the cache blocks", "[gemm]") {
  struct Shape {
    Index m, n, k;
  };
  // depth blocks of at most 256 (257, 385: two blocks; 512: two full ones), row blocks of
  // 112 / 144 (300: three), column blocks of at most 4096 (4097: two)
  const std::vector<Shape> shapes{{100, 100, 257}, {300, 70, 385}, {37, 45, 512},
                                  {3, 4097, 20},   {145, 33, 100}, {1, 300, 300}};
  for (const Isa isa : supported_isas()) {
    unsigned seed = 100;
    for (const Shape& s : shapes)
      check_problem(isa, Problem(s.m, s.n, s.k, 3, seed++));
  }
}

TEST_CASE("gemm: the bias is added after the chain, accumulate starts from c", "[gemm]") {
  // c = a b + bias must be, bit for bit, (a b) + bias: the bias never enters the sum over K.
  for (const Isa isa : supported_isas()) {
    const Problem p(53, 77, 300, 1, 7);
    INFO(attn::isa_name(isa));
    const std::vector<float> plain = run(isa, p, false, false);
    const std::vector<float> with_bias = run(isa, p, true, false);
    Index differences = 0;
    for (std::size_t at = 0; at < plain.size(); ++at) {
      if (in_view(at, p.n, p.ldc)) {
        const float expected =
            plain[at] + p.bias[static_cast<std::size_t>(static_cast<Index>(at) % p.ldc)];
        differences += same_bits(with_bias[at], expected) ? 0 : 1;
      }
    }
    CHECK(differences == 0);
    // accumulate with c = 0 is the plain product
    Problem zero = p;
    for (std::size_t at = 0; at < zero.c0.size(); ++at) {
      if (in_view(at, zero.n, zero.ldc))
        zero.c0[at] = 0.0f;
    }
    const std::vector<float> from_zero = run(isa, zero, false, true);
    differences = 0;
    for (std::size_t at = 0; at < plain.size(); ++at) {
      if (in_view(at, p.n, p.ldc))
        differences += same_bits(from_zero[at], plain[at]) ? 0 : 1;
    }
    CHECK(differences == 0);
  }
}

TEST_CASE("gemm: an element's bits do not depend on where the tiles fall", "[gemm]") {
  // Rows 1.. of c computed alone (a and c advanced by one row, so every tile boundary moves)
  // equal the same rows of the whole product, on the vector kernels.
  for (const Isa isa : supported_isas()) {
    if (isa == Isa::generic)
      continue;  // Eigen's own kernels: not promised
    INFO(attn::isa_name(isa));
    const auto [mr, nr] = register_block(isa);
    const Index m = 3 * mr + 2, n = 3 * nr + 5, k = 301;
    const Problem p(m, n, k, 2, 11);
    const std::vector<float> whole = run(isa, p, true, true);
    std::vector<float> shifted = p.c0;
    attn::detail::gemm(isa, m - 1, n - 1, k, p.a.data() + p.lda, p.lda, p.b.data() + 1, p.ldb,
                       shifted.data() + p.ldc + 1, p.ldc, p.bias.data() + 1, true);
    Index differences = 0;
    for (Index i = 1; i < m; ++i) {
      for (Index j = 1; j < n; ++j) {
        const std::size_t at = static_cast<std::size_t>(i * p.ldc + j);
        differences += same_bits(whole[at], shifted[at]) ? 0 : 1;
      }
    }
    CHECK(differences == 0);
  }
}

TEST_CASE("gemm: a product of a few rows (unpacked) has the bits of the same rows in a larger one",
          "[gemm]") {
  // Up to gemm_unpacked_rows rows run unpacked, straight from a and b: the same chains as the
  // packed register blocks, so row i of a product is the same whether the product has one row
  // or many (a sequence decoded alone or in a batch). Depths of one and two blocks, column
  // edges, several strips of columns, bias and accumulate.
  for (const Isa isa : supported_isas()) {
    if (isa == Isa::generic)
      continue;  // Eigen's own kernels: not promised
    const auto [mr, nr] = register_block(isa);
    for (const Index n : {nr + 5, Index(600)}) {
      for (const Index k : {Index(37), Index(301)}) {
        const Index m = 2 * mr + 3;
        const Problem p(m, n, k, 2, 13);
        for (const bool bias : {false, true}) {
          for (const bool accumulate : {false, true}) {
            INFO(describe(isa, p, bias, accumulate));
            const std::vector<float> whole = run(isa, p, bias, accumulate);
            for (const Index rows : {Index(1), attn::detail::gemm_unpacked_rows}) {
              for (const Index first : {Index(0), mr - 1, m - rows}) {
                std::vector<float> part = p.c0;
                if (!accumulate)
                  std::fill(part.begin(), part.end(), sentinel);
                attn::detail::gemm(isa, rows, n, k, p.a.data() + first * p.lda, p.lda, p.b.data(),
                                   p.ldb, part.data() + first * p.ldc, p.ldc,
                                   bias ? p.bias.data() : nullptr, accumulate);
                Index differences = 0;
                for (Index i = first; i < first + rows; ++i) {
                  for (Index j = 0; j < n; ++j) {
                    const auto at = static_cast<std::size_t>(i * p.ldc + j);
                    differences += same_bits(whole[at], part[at]) ? 0 : 1;
                  }
                }
                INFO(rows << " rows from row " << first);
                CHECK(differences == 0);
              }
            }
          }
        }
      }
    }
  }
}

TEST_CASE("gemm gives the same bits for any thread count", "[gemm][determinism]") {
  struct Shape {
    Index m, n, k;
  };
  // many rows (the threads split the rows), few rows (they split the columns) and one row
  // (unpacked: they split its strips of columns); all above the 1 MFLOP threshold
  const std::vector<Shape> shapes{{301, 203, 300}, {5, 1000, 300}, {1, 1000, 700}};
  for (const Isa isa : supported_isas()) {
    for (const Shape& s : shapes) {
      const Problem p(s.m, s.n, s.k, 1, 21);
      INFO(describe(isa, p, true, true));
      const std::vector<float> serial = run(isa, p, true, true, false);
      REQUIRE(serial.size() == p.c0.size());
#if ATTN_HAS_OPENMP
      const int previous = omp_get_max_threads();
      for (const int threads : {1, 2, 3}) {
        omp_set_num_threads(threads);
        const std::vector<float> c = run(isa, p, true, true, true);
        omp_set_num_threads(previous);
        INFO(threads << " threads");
        CHECK(std::memcmp(c.data(), serial.data(), c.size() * sizeof(float)) == 0);
      }
#else
      const std::vector<float> c = run(isa, p, true, true, true);
      CHECK(std::memcmp(c.data(), serial.data(), c.size() * sizeof(float)) == 0);
#endif
    }
  }
}

TEST_CASE("gemm in double runs Eigen's product", "[gemm]") {
  const Index m = 7, n = 5, k = 9;
  std::vector<double> a(static_cast<std::size_t>(m * k)), b(static_cast<std::size_t>(k * n)),
      bias(static_cast<std::size_t>(n)), c(static_cast<std::size_t>(m * n), 1.0);
  for (std::size_t i = 0; i < a.size(); ++i)
    a[i] = static_cast<double>(i % 7) - 3;
  for (std::size_t i = 0; i < b.size(); ++i)
    b[i] = static_cast<double>(i % 5) - 2;
  for (std::size_t i = 0; i < bias.size(); ++i)
    bias[i] = static_cast<double>(i);
  attn::detail::gemm(attn::active_isa(), m, n, k, a.data(), k, b.data(), n, c.data(), n,
                     bias.data(), true);
  for (Index i = 0; i < m; ++i) {
    for (Index j = 0; j < n; ++j) {
      double expected = 1.0 + bias[static_cast<std::size_t>(j)];
      for (Index q = 0; q < k; ++q)
        expected += a[static_cast<std::size_t>(i * k + q)] * b[static_cast<std::size_t>(q * n + j)];
      INFO("c[" << i << ", " << j << "]");
      CHECK(c[static_cast<std::size_t>(i * n + j)] == expected);  // small integers: exact
    }
  }
}
