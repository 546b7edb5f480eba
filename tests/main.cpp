// The Catch2 runner for attn_tests; the test cases live in test_*.cpp.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
