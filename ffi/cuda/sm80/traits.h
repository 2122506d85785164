// Tile configurations of the mma.sync forward kernel, one per instantiated head dim.
//
// Each warp owns kSlabs slabs of 16 query rows and keeps its Q fragments in registers for the
// whole K/V loop. Shared memory holds the Q tile and kStages K and V tiles, each row padded to
// kSmemDim (a multiple of 64 elements = 128 bytes) so the XOR swizzle of 16-byte chunks stays
// inside the row; a head dim below kHeadDim is zero-filled there.
#pragma once

namespace jax_flashattn::sm80 {

// Rows of 2-byte elements padded to a whole number of 128-byte swizzle spans.
constexpr int smem_dim_for(int head_dim) {
  return head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256;
}

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, int kMinBlocks_>
struct ForwardTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // query rows per block
  static constexpr int kBlockN = kBlockN_;  // keys per K/V tile
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;
  // Blocks per SM the register allocation must allow (__launch_bounds__): with more than one,
  // one block's barrier waits overlap another block's math.
  static constexpr int kMinBlocks = kMinBlocks_;
  static constexpr int kStages = 2;  // K/V tiles in flight: compute tile j while j+1 lands
  static constexpr int kSlabs = kBlockM / (16 * kWarps);
  static constexpr int kSmemDim = smem_dim_for(kHeadDim);
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row that hold data
  static constexpr int kElemBytes = 2;
  static constexpr int kSmemBytes =
      (kBlockM + 2 * kStages * kBlockN) * kSmemDim * kElemBytes;

  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 256, "mma k-steps are 16 wide");
  static_assert(kBlockM % (16 * kWarps) == 0, "each warp owns whole 16-row slabs");
  static_assert(kBlockN % 16 == 0, "P.V consumes keys 16 at a time");
  static_assert(kSmemDim % 64 == 0, "the swizzle XORs the chunk index with row % 8");
  static_assert(kSmemBytes <= 99 * 1024, "fits the opt-in shared memory of every sm_8x/sm_120");
};

// Registers per thread are dominated by Q (kSlabs * kHeadDim / 4 32-bit), O (kSlabs *
// kHeadDim / 2 floats) and S (kSlabs * kBlockN / 2 floats); ptxas adds ~70-100 on top (see
// docs/kernel_notes.md). Each choice below was measured on an H200 against its alternatives.
template <int kHeadDim>
struct ForwardConfig;

// Two slabs per warp halve the K/V shared-memory reads per FLOP. Q 16 + O 32 + S 64;
// 230 registers; smem (128 + 4 * 64) * 64 * 2 = 48 KiB.
template <>
struct ForwardConfig<32> : ForwardTraits<32, 128, 64, 4, 1> {};
// Q 32 + O 64 + S 64; 255 registers with ~64 bytes spilled, still 16% faster than one slab
// per warp (211 vs 182 TFLOP/s at T = 8192); smem 48 KiB.
template <>
struct ForwardConfig<64> : ForwardTraits<64, 128, 64, 4, 1> {};
// One slab per warp (two would spill): Q 24 + O 48 + S 32; smem (128 + 256) * 128 * 2 =
// 96 KiB; eight warps share each K/V tile.
template <>
struct ForwardConfig<96> : ForwardTraits<96, 128, 64, 8, 1> {};
// Q 32 + O 64 + S 32; 255 registers, no spills; smem 96 KiB. Beat four-warp blocks at two
// per SM (230 vs 210 TFLOP/s at T = 8192).
template <>
struct ForwardConfig<128> : ForwardTraits<128, 128, 64, 8, 1> {};
// Q 48 + O 96 + S 8; smem (64 + 64) * 256 * 2 = 64 KiB; 128 threads at <= 255 registers
// leave room for two blocks per SM.
template <>
struct ForwardConfig<192> : ForwardTraits<192, 64, 16, 4, 1> {};
// Q 64 + O 128 + S 8 (spills ~136 bytes); smem 64 KiB.
template <>
struct ForwardConfig<256> : ForwardTraits<256, 64, 16, 4, 1> {};

// The instantiated head dims, smallest first; a head dim (multiple of 8) runs on the first
// one that is at least as large.
inline constexpr int kHeadDims[] = {32, 64, 96, 128, 192, 256};

}  // namespace jax_flashattn::sm80
