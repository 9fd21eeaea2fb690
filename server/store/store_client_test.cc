// The worker's end-to-end check of what a fetch delivered: the blob asked for, at the
// version asked for, with the bytes the store recorded at write (CRC32C).
#include "server/store/store_client.h"

#include <vector>

#include "common/crc32c.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pith::store {
namespace {

StoreClient::FetchItem Landed(std::vector<float>& bytes, int64_t asked_version) {
  StoreClient::FetchItem item;
  item.key.set_job_id("job-1");
  item.key.set_layer(2);
  item.key.set_expert(5);
  item.key.set_kind(v1::BLOB_KIND_WEIGHTS);
  item.version = asked_version;
  item.buffer = bytes.data();
  item.capacity = bytes.size() * sizeof(float);
  *item.info.mutable_key() = item.key;  // what the store answered
  item.info.set_version(7);
  item.info.set_size_bytes(item.capacity);
  item.info.set_crc32c(Crc32c(bytes.data(), item.capacity));
  return item;
}

TEST(StoreClientCheckTest, AFetchMustDeliverTheBlobVersionAndBytesAskedFor) {
  std::vector<float> bytes(1000, 1.5f);
  EXPECT_TRUE(StoreClient::CheckFetched(Landed(bytes, 7)).ok());
  EXPECT_TRUE(StoreClient::CheckFetched(Landed(bytes, -1)).ok());  // the committed one

  StoreClient::FetchItem old = Landed(bytes, 8);  // asked for 8, got 7
  EXPECT_EQ(StoreClient::CheckFetched(old).code(), absl::StatusCode::kDataLoss);

  StoreClient::FetchItem other = Landed(bytes, 7);
  other.info.mutable_key()->set_expert(6);
  const absl::Status s = StoreClient::CheckFetched(other);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), testing::HasSubstr("expert: 6"));

  StoreClient::FetchItem torn = Landed(bytes, 7);
  bytes[500] = 2.5f;  // one value changed after the store checksummed it
  const absl::Status t = StoreClient::CheckFetched(torn);
  EXPECT_EQ(t.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(t.message(), testing::HasSubstr("CRC32C"));
}

}  // namespace
}  // namespace pith::store
