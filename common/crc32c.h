// CRC32C (Castagnoli), the checksum Pith keeps with every blob. Uses the SSE4.2 crc32
// instruction where the CPU has it, a table otherwise.
//
// Thread safety: pure functions.
#ifndef PITH_COMMON_CRC32C_H_
#define PITH_COMMON_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace pith {

// Extends `crc` (0 to start) over `size` bytes at `data`.
uint32_t Crc32c(const void* data, size_t size, uint32_t crc = 0);

}  // namespace pith

#endif  // PITH_COMMON_CRC32C_H_
