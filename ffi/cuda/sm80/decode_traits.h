// Tile configurations of the split-KV decode kernel (sm80/decode_kernel.cuh), one per
// instantiated head dim.
//
// A decode block has few query rows (at most kDecodeMaxRows, sm80/decode_plan.h) and streams a
// long range of keys, so it is limited by HBM, not by the tensor cores: the configuration is
// chosen for bytes in flight. Every config keeps a 32 KiB K/V stage (K and V tiles of kBlockN
// keys, rows padded to kSmemDim elements) in a ring of kStages = 3, i.e. 96 KiB per block, so
// two blocks fit one Hopper SM (228 KiB) with four stages (128 KiB) in flight per SM; A100
// (164 KiB) holds one block, sm_86/89/120 (99 KiB opt-in) one.
//
// Four warps. With s = ceil(rows / 16) slabs, warp w computes slab w % s against the 16-key
// chunks w / s, w / s + 4 / s, ... of every tile (warps past s * (4 / s) only load), so one
// slab is computed by up to four warps on disjoint keys, and their partial softmax states are
// merged through shared memory (the drained ring) at the end.
//
// Registers per thread: Q fragments kHeadDim / 4 (held for the whole loop, loaded once from
// global memory), O kHeadDim / 2 floats, S 8 floats, one K or V fragment 4: 56 / 104 / 200 at
// head dims 64 / 128 / 256 before addressing; __launch_bounds__ allows 255 (two blocks of 128
// threads per SM). ptxas (nvcc 13.0, sm_80 / sm_90a, bf16 = fp16): 124 / 128, 174 / 178 and
// 255 / 255 registers, no spills.
#pragma once

#include "ffi/cuda/sm80/decode_plan.h"
#include "ffi/cuda/sm80/traits.h"

namespace jax_flashattn::sm80 {

template <int kHeadDim_, int kBlockN_, int kStages_, int kMinBlocks_>
struct DecodeTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;  // keys per K/V tile
  static constexpr int kStages = kStages_;  // K/V tiles in the ring: kStages - 1 in flight
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kMinBlocks = kMinBlocks_;  // per SM, for __launch_bounds__
  static constexpr int kChunkKeys = 16;       // keys of one warp step (one P.V k-step)
  static constexpr int kChunksPerTile = kBlockN / kChunkKeys;
  static constexpr int kSmemDim = smem_dim_for(kHeadDim);
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row that hold data
  static constexpr int kElemBytes = 2;
  static constexpr int kStageBytes = 2 * kBlockN * kSmemDim * kElemBytes;  // K tile + V tile
  static constexpr int kRingBytes = kStages * kStageBytes;
  // Cross-warp merge: per warp and lane, its O fragment (kHeadDim / 2 floats), its two row
  // maxima and its two partial row sums, stored lane-minor so every access is conflict-free.
  static constexpr int kMergeFloatsPerWarp = (kHeadDim / 2 + 4) * 32;
  static constexpr int kMergeBytes = kWarps * kMergeFloatsPerWarp * 4;
  static constexpr int kSmemBytes = kRingBytes;

  static_assert(kHeadDim % 16 == 0 && kHeadDim <= kDecodeMaxHeadDim, "mma k-steps are 16 wide");
  static_assert(kBlockN % kChunkKeys == 0, "warps take whole 16-key chunks");
  static_assert(kWarps * 16 >= kDecodeMaxRows, "one warp per 16-row slab at the most rows");
  static_assert(kMergeBytes <= kRingBytes, "the merge reuses the drained K/V ring");
  static_assert(kSmemBytes <= 99 * 1024, "fits the opt-in shared memory of every sm_8x/sm_120");
};

template <int kHeadDim>
struct DecodeConfig;

// Stage (128 + 128) * 64 * 2 B = 32 KiB; ring 96 KiB; merge 18 KiB.
template <>
struct DecodeConfig<64> : DecodeTraits<64, 128, 3, 2> {};
// Stage (64 + 64) * 128 * 2 B = 32 KiB; ring 96 KiB; merge 34 KiB.
template <>
struct DecodeConfig<128> : DecodeTraits<128, 64, 3, 2> {};
// Stage (32 + 32) * 256 * 2 B = 32 KiB; ring 96 KiB; merge 66 KiB. Two 16-key chunks per tile,
// so with one slab only two warps compute (the other two still issue their share of loads).
template <>
struct DecodeConfig<256> : DecodeTraits<256, 32, 3, 2> {};

// The instantiated head dims, smallest first; a head dim (multiple of 8) runs on the first one
// that is at least as large. The kernel reads no more HBM bytes for the padding (the columns
// past head_dim are zero-filled in shared memory), so three suffice.
inline constexpr int kDecodeHeadDims[] = {64, 128, 256};

}  // namespace jax_flashattn::sm80
