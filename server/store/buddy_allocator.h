// BuddyAllocator: offsets into one fixed arena (the store's RAM tier), in power-of-two
// blocks from `min_block` to `max_block` bytes. Its bookkeeping is sized once at
// construction: allocating and freeing a blob never touches the heap.
//
// Thread safety: none; the owner serializes calls.
#ifndef PITH_SERVER_STORE_BUDDY_ALLOCATOR_H_
#define PITH_SERVER_STORE_BUDDY_ALLOCATOR_H_

#include <cstdint>
#include <optional>
#include <vector>

namespace pith::store {

class BuddyAllocator {
 public:
  // Manages floor(capacity / max_block) blocks of max_block bytes. min_block and
  // max_block are powers of two with min_block <= max_block.
  BuddyAllocator(uint64_t capacity, uint64_t min_block, uint64_t max_block);

  // The offset of a block of at least `size` bytes (size > 0), or nullopt when no block
  // is free or size > max_block.
  std::optional<uint64_t> Allocate(uint64_t size);
  // Frees a block Allocate returned.
  void Free(uint64_t offset);

  // Bytes of the block at `offset` (a power of two >= the size asked for).
  uint64_t BlockSize(uint64_t offset) const;
  // The block size that Allocate(size) would use.
  uint64_t RoundUp(uint64_t size) const;

  uint64_t capacity() const { return capacity_; }
  uint64_t used() const { return used_; }
  uint64_t max_block() const { return max_block_; }

 private:
  int OrderFor(uint64_t size) const;
  void Push(int order, int64_t index);
  void Remove(int order, int64_t index);

  uint64_t min_block_, max_block_, capacity_, used_ = 0;
  int max_order_;
  // Per min-block index; meaningful at block starts only.
  std::vector<int8_t> order_;         // the block's order
  std::vector<uint8_t> free_;         // 1 when the block is on a free list
  std::vector<int64_t> next_, prev_;  // free-list links (-1 ends)
  std::vector<int64_t> head_;         // per order
};

}  // namespace pith::store

#endif  // PITH_SERVER_STORE_BUDDY_ALLOCATOR_H_
