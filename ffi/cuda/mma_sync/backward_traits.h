// Tile configurations of the mma.sync backward kernels, one per instantiated head dim.
//
// dK/dV kernel: one block per (key block, kv head, batch), eight warps. The Q and dO tiles of
// every query head of the GQA group stream through two shared-memory buffers while K and V
// stay in shared memory. Each warp owns a slab of 16 keys; with fewer than eight slabs
// (kBlockN = 64) the warps split S^T / dP^T (keys x queries) and dK / dV (keys x head dim)
// two-dimensionally and exchange P^T and dS^T through shared memory: a warp that owned 16 keys
// across the whole head dim would hold kHeadDim accumulator floats for dK and dV alone. With
// eight slabs (kBlockN = 128, the large-shared-memory table) each warp owns its keys across
// every query of the tile and every head-dim column, so P^T and dS^T stay in registers as the
// A operands of dV += P^T dO and dK += dS^T Q; only dS^T goes to shared memory, for dQ.
//
// dQ kernel (deterministic mode only): one block per (query tile, head, batch), the forward's
// shape, each warp owning 16 query rows.
//
// Rows of 2-byte elements are padded to 64, 128 or 256 elements (smem_dim_for): whole 128-byte
// swizzle spans, rows of a power-of-two size (ldmatrix column steps are XORs into the row
// address: LdmatrixAddress) and a whole number of rows per 256-thread copy pass. DkDvConfig and
// DqConfig fit the 99 KiB of opt-in shared memory of every sm_8x/sm_120; DkDvConfigLarge needs
// the 163 KiB of sm_80/sm_87 (227 KiB on sm_90/sm_100) and runs where the device's opt-in limit
// is at least kLargeSmemBytes (backward_launch.cuh). Head dims above kSmallTableMaxHeadDim have
// only the large table: on other devices they run on the CUDA-core backward.
#pragma once

#include "ffi/cuda/common/smem_tile.cuh"  // smem_dim_for
#include "ffi/cuda/launch.h"               // opt_in_smem_bytes

namespace jax_flashattn::mma_sync {

// Opt-in shared memory per block: every sm_80+ device, and sm_80 / sm_87 / sm_90 / sm_100.
inline constexpr int kSmallSmemBytes = 99 * 1024;
inline constexpr int kLargeSmemBytes = 163 * 1024;

// Whether CUDA device `device`'s opt-in shared memory per block holds the large tables
// (sm_80, sm_87, sm_90, sm_100): the launcher's choice of table, and the dispatcher's rule for
// the head dims that have only the large one.
inline cudaError_t large_tables_fit(int device, bool& large) {
  int bytes = 0;
  const cudaError_t error = cuda::opt_in_smem_bytes(device, bytes);
  large = bytes >= kLargeSmemBytes;
  return error;
}

template <int kHeadDim_, int kBlockN_, int kBlockM_, int kSubCols_, int kDqRows_,
          int kDqColGroups_, int kSmemLimit_>
struct DkDvTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // queries per streamed Q/dO tile
  static constexpr int kBlockN = kBlockN_;  // keys per block
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  // One 256-thread block per SM: two would cap registers at 128, which spills.
  static constexpr int kMinBlocks = 1;
  // Q/dO tiles in flight: compute tile i while tile i + 1 lands (the load of tile i + 1 is
  // issued after the barrier that starts tile i, into the buffer tile i - 1 used).
  static constexpr int kStages = 2;
  static constexpr int kSmemDim = smem_dim_for(kHeadDim);
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row that hold data
  static constexpr int kElemBytes = 2;
  // Warp w works on key slab w % kKeySlabs (16 keys) and part w / kKeySlabs of the other dim:
  // of the tile's queries for S^T and dP^T (kSdpCols), of the head dim for dK and dV
  // (kDkvCols).
  static constexpr int kKeySlabs = kBlockN / 16;
  static constexpr int kParts = kWarps / kKeySlabs;
  static constexpr int kSdpCols = kBlockM / kParts;
  static constexpr int kDkvCols = kHeadDim / kParts;
  // One part: P^T and dS^T never leave the registers of the warp that computed them.
  static constexpr bool kPInRegisters = kParts == 1;
  // A warp takes its kSdpCols queries kSubCols at a time from S^T to dS^T (and, with
  // kPInRegisters, through dV and dK), so that only kSubCols queries' S^T / dP^T accumulators
  // are live beside dK and dV (all 64 at once spilled at head dims 64 to 128).
  static constexpr int kSubCols = kSubCols_;
  // dS^T (and P^T unless kPInRegisters) [kBlockN][kDsDim] in shared memory, rows padded to
  // whole swizzle spans.
  static constexpr int kDsDim = smem_dim_for(kBlockM);
  static constexpr int kDsTiles = kPInRegisters ? 1 : 2;
  // dQ = dS K of a Q tile: kDqSlabs slabs of kDqRows queries times kDqColGroups groups of
  // kDqCols head-dim columns, one per warp (warps past kDqWarps sit that product out). 32-row
  // slabs let each K fragment feed two mma.
  static constexpr int kDqRows = kDqRows_;
  static constexpr int kDqSlabs = kBlockM / kDqRows;
  static constexpr int kDqColGroups = kDqColGroups_;
  static constexpr int kDqCols = kHeadDim / kDqColGroups;
  static constexpr int kDqWarps = kDqSlabs * kDqColGroups;
  // Per stage, float32 -lse log2(e) and D of the tile's queries [2][kBlockM].
  static constexpr int kStatsBytes = kStages * 2 * kBlockM * 4;
  static constexpr int kSmemBytes =
      ((2 * kBlockN + 2 * kStages * kBlockM) * kSmemDim + kDsTiles * kBlockN * kDsDim) *
          kElemBytes +
      kStatsBytes;
  static constexpr int kSmemLimit = kSmemLimit_;

  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 256, "mma k-steps are 16 wide");
  static_assert(kBlockN % 16 == 0 && kWarps % kKeySlabs == 0,
                "every key slab has the same number of warps");
  static_assert(kSdpCols % 16 == 0 && kDkvCols % 16 == 0 && kSdpCols % kSubCols == 0,
                "warp parts are whole pairs of 8-column tiles");
  static_assert(kBlockM % 16 == 0 && kBlockM <= kDsDim, "P^T and dS^T rows hold one Q tile");
  static_assert(2 * kBlockM <= kThreads, "one thread stages each lse and D of a tile");
  static_assert(kDqRows % 16 == 0 && kBlockM % kDqRows == 0, "dQ slabs are whole 16-row steps");
  static_assert(kDqWarps <= kWarps && kDqCols % 16 == 0 && kHeadDim % kDqColGroups == 0,
                "dQ splits into whole slabs x pairs of 8-column tiles");
  static_assert(kSmemDim % 64 == 0 && kDsDim % 64 == 0,
                "the swizzle XORs the chunk index with row % 8");
  static_assert(kSmemBytes <= kSmemLimit, "fits the opt-in shared memory it is selected for");
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
  static constexpr int kSmemDim = smem_dim_for(kHeadDim);
  static constexpr int kChunks = kHeadDim / 8;
  static constexpr int kElemBytes = 2;
  static constexpr int kSmemBytes = (2 * kBlockM + 2 * kStages * kBlockN) * kSmemDim * kElemBytes;

  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 256, "mma k-steps are 16 wide");
  static_assert(kBlockN % 16 == 0, "dS K consumes keys 16 at a time");
  static_assert(kSmemDim % 64 == 0, "the swizzle XORs the chunk index with row % 8");
  static_assert(kSmemBytes <= 99 * 1024, "fits the opt-in shared memory of every sm_8x/sm_120");
};

// Registers per thread of the dK/dV kernel: dK + dV accumulators kDkvCols floats, S^T and
// dP^T kSdpCols / 2 each, the dQ part kDqRows kDqCols / 32, plus addressing; ptxas (CUDA 13.0,
// bf16) takes far more than the fragments need when 255 are allowed, as for the forward.
// Shared memory: K + V + two stages of Q + dO, P^T + dS^T (dS^T only with kPInRegisters), and
// kStatsBytes of lse / D.
template <int kHeadDim>
struct DkDvConfig;
// 64 keys x 64 queries. dK+dV 16, S+dP 16, dQ 8 (4 x 2 warps of 16 x 16); smem
// (128 + 256) * 64 * 2 + 16 KiB + 1 KiB = 65 KiB.
// ptxas sm_80 / sm_90a (CUDA 13.0, bf16 and fp16 alike): 140 / 150 registers, no spills.
template <>
struct DkDvConfig<32> : DkDvTraits<32, 64, 64, 32, 16, 2, kSmallSmemBytes> {};
// dK+dV 32, S+dP 16, dQ 16; smem 65 KiB.
// ptxas sm_80 / sm_90a: 168 / 187 registers, no spills (at two blocks per SM, i.e. 128
// registers, an earlier version spilled: docs/decisions/backward-kernels.md).
template <>
struct DkDvConfig<64> : DkDvTraits<64, 64, 64, 32, 16, 2, kSmallSmemBytes> {};
// 32-query tiles keep Q/dO double-buffered under 99 KiB. dK+dV 48, S+dP 8; dQ 24 on four of
// the eight warps (2 slabs x 2 groups of 48 columns: 24-column groups would not be pairs of
// 8-column tiles); smem (128 + 128) * 128 * 2 + 16 KiB + 0.5 KiB = 80.5 KiB.
// ptxas sm_80 / sm_90a: 170 / 192 registers, no spills.
template <>
struct DkDvConfig<96> : DkDvTraits<96, 64, 32, 16, 16, 2, kSmallSmemBytes> {};
// dK+dV 64, S+dP 8, dQ 16 (2 slabs x 4 groups of 32 columns); smem 80.5 KiB.
// ptxas sm_80 / sm_90a: 186 / 211 registers, no spills (at two blocks per SM, an earlier
// version spilled: docs/decisions/backward-kernels.md).
template <>
struct DkDvConfig<128> : DkDvTraits<128, 64, 32, 16, 16, 4, kSmallSmemBytes> {};

// The large-shared-memory table: 128 keys x 64 queries (FlashAttention-2's sm_80 tile at head
// dim 128), one 16-key slab per warp across the whole tile, so P^T / dS^T stay in registers
// and half as many key blocks add into each dQ element. Registers: dK + dV kHeadDim / 2 floats,
// S^T and dP^T kSubCols / 4 floats each per sub-tile.
template <int kHeadDim>
struct DkDvConfigLarge;
// dK+dV 32, S+dP 16, dQ 8 (4 x 2 warps of 16 x 16); smem (256 + 256) * 64 * 2 + 16 KiB +
// 1 KiB = 81 KiB.
// ptxas sm_80 / sm_90a: 175 / 193 registers, no spills.
template <>
struct DkDvConfigLarge<32> : DkDvTraits<32, 128, 64, 32, 16, 2, kLargeSmemBytes> {};
// dK+dV 64, S+dP 16, dQ 16 (2 x 4 warps of 32 x 16); smem 81 KiB.
// ptxas sm_80 / sm_90a: 234 / 235 registers, no spills.
template <>
struct DkDvConfigLarge<64> : DkDvTraits<64, 128, 64, 32, 32, 4, kLargeSmemBytes> {};
// 16-query sub-tiles. dK+dV 96, S+dP 16, dQ 24 (4 x 2 warps of 16 x 48); smem
// (256 + 256) * 128 * 2 + 16 KiB + 1 KiB = 145 KiB.
// ptxas sm_80 / sm_90a: 227 / 252 registers, no spills.
template <>
struct DkDvConfigLarge<96> : DkDvTraits<96, 128, 64, 16, 16, 2, kLargeSmemBytes> {};
// dK+dV 128, S+dP 16, dQ 32 (2 x 4 warps of 32 x 32); smem 145 KiB.
// 16-query sub-tiles (32 spilled 48 / 64 bytes).
// ptxas sm_80 / sm_90a: 245 / 255 registers; sm_80 no spills, sm_90a 24 bytes of spill
// stores (36 of loads): NOT yet spill-free on sm_90a.
template <>
struct DkDvConfigLarge<128> : DkDvTraits<128, 128, 64, 16, 32, 4, kLargeSmemBytes> {};
// Head dims above 128: 128 keys would hold kHeadDim / 2 dK + dV floats per thread, so these
// keep DkDvConfig<128>'s shape (64 keys x 32 queries, two parts, P^T through shared memory) on
// rows padded to 256 elements. dK+dV 96 / 128, S+dP 8, dQ 24 / 32 (2 slabs x 4 groups of 48 /
// 64 columns); smem (128 + 128) * 256 * 2 + 16 KiB + 0.5 KiB = 144.5 KiB.
template <>
struct DkDvConfigLarge<192> : DkDvTraits<192, 64, 32, 16, 16, 4, kLargeSmemBytes> {};
template <>
struct DkDvConfigLarge<256> : DkDvTraits<256, 64, 32, 16, 16, 4, kLargeSmemBytes> {};

// The largest head dim of the 99 KiB table: above it, 64-key K/V tiles plus two 32-query Q/dO
// stages pass the 99 KiB (H = 256: 32 + 32 + 32 + 32 + 16 KiB), and 16-query tiles would leave
// each warp half a pair of 8-column tiles.
inline constexpr int kSmallTableMaxHeadDim = 128;

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
// dQ 96 / 128, S+dP 8; 16-key K/V tiles keep two blocks of (128 + 64) * 256 * 2 = 96 KiB.
template <>
struct DqConfig<192> : DqTraits<192, 16, 4, 2> {};
template <>
struct DqConfig<256> : DqTraits<256, 16, 4, 2> {};

// The instantiated head dims, smallest first; a head dim (multiple of 8) runs on the first
// one that is at least as large.
inline constexpr int kBackwardHeadDims[] = {32, 64, 96, 128, 192, 256};

}  // namespace jax_flashattn::mma_sync
