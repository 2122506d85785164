// Tile configurations of the Hopper split-KV decode kernel (decode/wgmma_kernel.cuh), one per
// instantiated head dim.
//
// Why a Hopper kernel beside the mma.sync one (decode/mma_sync_kernel.cuh): at 64 query rows per
// block (T = 16 with GQA 4) a decode step does 128 FLOP per K/V element it reads, and the
// mma.sync kernel's eight warps per SM, each a chain of ldmatrix, mma.sync and softmax, cannot
// keep up with HBM there (docs/decisions/decode-wgmma-kernel.md). One wgmma warpgroup computes
// the same 64 rows with 8 + 4 instructions per 64-key tile (m64n64k16 for S, m64n128k16 for O
// at head dim 128) where four warps issue 128 mma.sync and 64 ldmatrix each.
//
// One warpgroup per split: warp w of it owns the 16-row slab w of the split's (up to) 64 rows,
// as a wgmma accumulator lays them out. K and V stream through the warpgroup's ring of kStages
// stages by cp.async (every thread of the warpgroup a share of each tile; keys past the length
// zero-filled, never read, as in the mma.sync kernel), written in the 128-byte-swizzled span
// layout wgmma's descriptors read. Each stage is 32 KiB (K and V tiles of kBlockN keys), the
// ring 96 KiB, so two rings fit one SM with four stages (128 KiB) in flight per SM, as the
// mma.sync decode kernel keeps: the split counts of ffi/decode_plan.h hold for both.
//
// Two block shapes hold those two rings per SM. One split per block, two blocks per SM: the
// splits merge through the workspace and the combine, or in a cluster of the unit's splits
// where every unit's cluster is resident at once. Two splits per block (the paired
// configuration, one warpgroup, ring and named barrier each, one block per SM): the unit's
// blocks merge in a cluster of half as many blocks, which stays resident where the first's does
// not. The decode preset at T = 16 (64 kv heads x 4 splits) is 64 clusters of 4 two-per-SM
// blocks, of which an H200 holds only 62, or 64 clusters of 2 paired blocks, which it holds: no
// partials through HBM and no combine (why, with measurements:
// docs/decisions/decode-paired-blocks.md). The dispatcher takes it only for that: with the
// cluster merge and an even split count, where the first shape would need the combine.
//
// Registers per thread: Q as wgmma's register A operand kHeadDim / 4 (loaded once from global
// memory), O kHeadDim / 2 floats, S kBlockN / 2, P kBlockN / 4: 16 + 32 + 64 + 32 = 144 at head
// dim 64 and 32 + 64 + 32 + 16 = 144 at 128, within the 255 of two 128-thread warpgroups per SM.
// Head dim 256 (64 + 128 registers of Q and O before S) stays on the mma.sync kernel.
#pragma once

#include "ffi/cuda/common/swizzle_layout.h"
#include "ffi/decode_plan.h"

namespace jax_flashattn::wgmma {

template <int kHeadDim_, int kBlockN_, int kStages_, int kSplitsPerBlock_, int kKvBytes_ = 2>
struct DecodeTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;  // keys per K/V tile
  static constexpr int kStages = kStages_;  // K/V tiles in a ring: kStages - 1 in flight
  static constexpr int kSplitsPerBlock = kSplitsPerBlock_;  // one warpgroup and ring each
  static constexpr int kWarpgroupThreads = 128;  // one 16-row slab per warp
  static constexpr int kThreads = kSplitsPerBlock * kWarpgroupThreads;
  static constexpr int kMinBlocks = 2 / kSplitsPerBlock;  // per SM, for __launch_bounds__
  // Soft-capped logits (mma_sync::DecodeWithSoftCap, decode/block.cuh).
  static constexpr bool kSoftCap = false;
  // Any of a bias, a mask and ALiBi (mma_sync::DecodeWithBiasAndMask, decode/block.cuh);
  // kAlibi: ALiBi among them, in kernels of its own.
  static constexpr bool kBiasAndMask = false;
  static constexpr bool kAlibi = false;
  static constexpr bool kSegments = false;  // segment ids, with kBiasAndMask (kWithIds)
  // Bytes per K/V element: 2 (q's dtype), or 1 for float8_e4m3fn keys and values (kFp8Kv;
  // DecodeFp8Config below), which the ring holds as stored, rows of byte pairs (cuda::E4m3Pair)
  // one after another (kSmemDim pairs: only the widening reads them, 16 bytes a thread in row
  // order), widened tile by tile into one K and one V tile of float16 (common/e4m3.cuh) at the
  // start of the warpgroup's region (kWidenedBytes), which the products read as a 2-byte stage.
  static constexpr int kKvBytes = kKvBytes_;
  static constexpr bool kFp8Kv = kKvBytes == 1;
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;  // one K or one V tile, 2-byte
  static constexpr int kStageBytes = 2 * kBlockN * kHeadDim * kKvBytes;  // K tile + V tile
  static constexpr int kSmemDim = kHeadDim / 2;  // e4m3 ring rows, in byte pairs
  static constexpr int kWidenedBytes = kFp8Kv ? 2 * kKVBytes : 0;
  static constexpr int kRingBytes = kWidenedBytes + kStages * kStageBytes;  // one warpgroup's
  // The rings, plus kGroupBytes to align their start to the swizzle's period.
  static constexpr int kSmemBytes = kSplitsPerBlock * kRingBytes + int(kGroupBytes);
  // The elementwise terms' instantiations (mma_sync::DecodeWithBiasAndMask) stage each tile's
  // bias and mask rows after the rings, kTermStageBytes per stage of each ring: 3 x 4 KiB per
  // ring, 109 KiB a block of one ring, two per SM (decode_terms_stage: a GQA group of 16 with a
  // float32 bias at 64-key tiles).
  static constexpr bool kStagedTerms = false;
  static constexpr int kRings = kSplitsPerBlock;
  static constexpr int kTermStageBytes = 4096;

  // What mma_sync::load_split_tile (and, for e4m3, mma_sync::widen_e4m3_tile) needs of one
  // warpgroup, which copies (and widens) its ring's tiles alone.
  struct WarpgroupCopies {
    static constexpr int kBlockN = kBlockN_, kChunks = kHeadDim_ * kKvBytes_ / 16;
    static constexpr int kThreads = 128;
    static constexpr int kWidenedDim = kHeadDim_;
    static constexpr int kWidenUnroll = kBlockN * kChunks / kThreads;  // the whole tile
  };

  static_assert(kSplitsPerBlock == 1 || kSplitsPerBlock == 2, "two rings per SM");
  static_assert(kHeadDim % 64 == 0, "tiles are whole 128-byte swizzle spans");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "wgmma N is a multiple of 16 up to 256");
  static_assert(kKVBytes % kGroupBytes == 0 && kRingBytes % kGroupBytes == 0,
                "tiles and rings stay 1024-byte aligned");
  static_assert(WarpgroupCopies::kThreads == kWarpgroupThreads &&
                    kWarpgroupThreads % WarpgroupCopies::kChunks == 0,
                "every copy of a thread is the same chunk column");
  static_assert(64 >= mma_sync::kDecodeMaxRows, "one warpgroup holds every row of a split");
  static_assert(kMinBlocks * (kSmemBytes + 1024) <= 228 * 1024,
                "the blocks of an SM (and their 1 KiB of reserved shared memory) fit it");
};

template <int kHeadDim, int kSplitsPerBlock>
struct DecodeConfig;

// Stage (128 + 128) keys x 64 x 2 B = 32 KiB; ring 96 KiB; 97 KiB per block, two per SM.
template <>
struct DecodeConfig<64, 1> : DecodeTraits<64, 128, 3, 1> {};
// Stage (64 + 64) keys x 128 x 2 B = 32 KiB; ring 96 KiB; 97 KiB per block, two per SM.
template <>
struct DecodeConfig<128, 1> : DecodeTraits<128, 64, 3, 1> {};
// Paired: the same rings, two per block; 193 KiB per block, one per SM.
template <>
struct DecodeConfig<64, 2> : DecodeTraits<64, 128, 3, 2> {};
template <>
struct DecodeConfig<128, 2> : DecodeTraits<128, 64, 3, 2> {};

// Configurations for float8_e4m3fn keys and values beside a bfloat16 or float16 query (a
// quantised KV cache; AttentionParams::k_descale): the 2-byte configurations' tiles, each
// widened once by the whole warpgroup (DecodeTraits::kKvBytes), in four stages: per warpgroup
// 2 x 16 KiB widened + 4 x 16 KiB of e4m3 = 96 KiB, two per SM as the 2-byte configurations;
// three e4m3 stages (48 KiB) of a warpgroup in flight hold as many keys as 96 KiB of a 2-byte
// cache. ptxas (CUDA 13.0, sm_90a, bf16, the float16 products): 225 / 239 registers at head
// dim 128 (one / two warpgroups a block), 251 / 251 at 64, no spills.
template <int kHeadDim, int kSplitsPerBlock>
struct DecodeFp8Config;
// Stage (128 + 128) keys x 64 B = 16 KiB; widened 2 x 128 x 64 x 2 B = 32 KiB.
template <int kSplitsPerBlock>
struct DecodeFp8Config<64, kSplitsPerBlock> : DecodeTraits<64, 128, 4, kSplitsPerBlock, 1> {};
// Stage (64 + 64) keys x 128 B = 16 KiB; widened 2 x 64 x 128 x 2 B = 32 KiB.
template <int kSplitsPerBlock>
struct DecodeFp8Config<128, kSplitsPerBlock> : DecodeTraits<128, 64, 4, kSplitsPerBlock, 1> {};

// Query rows per block from which (inclusive) a decode call takes this kernel; fewer stay on the
// mma.sync decode kernel. At 32 rows the two are level with the combine, and this one is ahead
// with the paired blocks' cluster merge (docs/decisions/decode-wgmma-kernel.md).
inline constexpr int64_t kDecodeMinRows = 32;

// The instantiated head dims, smallest first; a head dim (multiple of 8) runs on the first one
// that is at least as large (the columns past it are zero-filled in shared memory and Q).
inline constexpr int kDecodeHeadDims[] = {64, 128};

}  // namespace jax_flashattn::wgmma
