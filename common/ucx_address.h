// The form a UCX worker address travels in between Pith processes: the packed address of
// ucp_worker_get_address inside a small envelope ("PUCX", its length, its CRC32C).
// ucp_ep_create takes a bare pointer and trusts what it points at, so a truncated or junk
// address (a 1-byte one in a hello, a corrupt one in a registration) could read past its
// buffer or abort inside UCX; every address is checked here before UCX sees it.
// The check catches damage and junk, not a forger (the data plane's authentication is
// a separate matter, DESIGN §4.3).
//
// Thread safety: pure functions.
#ifndef PITH_COMMON_UCX_ADDRESS_H_
#define PITH_COMMON_UCX_ADDRESS_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pith {

// `raw` (a packed UCX worker address) in its envelope.
std::string WrapUcxAddress(absl::string_view raw);

// The packed address inside `wrapped` (a view into it). INVALID_ARGUMENT, saying what is
// wrong, for anything WrapUcxAddress did not make.
absl::StatusOr<absl::string_view> UnwrapUcxAddress(absl::string_view wrapped);

}  // namespace pith

#endif  // PITH_COMMON_UCX_ADDRESS_H_
