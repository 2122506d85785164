// Tile configurations of the Hopper (TMA + wgmma) backward kernel, one per instantiated head dim.
//
// A block is one (128-key block, kv head, batch): one producer warpgroup and two consumer
// warpgroups of 64 keys each. K and V of the block load once; the Q and dO tiles of every query
// head of the GQA group (64 queries each, with their lse and D) stream through a ring of
// kStages buffers guarded by full/empty mbarriers. Every tile TMA writes is stored with the
// 128-byte swizzle exactly as the forward's (traits.h): the head dim in 64-element spans, each
// span a [rows][64] array of 128-byte rows, spans one after another. dS^T [128 keys][64 queries]
// is one such span; it is double-buffered so that one barrier per tile both publishes a tile's
// dS^T to the other warpgroup's dQ product and retires the buffer of the tile before.
#pragma once

#include <cstdint>

#include "ffi/cuda/common/tensor_maps.h"  // kFlatAlignElems

namespace jax_flashattn::wgmma {

// Keys per block, 64 per consumer warpgroup, at every head dim: the dispatcher sizes the grid
// with it before choosing a configuration.
inline constexpr int kBackwardConsumers = 2;
inline constexpr int kBackwardBlockN = 64 * kBackwardConsumers;

template <int kHeadDim_>
struct BackwardTraits {
  static constexpr int kHeadDim = kHeadDim_;  // padded head dim: a whole number of spans
  static constexpr int kConsumers = kBackwardConsumers;  // consumer warpgroups
  static constexpr int kBlockN = kBackwardBlockN;
  // Queries per streamed Q/dO tile: the N of S^T = K Q^T and the K of dV += P^T dO. 64 keeps
  // S^T and dP^T at 32 floats per thread each beside dK and dV.
  static constexpr int kBlockM = 64;
  static constexpr int kStages = 2;    // Q/dO tiles in flight
  static constexpr int kDsStages = 2;  // dS^T buffers: tile i + 1's lands while tile i's is read
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kConsumerWarps = 4 * kConsumers;
  // setmaxnreg budgets, as in the forward: 128 x 24 + 256 x 240 = 64512, all that the block
  // is launched with (register_budgets_fit in traits.h).
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;

  static constexpr int kSpanElems = 64;                 // 128 bytes of 2-byte elements
  static constexpr int kSpans = kHeadDim / kSpanElems;  // TMA boxes per tile
  // dQ = dS K: each consumer computes every query of the tile for kDqCols head-dim columns,
  // reducing over all kBlockN keys (splitting the keys instead would double the float atomics).
  static constexpr int kDqCols = kHeadDim / kConsumers;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;   // one Q or one dO tile
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;  // K or V (later dK or dV staged)
  static constexpr int kDsBytes = kBlockN * kBlockM * 2;   // one dS^T buffer
  // lse and D of a tile: kBlockM rows and up to kFlatAlignElems - 1 before them, since their
  // TMA boxes start 16-byte aligned (common/tensor_maps.h); each array 128-byte aligned for TMA.
  static constexpr int kStatsBox = kBlockM + kFlatAlignElems;
  static constexpr int kStatsStride = (kStatsBox + 31) / 32 * 32;         // floats per array
  static constexpr int kStatsStageBytes = 2 * kStatsStride * 4;  // [lse, D][row]
  static constexpr int kStatsBytes = kStages * kStatsStageBytes;
  static constexpr int kBarrierBytes = 8 * (1 + 2 * kStages);   // kv_full, q_full[], q_empty[]
  // A consumer's dQ of a tile in float32, staged for the TMA reduction into dq_accum: boxes of
  // 32 columns (128 bytes, swizzled as the tiles) x kBlockM rows, kDqBoxes of them.
  static constexpr int kDqBoxCols = 32;
  static constexpr int kDqBoxes = kDqCols / kDqBoxCols;
  static constexpr int kDqBytes = kBlockM * kDqCols * 4;
  // K, V, kStages Q and dO tiles, kDsStages dS^T buffers, the consumers' dQ staging tiles
  // (1024-byte aligned each: the swizzle repeats every 8 rows of 128 bytes), lse / D, barriers;
  // plus 1024 bytes to align the start.
  static constexpr int kSmemBytes = 2 * kKVBytes + 2 * kStages * kQBytes + kDsStages * kDsBytes +
                                    kConsumers * kDqBytes + kStatsBytes + kBarrierBytes + 1024;

  static_assert(kHeadDim % kSpanElems == 0, "tiles are whole 128-byte swizzle spans");
  static_assert(kBlockM == kSpanElems, "a dS^T row (kBlockM queries) is one 128-byte span");
  static_assert(kDqCols % kDqBoxCols == 0 && kDqCols <= kSpanElems,
                "a consumer's dQ columns are a wgmma N within one span of K, in whole boxes");
  static_assert(kQBytes % 1024 == 0 && kKVBytes % 1024 == 0 && kDsBytes % 1024 == 0 &&
                    kDqBytes % 1024 == 0,
                "tiles stay 1024-byte aligned");
  static_assert(kSmemBytes <= 227 * 1024, "fits Hopper's 227 KiB of shared memory per block");
};

// Registers per consumer thread: dK + dV kHeadDim floats, S^T + dP^T 32 + 32, then P^T and dS^T
// as A fragments (16 + 16) and dQ kDqCols / 2. The peak is during P^T: dK, dV, S^T and dP^T
// (192 at head dim 128), which leaves 48 of the 240 for everything else; holding the block's
// 64-bit visibility bounds or the loop-invariant descriptors through the tile loop, or masking
// with per-element branches, spills (see backward_kernel.cuh;
// docs/decisions/hopper-kernels-without-spills.md, backward-kernels.md).
// ptxas (CUDA 13.0, sm_90a, bf16 and fp16 alike): 168 registers at launch (setmaxnreg moves
// them), no spills, at both head dims.
template <int kHeadDim>
struct BackwardConfig;
// dK+dV 64, S+dP 64, dQ 16; smem 2 x 16 + 4 x 8 + 2 x 16 + 2 x 8 (dQ) KiB + 1.5 KiB stats +
// 1 KiB alignment = 114.5 KiB.
template <>
struct BackwardConfig<64> : BackwardTraits<64> {};
// dK+dV 128, S+dP 64, dQ 32; smem 2 x 32 + 4 x 16 + 2 x 16 + 2 x 16 (dQ) KiB + 1.5 KiB stats +
// 1 KiB alignment = 194.5 KiB.
template <>
struct BackwardConfig<128> : BackwardTraits<128> {};

// The instantiated head dims, smallest first; a head dim (multiple of 8) runs on the first one
// that is at least as large (TMA zero-fills the columns past it and clips them from stores).
inline constexpr int kBackwardHeadDims[] = {64, 128};

}  // namespace jax_flashattn::wgmma
