// attn::mpi from the installed package: attn/distributed.hpp compiles against the consumer's
// MPI, and a ring of one rank (a singleton MPI_Init, no mpirun) gives the single-process
// result.
#include <mpi.h>

#include <cmath>
#include <cstdio>

#include <attn/attention.hpp>
#include <attn/distributed.hpp>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  attn::Tensor<float, 4> q(1, 2, 9, 4);
  q.setRandom();
  attn::AttentionOptions<float> options;
  options.causal = attn::Causal::top_left;
  const auto ring = attn::distributed::ring_attention<float>(
      q, q, q, options, {attn::distributed::SequenceSplit::zigzag}, MPI_COMM_WORLD);
  const attn::Tensor<float, 4> single = attn::scaled_dot_product_attention(q, q, q, options);
  float worst = 0;
  for (attn::Index n = 0; n < single.size(); ++n)
    worst = std::fmax(worst, std::fabs(ring.out.data()[n] - single.data()[n]));
  MPI_Finalize();
  std::printf("ring of one rank against one call: %g\n", static_cast<double>(worst));
  return worst < 1e-6f ? 0 : 1;
}
