// The data helpers of support/heads.hpp and support/masked_problem.hpp (random heads, casts,
// exact values, errors), compiled once: the tests run them on tens of millions of numbers.
#include "support/heads.hpp"
#include "support/masked_problem.hpp"

namespace attn_test {

ATTN_TEST_HEADS_INSTANCES(, float)
ATTN_TEST_HEADS_INSTANCES(, double)
ATTN_TEST_HEADS_INSTANCES(, Eigen::half)
ATTN_TEST_HEADS_INSTANCES(, Eigen::bfloat16)
template Heads<Eigen::half> Heads<float>::cast<Eigen::half>() const;
template Heads<Eigen::bfloat16> Heads<float>::cast<Eigen::bfloat16>() const;

ATTN_TEST_ERROR_INSTANCES(, float)
ATTN_TEST_ERROR_INSTANCES(, double)
ATTN_TEST_ERROR_INSTANCES(, Eigen::half)
ATTN_TEST_ERROR_INSTANCES(, Eigen::bfloat16)

}  // namespace attn_test
