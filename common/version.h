// The Pith version reported by every binary and in pith_build_info.
#ifndef PITH_COMMON_VERSION_H_
#define PITH_COMMON_VERSION_H_

namespace pith {

inline constexpr char kPithVersion[] = "0.1.0";

}  // namespace pith

#endif  // PITH_COMMON_VERSION_H_
