// Test support: test cases over the scalars, registered so that each runs on the
// instruction sets where it means something.
#pragma once

#include <catch2/catch.hpp>

/// Registers body<float>() as a test case run once per instruction set ([isa]) and
/// body<double>() as one run once: double always runs the generic kernels.
#define ATTN_TEST_FLOAT_PER_ISA_DOUBLE_ONCE(name, tags, body) \
  TEST_CASE(name " - float", tags "[isa]") {                  \
    body<float>();                                            \
  }                                                           \
  TEST_CASE(name " - double", tags) {                         \
    body<double>();                                           \
  }
