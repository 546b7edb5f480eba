// The distributed tests' main: MPI around Catch2's session. Every rank runs every test case
// in the same order, so the collective calls inside them match; the test cases use CHECK,
// never REQUIRE, so that a failure on one rank does not skip a collective the others make.
#define CATCH_CONFIG_RUNNER
#include <mpi.h>
#include <catch2/catch.hpp>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  const int status = Catch::Session().run(argc, argv);
  // A failure on any rank fails every rank's exit status.
  int worst = 0;
  MPI_Allreduce(&status, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
