// The shared-memory layout both Hopper kernels keep their TMA tiles in (wgmma/traits.h,
// wgmma/backward_traits.h): 128-byte rows with the 128-byte swizzle, whose pattern repeats every 8
// rows, so every tile starts at a kGroupBytes boundary and the kernels align their dynamic
// shared memory to one (FP8 attention's V^T of 64-key tiles: 64-byte rows with the 64-byte
// swizzle, whose pattern repeats every 512 bytes).
#pragma once

#include <cstdint>

namespace jax_flashattn::wgmma {

inline constexpr uint32_t kRowBytes = 128;              // one swizzle span of one row
inline constexpr uint32_t kGroupBytes = 8 * kRowBytes;  // 8-row core-matrix groups (descriptor SBO)

// Where wgmma's k-step `ks` (16 two-byte elements) starts in a tile of this layout, in bytes
// from the tile's start, for the descriptors' start address:
// - K-major (the reduction dim runs along the rows, e.g. Q or K for S = Q K^T): a row's 64
//   elements of each span hold 4 k-steps of 32 bytes, and the spans are `rows` rows apart;
// - MN-major (the reduction dim runs down the rows, e.g. V for O += P V): 16 rows per k-step.
constexpr uint32_t k_major_step_bytes(uint32_t rows, int ks) {
  return uint32_t(ks / 4) * rows * kRowBytes + uint32_t(ks % 4) * 32;
}
constexpr uint32_t mn_major_step_bytes(int kk) { return uint32_t(kk) * 16 * kRowBytes; }

}  // namespace jax_flashattn::wgmma
