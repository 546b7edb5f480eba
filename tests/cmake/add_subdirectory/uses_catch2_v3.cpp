// One translation unit with Catch2 v3's header (the stand-in) and attn's: exits 0 when both
// are the ones the project asked for.
#include <catch2/catch_test_macros.hpp>

#include <attn/softmax.hpp>

#include <iostream>

int main() {
  static_assert(CATCH2_V3_STAND_IN == 3, "the consumer's Catch2 v3 header was not found first");
  attn::Matrix<float> x(1, 2);
  x << 0.0f, 0.0f;
  const attn::Matrix<float> p = attn::softmax_rows(x);
  if (p(0, 0) != 0.5f || p(0, 1) != 0.5f) {
    std::cerr << "consumer_catch2_v3: softmax of [0, 0] is not [0.5, 0.5]\n";
    return 1;
  }
  return 0;
}
