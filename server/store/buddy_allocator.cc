#include "server/store/buddy_allocator.h"

#include <bit>

namespace pith::store {

BuddyAllocator::BuddyAllocator(uint64_t capacity, uint64_t min_block, uint64_t max_block)
    : min_block_(min_block),
      max_block_(max_block),
      capacity_(capacity / max_block * max_block),
      max_order_(std::countr_zero(max_block) - std::countr_zero(min_block)) {
  const int64_t blocks = static_cast<int64_t>(capacity_ / min_block_);
  order_.assign(blocks, 0);
  free_.assign(blocks, 0);
  next_.assign(blocks, -1);
  prev_.assign(blocks, -1);
  head_.assign(max_order_ + 1, -1);
  const int64_t top = int64_t{1} << max_order_;
  for (int64_t i = blocks - top; i >= 0; i -= top) Push(max_order_, i);
}

int BuddyAllocator::OrderFor(uint64_t size) const {
  const uint64_t blocks = (size + min_block_ - 1) / min_block_;
  return blocks <= 1 ? 0 : 64 - std::countl_zero(blocks - 1);
}

uint64_t BuddyAllocator::RoundUp(uint64_t size) const { return min_block_ << OrderFor(size); }

void BuddyAllocator::Push(int order, int64_t index) {
  order_[index] = static_cast<int8_t>(order);
  free_[index] = 1;
  prev_[index] = -1;
  next_[index] = head_[order];
  if (head_[order] >= 0) prev_[head_[order]] = index;
  head_[order] = index;
}

void BuddyAllocator::Remove(int order, int64_t index) {
  if (prev_[index] >= 0) {
    next_[prev_[index]] = next_[index];
  } else {
    head_[order] = next_[index];
  }
  if (next_[index] >= 0) prev_[next_[index]] = prev_[index];
  free_[index] = 0;
}

std::optional<uint64_t> BuddyAllocator::Allocate(uint64_t size) {
  if (size == 0 || size > max_block_) return std::nullopt;
  const int want = OrderFor(size);
  int order = want;
  while (order <= max_order_ && head_[order] < 0) ++order;
  if (order > max_order_) return std::nullopt;
  const int64_t index = head_[order];
  Remove(order, index);
  while (order > want) {  // split, keeping the lower half
    --order;
    Push(order, index + (int64_t{1} << order));
  }
  order_[index] = static_cast<int8_t>(want);
  used_ += min_block_ << want;
  return static_cast<uint64_t>(index) * min_block_;
}

void BuddyAllocator::Free(uint64_t offset) {
  int64_t index = static_cast<int64_t>(offset / min_block_);
  int order = order_[index];
  used_ -= min_block_ << order;
  while (order < max_order_) {
    const int64_t buddy = index ^ (int64_t{1} << order);
    if (!free_[buddy] || order_[buddy] != order) break;
    Remove(order, buddy);
    index = index < buddy ? index : buddy;
    ++order;
  }
  Push(order, index);
}

uint64_t BuddyAllocator::BlockSize(uint64_t offset) const {
  return min_block_ << order_[offset / min_block_];
}

}  // namespace pith::store
