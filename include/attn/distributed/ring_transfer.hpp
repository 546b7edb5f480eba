// attn/distributed/ring_transfer.hpp: one non-blocking send to the next rank and receive
// from the previous one, and what a ring call measures of its time.
//
// A ring step posts MPI_Isend of the block it holds and MPI_Irecv of the next one, computes
// on the block it holds while they travel, and waits at the end of the step (double
// buffering: the received block lands in the other buffer). Between its attention calls it
// calls progress() (MPI_Testall), so that an MPI library without a progress thread still
// moves the rendezvous of a large message along. Messages larger than 2^30 elements go in
// several parts (MPI counts are int).
//
// Extra memory: the requests.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attn/config.hpp"
#include "attn/distributed/agreement.hpp"

namespace attn::distributed {

/// What one call of ring attention did on this rank (optional; RingOptions::stats).
struct RingStats {
  int steps = 0;                ///< ring steps (P)
  int blocks_computed = 0;      ///< blocks with a visible key (others are skipped)
  std::int64_t bytes_sent = 0;  ///< by this rank, every transfer included
  double compute_seconds = 0;   ///< attention calls, merges and accumulations
  double wait_seconds = 0;      ///< blocked in MPI_Wait for transfers still under way
  double total_seconds = 0;     ///< the whole call, checks and agreement included
};

namespace detail {

template <class T>
MPI_Datatype mpi_type() {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "attn::distributed: float or double");
  return std::is_same_v<T, float> ? MPI_FLOAT : MPI_DOUBLE;
}

/// The transfers of one ring step: a send to `to` and a receive from `from`, each of one or
/// more messages of tags tag_base + part.
template <class T>
class RingTransfer {
 public:
  RingTransfer(const char* function, MPI_Comm comm, int tag_base)
      : function_(function), comm_(comm), tag_base_(tag_base) {}
  RingTransfer(const RingTransfer&) = delete;
  RingTransfer& operator=(const RingTransfer&) = delete;
  ~RingTransfer() {
    // Only reached with requests on an exception's path: complete them before the buffers go.
    if (!requests_.empty())
      MPI_Waitall(static_cast<int>(requests_.size()), requests_.data(), MPI_STATUSES_IGNORE);
  }

  /// Posts the receive of `recv_count` elements into `recv` from rank `from` (none when
  /// from < 0) and the send of `send_count` from `send` to rank `to` (none when to < 0).
  void start(const T* send, Index send_count, int to, T* recv, Index recv_count, int from,
             RingStats* stats) {
    if (from >= 0)
      post(recv, recv_count, from, false);
    if (to >= 0) {
      post(const_cast<T*>(send), send_count, to, true);  // NOLINT: MPI_Isend takes void*
      if (stats != nullptr)
        stats->bytes_sent += static_cast<std::int64_t>(send_count) * Index(sizeof(T));
    }
  }

  /// Lets the library move the messages along (MPI_Testall); never blocks.
  void progress() {
    if (requests_.empty())
      return;
    int done = 0;
    check_mpi(function_,
              MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &done,
                          MPI_STATUSES_IGNORE),
              "MPI_Testall");
    if (done != 0)
      requests_.clear();
  }

  /// Waits until both are complete, adding the time blocked to stats->wait_seconds.
  void wait(RingStats* stats) {
    if (requests_.empty())
      return;
    const double start = MPI_Wtime();
    const int status =
        MPI_Waitall(static_cast<int>(requests_.size()), requests_.data(), MPI_STATUSES_IGNORE);
    requests_.clear();
    check_mpi(function_, status, "MPI_Waitall");
    if (stats != nullptr)
      stats->wait_seconds += MPI_Wtime() - start;
  }

 private:
  static constexpr Index part_elements = Index(1) << 30;

  void post(T* data, Index count, int peer, bool send) {
    for (Index first = 0, part = 0; first < count || (count == 0 && part == 0);
         first += part_elements, ++part) {
      const int n = static_cast<int>(std::min(part_elements, count - first));
      MPI_Request request = MPI_REQUEST_NULL;
      const int tag = tag_base_ + static_cast<int>(part);
      const int status =
          send ? MPI_Isend(data + first, n, mpi_type<T>(), peer, tag, comm_, &request)
               : MPI_Irecv(data + first, n, mpi_type<T>(), peer, tag, comm_, &request);
      check_mpi(function_, status, send ? "MPI_Isend" : "MPI_Irecv");
      requests_.push_back(request);
      if (count == 0)
        break;
    }
  }

  const char* function_;
  MPI_Comm comm_;
  int tag_base_;
  std::vector<MPI_Request> requests_;
};

}  // namespace detail
}  // namespace attn::distributed
