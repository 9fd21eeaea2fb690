#include "worker/runtime/grad_pool.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "glog/logging.h"

namespace pith::runtime {
namespace {

constexpr char kScratchName[] = "the gradient scratch file";

}  // namespace

absl::StatusOr<std::unique_ptr<GradPool>> GradPool::Create(int64_t floats, int buffers,
                                                           std::string scratch_dir) {
  if (floats <= 0 || buffers < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("gradient pool: ", buffers, " buffers of ", floats, " floats"));
  }
  ASSIGN_OR_RETURN(Buffer memory,
                   Buffer::Allocate(static_cast<size_t>(floats) * buffers * sizeof(float),
                                    Buffer::Init::kUninitialized));
  return std::unique_ptr<GradPool>(
      new GradPool(floats, std::move(memory), buffers, std::move(scratch_dir)));
}

GradPool::GradPool(int64_t floats, Buffer memory, int buffers, std::string scratch_dir)
    : floats_(floats),
      buffer_count_(buffers),
      memory_(std::move(memory)),
      scratch_dir_(std::move(scratch_dir)) {
  buffers_.resize(buffers);
}

void GradPool::Reset() {
  absl::MutexLock lock(&mu_);
  for (Slot& s : buffers_) {
    LOG_IF(ERROR, s.holds > 0) << "gradient pool reset while layer " << s.owner.first << " expert "
                               << s.owner.second << "'s gradient is held";
    s = Slot();
  }
  grads_.clear();
}

absl::Status GradPool::OpenFileLocked() {
  if (file_.valid()) return absl::OkStatus();
  const std::string dir = scratch_dir_.empty() ? "/tmp" : scratch_dir_;
  // Unlinked from the start: it goes with the process, however that ends.
  int fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)) {
    std::string path = dir + "/pith-gradients-XXXXXX";
    fd = ::mkostemp(path.data(), O_CLOEXEC);
    if (fd >= 0) ::unlink(path.c_str());
  }
  if (fd < 0) {
    return absl::FailedPreconditionError(absl::StrCat("cannot create the gradient scratch file in ",
                                                      dir, ": ", std::strerror(errno)));
  }
  file_ = UniqueFd(fd);
  struct statfs fs;
  if (::fstatfs(fd, &fs) == 0 && fs.f_type == TMPFS_MAGIC) {
    LOG(WARNING) << "the gradient scratch file is on tmpfs (" << dir
                 << "): spilled gradients stay in memory; point --scratch_dir at a disk";
  }
  return absl::OkStatus();
}

absl::Status GradPool::SpillLocked(int slot) {
  const Expert x = buffers_[slot].owner;
  if (buffers_[slot].dropped) {  // done with: nothing to keep
    grads_.erase(x);
    buffers_[slot] = Slot();
    return absl::OkStatus();
  }
  Grad& g = grads_.at(x);
  if (buffers_[slot].dirty || g.file_index < 0) {
    RETURN_IF_ERROR(OpenFileLocked());
    auto [it, added] = file_index_.emplace(x, static_cast<int64_t>(file_index_.size()));
    g.file_index = it->second;
    const size_t bytes = static_cast<size_t>(floats_) * sizeof(float);
    RETURN_IF_ERROR(PwriteAll(file_.get(), {reinterpret_cast<const uint8_t*>(Data(slot)), bytes},
                              static_cast<uint64_t>(g.file_index) * bytes, kScratchName));
    ++stats_.spills;
  }
  g.slot = -1;
  buffers_[slot] = Slot();
  return absl::OkStatus();
}

absl::StatusOr<int> GradPool::TakeSlotLocked() {
  int victim = -1;
  for (int i = 0; i < static_cast<int>(buffers_.size()); ++i) {
    const Slot& s = buffers_[i];
    if (!s.used) return i;
    if (s.holds == 0 && (victim < 0 || s.last_use < buffers_[victim].last_use)) victim = i;
  }
  if (victim < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("gradient pool: all ", buffers_.size(), " buffers are held"));
  }
  RETURN_IF_ERROR(SpillLocked(victim));
  return victim;
}

absl::StatusOr<float*> GradPool::Open(Expert x) {
  absl::MutexLock lock(&mu_);
  return OpenLocked(x);
}

absl::StatusOr<float*> GradPool::OpenLocked(Expert x) {
  if (grads_.contains(x)) {
    return absl::FailedPreconditionError(absl::StrCat("gradient pool: layer ", x.first, " expert ",
                                                      x.second, " opened twice in a step"));
  }
  ASSIGN_OR_RETURN(const int slot, TakeSlotLocked());
  buffers_[slot] = Slot{x, true, 1, ++clock_};
  grads_[x].slot = slot;
  float* data = Data(slot);
  std::memset(data, 0, static_cast<size_t>(floats_) * sizeof(float));
  return data;
}

void GradPool::Close(Expert x) { Release(x); }

absl::StatusOr<float*> GradPool::Acquire(Expert x, Use use) {
  absl::MutexLock lock(&mu_);
  auto it = grads_.find(x);
  if (it == grads_.end() && use == Use::kUpdate) return OpenLocked(x);
  if (it == grads_.end()) {
    return absl::NotFoundError(
        absl::StrCat("no gradient of layer ", x.first, " expert ", x.second, " this step"));
  }
  if (it->second.slot < 0) {
    ASSIGN_OR_RETURN(const int slot, TakeSlotLocked());
    const size_t bytes = static_cast<size_t>(floats_) * sizeof(float);
    RETURN_IF_ERROR(PreadAll(file_.get(), {reinterpret_cast<uint8_t*>(Data(slot)), bytes},
                             static_cast<uint64_t>(it->second.file_index) * bytes, kScratchName));
    buffers_[slot] = Slot{x, true, 0, ++clock_, /*dirty=*/false};
    it->second.slot = slot;
    ++stats_.loads;
  }
  Slot& held = buffers_[it->second.slot];
  ++held.holds;
  held.dirty |= use == Use::kUpdate;
  return Data(it->second.slot);
}

void GradPool::Release(Expert x, bool drop) {
  absl::MutexLock lock(&mu_);
  auto it = grads_.find(x);
  if (it == grads_.end() || it->second.slot < 0) return;
  Slot& s = buffers_[it->second.slot];
  if (s.holds > 0) --s.holds;
  s.last_use = ++clock_;
  s.dropped |= drop;
  if (s.dropped && s.holds == 0) {
    grads_.erase(it);
    s = Slot();
  }
}

bool GradPool::Has(Expert x) const {
  absl::MutexLock lock(&mu_);
  return grads_.contains(x);
}

GradPool::Stats GradPool::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

}  // namespace pith::runtime
