// What every docs snippet may use without showing it (scripts/extract_snippets.py puts each
// README.md and docs/*.md snippet in a function after this header; docs/testing.md, "Docs
// snippets"): the umbrella header, the standard headers the snippets print and store with,
// and attn_docs::random_tensor / random_matrix for the hidden setups that give a snippet's
// inputs values.
#pragma once

#include <attn/attn.hpp>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <initializer_list>
#include <iostream>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace attn_docs {

// A tensor of the given dimensions, values uniform in [-1, 1) from a fixed seed.
template <typename T, typename... Dims>
attn::Tensor<T, sizeof...(Dims)> random_tensor(Dims... dims) {
  attn::Tensor<T, sizeof...(Dims)> t(static_cast<attn::Index>(dims)...);
  std::mt19937 rng(42);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (attn::Index i = 0; i < t.size(); ++i)
    t.data()[i] = T(u(rng));
  return t;
}

template <typename T>
attn::Matrix<T> random_matrix(attn::Index rows, attn::Index cols) {
  attn::Matrix<T> m(rows, cols);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (attn::Index i = 0; i < m.size(); ++i)
    m.data()[i] = T(u(rng));
  return m;
}

struct Snippet {
  const char* where;  // page:line of the opening fence
  bool run;           // false: compile-only
  void (*function)();
};

struct NonZeroExit : std::exception {
  const char* what() const noexcept override { return "main returned non-zero"; }
};

// The main of a whole-program snippet, int main() or int main(int, char**).
template <class Main>
int call_main(Main main) {
  if constexpr (std::is_invocable_v<Main>) {
    return main();
  } else {
    char name[] = "snippet";
    char* argv[] = {name, nullptr};
    return main(1, argv);
  }
}

inline void expect_zero(int status) {
  if (status != 0)
    throw NonZeroExit();
}

// Runs the snippets in page order; 1 on the first that throws.
inline int run_snippets(std::initializer_list<Snippet> snippets) {
  for (const Snippet& s : snippets) {
    if (!s.run) {
      std::printf("%s: compiled only\n", s.where);
      continue;
    }
    try {
      s.function();
    } catch (const std::exception& e) {
      std::printf("%s: threw: %s\n", s.where, e.what());
      return 1;
    }
    std::printf("%s: ran\n", s.where);
  }
  return 0;
}

}  // namespace attn_docs
