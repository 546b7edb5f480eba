// attn/distributed/head_exchange.hpp: the two all-to-alls of DeepSpeed-Ulysses: a sequence
// split turned into a head split and back.
//
//   local  (B, H, l_r, X)      rank r's runs of the L rows (sequence_split.hpp), every head
//   full   (B, H / P, L, X)    rank r's group of H / P heads (heads [r H / P, (r + 1) H / P)),
//                              every row, contiguous
//
// sequence_to_heads sends rank g the rows of its head group (MPI_Alltoallv) and places what
// arrives at its global rows; heads_to_sequence is the inverse. Each sends (P - 1) / P of
// its local tensor. H must be a multiple of P (the callers check, on every rank alike).
//
// Extra memory: one send and one receive buffer of the local tensor's size.
#pragma once

#include <mpi.h>

#include <string>
#include <vector>

#include "attn/config.hpp"
#include "attn/distributed/agreement.hpp"
#include "attn/distributed/ring_transfer.hpp"
#include "attn/distributed/sequence_split.hpp"
#include "attn/tensor.hpp"

namespace attn::distributed::detail {

/// Counts and displacements of an MPI_Alltoallv, from element counts per rank.
struct AlltoallCounts {
  std::vector<int> counts, displacements;
  Index total = 0;
};

inline AlltoallCounts alltoall_counts(const char* function, const std::vector<Index>& elements) {
  AlltoallCounts c;
  for (const Index n : elements) {
    if (c.total + n > Index(2147483647)) {
      attn::detail::throw_invalid_argument(
          function, "an all-to-all of over 2^31 elements a rank: split the batch");
    }
    c.counts.push_back(static_cast<int>(n));
    c.displacements.push_back(static_cast<int>(c.total));
    c.total += n;
  }
  return c;
}

/// The rows of rank r's runs in its local order.
inline Index rows_of(const std::vector<TokenRun>& runs) {
  Index n = 0;
  for (const TokenRun& run : runs)
    n += run.size();
  return n;
}

/// (B, H, l_r, X) local rows of every head -> (B, H / P, L, X) of this rank's head group.
template <class T>
std::vector<T> sequence_to_heads(const char* function, MPI_Comm comm,
                                 const HeadsView<const T>& local,  // (B, H, l_r, X)
                                 const std::vector<std::vector<TokenRun>>& runs, Index length) {
  const int ranks = static_cast<int>(runs.size());
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  const Index B = local.batch, group = local.heads / ranks, X = local.dim;
  std::vector<Index> send_elements, receive_elements;
  for (int r = 0; r < ranks; ++r) {
    send_elements.push_back(B * group * local.length * X);
    receive_elements.push_back(B * group * rows_of(runs[static_cast<std::size_t>(r)]) * X);
  }
  const AlltoallCounts send = alltoall_counts(function, send_elements);
  const AlltoallCounts receive = alltoall_counts(function, receive_elements);
  std::vector<T> out(static_cast<std::size_t>(send.total)),
      in(static_cast<std::size_t>(receive.total));
  T* to = out.data();
  for (int g = 0; g < ranks; ++g)  // by destination: its heads, all local rows
    for (Index b = 0; b < B; ++b)
      for (Index h = g * group; h < (g + 1) * group; ++h)
        for (Index i = 0; i < local.length; ++i, to += X)
          std::copy_n(attn::detail::row_data(local, b, h, i), X, to);
  check_mpi(function,
            MPI_Alltoallv(out.data(), send.counts.data(), send.displacements.data(), mpi_type<T>(),
                          in.data(), receive.counts.data(), receive.displacements.data(),
                          mpi_type<T>(), comm),
            "MPI_Alltoallv");
  std::vector<T> full(static_cast<std::size_t>(B * group * length * X));
  const T* from = in.data();
  for (int s = 0; s < ranks; ++s)  // by source: my heads, its rows at their global places
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < group; ++h)
        for (const TokenRun& run : runs[static_cast<std::size_t>(s)])
          for (Index i = run.begin; i < run.end; ++i, from += X)
            std::copy_n(from, X, full.data() + ((b * group + h) * length + i) * X);
  return full;
}

/// The inverse: (B, H / P, L, X) of this rank's head group -> (B, H, l_r, X) local rows.
template <class T>
void heads_to_sequence(const char* function, MPI_Comm comm, const std::vector<T>& full,
                       const HeadsView<T>& local,  // (B, H, l_r, X)
                       const std::vector<std::vector<TokenRun>>& runs, Index length) {
  const int ranks = static_cast<int>(runs.size());
  const Index B = local.batch, group = local.heads / ranks, X = local.dim;
  std::vector<Index> send_elements, receive_elements;
  for (int r = 0; r < ranks; ++r) {
    send_elements.push_back(B * group * rows_of(runs[static_cast<std::size_t>(r)]) * X);
    receive_elements.push_back(B * group * local.length * X);
  }
  const AlltoallCounts send = alltoall_counts(function, send_elements);
  const AlltoallCounts receive = alltoall_counts(function, receive_elements);
  std::vector<T> out(static_cast<std::size_t>(send.total)),
      in(static_cast<std::size_t>(receive.total));
  T* to = out.data();
  for (int s = 0; s < ranks; ++s)  // by destination: my heads, its rows
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < group; ++h)
        for (const TokenRun& run : runs[static_cast<std::size_t>(s)])
          for (Index i = run.begin; i < run.end; ++i, to += X)
            std::copy_n(full.data() + ((b * group + h) * length + i) * X, X, to);
  check_mpi(function,
            MPI_Alltoallv(out.data(), send.counts.data(), send.displacements.data(), mpi_type<T>(),
                          in.data(), receive.counts.data(), receive.displacements.data(),
                          mpi_type<T>(), comm),
            "MPI_Alltoallv");
  const T* from = in.data();
  for (int g = 0; g < ranks; ++g)  // by source: its heads, my rows
    for (Index b = 0; b < B; ++b)
      for (Index h = g * group; h < (g + 1) * group; ++h)
        for (Index i = 0; i < local.length; ++i, from += X)
          std::copy_n(from, X, attn::detail::row_data(local, b, h, i));
}

}  // namespace attn::distributed::detail
