// Tile configurations of the mma.sync forward kernel, one per instantiated head dim.
//
// Each warp owns kSlabs slabs of 16 query rows. With kQInRegisters it keeps its Q fragments in
// registers for the whole K/V loop; otherwise it re-reads them from shared memory at every
// k-step, which costs shared-memory bandwidth but frees the registers that let a warp own two
// slabs: every K/V fragment it loads then feeds twice as many mma. Shared memory holds the Q
// tile and kStages K and V tiles, each row padded to kSmemDim (a multiple of 64 elements = 128
// bytes) so the XOR swizzle of 16-byte chunks stays inside the row; a head dim below kHeadDim
// is zero-filled there. With TMA loads (Hopper) the K and V tiles are stored as TMA writes them
// instead: each 64-element span of the rows a [kBlockN][128 bytes] array of its own, the same
// XOR on the row's 8 chunks of a span.
#pragma once

#include "ffi/cuda/common/smem_tile.cuh"

namespace jax_flashattn::mma_sync {

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, int kMinBlocks_,
          bool kQInRegisters_>
struct ForwardTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // query rows per block
  static constexpr int kBlockN = kBlockN_;  // keys per K/V tile
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;
  // Blocks per SM the register allocation must allow (__launch_bounds__): with more than one,
  // one block's barrier waits overlap another block's math.
  static constexpr int kMinBlocks = kMinBlocks_;
  static constexpr bool kQInRegisters = kQInRegisters_;
  static constexpr int kStages = 2;  // K/V tiles in flight: compute tile j while j+1 lands
  static constexpr int kSlabs = kBlockM / (16 * kWarps);
  static constexpr int kSmemDim = smem_dim_for(kHeadDim);
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row that hold data
  static constexpr int kElemBytes = 2;
  static constexpr int kSmemBytes =
      (kBlockM + 2 * kStages * kBlockN) * kSmemDim * kElemBytes;
  // With TMA K/V loads (Hopper, kTmaKV): up to 1024 bytes to align the tiles to the swizzle's
  // period, then per stage an mbarrier and a counter (at head dim 128, 2 x 97 KiB per SM). TMA
  // loads only the spans that hold head dims (three of four at 192).
  static constexpr int kTmaSmemBytes =
      kSmemBytes + 1024 + (sizeof(unsigned long long) + sizeof(unsigned)) * kStages;
  static constexpr int kSpanElems = 64;  // 128 bytes: the widest box of TMA's 128-byte swizzle
  static constexpr int kTmaSpans = (kHeadDim + kSpanElems - 1) / kSpanElems;

  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 256, "mma k-steps are 16 wide");
  static_assert(kBlockM % (16 * kWarps) == 0, "each warp owns whole 16-row slabs");
  static_assert(kBlockN % 16 == 0, "P.V consumes keys 16 at a time");
  static_assert(kSmemDim % 64 == 0, "the swizzle XORs the chunk index with row % 8");
  static_assert((kBlockM * kSmemDim * kElemBytes) % 1024 == 0 &&
                    (kBlockN * kSmemDim * kElemBytes) % 1024 == 0 && kBlockN % 8 == 0,
                "TMA's tiles and spans start at 1024-byte boundaries (the swizzle's period)");
  static_assert(kSmemBytes <= 99 * 1024, "fits the opt-in shared memory of every sm_8x/sm_120");
};

// Registers per thread are dominated by O (kSlabs * kHeadDim / 2 floats), S (kSlabs *
// kBlockN / 2 floats) and, with kQInRegisters, Q (kSlabs * kHeadDim / 4 32-bit); ptxas adds
// ~40-100 on top. Each choice below was measured against its alternatives (why, with
// measurements: docs/decisions/mma-sync-forward-tile-configs.md).
template <int kHeadDim>
struct ForwardConfig;

// Two slabs per warp: Q 16 + O 32 + S 64; smem (128 + 4 * 64) * 64 * 2 = 48 KiB.
template <>
struct ForwardConfig<32> : ForwardTraits<32, 128, 64, 4, 1, true> {};
// Two slabs per warp, Q re-read: O 64 + S 64; smem 48 KiB.
template <>
struct ForwardConfig<64> : ForwardTraits<64, 128, 64, 4, 1, false> {};
// Two slabs per warp, Q re-read: O 96 + S 64; smem (128 + 256) * 128 * 2 = 96 KiB.
template <>
struct ForwardConfig<96> : ForwardTraits<96, 128, 64, 4, 1, false> {};
// Two slabs per warp, Q re-read: O 128 + S 64; smem 96 KiB (two blocks per SM on Hopper).
template <>
struct ForwardConfig<128> : ForwardTraits<128, 128, 64, 4, 1, false> {};
// One slab per warp (O alone is 96 or 128 registers), Q re-read; smem (64 + 4 * 32) * 256 * 2
// = 96 KiB.
template <>
struct ForwardConfig<192> : ForwardTraits<192, 64, 32, 4, 1, false> {};
template <>
struct ForwardConfig<256> : ForwardTraits<256, 64, 32, 4, 1, false> {};

// The instantiated head dims, smallest first; a head dim (multiple of 8) runs on the first
// one that is at least as large.
inline constexpr int kHeadDims[] = {32, 64, 96, 128, 192, 256};

}  // namespace jax_flashattn::mma_sync
