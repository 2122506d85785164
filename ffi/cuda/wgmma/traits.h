// Tile configurations of the Hopper (TMA + wgmma) forward kernel, one per instantiated head dim.
//
// A block (one per SM, persistent) is one producer warpgroup (a single thread issues every
// TMA load) and kConsumers warpgroups of 64 query rows each. Every tile in shared memory is
// stored as TMA writes it with the 128-byte swizzle: the head dim split into 64-element
// spans, each span a [rows][64] array of 128-byte rows, spans one after another (FP8
// attention's V^T of 64-key tiles alone has 64-byte rows in the 64-byte swizzle). K and V
// cycle through kStages buffers guarded by full/empty mbarriers, Q through kQStages. O is
// staged for its TMA store in a buffer of its own, or (kOInKV: head dims 192 and 256, where
// shared memory has no room for a second Q-sized tile) in a K/V stage that the ring lends for it.
#pragma once

#include <cstdint>

#include "ffi/cuda/common/tensor_maps.h"  // kFlatAlignElems
#include "ffi/params.h"

namespace jax_flashattn::wgmma {

// The forward's barrier bytes for q_stages Q buffers and kv_stages K/V stages: Q and K/V full
// and empty barriers, the tile slot's full and empty barriers, then the slot (32 bytes at the
// next 16-byte boundary).
constexpr int forward_barrier_bytes(int q_stages, int kv_stages) {
  return 8 * (2 * q_stages + 4 * kv_stages + 2) + 8 + 32;
}

template <int kHeadDim_, int kBlockN_, int kStages_, int kQStages_, bool kOInKV_,
          int kConsumers_ = 2, int kElemBytes_ = 2>
struct ForwardTraits {
  static constexpr int kHeadDim = kHeadDim_;  // padded head dim: a whole number of spans
  // The head dims the calls have at most (the columns past them are zeros, which TMA fills
  // in): S = Q K^T reduces over them and O += P V has their columns (Narrowed below).
  static constexpr int kUsedDim = kHeadDim_;
  // Bytes per element of q, k and v: 2, or 1 for FP8 attention (kE4m3: float8_e4m3fn q, k
  // and v^T, out of 2-byte elements; ForwardE4m3Config below).
  static constexpr int kElemBytes = kElemBytes_;
  static constexpr bool kE4m3 = kElemBytes == 1;
  // Consumer warpgroups, taking turns at the tensor cores: each one's softmax runs under the
  // products of the kConsumers - 1 others.
  static constexpr int kConsumers = kConsumers_;
  static constexpr int kBlockM = 64 * kConsumers;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  // Q tiles in flight: with two, the next tile's Q lands while the current one computes; with
  // one, while the current one finishes its last tile's softmax and O += P V.
  static constexpr int kQStages = kQStages_;
  // O staged in the K/V ring: each tile with keys takes one more ring position after its key
  // tiles, whose K buffer holds consumer 0's 64 rows of O and whose V buffer consumer 1's.
  static constexpr bool kOInKV = kOInKV_;
  // Whether calls with causal or window bounds run on this configuration (if not, the kernel
  // drops each warpgroup's own key range: every row then sees the same keys).
  static constexpr bool kWindowed = true;
  // Segment ids (WithSegmentIds below).
  static constexpr bool kSegments = false;
  // Soft-capped logits (WithSoftCap below).
  static constexpr bool kSoftCap = false;
  // An additive bias and a boolean mask, read element by element, and ALiBi
  // (WithBiasAndMask below); kStagedTerm: the bias or mask staged in shared memory, with each
  // consumer warp's buffer for it (WithStagedTerm below).
  static constexpr bool kBiasAndMask = false;
  static constexpr bool kStagedTerm = false;
  static constexpr int kTermStageBytes = 0;
  // ALiBi alone, computed on the plain tiles with the key tiles visited from the diagonal
  // (WithAlibi below).
  static constexpr bool kAlibi = false;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kConsumerWarps = 4 * kConsumers;
  // setmaxnreg budgets (a configuration may trade some, register_budgets_fit() below):
  // with two consumers 128 x 24 + 256 x 240 = 64512, within the 168 x 384 registers the block
  // is launched with. The producer only computes coordinates; the consumers hold S
  // (kBlockN / 2), O (kUsedDim / 2) and P (kBlockN / 4) registers per thread. Every
  // configuration compiles without spills (docs/decisions/hopper-kernels-without-spills.md).
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;

  static constexpr int kSpanElems = 128 / kElemBytes;   // elements of a 128-byte row
  // kE4m3: the keys (one byte each) of a V^T row in one TMA box and swizzle span: 128 with the
  // 128-byte swizzle, or with 64-key tiles 64 with the 64-byte one.
  static constexpr int kVtBoxKeys = kBlockN < 128 ? kBlockN : 128;
  static constexpr int kSpans = kHeadDim / kSpanElems;  // TMA boxes per Q or K tile
  static constexpr int kQBytes = kBlockM * kHeadDim * kElemBytes;
  static constexpr int kKVBytes = kBlockN * kHeadDim * kElemBytes;  // one K or one V tile
  // O is written in 2-byte elements, in spans of 64 (the epilogue's TMA boxes).
  static constexpr int kOutSpanElems = 64;
  // kQStages Q tiles, O (unless in the K/V ring), kStages K tiles and kStages V tiles,
  // 1024-byte aligned each (the swizzle pattern repeats every 8 rows of 128 bytes), then the
  // barriers; plus 1024 bytes to align the start.
  static constexpr int kOBytes = kOInKV ? 0 : kBlockM * kHeadDim * 2;
  static constexpr int kBarrierBytes = forward_barrier_bytes(kQStages, kStages);
  // Key ids per K stage (WithSegmentIds below); none here.
  using KeyIdBox = NoIdBox;
  static constexpr int kSmemBytes =
      kQStages * kQBytes + kOBytes + 2 * kStages * kKVBytes + kBarrierBytes + 1024;

  static_assert(kHeadDim % kSpanElems == 0, "tiles are whole 128-byte swizzle spans");
  static_assert(kElemBytes == 2 ||
                    (kElemBytes == 1 && (kBlockN == 64 || kBlockN % 128 == 0) && !kOInKV),
                "an e4m3 V^T tile is one 64-byte span or whole 128-byte spans per head-dim row");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "wgmma N is a multiple of 16 up to 256");
  static_assert(kQStages == 1 || kQStages == 2, "one Q buffer or two");
  static_assert(kConsumers == 2 || kConsumers == 3, "two or three consumer warpgroups");
  static_assert(!kOInKV || (kKVBytes >= 64 * kHeadDim * 2 && kConsumers == 2),
                "a K or V buffer holds one consumer's 64 rows of O");
  static_assert(kQBytes % 1024 == 0 && kKVBytes % 1024 == 0, "tiles stay 1024-byte aligned");
  static_assert(kSmemBytes <= 227 * 1024, "fits Hopper's 227 KiB of shared memory per block");
};

// The tile scheduler keeps rows, (batch, head) and tile indices in 32 bits: T, S, batch * heads
// and the tile count (at most one per 64 rows, per head) plus the grid must stay below 2^31, and
// so must T + S, which the forward's bounds (variant::KeyWindow<int>) add up
// (docs/decisions/int32-bounds-and-column-bits-masking.md).
inline bool indices_fit_32_bits(const AttentionParams& p) {
  constexpr int64_t kLimit = 0x7fffffff - 1024;
  return p.seqlen_q + p.seqlen_k <= kLimit && p.batch * p.num_heads <= kLimit &&
         (p.seqlen_q / 64 + 1) <= kLimit / (p.batch * p.num_heads > 0 ? p.batch * p.num_heads : 1);
}

// The tile configuration of each instantiated head dim, and (kWide) its larger tile for the
// calls where that pays (wide_config_pays below): more query rows at head dim 64, more keys
// at 128.
template <int kHeadDim, bool kWide = false>
struct ForwardConfig;

// S and P: 64 + 32 registers, O 32; smem 3 x 16 + 6 x 16 KiB = 145 KiB. Calls below T = 512
// take this configuration. Three K/V stages: a short block has few key tiles, and the third
// stage lets the next block's first K/V tile load under the current block's last one
// (docs/decisions/hopper-forward-kv-stages.md). The producer holds the next tile as well
// as the current one (two Q buffers: ForwardProducer::kQAhead): within 24 registers it spills,
// so it gets 32 and the consumers 232 (0 spills; docs/decisions/next-q-a-tile-ahead.md).
template <>
struct ForwardConfig<64> : ForwardTraits<64, 128, 3, 2, false> {
  static constexpr int kProducerRegisters = 32;
  static constexpr int kConsumerRegisters = 232;
};
// Three consumers (192-row query tiles): at this head dim a tile's softmax takes longer than
// its two products, so each consumer's softmax runs under two others' products
// (docs/decisions/three-consumer-warpgroups-at-head-dim-64.md). S and P
// 64 + 32 registers, O 32, within 160 (128 x 32 + 384 x 160 = 65536, the 128 x 512 the block
// is launched with); smem 3 x 24 + 8 x 16 KiB = 201 KiB. Four K/V stages: at T = 512-2048 a
// 192-row block has 2-16 key tiles, and the two more stages let the producer load the next
// block's first K/V tiles under the current block's last ones; three stages lose at
// T >= 1024 (why, with measurements: docs/decisions/hopper-forward-kv-stages.md).
template <>
struct ForwardConfig<64, true> : ForwardTraits<64, 128, 4, 2, false, 3> {
  static constexpr int kProducerRegisters = 32;
  static constexpr int kConsumerRegisters = 160;
};
// S and P: 64 + 32 registers, O 64; smem 3 x 32 + 4 x 32 KiB = 225 KiB. The producer holds
// the next tile as well as the current one (two Q buffers: ForwardProducer::kQAhead). Within 24
// registers it spills, which costs more than the early Q gains; 0 spills with 32 / 232
// (docs/decisions/next-q-a-tile-ahead.md).
template <>
struct ForwardConfig<128> : ForwardTraits<128, 128, 2, 2, false> {
  static constexpr int kProducerRegisters = 32;
  static constexpr int kConsumerRegisters = 232;
};
// 160-key tiles: S and P 80 + 40 registers, O 64; smem one Q, one O tile of 32 KiB + 4 x 40 KiB
// = 225 KiB. The single Q buffer is released once the tile's last S = Q K^T has landed, so the
// next Q loads under the last softmax and O += P V. Only unwindowed calls with S >= 16384 take
// it (docs/decisions/160-key-tiles-from-s-16384.md).
template <>
struct ForwardConfig<128, true> : ForwardTraits<128, 160, 2, 1, false> {
  static constexpr bool kWindowed = false;  // wide_config_pays(): the dispatcher's promise
};
// O alone is 128 registers, so 64-key tiles: S and P 32 + 16; smem one Q tile of 64 KiB
// + 4 x 32 KiB = 192 KiB, no room for an O tile, so O is staged in the K/V ring (one more
// position per query block; docs/decisions/o-staged-in-kv-ring-at-head-dim-256.md); 80-key
// tiles (S and P 40 + 20, 224 KiB) spill. The producer gets 32 registers here (with 24 ptxas
// spills one of its values: 4 TMA boxes per tile), the consumers 232; ptxas (CUDA 13.0):
// 0 spills.
template <>
struct ForwardConfig<256> : ForwardTraits<256, 64, 2, 1, true> {
  static constexpr int kProducerRegisters = 32;
  static constexpr int kConsumerRegisters = 232;
};

// Head dims 136-192: three spans, and with O at 96 registers 96-key tiles: S and P 48 + 24
// registers (168 with O, where 256's 64-key tiles hold 176); smem one Q tile of 48 KiB + 4 x
// 36 KiB = 192 KiB, O staged in the K/V ring as at 256 (a consumer's 64 x 192 O, 24 KiB, in a
// 36 KiB K or V buffer). On 256's 64-key tiles cut to 192 columns the forward trailed cuDNN
// (0.86-0.96x; these tiles 1.10-1.32x, docs/decisions/head-dims-96-and-192-on-hopper.md): per
// 64 x 64 scores it had three quarters of 256's products for the same softmax, barriers and O
// rescaling, and loaded a span of zeros with each tile. Calls with an option run on 256's
// instantiations (kPaddedHeadDims). The registers of 256: 32 for the producer (three TMA boxes
// per tile here, where 24 spilled at 256's four; not tried at 192), 232 for the consumers.
// ptxas (CUDA 13.0): 0 spills.
template <>
struct ForwardConfig<192> : ForwardTraits<192, 96, 2, 1, true> {
  static constexpr int kProducerRegisters = 32;
  static constexpr int kConsumerRegisters = 232;
};

// Head dims 72-96 on the layouts, tiles and registers budgets of 128 (zero columns past the
// head dim, as every head dim between instantiations has), with S = Q K^T reduced over kUsed
// columns (6 of 8 k16 steps) and O of kUsed columns (O += P V of N = kUsed: 48 registers); the
// epilogue stores the spans the columns start in, whose map clips the rest. Calls with an
// option run on the padded instantiations (kPaddedHeadDims).
template <typename Config, int kUsed>
struct Narrowed : Config {
  static constexpr int kUsedDim = kUsed;
  static_assert(kUsed % 32 == 0 && kUsed <= Config::kHeadDim && !Config::kE4m3,
                "whole k16 steps of S and whole pairs of O's 8-column tiles, in bf16 / fp16");
};
template <>
struct ForwardConfig<96> : Narrowed<ForwardConfig<128>, 96> {};
template <>
struct ForwardConfig<96, true> : Narrowed<ForwardConfig<128, true>, 96> {};

// FP8 attention (params.h's e4m3_attention): q, k and v^T of float8_e4m3fn, S = Q K^T and
// O += P V by wgmma's e4m3 k32 steps, P in [0, 256] converted to e4m3 in registers
// (ForwardConsumer::pack_p). Smaller head dims run zero-padded by TMA. At 128 (a Q, K or V^T
// row of 128 one-byte elements: one swizzle span): S 64 registers, P 16, O 64; smem two Q
// tiles of 16 KiB, O 32 KiB, 4 x (16 + 16) KiB = 192 KiB; 32 / 232 registers as the bf16
// configuration (the producer holds the next tile: two Q buffers).
template <int kHeadDim>
struct ForwardE4m3Config;
template <>
struct ForwardE4m3Config<128> : ForwardTraits<128, 128, 4, 2, false, 2, 1> {
  static constexpr int kProducerRegisters = 32;
  static constexpr int kConsumerRegisters = 232;
};
// O alone is 128 registers, so 64-key tiles (V^T rows of 64 bytes, in the 64-byte swizzle):
// S 32 registers, P 8, O 128; 128-key tiles (S 64, P 16) leave ptxas too few registers to keep
// the wgmma chain asynchronous (C7512) and spill 28 bytes. smem two Q tiles of 32 KiB, O 64
// KiB, 3 x (16 + 16) KiB, barriers and alignment = 225.2 KiB.
template <>
struct ForwardE4m3Config<256> : ForwardTraits<256, 64, 3, 2, false, 2, 1> {
  static constexpr int kProducerRegisters = 32;
  static constexpr int kConsumerRegisters = 232;
};

// The head dims FP8 attention is instantiated for (its calls' head dims run on the first one
// at least as large).
inline constexpr int kE4m3HeadDims[] = {128, 256};

// A configuration's tiles for calls with segment ids: the block's key tiles narrowed to the
// documents its rows are in, and the ids' element test on the tiles where a warp's rows and
// the tile's keys are not all of one document. Instantiated in translation units of their own
// (cuda/instantiations/forward_wgmma_segments.cu.in), so the other kernels' code stays as it
// is.
// The producer narrows each tile's key range by the spans: 8 more registers, or at head dim
// 64 (holding two tiles) ptxas spills it (128 x 40 + 256 x 232 = 64512 fits the 168 x 384).
// Each K tile lands with its keys' ids (a TMA box of KeyIdBox::kIds ids from the 16-byte boundary
// at or below the tile's first key: ForwardMapsWithIds), which the consumers test in shared
// memory: read from global memory on the consumers' path between a tile's scores and its
// softmax, their latency cost the packed rows of the benchmark 30% (mean document 1024,
// T = 8192, H200). Head dim 128's configuration has 1.8 KiB of shared memory left for them
// (2 x 640 bytes).
template <typename Config>
struct WithSegmentIds : Config {
  static constexpr bool kSegments = true;
  static constexpr int kProducerRegisters = Config::kProducerRegisters + 8;
  using KeyIdBox = FlatIdBox<Config::kBlockN>;
  static constexpr int kSmemBytes = Config::kSmemBytes + Config::kStages * KeyIdBox::kStageBytes;
  static_assert(kSmemBytes <= 227 * 1024, "fits Hopper's 227 KiB of shared memory per block");
};

// Soft-capped logits: each key tile's scores become tanh(s scale / cap) as they land
// (cuda::SoftCapLogits: FMUL, MUFU.TANH), and the softmax takes them with factor cap log2(e).
// Instantiations of their own (forward_softcap_launch.cuh), so that the others keep their
// code. Calls with segment ids and a soft-cap run on the mma.sync family.
template <typename Config>
struct WithSoftCap : Config {
  static_assert(!Config::kSegments, "soft-capped calls with segment ids take the mma.sync family");
  static constexpr bool kSoftCap = true;
};

// An additive bias, a boolean mask and ALiBi: each key tile's scores become base-2 logits with
// the bias and ALiBi's term added, and -inf where the mask hides them, as they land; the softmax
// takes them with factor 1. Each consumer thread reads its own elements of the bias and mask
// from global memory (its two rows, 2 x kBlockN / 8 pairs of keys), hit in L2 where it
// prefetched them under the tile before (WithStagedTerm below stages them instead), and
// computes ALiBi's (forward_bias_and_mask.cuh). Instantiations of their own
// (forward_bias_launch.cuh); calls that also have segment ids or a soft-cap run on the mma.sync
// family.
template <typename Config>
struct WithBiasAndMask : Config {
  static_assert(!Config::kSegments && !Config::kSoftCap,
                "calls with a bias or mask and segment ids or a soft-cap take the mma.sync family");
  static constexpr bool kBiasAndMask = true;
};

// A bias of 2-byte elements alone, or a mask alone, with 16-byte aligned rows (staged_term,
// forward_bias_and_mask.cuh): each consumer warp copies its 16 rows of the next key tile into
// a buffer of its own by cp.async under the tile before, and reads them from there, a pair of
// keys a shared load (16 x kBlockN 2-byte elements: 4 KiB at 128-key tiles, 32 KiB for eight
// warps). Where that leaves no room for two Q buffers (head dim 128: 225 KiB without it), one:
// the next tile's Q then loads under the last softmax and O += P V
// (docs/decisions/next-q-a-tile-ahead.md). An instantiation apart from WithBiasAndMask's: in
// one kernel, the staged reads' code beside the global ones spilled 200-700 bytes.
template <typename Config>
struct WithStagedTerm : WithBiasAndMask<Config> {
  static constexpr bool kStagedTerm = true;
  static constexpr int kTermStageBytes = 16 * Config::kBlockN * 2;
  static constexpr int kQStages =
      Config::kSmemBytes + Config::kConsumerWarps * kTermStageBytes <= 227 * 1024
          ? Config::kQStages
          : 1;
  // With one Q buffer where the configuration had two, the producer no longer holds the next
  // tile (ForwardProducer::kQAhead), and its 24 default registers leave the consumers 240:
  // with 32 / 232 the staged reads' consumers spilled 136 bytes at head dim 128, 34 stores
  // and 62 loads of local memory, against 48 bytes, 11 and 10.
  static constexpr bool kQBufferDropped = kQStages < Config::kQStages;
  static constexpr int kProducerRegisters = kQBufferDropped ? 24 : Config::kProducerRegisters;
  static constexpr int kConsumerRegisters = kQBufferDropped ? 240 : Config::kConsumerRegisters;
  static constexpr int kBarrierBytes = forward_barrier_bytes(kQStages, Config::kStages);
  static constexpr int kSmemBytes = kQStages * Config::kQBytes + Config::kOBytes +
                                    2 * Config::kStages * Config::kKVBytes +
                                    Config::kConsumerWarps * kTermStageBytes + kBarrierBytes +
                                    1024;
  static_assert(kSmemBytes <= 227 * 1024, "fits Hopper's 227 KiB of shared memory per block");
};

// ALiBi without a bias or mask: each key tile's scores become base-2 logits with ALiBi's
// term, two FFMAs per score (alibi_terms.cuh), and the softmax takes them with factor 1. The
// block visits its key tiles from the one that holds its first row's diagonal key on, cyclically
// (AlibiTileOrder, alibi_tile_order.cuh): ALiBi's logits fall away from the diagonal, so the
// row maxima settle on the first tile and the later tiles are exponentiated against them, as
// in the plain kernel. With key tiles out of order, every computing warpgroup multiplies all
// of the block's key tiles whole (no tail, no half-seen last tile: the masks hide what its rows
// do not see), and the V rows past a key length are zeroed before the product that reads that
// tile, wherever it falls in the order. Instantiations of their own (forward_alibi_launch.cuh);
// ALiBi beside a bias or mask takes WithBiasAndMask. The producer works the order out for each
// tile's loads: 8 more registers (with 32 ptxas spilled 12 bytes), 128 x 40 + 256 x 232 = 64512.
template <typename Config>
struct WithAlibi : Config {
  static_assert(!Config::kSegments && !Config::kSoftCap && !Config::kBiasAndMask,
                "ALiBi with other terms takes WithBiasAndMask or the mma.sync family");
  static constexpr bool kAlibi = true;
  static constexpr int kProducerRegisters = Config::kProducerRegisters + 8;
};

// Whether a forward configuration narrows each block's key tiles to the spans (params.h's
// q_key_spans; a no-op where a call has none): with segment ids, and with a bias and mask,
// whose call carries the mask's spans.
template <typename Traits>
inline constexpr bool kNarrowsToSpans = Traits::kSegments || Traits::kBiasAndMask;

// Whether a call's bias and mask suit WithBiasAndMask: their keys contiguous, so that a thread
// reads its row's elements at constant offsets from one pointer (with a stride per element,
// the address arithmetic spills). A bias or mask broadcast over the keys takes the mma.sync
// family.
inline bool bias_and_mask_fit(const AttentionParams& p) {
  const bool one_key = p.seqlen_k == 1;
  return (p.bias == nullptr || p.bias_strides.col == 1 || one_key) &&
         (p.mask == nullptr || p.mask_strides.col == 1 || one_key);
}

// Whether a call takes WithAlibi: ALiBi without a bias or mask, its distances (each thread's
// per tile: ForwardConsumer's alibi_distance, and the few rows and keys the tile adds) within
// int32: |shift| + |kv_len - q_len| + T + S + 2 x 256 stays below 2^31 with each part below
// 2^29.
inline bool alibi_fits(const AttentionParams& p) {
  const int64_t shift = p.alibi_shift < 0 ? -p.alibi_shift : p.alibi_shift;
  constexpr int64_t kLimit = int64_t(1) << 29;
  return p.alibi_slopes != nullptr && p.bias == nullptr && p.mask == nullptr &&
         shift < kLimit && p.seqlen_q < kLimit && p.seqlen_k < kLimit;
}

// setmaxnreg only moves registers within what the block was launched with: 168 per thread
// at 384 threads, 128 at 512 (65536 / threads rounded down to a multiple of 8). A budget
// beyond that makes setmaxnreg wait forever (docs/decisions/hopper-kernels-without-spills.md).
template <typename Traits>
constexpr bool register_budgets_fit() {
  return 128 * Traits::kProducerRegisters + 128 * Traits::kConsumers * Traits::kConsumerRegisters <=
         Traits::kThreads * (65536 / Traits::kThreads / 8 * 8);
}

// Head dims with a kWide configuration.
template <int kHeadDim>
inline constexpr bool kHasWideConfig = kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128;

// Whether a call takes its head dim's kWide configuration (thresholds chosen in one process,
// the dispatch switched between calls):
// - 64, three consumers: T >= 512, causal or not: there a tile's softmax outlasts its
//   products, and with the next Q issued a tile ahead three consumers gain from causal
//   T = 512 on (docs/decisions/three-consumer-warpgroups-at-head-dim-64.md).
// - 96 and 128, 160-key tiles: no causal or window bound (every key tile but the last is fully
//   visible) and S >= 16384; below that 128-key tiles are ahead
//   (docs/decisions/160-key-tiles-from-s-16384.md).
template <int kHeadDim>
inline bool wide_config_pays(const AttentionParams& p) {
  if constexpr (kHeadDim == 64) return p.seqlen_q >= 512;
  return (kHeadDim == 96 || kHeadDim == 128) && p.unwindowed() && p.seqlen_k >= 16384;
}

// The instantiated head dims, smallest first; a head dim (multiple of 8) runs on the first one
// that is at least as large (TMA zero-fills the columns past it).
inline constexpr int kHeadDims[] = {64, 96, 128, 192, 256};
// The head dims of the instantiations with an option (segment ids, a soft-cap, a bias, mask or
// ALiBi): 96 and 192 run those on 128 and 256.
inline constexpr int kPaddedHeadDims[] = {64, 128, 256};
// The first of `dims` (smallest first) that is at least head_dim, or 0: the instantiation a
// call with an option runs on (kPaddedHeadDims, backward_traits.h's kBackwardPaddedHeadDims).
template <int N>
constexpr int padded_head_dim(const int (&dims)[N], int head_dim) {
  for (const int h : dims)
    if (h >= head_dim) return h;
  return 0;
}

}  // namespace jax_flashattn::wgmma
