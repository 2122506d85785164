// Tile configurations of the mma.sync backward kernels, one per instantiated head dim.
//
// dK/dV kernel: one block per (key block, kv head, batch), eight warps. The Q and dO tiles of
// every query head of the GQA group stream through kStages shared-memory buffers while K and V
// stay in shared memory. Warps split S^T / dP^T (keys x queries) and dK / dV (keys x head dim)
// two-dimensionally, exchanging P^T and dS^T through shared memory: a warp that owned 16 keys
// across the whole head dim would hold kHeadDim accumulator floats for dK and dV alone, and
// at head dim 128 spilled (measured: 255 registers + 200 bytes of spills).
//
// dQ kernel (deterministic mode only): one block per (query tile, head, batch), the forward's
// shape, each warp owning 16 query rows.
//
// Rows of 2-byte elements are padded to whole 128-byte swizzle spans (kSmemDim); the XOR
// swizzle only touches the low three bits of the 16-byte chunk index, so any multiple of 64
// works. Every configuration fits the 99 KiB of opt-in shared memory of every sm_8x/sm_120.
#pragma once

namespace jax_flashattn::sm80 {

constexpr int backward_smem_dim(int head_dim) { return (head_dim + 63) / 64 * 64; }

template <int kHeadDim_, int kBlockM_, int kDqColGroups_, int kMinBlocks_>
struct DkDvTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // queries per streamed Q/dO tile
  static constexpr int kBlockN = 64;        // keys per block
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kMinBlocks = kMinBlocks_;
  static constexpr int kStages = 2;  // Q/dO tiles in flight: compute tile i while i+1 lands
  static constexpr int kSmemDim = backward_smem_dim(kHeadDim);
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row that hold data
  static constexpr int kElemBytes = 2;
  // Warp w works on key slab w % kKeySlabs (16 keys) and half w / kKeySlabs of the other dim:
  // of the tile's queries for S^T and dP^T (kSdpCols), of the head dim for dK and dV
  // (kDkvCols).
  static constexpr int kKeySlabs = kBlockN / 16;
  static constexpr int kHalves = kWarps / kKeySlabs;
  static constexpr int kSdpCols = kBlockM / kHalves;
  static constexpr int kDkvCols = kHeadDim / kHalves;
  // P^T and dS^T [kBlockN][kBlockM] in shared memory, rows padded to one swizzle span.
  static constexpr int kDsDim = 64;
  // dQ = dS K of a Q tile: kDqSlabs slabs of 16 queries times kDqColGroups groups of kDqCols
  // head-dim columns, one per warp (warps past kDqWarps sit that product out).
  static constexpr int kDqSlabs = kBlockM / 16;
  static constexpr int kDqColGroups = kDqColGroups_;
  static constexpr int kDqCols = kHeadDim / kDqColGroups;
  static constexpr int kDqWarps = kDqSlabs * kDqColGroups;
  static constexpr int kSmemBytes =
      ((2 * kBlockN + 2 * kStages * kBlockM) * kSmemDim + 2 * kBlockN * kDsDim) * kElemBytes;

  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 256, "mma k-steps are 16 wide");
  static_assert(kWarps % kKeySlabs == 0, "every key slab has the same number of warps");
  static_assert(kSdpCols % 16 == 0 && kDkvCols % 16 == 0,
                "warp parts are whole pairs of 8-column tiles");
  static_assert(kBlockM <= kDsDim, "P^T and dS^T rows hold one Q tile");
  static_assert(kDqWarps <= kWarps && kDqCols % 16 == 0 && kHeadDim % kDqColGroups == 0,
                "dQ splits into whole 16-row slabs x pairs of 8-column tiles");
  static_assert(kSmemDim % 64 == 0, "the swizzle XORs the chunk index with row % 8");
  static_assert(kSmemBytes <= 99 * 1024, "fits the opt-in shared memory of every sm_8x/sm_120");
};

template <int kHeadDim_, int kBlockN_, int kWarps_, int kMinBlocks_>
struct DqTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockM = 16 * kWarps;  // query rows per block: 16 per warp
  static constexpr int kBlockN = kBlockN_;     // keys per K/V tile
  static constexpr int kMinBlocks = kMinBlocks_;
  static constexpr int kStages = 2;
  static constexpr int kSmemDim = backward_smem_dim(kHeadDim);
  static constexpr int kChunks = kHeadDim / 8;
  static constexpr int kElemBytes = 2;
  static constexpr int kSmemBytes = (2 * kBlockM + 2 * kStages * kBlockN) * kSmemDim * kElemBytes;

  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 256, "mma k-steps are 16 wide");
  static_assert(kBlockN % 16 == 0, "dS K consumes keys 16 at a time");
  static_assert(kSmemDim % 64 == 0, "the swizzle XORs the chunk index with row % 8");
  static_assert(kSmemBytes <= 99 * 1024, "fits the opt-in shared memory of every sm_8x/sm_120");
};

// Registers per thread of the dK/dV kernel: dK + dV accumulators kDkvCols floats, S^T and
// dP^T kSdpCols / 2, the dQ part kDqCols / 2, plus addressing; ptxas (CUDA 13.0, bf16) takes
// far more than the fragments need when 255 are allowed, as for the forward. One 256-thread
// block per SM (kMinBlocks = 1): two would cap registers at 128, which spills.
template <int kHeadDim>
struct DkDvConfig;
// dK+dV 16, S+dP 16, dQ 8 (4 x 2 warps of 16 columns); smem (128 + 256) * 64 * 2 + 16 KiB
// = 64 KiB.
// ptxas sm_80 / sm_90a: 172 / 172 registers, no spills.
template <>
struct DkDvConfig<32> : DkDvTraits<32, 64, 2, 1> {};
// dK+dV 32, S+dP 16, dQ 16; smem 64 KiB.
// ptxas sm_80 / sm_90a: 227 / 225 registers, no spills (with kMinBlocks = 2, i.e. 128
// registers, 60 bytes spill).
template <>
struct DkDvConfig<64> : DkDvTraits<64, 64, 2, 1> {};
// 32-query tiles keep Q/dO double-buffered under 99 KiB. dK+dV 48, S+dP 8; dQ 24 on four of
// the eight warps (2 slabs x 2 groups of 48 columns: 24-column groups would not be pairs of
// 8-column tiles); smem (128 + 128) * 128 * 2 + 16 KiB = 80 KiB.
// ptxas sm_80 / sm_90a: 221 / 223 registers, no spills.
template <>
struct DkDvConfig<96> : DkDvTraits<96, 32, 2, 1> {};
// dK+dV 64, S+dP 8, dQ 16 (2 slabs x 4 groups of 32 columns); smem 80 KiB.
// ptxas sm_80 / sm_90a: 242 / 243 registers, no spills (with kMinBlocks = 2: 192 bytes
// spill).
template <>
struct DkDvConfig<128> : DkDvTraits<128, 32, 4, 1> {};

// Registers of the dQ kernel: dQ kHeadDim / 2 floats, S and dP kBlockN / 2 floats (Q and dO
// fragments are re-read from shared memory per K/V tile: held in registers they spilled 16
// bytes at head dim 128).
template <int kHeadDim>
struct DqConfig;
// dQ 16, S+dP 64; smem (128 + 256) * 64 * 2 = 48 KiB.
// ptxas sm_80 / sm_90a: 192 / 192 registers, no spills.
template <>
struct DqConfig<32> : DqTraits<32, 64, 4, 2> {};
// dQ 32, S+dP 64; smem 48 KiB.
// ptxas sm_80 / sm_90a: 242 / 241 registers, no spills.
template <>
struct DqConfig<64> : DqTraits<64, 64, 4, 2> {};
// dQ 48, S+dP 32; smem (128 + 128) * 128 * 2 = 64 KiB.
// ptxas sm_80 / sm_90a: 218 / 220 registers, no spills.
template <>
struct DqConfig<96> : DqTraits<96, 32, 4, 2> {};
// dQ 64, S+dP 32; smem 64 KiB.
// ptxas sm_80 / sm_90a: 246 / 246 registers, no spills.
template <>
struct DqConfig<128> : DqTraits<128, 32, 4, 2> {};

// The instantiated head dims, smallest first; a head dim (multiple of 8) runs on the first
// one that is at least as large. Above 128, 64-key K/V tiles plus two 32-query Q/dO stages
// pass the 99 KiB (H = 256: 32 + 32 + 32 + 32 + 16 KiB), and the 16-query tiles that would fit
// leave each warp half a pair of 8-column tiles: those head dims run on the CUDA-core backward.
inline constexpr int kBackwardHeadDims[] = {32, 64, 96, 128};

}  // namespace jax_flashattn::sm80
