// Tile configurations of the split-KV decode kernel (decode/mma_sync_kernel.cuh): per instantiated
// head dim one with 16-key warp steps and, where registers allow, one with whole-tile warp steps
// (when and why below).
//
// A decode block has few query rows (at most kDecodeMaxRows, ffi/decode_plan.h) and streams a
// long range of keys, so it is limited by HBM, not by the tensor cores: the configuration is
// chosen for bytes in flight. Every config keeps a 32 KiB K/V stage (K and V tiles of kBlockN
// keys, rows padded to kSmemDim elements) in a ring of kStages = 3, i.e. 96 KiB per block, so
// two blocks fit one Hopper SM (228 KiB) with four stages (128 KiB) in flight per SM; A100
// (164 KiB) holds one block, sm_86/89/120 (99 KiB opt-in) one.
//
// Four warps. With s = ceil(rows / 16) slabs, warp w computes slab w % s against the steps
// w / s, w / s + 4 / s, ... of every tile (warps past s * (4 / s) only load), a step being
// kStepChunks 16-key chunks; so one slab is computed by up to four warps on disjoint keys, and
// their partial softmax states are merged through shared memory (the drained ring) at the end.
//
// Steps. Up to 32 rows a step is one 16-key chunk, and the 4 / s key groups split each tile.
// Past 32 rows every warp owns a slab alone and runs all of each tile itself; in 16-key steps
// that is one dependent chain per chunk (ldmatrix, 8 k-steps of S, softmax with quad shuffles,
// O rescale, P V), four per tile at head dim 128 against one at T = 1, and the two warps per
// SM sub-partition (two blocks) cannot hide them. So past 32 rows a step is the whole tile,
// as in the forward kernel: the tile's S products are independent chains interleaved per
// k-step (each k-step issues kStepChunks ldmatrix and 2 kStepChunks mma with no dependence
// between them), the softmax is one pass over all its keys (one pair of quad shuffles per row
// and one rescale of O per tile: 64 FMULs per tile at head dim 128 instead of 256), and P V
// runs one k-step at a time across all of O's column tiles. The same mma and ldmatrix, in
// fewer instructions per tile (why, with measurements:
// docs/decisions/decode-mma-sync-warp-steps.md).
// Rejected: two slabs per warp (each K/V fragment feeds two slabs' mma) holds O and Q of two
// slabs, 192 registers at head dim 128 before S, which spills; eight warps per block (two per
// slab) keeps the 16-key chains and needs <= 128 registers per thread for two blocks per SM,
// where one slab's O and Q alone are 96 at head dim 128.
//
// Registers per thread: Q fragments kHeadDim / 4 (held for the whole loop, loaded once from
// global memory), O kHeadDim / 2 floats, S kStepChunks * 8 floats, P kStepChunks * 4, one K or
// V fragment 4. 16-key steps: 64 / 112 / 208 at head dims 64 / 128 / 256 before addressing;
// whole tiles: 148 (128 keys) / 148 (64 keys) / 220 (32 keys). __launch_bounds__ allows 255
// (two blocks of 128 threads per SM). ptxas (nvcc 13.0, sm_80 / sm_90a, bf16 = fp16, no
// spills): 16-key steps 124 / 128, 174 / 178 and 255 / 255 registers at head dims 64 / 128 /
// 256; whole tiles 222 / 233 at 64 and 221 / 225 at 128 (at 256 they spill: see
// kDecodeManyRowsStepChunks).
#pragma once

#include "ffi/cuda/common/smem_tile.cuh"
#include "ffi/decode_plan.h"

namespace jax_flashattn::mma_sync {

template <int kHeadDim_, int kBlockN_, int kStages_, int kMinBlocks_, int kStepChunks_,
          int kKvBytes_ = 2, bool kWidenInSmem_ = false>
struct DecodeTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;  // keys per K/V tile
  static constexpr int kStages = kStages_;  // K/V tiles in the ring: kStages - 1 in flight
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kMinBlocks = kMinBlocks_;  // per SM, for __launch_bounds__
  static constexpr int kChunkKeys = 16;       // keys of one chunk (one P.V k-step)
  static constexpr int kChunksPerTile = kBlockN / kChunkKeys;
  static constexpr int kStepChunks = kStepChunks_;  // 16-key chunks of one warp step
  static constexpr int kStepsPerTile = kChunksPerTile / kStepChunks;
  static constexpr bool kSoftCap = false;  // soft-capped logits (DecodeWithSoftCap, block.cuh)
  // Any of a bias, a mask and ALiBi (DecodeWithBiasAndMask, block.cuh); kAlibi: ALiBi among
  // them, in kernels of its own.
  static constexpr bool kBiasAndMask = false;
  static constexpr bool kAlibi = false;
  static constexpr bool kSegments = false;  // segment ids, with kBiasAndMask (kWithIds)
  // Bytes per K/V element: 2 (q's dtype), or 1 for float8_e4m3fn keys and values (kFp8Kv;
  // DecodeFp8Config below), widened (to float16 from sm_89, else to q's dtype: common/e4m3.cuh)
  // in registers after each ldmatrix, or with kWidenInSmem once per tile into a 2-byte tile
  // that the warps then read as the 2-byte configs read their ring (kWidenedBytes after the
  // ring: K and V of kBlockN rows of kWidenedDim elements).
  static constexpr int kKvBytes = kKvBytes_;
  static constexpr bool kFp8Kv = kKvBytes == 1;
  static constexpr bool kWidenInSmem = kWidenInSmem_;
  static constexpr int kWidenedDim = smem_dim_for(kHeadDim);
  static constexpr int kWidenedBytes = kWidenInSmem ? 2 * kBlockN * kWidenedDim * 2 : 0;
  static constexpr int kWidenUnroll = 1;  // widen_e4m3_tile's chunks at a time
  // Shared-memory rows in 2-byte units (e4m3 bytes by pairs), padded to a whole 128-byte span
  // (the XOR swizzle spreads 8 rows over all banks), and their 16-byte chunks that hold data.
  static constexpr int kSmemDim = smem_dim_for(kHeadDim * kKvBytes / 2);
  static constexpr int kChunks = kHeadDim * kKvBytes / 16;
  static constexpr int kElemBytes = 2;
  static constexpr int kStageBytes = 2 * kBlockN * kSmemDim * kElemBytes;  // K tile + V tile
  static constexpr int kRingBytes = kStages * kStageBytes;
  // Cross-warp merge: per warp and lane, its O fragment (kHeadDim / 2 floats), its two row
  // maxima and its two partial row sums, stored lane-minor so every access is conflict-free.
  static constexpr int kMergeFloatsPerWarp = (kHeadDim / 2 + 4) * 32;
  static constexpr int kMergeBytes = kWarps * kMergeFloatsPerWarp * 4;
  // After that merge the drained ring also holds the split's result for the cluster merge
  // (decode/cluster_merge.cuh, ClusterPartial: 64 rows of kHeadDim + 8 floats and their
  // lse, 34.3 KiB at head dim 128, 66.3 KiB at 256; checked in the kernel).
  static constexpr int kSmemBytes = kRingBytes + kWidenedBytes;
  // The elementwise terms' instantiations (DecodeWithBiasAndMask, block.cuh) stage each tile's
  // bias and mask rows after that, kTermStageBytes per ring stage: with the 96 KiB ring, 99
  // KiB, what every sm_8x/sm_120 allows a block (decode_terms_stage: a GQA group of 4 with a
  // float32 bias at 64-key tiles).
  static constexpr bool kStagedTerms = false;
  static constexpr int kRings = 1;
  static constexpr int kTermStageBytes = 1024;

  static_assert(kHeadDim % 16 == 0 && kHeadDim <= kDecodeMaxHeadDim, "mma k-steps are 16 wide");
  static_assert(kBlockN % kChunkKeys == 0, "warps take whole 16-key chunks");
  static_assert(kChunksPerTile % kStepChunks == 0, "warps take whole steps");
  static_assert(kWarps * 16 >= kDecodeMaxRows, "one warp per 16-row slab at the most rows");
  static_assert(kMergeBytes <= kSmemBytes, "the merge reuses the drained K/V ring");
  static_assert(!kWidenInSmem || kFp8Kv, "only e4m3 tiles are widened");
  static_assert(kSmemBytes <= 99 * 1024, "fits the opt-in shared memory of every sm_8x/sm_120");
};

// Query rows up to which a block takes 16-key steps; past it, the head dim's
// kDecodeManyRowsStepChunks (below). At 32 rows and fewer the key groups already split each
// tile over two or four warps.
inline constexpr int64_t kDecodeChunkStepMaxRows = 32;

// The configs of a head dim differ only in kStepChunks (16-key chunks of a warp step), so they
// share tile, ring and merge sizes.
template <int kHeadDim, int kStepChunks>
struct DecodeConfig;

// Stage (128 + 128) * 64 * 2 B = 32 KiB; ring 96 KiB; merge 18 KiB.
template <int kStepChunks>
struct DecodeConfig<64, kStepChunks> : DecodeTraits<64, 128, 3, 2, kStepChunks> {};
// Stage (64 + 64) * 128 * 2 B = 32 KiB; ring 96 KiB; merge 34 KiB.
template <int kStepChunks>
struct DecodeConfig<128, kStepChunks> : DecodeTraits<128, 64, 3, 2, kStepChunks> {};
// Stage (32 + 32) * 256 * 2 B = 32 KiB; ring 96 KiB; merge 66 KiB. Two 16-key chunks per tile,
// so with one slab only two warps compute (the other two still issue their share of loads).
template <int kStepChunks>
struct DecodeConfig<256, kStepChunks> : DecodeTraits<256, 32, 3, 2, kStepChunks> {};

// Configurations for float8_e4m3fn keys and values (a quantised KV cache beside a bfloat16 or
// float16 query). Up to 16 query rows (one slab, split over the warps by keys) each warp widens
// the fragments it loads, in registers: tiles of twice the keys at head dims 128 and 256, so
// that a stage keeps the 32 KiB of the 2-byte configs in flight (the same bytes per SM; half
// the tiles per key), and the same tile at 64, whose 64-byte rows pad to a 128-byte span.
// Stage 128 * 128 B * 2 (64), 128 * 128 B * 2 (128), 64 * 256 B * 2 (256) = 32 KiB; ring
// 96 KiB; two blocks per SM (decode_blocks_per_sm), as the widening makes the warps wait on
// arithmetic as well as on memory (one block per SM read the cache at 0.45 of the copy
// bandwidth, two at 0.62; four blocks of 48 KiB rings at 0.60). 16-key steps. ptxas (nvcc
// 13.0, sm_90a, bf16, the float16 products): 181 / 224 / 255 registers at 64 / 128 / 256, no
// spills but 20 bytes at 256 (the integer widening had none, and took 24% longer a call).
template <int kHeadDim>
struct DecodeFp8Config;
template <>
struct DecodeFp8Config<64> : DecodeTraits<64, 128, 3, 2, 1, 1> {};
template <>
struct DecodeFp8Config<128> : DecodeTraits<128, 128, 3, 2, 1, 1> {};
template <>
struct DecodeFp8Config<256> : DecodeTraits<256, 64, 3, 2, 1, 1> {};

// Past 16 rows each warp owns a slab and reads every key of its tiles, so widening in registers
// would widen each tile once per slab (0.39x the bf16 cache's call at 64 rows, 0.61x this way:
// docs/decisions/fp8-kv-decode.md);
// instead the block widens each tile once into a 2-byte tile (kWidenInSmem), which the
// warps read as the 2-byte configs do, in the 2-byte configs' steps. The ring has four stages
// of the 2-byte configs' keys in e4m3 (five at 64, whose rows are padded), beside the widened
// tile: 4 * 16 KiB + 32 KiB (128: 64 keys; 256: 32 keys), 5 * 16 KiB + 16 KiB (64: 64 keys)
// = 96 KiB, two blocks per SM as the 2-byte configs; 48-64 KiB of a block in flight. ptxas
// (nvcc 13.0, sm_90a, bf16, the float16 products): 219 / 244 registers at head dim 128
// (16-key / whole-tile steps), 161 / 208 at 64, no spills; at 256 255 registers and 64 bytes
// of spills (the widening's registers beside Q and O, 192 of them).
template <int kHeadDim, int kStepChunks>
struct DecodeFp8WidenConfig;
template <int kStepChunks>
struct DecodeFp8WidenConfig<64, kStepChunks>
    : DecodeTraits<64, 64, 5, 2, kStepChunks, 1, true> {};
template <int kStepChunks>
struct DecodeFp8WidenConfig<128, kStepChunks>
    : DecodeTraits<128, 64, 4, 2, kStepChunks, 1, true> {};
template <int kStepChunks>
struct DecodeFp8WidenConfig<256, kStepChunks>
    : DecodeTraits<256, 32, 4, 2, kStepChunks, 1, true> {};

// The step past kDecodeChunkStepMaxRows rows: the whole tile, except at head dim 256, where S
// and P of a 32-key tile on top of O and Q (192 registers) make ptxas spill; its tiles have
// two chunks, so its 16-key steps are two chains per tile, not four
// (docs/decisions/decode-mma-sync-warp-steps.md).
template <int kHeadDim>
inline constexpr int kDecodeManyRowsStepChunks = DecodeConfig<kHeadDim, 1>::kChunksPerTile;
template <>
inline constexpr int kDecodeManyRowsStepChunks<256> = 1;

// The widened configs' step past kDecodeChunkStepMaxRows rows: the 2-byte configs', within
// their 64-key tiles.
template <int kHeadDim>
inline constexpr int kDecodeFp8ManyRowsStepChunks =
    kDecodeManyRowsStepChunks<kHeadDim> < DecodeFp8WidenConfig<kHeadDim, 1>::kChunksPerTile
        ? kDecodeManyRowsStepChunks<kHeadDim>
        : DecodeFp8WidenConfig<kHeadDim, 1>::kChunksPerTile;

// The instantiated head dims, smallest first; a head dim (multiple of 8) runs on the first one
// that is at least as large. The kernel reads no more HBM bytes for the padding (the columns
// past head_dim are zero-filled in shared memory), so three suffice.
inline constexpr int kDecodeHeadDims[] = {64, 128, 256};

}  // namespace jax_flashattn::mma_sync
