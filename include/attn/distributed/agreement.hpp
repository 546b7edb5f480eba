// attn/distributed/agreement.hpp: every rank checks, every rank throws.
//
// A collective call whose arguments are wrong on one rank must not leave the others waiting
// in a send that is never matched. So each public function of attn/distributed/ first
// runs its local checks, catching the message, and then calls agree_or_throw() with the
// numbers that must be equal on every rank (shapes, options) and those that are the rank's
// own (its local lengths): one MPI_Allgather of the numbers and one of the messages later,
// every rank knows the same things and throws the same std::invalid_argument, naming the
// function, the ranks and the values, or none throws.
//
// Extra memory: P times the numbers and the messages (a few hundred bytes a rank).
#pragma once

#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "attn/config.hpp"

namespace attn::distributed::detail {

/// One number of a call's signature. `shared` ones must be equal on every rank; the others
/// are the rank's own, gathered for the caller (RankValues).
struct SignatureField {
  const char* name;
  std::int64_t value;
  bool shared = true;
  bool real = false;  ///< the bits of a double (double_bits), printed as the double
};

/// A double as the bits of a field (scale, softcap): equal only when bitwise equal.
inline std::int64_t double_bits(double x) {
  std::int64_t bits = 0;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

inline double bits_double(std::int64_t bits) {
  double x = 0;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

/// Every rank's values of the fields, field f of rank r at [r * fields + f].
struct RankValues {
  int ranks = 0;
  std::size_t fields = 0;
  std::vector<std::int64_t> values;
  std::int64_t at(int rank, std::size_t field) const {
    return values[static_cast<std::size_t>(rank) * fields + field];
  }
};

inline void check_mpi(const char* function, int status, const char* what) {
  if (status != MPI_SUCCESS) {
    char text[MPI_MAX_ERROR_STRING] = {};
    int length = 0;
    MPI_Error_string(status, text, &length);
    throw std::runtime_error(std::string(function) + ": " + what + " failed: " + text);
  }
}

/// Gathers every rank's local error (empty: none) and throws on every rank when one has
/// one: "function: rank r: message" for each failing rank.
inline void throw_if_any_rank_failed(const char* function, MPI_Comm comm,
                                     const std::string& local_error) {
  int ranks = 0;
  MPI_Comm_size(comm, &ranks);
  const std::string mine = local_error.substr(0, 4000);  // bounded, whatever the message
  int length = static_cast<int>(mine.size());
  std::vector<int> lengths(static_cast<std::size_t>(ranks));
  check_mpi(function, MPI_Allgather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, comm),
            "MPI_Allgather of the error lengths");
  std::vector<int> displacements(static_cast<std::size_t>(ranks), 0);
  int total = 0;
  for (int r = 0; r < ranks; ++r) {
    displacements[static_cast<std::size_t>(r)] = total;
    total += lengths[static_cast<std::size_t>(r)];
  }
  if (total == 0)
    return;
  std::vector<char> all(static_cast<std::size_t>(total));
  check_mpi(function,
            MPI_Allgatherv(mine.data(), length, MPI_CHAR, all.data(), lengths.data(),
                           displacements.data(), MPI_CHAR, comm),
            "MPI_Allgatherv of the errors");
  std::string message;
  for (int r = 0; r < ranks; ++r) {
    const auto n = static_cast<std::size_t>(lengths[static_cast<std::size_t>(r)]);
    if (n == 0)
      continue;
    std::string text(all.data() + displacements[static_cast<std::size_t>(r)], n);
    // The rank's message already names the function: keep it once.
    const std::string prefix = std::string(function) + ": ";
    if (text.compare(0, prefix.size(), prefix) == 0)
      text.erase(0, prefix.size());
    message += (message.empty() ? "" : "; ") + ("rank " + std::to_string(r) + ": " + text);
  }
  attn::detail::throw_invalid_argument(function, message);
}

/// The agreement of a collective call: every rank's local error (empty: none) and fields
/// gathered; every rank throws when a rank failed its local checks or when a shared field
/// differs between ranks ("B is 2 on rank 0 but 3 on rank 1"). Returns the fields of every
/// rank. Call it on every rank with the same fields in the same order.
inline RankValues agree_or_throw(const char* function, MPI_Comm comm,
                                 const std::vector<SignatureField>& fields,
                                 const std::string& local_error) {
  throw_if_any_rank_failed(function, comm, local_error);
  RankValues all;
  MPI_Comm_size(comm, &all.ranks);
  all.fields = fields.size();
  // The field count first: a rank with another count would make the next gather unequal.
  const auto count = static_cast<std::int64_t>(fields.size());
  std::vector<std::int64_t> counts(static_cast<std::size_t>(all.ranks));
  check_mpi(function, MPI_Allgather(&count, 1, MPI_INT64_T, counts.data(), 1, MPI_INT64_T, comm),
            "MPI_Allgather of the signature sizes");
  for (int r = 1; r < all.ranks; ++r) {
    if (counts[static_cast<std::size_t>(r)] != counts[0]) {
      attn::detail::throw_invalid_argument(
          function, "the ranks' arguments differ: rank 0 gives " + std::to_string(counts[0]) +
                        " numbers but rank " + std::to_string(r) + " gives " +
                        std::to_string(counts[static_cast<std::size_t>(r)]) +
                        " (batch sizes or option lists differ)");
    }
  }
  std::vector<std::int64_t> mine(fields.size());
  for (std::size_t f = 0; f < fields.size(); ++f)
    mine[f] = fields[f].value;
  all.values.resize(fields.size() * static_cast<std::size_t>(all.ranks));
  check_mpi(function,
            MPI_Allgather(mine.data(), static_cast<int>(mine.size()), MPI_INT64_T,
                          all.values.data(), static_cast<int>(mine.size()), MPI_INT64_T, comm),
            "MPI_Allgather of the signatures");
  std::string differences;
  for (std::size_t f = 0; f < fields.size(); ++f) {
    if (!fields[f].shared)
      continue;
    for (int r = 1; r < all.ranks; ++r) {
      if (all.at(r, f) != all.at(0, f)) {
        const auto text = [&](std::int64_t v) {
          return fields[f].real ? std::to_string(bits_double(v)) : std::to_string(v);
        };
        differences += (differences.empty() ? "" : ", ") + std::string(fields[f].name) + " is " +
                       text(all.at(0, f)) + " on rank 0 but " + text(all.at(r, f)) + " on rank " +
                       std::to_string(r);
        break;
      }
    }
  }
  if (!differences.empty()) {
    attn::detail::throw_invalid_argument(
        function, "the ranks' arguments differ: " + differences +
                      " (shapes and options must be the same on every rank)");
  }
  return all;
}

}  // namespace attn::distributed::detail
