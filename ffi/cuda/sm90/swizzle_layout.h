// The shared-memory layout both Hopper kernels keep their TMA tiles in (traits.h,
// backward_traits.h): 128-byte rows with the 128-byte swizzle, whose pattern repeats every 8
// rows, so every tile starts at a kGroupBytes boundary and the kernels align their dynamic
// shared memory to one.
#pragma once

#include <cstdint>

namespace jax_flashattn::sm90 {

inline constexpr uint32_t kRowBytes = 128;              // one swizzle span of one row
inline constexpr uint32_t kGroupBytes = 8 * kRowBytes;  // 8-row core-matrix groups (descriptor SBO)

}  // namespace jax_flashattn::sm90
