#include <algorithm>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "server/store/cold_tier.h"

namespace pith::store {

absl::Status MemoryColdTier::PutData(absl::string_view key, int64_t version,
                                     absl::Span<const uint8_t> bytes) {
  absl::MutexLock lock(&mu_);
  live_.data[{std::string(key), version}] =
      std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  return absl::OkStatus();
}

absl::Status MemoryColdTier::LinkData(absl::string_view key, int64_t version,
                                      absl::string_view source_key, int64_t source_version,
                                      uint64_t size) {
  absl::MutexLock lock(&mu_);
  auto it = live_.data.find({std::string(source_key), source_version});
  if (it == live_.data.end() || it->second.size() != size) {
    return absl::NotFoundError("no such blob version to share");
  }
  live_.data[{std::string(key), version}] = it->second;  // a copy: the tier is for tests
  return absl::OkStatus();
}

absl::Status MemoryColdTier::ReadData(absl::string_view key, int64_t version,
                                      absl::Span<uint8_t> out) {
  absl::MutexLock lock(&mu_);
  auto it = live_.data.find({std::string(key), version});
  if (it == live_.data.end()) return absl::NotFoundError("no such blob version in the cold tier");
  if (it->second.size() != out.size()) {
    return absl::DataLossError(
        absl::StrCat("cold blob has ", it->second.size(), " bytes, want ", out.size()));
  }
  std::memcpy(out.data(), it->second.data(), out.size());
  return absl::OkStatus();
}

absl::StatusOr<ColdRead> MemoryColdTier::ReadPinned(absl::string_view key, int64_t version) {
  absl::MutexLock lock(&mu_);
  auto it = live_.data.find({std::string(key), version});
  if (it == live_.data.end()) return absl::NotFoundError("no such blob version in the cold tier");
  auto copy = std::make_shared<std::string>(it->second);
  return ColdRead{reinterpret_cast<const uint8_t*>(copy->data()), copy->size(), copy};
}

absl::Status MemoryColdTier::Apply(const ColdBatch& batch, bool sync) {
  absl::MutexLock lock(&mu_);
  for (const auto& r : batch.set_pending) {
    if (!live_.data.contains({r.key, r.pending.record.version})) {
      return absl::FailedPreconditionError("a pending record names bytes the tier lacks");
    }
  }
  for (const auto& p : batch.put_data) {
    live_.data[{p.key, p.version}] =
        std::string(reinterpret_cast<const char*>(p.bytes.data()), p.bytes.size());
  }
  ColdContents& m = live_.meta;
  for (const auto& r : batch.set_records) m.records[r.key] = r.record;
  for (const auto& k : batch.delete_records) m.records.erase(k);
  for (const auto& d : batch.delete_data) live_.data.erase({d.key, d.version});
  for (const auto& [job, step] : batch.set_job_steps) m.job_steps[job] = step;
  for (const auto& job : batch.delete_job_steps) m.job_steps.erase(job);
  for (const auto& r : batch.set_pending) m.pending[{r.key, r.pending.record.version}] = r.pending;
  for (const auto& d : batch.delete_pending) m.pending.erase({d.key, d.version});
  if (sync) durable_ = live_;
  return absl::OkStatus();
}

absl::StatusOr<ColdContents> MemoryColdTier::Load() {
  absl::MutexLock lock(&mu_);
  ColdContents out = live_.meta;
  out.data.clear();
  for (const auto& [k, v] : live_.data) out.data.push_back({k.first, k.second});
  return out;
}

void MemoryColdTier::Crash() {
  absl::MutexLock lock(&mu_);
  live_ = durable_;
}

absl::Status ForwardingColdTier::PutData(absl::string_view k, int64_t v,
                                         absl::Span<const uint8_t> b) {
  return t_->PutData(k, v, b);
}
absl::Status ForwardingColdTier::LinkData(absl::string_view k, int64_t v, absl::string_view sk,
                                          int64_t sv, uint64_t n) {
  return t_->LinkData(k, v, sk, sv, n);
}
absl::Status ForwardingColdTier::ReadData(absl::string_view k, int64_t v, absl::Span<uint8_t> o) {
  return t_->ReadData(k, v, o);
}
absl::StatusOr<ColdRead> ForwardingColdTier::ReadPinned(absl::string_view k, int64_t v) {
  return t_->ReadPinned(k, v);
}
absl::Status ForwardingColdTier::Apply(const ColdBatch& b, bool sync) { return t_->Apply(b, sync); }
absl::StatusOr<ColdContents> ForwardingColdTier::Load() { return t_->Load(); }
absl::Status ForwardingColdTier::Checkpoint(const std::string& d) { return t_->Checkpoint(d); }

std::unique_ptr<ColdTier> ForwardTo(MemoryColdTier* tier) {
  return std::make_unique<ForwardingColdTier>(tier);
}

}  // namespace pith::store
