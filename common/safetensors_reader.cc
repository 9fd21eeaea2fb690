#include "common/safetensors_reader.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace pith {

absl::StatusOr<SafetensorsReader> SafetensorsReader::Open(const std::string& path) {
  SafetensorsReader r;
  r.path_ = path;
  r.fd_ = UniqueFd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!r.fd_.valid()) {
    return errno == ENOENT ? absl::NotFoundError(absl::StrCat("no file ", path))
                           : absl::FailedPreconditionError(
                                 absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  }
  struct stat st;
  if (::fstat(r.fd_.get(), &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  uint8_t first8[8] = {};
  if (size >= 8) RETURN_IF_ERROR(PreadAll(r.fd_.get(), first8, 0, path));
  absl::StatusOr<uint64_t> header_len = SafetensorsHeaderLength(first8, size);
  if (!header_len.ok()) return Annotate(header_len.status(), path);
  std::string header(*header_len, '\0');
  RETURN_IF_ERROR(
      PreadAll(r.fd_.get(), {reinterpret_cast<uint8_t*>(header.data()), header.size()}, 8, path));
  RETURN_IF_ERROR(Annotate(
      ParseSafetensorsHeader(header, size - 8 - *header_len, &r.entries_, &r.metadata_), path));
  r.data_offset_ = 8 + *header_len;
  return r;
}

absl::StatusOr<const SafetensorsEntry*> SafetensorsReader::Find(absl::string_view name) const {
  auto it =
      std::lower_bound(entries_.begin(), entries_.end(), name,
                       [](const SafetensorsEntry& e, absl::string_view n) { return e.name < n; });
  if (it == entries_.end() || it->name != name) {
    return absl::NotFoundError(absl::StrCat("safetensors: no tensor \"", name, "\""));
  }
  return &*it;
}

absl::Status SafetensorsReader::Read(absl::string_view name, absl::Span<uint8_t> out) const {
  ASSIGN_OR_RETURN(const SafetensorsEntry* e, Find(name));
  if (out.size() != e->end - e->begin) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors: tensor \"", name, "\" has ",
                                                   e->end - e->begin, " bytes, not ", out.size()));
  }
  return PreadAll(fd_.get(), out, data_offset_ + e->begin, path_);
}

}  // namespace pith
