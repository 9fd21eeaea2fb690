// Status helpers used across Pith. Every fallible call returns absl::Status or
// absl::StatusOr<T>; these macros keep the propagation to one line.
#ifndef PITH_COMMON_STATUS_H_
#define PITH_COMMON_STATUS_H_

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define RETURN_IF_ERROR(expr)                    \
  do {                                           \
    ::absl::Status pith_status_ = (expr);        \
    if (!pith_status_.ok()) return pith_status_; \
  } while (0)

#define PITH_STATUS_CONCAT_INNER_(a, b) a##b
#define PITH_STATUS_CONCAT_(a, b) PITH_STATUS_CONCAT_INNER_(a, b)

// ASSIGN_OR_RETURN(lhs, expr): evaluates `expr` (an absl::StatusOr<T>); on error returns
// its status, else assigns (moves) the value to `lhs`, which may be a declaration
// (`ASSIGN_OR_RETURN(auto file, Open(path));`).
#define ASSIGN_OR_RETURN(lhs, expr) \
  PITH_ASSIGN_OR_RETURN_IMPL_(PITH_STATUS_CONCAT_(pith_statusor_, __LINE__), lhs, expr)

#define PITH_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr)   \
  auto statusor = (expr);                                  \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

namespace pith {

// Returns `status` with `context` prepended to its message ("context: message"), keeping
// the code and the payloads. OK stays OK.
inline absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  absl::Status out(status.code(), absl::StrCat(context, ": ", status.message()));
  status.ForEachPayload(
      [&out](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

// A full disk (ENOSPC, EDQUOT, or under a --disk_reserve_bytes): RESOURCE_EXHAUSTED with
// a payload that tells it from other exhaustion (a wait for RAM, a blob over a limit), so
// that a store's refusal for want of disk is known as such across its data plane (the
// reply's disk_full) and up to the worker's failure report. The payload's value names the
// store once one is known.
inline constexpr absl::string_view kDiskFullPayload = "pith.dev/disk-full";

inline absl::Status DiskFullError(absl::string_view message, absl::string_view store_id = "") {
  absl::Status s = absl::ResourceExhaustedError(message);
  s.SetPayload(kDiskFullPayload, absl::Cord(store_id));
  return s;
}

inline bool IsDiskFull(const absl::Status& status) {
  return status.GetPayload(kDiskFullPayload).has_value();
}

// The store a disk-full status names; empty where it names none or is not one.
inline std::string DiskFullStore(const absl::Status& status) {
  const auto store = status.GetPayload(kDiskFullPayload);  // an absl::optional<absl::Cord>
  return store ? std::string(*store) : std::string();
}

}  // namespace pith

#endif  // PITH_COMMON_STATUS_H_
