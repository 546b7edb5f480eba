// The preamble of the test pages of scripts/extract_snippets.py: their units compile against
// this instead of attn, so that the check costs a fraction of a second.
#pragma once
#include <cstdio>
#include <exception>
#include <initializer_list>
#include <type_traits>

namespace attn_docs {
struct Snippet {
  const char* where;
  bool run;
  void (*function)();
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
    throw std::exception();
}
inline int run_snippets(std::initializer_list<Snippet> snippets) {
  for (const Snippet& s : snippets)
    if (s.run)
      s.function();
  return 0;
}
}  // namespace attn_docs
