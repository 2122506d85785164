// Tile configurations of the Hopper (TMA + wgmma) backward kernel, one per instantiated head dim.
//
// A block is one (key block, kv head, batch): one producer warpgroup and two consumer
// warpgroups. Up to head dim 128 the block has 128 keys, 64 per consumer, and each consumer
// holds dK and dV of its keys for every head-dim column; above it (kSplitHeadDim) those would
// not fit a consumer's registers, so the block has 64 keys that both consumers take, each
// computing S^T and dP^T (the two products run twice) and some of the columns of dK, dV and
// dQ: half of them at 256, two spans and one at 192.
// K and V of the block load once; the Q and dO tiles of every query head of the GQA group
// (kBlockM queries each, with their lse and D) stream through a ring of kStages buffers guarded by
// full/empty mbarriers. Every tile TMA writes is stored with the 128-byte swizzle exactly as the
// forward's (traits.h): the head dim in 64-element spans, each span a [rows][64] array of
// 128-byte rows, spans one after another. dS^T [keys][queries] is laid out the same way, its
// queries in spans of 64; with 64 keys per consumer it is double-buffered so that one barrier
// per tile both publishes a tile's dS^T to the other warpgroup's dQ product and retires the
// buffer of the tile before; with kSplitHeadDim each consumer has the whole dS^T and keeps its
// own buffer.
#pragma once

#include <cstdint>

#include "ffi/cuda/common/tensor_maps.h"  // kFlatAlignElems
#include "ffi/params.h"

namespace jax_flashattn::wgmma {

// The fewest keys per block of any configuration: the dispatcher bounds the grid with it
// before choosing one.
inline constexpr int kBackwardConsumers = 2;
inline constexpr int kBackwardMinBlockN = 64;

template <int kHeadDim_, bool kSplitHeadDim_, int kBlockM_, int kFirstConsumerCols_ = 0>
struct BackwardTraits {
  static constexpr int kHeadDim = kHeadDim_;  // padded head dim: a whole number of spans
  // The head dims the calls have at most (the columns past them are zeros, which TMA fills in):
  // the reduction of S^T and dP^T and, without the split, dK's and dV's columns stop there
  // (BackwardNarrowed below).
  static constexpr int kUsedDim = kHeadDim_;
  static constexpr bool kSplitHeadDim = kSplitHeadDim_;
  static constexpr int kConsumers = kBackwardConsumers;  // consumer warpgroups
  static constexpr int kBlockN = kSplitHeadDim ? 64 : 64 * kConsumers;
  // A consumer's dK / dV columns: every one, or with the split the first consumer's (half of
  // them, or kFirstConsumerCols_) and the last consumer's the rest (kLastDkvCols). Consumers
  // whose columns differ (kUnevenSplit) run code of their own (BackwardConsumer's kConsumer).
  static constexpr int kDkvCols = !kSplitHeadDim        ? kHeadDim
                                  : kFirstConsumerCols_ ? kFirstConsumerCols_
                                                        : kHeadDim / kConsumers;
  static constexpr int kLastDkvCols = kSplitHeadDim ? kHeadDim - kDkvCols : kDkvCols;
  static constexpr bool kUnevenSplit = kLastDkvCols != kDkvCols;
  // Queries per streamed Q/dO tile: the N of S^T = K Q^T and the K of dV += P^T dO; S^T and
  // dP^T hold kBlockM / 2 floats per thread each beside dK and dV (BackwardConfig).
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kStages = 2;  // Q/dO tiles in flight
  // dS^T buffers: tile i + 1's lands while tile i's is read, or one per consumer.
  static constexpr int kDsBuffers = 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kConsumerWarps = 4 * kConsumers;
  static constexpr bool kSegments = false;  // segment ids (BackwardWithSegmentIds below)
  static constexpr bool kDeterministic = false;  // dQ in a fixed order (BackwardDeterministic)
  static constexpr bool kSoftCap = false;  // soft-capped logits (BackwardWithSoftCap below)
  // An additive bias, a boolean mask and / or ALiBi (BackwardWithBiasAndMask below).
  static constexpr bool kBiasAndMask = false;
  // The bias or mask staged in shared memory, a tile of it in each stage
  // (BackwardWithStagedTerm below); none here.
  static constexpr bool kStagedTerm = false;
  static constexpr int kTermStageBytes = 0;
  // Arrivals that complete a stage's full barrier: the producer thread's (with the TMA bytes).
  static constexpr int kQFullArrivals = 1;
  // setmaxnreg budgets, as in the forward: 128 x 24 + 256 x 240 = 64512, all that the block
  // is launched with (register_budgets_fit in traits.h).
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;

  static constexpr int kSpanElems = 64;                 // 128 bytes of 2-byte elements
  static constexpr int kSpans = kHeadDim / kSpanElems;  // TMA boxes per tile
  // dQ = dS K, reducing over all kBlockN keys (splitting the keys instead doubles the bytes
  // added into dq_accum: docs/decisions/backward-kernels.md), is one wgmma M of 64 queries per
  // consumer: of a 64-query tile each consumer computes some of the columns (kHeadDim / 2, or
  // with the split its dK / dV columns), of a 128-query tile (kDqSplitRows) half of the
  // queries, every column. kDqCols: the first consumer's, kLastDqCols the last one's.
  static constexpr bool kDqSplitRows = kBlockM == 64 * kConsumers;
  static constexpr int kDqRows = kDqSplitRows ? kBlockM / kConsumers : kBlockM;
  static constexpr int kDqCols = kDqSplitRows    ? kHeadDim
                                 : kSplitHeadDim ? kDkvCols
                                                 : kHeadDim / kConsumers;
  static constexpr int kLastDqCols = kDqSplitRows ? kHeadDim : kHeadDim - kDqCols;
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
  // Query ids per Q stage (BackwardWithSegmentIds below); none here.
  using QIdBox = NoIdBox;
  // A consumer's dQ of a tile in float32, staged for the TMA reduction into dq_accum: boxes of
  // 32 columns (128 bytes, swizzled as the tiles) x kDqRows rows, kDqBoxes of them (the first
  // consumer's; each consumer's staging tile has the room of the first's, at 192 the second
  // using half of its tile). With the head dim
  // split in halves the staging (64 KiB at head dim 256) does not fit beside the K, V, Q and dO
  // tiles: there each thread adds its dQ with red.global.add instead.
  static constexpr bool kDqStaged = !kSplitHeadDim || kUnevenSplit;
  static constexpr int kDqBoxCols = 32;
  static constexpr int kDqBoxes = kDqCols / kDqBoxCols;
  static constexpr int kDqBytes = kDqStaged ? kDqRows * kDqCols * 4 : 0;
  // K, V, kStages Q and dO tiles, kDsBuffers dS^T buffers, the consumers' dQ staging tiles
  // (1024-byte aligned each: the swizzle repeats every 8 rows of 128 bytes), lse / D, barriers;
  // plus 1024 bytes to align the start.
  static constexpr int kSmemBytes = 2 * kKVBytes + 2 * kStages * kQBytes +
                                    kDsBuffers * kDsBytes + kConsumers * kDqBytes + kStatsBytes +
                                    kBarrierBytes + 1024;

  static_assert(kHeadDim % kSpanElems == 0, "tiles are whole 128-byte swizzle spans");
  static_assert(kBlockM % kSpanElems == 0, "a dS^T row (kBlockM queries) is whole spans");
  static_assert(kDqRows == 64, "a consumer's dQ is one wgmma M");
  static_assert(!(kSplitHeadDim && kDqSplitRows), "dQ is split by columns or by rows");
  static_assert(kDqCols % kDqBoxCols == 0 && kLastDqCols % kDqBoxCols == 0 &&
                    kDkvCols % kSpanElems == 0 && kLastDkvCols % kSpanElems == 0,
                "a consumer's dQ columns are whole boxes, its dK / dV columns whole spans");
  static_assert(kDqCols <= 256 && kDkvCols <= 256, "a wgmma N is at most 256");
  static_assert(kSplitHeadDim || kFirstConsumerCols_ == 0, "columns are split only with the split");
  static_assert(kLastDkvCols > 0 && kLastDkvCols <= kDkvCols && kLastDqCols <= kDqCols &&
                    kConsumers == 2,
                "the first of two consumers has the most columns: the staging tiles have its "
                "size, and the second consumer's first column is consumer * kDqCols");
  static_assert(kQBytes % 1024 == 0 && kKVBytes % 1024 == 0 && kDsBytes % 1024 == 0 &&
                    kDqBytes % 1024 == 0,
                "tiles stay 1024-byte aligned");
  static_assert(kStatsBox <= 256, "a TMA box spans at most 256 elements");
  static_assert(kSmemBytes <= 227 * 1024, "fits Hopper's 227 KiB of shared memory per block");
};

// Registers per consumer thread: dK + dV kDkvCols floats, S^T + dP^T kBlockM / 2 each, then P^T
// and dS^T as A fragments (kBlockM / 4 each) and dQ kDqCols / 2. The peak is during P^T: dK, dV,
// S^T and dP^T (192 at every head dim; at 192 the first consumer's), which leaves 48 of the 240
// for everything else; holding the block's 64-bit visibility bounds or the loop-invariant
// descriptors through the tile loop, or masking with per-element branches, spills (see
// backward_kernel.cuh; docs/decisions/hopper-kernels-without-spills.md, backward-kernels.md).
// ptxas (CUDA 13.0, sm_90a, bf16 and fp16 alike): 168 registers at launch (setmaxnreg moves
// them), no spills, at every head dim.
template <int kHeadDim>
struct BackwardConfig;
// 128-query tiles, each consumer half the queries of dQ: per tile twice the work of 64-query
// tiles for the same barriers, waits and stats loads, and S^T and dP^T of N = 128. dK+dV 64,
// S+dP 128, dQ 32; smem 2 x 16 + 4 x 16 + 2 x 32 + 2 x 16 (dQ) KiB + 2.5 KiB stats + 1 KiB
// alignment = 195.5 KiB.
template <>
struct BackwardConfig<64> : BackwardTraits<64, false, 128> {};
// dK+dV 128, S+dP 64, dQ 32; smem 2 x 32 + 4 x 16 + 2 x 16 + 2 x 16 (dQ) KiB + 1.5 KiB stats +
// 1 KiB alignment = 194.5 KiB.
template <>
struct BackwardConfig<128> : BackwardTraits<128, false, 64> {};
// 64 keys, both consumers on them, half the columns each. dK+dV 128, S+dP 64, dQ 64 (added by
// red.global.add); smem 2 x 32 + 4 x 32 + 2 x 8 KiB + 1.5 KiB stats + 1 KiB alignment =
// 210.5 KiB. dQ is issued once dV and dK have landed: in flight together (their
// accumulators, dQ's and the P^T / dS^T fragments: 224 registers) ptxas serialized every
// wgmma (its warning C7512), 6-10% slower on an H200.
template <>
struct BackwardConfig<256> : BackwardTraits<256, true, 64> {};
// Head dims 136-192: three spans, split as 256's is, the first consumer taking two spans of dK,
// dV and dQ (its registers are 256's) and the second one span, on code of its own
// (kUnevenSplit; the second's dK+dV 64 registers, dQ 32). Three spans leave room to stage dQ
// for TMA reductions, as up to 128: smem 2 x 24 + 4 x 24 + 2 x 8 + 2 x 32 (dQ) KiB + 1.5 KiB
// stats + 1 KiB alignment = 226.5 KiB. On 256's layout cut to 192 columns (each consumer 128
// of dK, dV and dQ, the second's half zeros, dQ by red.global.add) forward+backward ran at
// 0.86-0.99x cuDNN on an H200, on these 1.04-1.19x.
template <>
struct BackwardConfig<192> : BackwardTraits<192, true, 64, 128> {};
// Head dims 72-96 on the layout of 128 (zero columns past the head dim, as every head dim
// between instantiations has), with the products cut to the head dim where it is their
// reduction (S^T, dP^T: 6 of 8 k16 steps) or their columns (dK, dV: N = 96 of 128, dK+dV 96
// registers; the epilogue stores the half span, which the map clips). dQ keeps its columns
// (the second consumer's are half zeros), and every other option runs on the padded
// instantiation (launch_backward_sm90). The forward's Narrowed (traits.h) is the same for its
// products.
template <typename Config, int kUsed>
struct BackwardNarrowed : Config {
  static constexpr int kUsedDim = kUsed;
  static constexpr int kDkvCols = kUsed, kLastDkvCols = kUsed;
  static_assert(kUsed % 32 == 0 && kUsed <= Config::kHeadDim && !Config::kSplitHeadDim,
                "whole k16 steps of S^T and half spans of dK / dV, every column a consumer's");
};
template <>
struct BackwardConfig<96> : BackwardNarrowed<BackwardConfig<128>, 96> {};

// A configuration's tiles for calls with segment ids: each key block's query tiles narrowed to
// the documents of its keys, and the ids' element test on the steps where a warp's keys and the
// tile's queries are not all of one document. Instantiated in translation units of their own
// (cuda/instantiations/backward_wgmma_segments.cu.in), so the other kernels' code stays as it
// is.
// Each Q tile lands with its queries' ids (a box of QIdBox::kIds ids from the 16-byte boundary at
// or below the tile's first query: BackwardMapsWithIds), which the consumers test in shared
// memory; each warp reads its keys' ids once per block. Read from global memory before each
// tile's products, their latency stalled every step.
template <typename Config>
struct BackwardWithSegmentIds : Config {
  static constexpr bool kSegments = true;
  using QIdBox = FlatIdBox<Config::kBlockM>;
  static constexpr int kSmemBytes = Config::kSmemBytes + Config::kStages * QIdBox::kStageBytes;
  static_assert(kSmemBytes <= 227 * 1024, "fits Hopper's 227 KiB of shared memory per block");
};

// A configuration for deterministic calls: each query tile's dQ is added by the key blocks that
// see it one after another, in a fixed order (dq_turn in backward_pipeline.cuh), each once the
// tile's int32 semaphore has counted the arrivals of every block before it. A thread of the
// producer's second warp, the dQ writer, waits for the turns (so the consumers do not): with dQ
// staged it issues the TMA reductions itself and hands the staging tiles back once they have
// been read, without (head dim 256) it lets the consumers' red.global.add through and waits for
// them; then, once the adds are complete, it counts the block's arrivals. Instantiated in
// translation units of their own (cuda/instantiations/backward_wgmma_deterministic.cu.in).
template <typename Config>
struct BackwardDeterministic : Config {
  static constexpr bool kDeterministic = true;
  static constexpr int kWriterBarrierBytes = 8 * 2 * Config::kConsumers;  // DqWriterBarriers
  static constexpr int kSmemBytes = Config::kSmemBytes + kWriterBarrierBytes;
  static_assert(Config::kBlockM % AttentionParams::kDqSemaphoreRows == 0,
                "a tile's semaphore lies within the call's dq_semaphores_needed()");
  static_assert(!Config::kSegments, "dq_turn counts the blocks of unnarrowed tile ranges");
  static_assert(kSmemBytes <= 227 * 1024, "fits Hopper's 227 KiB of shared memory per block");
};

// A configuration for soft-capped logits: P^T from the capped scores (cuda::SoftCapLogits), and
// dS^T times the cap's slope, which is recovered from P^T itself (the capped logit is
// log2(P) + lse log2(e): one MUFU.LG2 per element) rather than kept beside it, which would hold
// as many registers again as S^T. Instantiated in translation units of their own
// (cuda/instantiations/backward_wgmma_softcap.cu.in), in both dQ modes; calls with segment ids
// and a soft-cap take the mma.sync family.
template <typename Config>
struct BackwardWithSoftCap : Config {
  static_assert(!Config::kSegments, "soft-capped calls with segment ids take the mma.sync family");
  static constexpr bool kSoftCap = true;
};

// A configuration for calls with an additive bias, a boolean mask and / or ALiBi, and dbias and
// dslopes: each consumer thread reads its elements of S^T's bias and mask from global memory
// and adds ALiBi's term as the scores land, and writes its elements of dS^T into dbias and their
// part of the slopes' gradient into dslopes (backward_bias_and_mask.cuh). Instantiated in
// translation units of their own (cuda/instantiations/backward_wgmma_bias.cu.in), in both dQ
// modes (BackwardDeterministic<BackwardWithBiasAndMask<...>>: its dbias is one writer's per
// element); calls that also have segment ids or a soft-cap take the mma.sync family.
template <typename Config>
struct BackwardWithBiasAndMask : Config {
  static_assert(!Config::kSegments && !Config::kSoftCap && !Config::kDeterministic,
                "the bias and mask's calls have neither ids nor a soft-cap; ordered dQ wraps it");
  static constexpr bool kBiasAndMask = true;
};

// A staged term's tile in each stage: [kBlockM][kBlockN] 2-byte elements; and whether a
// configuration has room for them.
template <typename Config>
constexpr int backward_term_stage_bytes() {
  return Config::kBlockM * Config::kBlockN * 2;
}
template <typename Config>
constexpr bool backward_term_stages_fit() {
  return Config::kSmemBytes + Config::kStages * backward_term_stage_bytes<Config>() <=
         227 * 1024;
}

// A bias of 2-byte elements alone, or a mask alone, with 16-byte aligned rows (staged_term):
// each step's tile of it lands in the step's stage beside Q and dO, copied by cp.async by a warp
// of the producer's warpgroup (backward_term_tile.cuh), and the consumers take their elements
// from there as S^T lands, where BackwardWithBiasAndMask's threads read theirs from global
// memory only then. A 2-byte [kBlockM][kBlockN] tile a stage: two stages of 16 KiB at head dim
// 128 beside its 194.5 KiB, of 8 KiB at 256 beside 210.5; head dim 64's 128-query tiles would
// need 64 KiB beside its 195.5. An instantiation apart from BackwardWithBiasAndMask's, as the
// forward's WithStagedTerm is.
template <typename Config>
struct BackwardWithStagedTerm : BackwardWithBiasAndMask<Config> {
  static_assert(backward_term_stages_fit<Config>(),
                "fits Hopper's 227 KiB of shared memory per block");
  static constexpr bool kStagedTerm = true;
  static constexpr int kTermStageBytes = backward_term_stage_bytes<Config>();
  // The producer thread's, and one per lane of the term copier warp (copy_terms).
  static constexpr int kQFullArrivals = 1 + 32;
  static constexpr int kSmemBytes = Config::kSmemBytes + Config::kStages * kTermStageBytes;
};

// The instantiated head dims, smallest first; a head dim (multiple of 8) runs on the first one
// that is at least as large (TMA zero-fills the columns past it and clips them from stores).
inline constexpr int kBackwardHeadDims[] = {64, 96, 128, 192, 256};
// The head dims of the instantiations with an option (segment ids, deterministic dQ, a
// soft-cap, a bias or mask): 96 and 192 run those on 128 and 256.
inline constexpr int kBackwardPaddedHeadDims[] = {64, 128, 256};

}  // namespace jax_flashattn::wgmma
