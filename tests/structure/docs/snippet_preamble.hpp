// The preamble of the test pages of scripts/extract_snippets.py: their units compile against
// this instead of attn, so that the check costs a fraction of a second.
#pragma once
#include <cstdio>
#include <exception>
#include <initializer_list>

namespace attn_docs {
struct Snippet {
  const char* where;
  bool run;
  void (*function)();
};
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
