// A unit of tests/mixed_flags (its flags: tests/mixed_flags/CMakeLists.txt).
#include "unit_body.hpp"

mixed_flags::Results mixed_flags::compute_avx2(const Inputs& inputs) {
  return compute_in_this_unit(inputs);
}
