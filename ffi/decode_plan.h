// When a forward call takes the split-KV decode kernel, how many splits it runs, and where the
// splits' partial results live in the workspace. Plain C++ (no CUDA): the dispatcher, the
// kernels and the Python extension (ffi/module.cc, through which src/jax_flashattn/_ffi.py sizes
// the workspace at trace time) share it.
//
// Workspace layout (float32, a result of the forward call, so XLA owns it):
//   o_partial   [work_units][splits][rows][head_dim]  each split's O, already normalised by
//                                                     its own softmax sum
//   lse_partial [work_units][splits][rows]            each split's natural-log lse; -inf where
//                                                     the split saw no key for that row (its
//                                                     o_partial row is then never read)
// where a work unit is one (batch, kv head) and row r is query t = r / group of query head
// kv_head * group + r % group (group = N / K): all query heads of a GQA group share one block.
#pragma once

#include <cstdint>

#include "ffi/params.h"

namespace jax_flashattn::mma_sync {

// Query rows one decode block serves, T * (N / K): four 16-row mma slabs, one per warp.
inline constexpr int64_t kDecodeMaxRows = 64;
// Keys from which a call takes the decode kernel: below it one normal tile covers the keys.
inline constexpr int64_t kDecodeMinKeys = 256;
// Keys up to which the decode kernel's int32 key positions (and tile * kBlockN) cannot overflow.
inline constexpr int64_t kDecodeMaxKeys = int64_t(1) << 30;
// The fewest keys a split owns, so that each block's pipeline has several tiles to stream.
inline constexpr int64_t kDecodeMinKeysPerSplit = 256;
// Blocks per SM the splits aim at (decode_blocks_per_sm), rounded down: a last wave with a few
// blocks would stream at the bandwidth of those few. Two blocks are resident per SM (96 KiB
// each; the wgmma kernel's paired configuration runs the same two splits as one block of two
// warpgroups, so the counts are in splits of 96 KiB rings). By call (why, with measurements:
// docs/decisions/decode-split-count.md):
// - per-batch key lengths: four (two waves), so that splits of unequal length even out;
// - equal lengths, every row in one 16-row slab (T = 1 with GQA up to 16), K and V of q's dtype
//   and no elementwise terms: one (fewer partial results to merge);
// - equal lengths, more rows: two (one wave).
inline constexpr int64_t kDecodeBlocksPerSmRagged = 4;
inline constexpr int64_t kDecodeBlocksPerSmOneSlab = 1;
inline constexpr int64_t kDecodeBlocksPerSmManyRows = 2;
inline constexpr int64_t kDecodeOneSlabRows = 16;
static_assert(kDecodeBlocksPerSmRagged >= kDecodeBlocksPerSmOneSlab &&
                  kDecodeBlocksPerSmRagged >= kDecodeBlocksPerSmManyRows,
              "the workspace is sized for the ragged count, the largest");
// The SM count the Python side sizes the workspace for (no device is known at trace time);
// a device with more SMs runs as many splits as that workspace holds.
inline constexpr int64_t kDecodeMaxMultiprocessors = 256;
// Largest head dim of the decode instantiations (decode/mma_sync_traits.h).
inline constexpr int64_t kDecodeMaxHeadDim = 256;

struct DecodePlan {
  int64_t work_units = 0;  // batch * num_kv_heads
  int64_t rows = 0;        // seqlen_q * group
  int64_t splits = 0;      // key ranges per work unit, one block each
  int64_t head_dim = 0;
  float* o_partial = nullptr;
  float* lse_partial = nullptr;
  // Splits one block runs, one per warpgroup: 1, or 2 on the wgmma kernel's paired
  // configuration (decode/wgmma_traits.h), which the dispatcher takes only with the cluster merge
  // and an even split count. Block unit * blocks_per_unit() + i runs splits
  // [i * splits_per_block, (i + 1) * splits_per_block) of work unit `unit`.
  int64_t splits_per_block = 1;
  // The blocks of a unit run as one thread block cluster and merge its splits there
  // (decode/cluster_merge.cuh); else through the workspace and the combine kernel. Set by
  // the dispatcher where every cluster is resident at once (cuda::cluster_merge_fits).
  bool cluster_merge = false;

  JAX_FLASHATTN_HOST_DEVICE int64_t blocks_per_unit() const { return splits / splits_per_block; }

  JAX_FLASHATTN_HOST_DEVICE int64_t partial_row(int64_t unit, int64_t split, int64_t row) const {
    return (unit * splits + split) * rows + row;
  }
};

// Query rows of one work unit (one decode block): T * (N / K), every query head of the group.
inline int64_t decode_rows(const AttentionParams& p) { return p.seqlen_q * p.group_size(); }

// Whether a decoding call takes the decode kernels' instantiations for the elementwise terms
// (DecodeWithBiasAndMask): a bias, a boolean mask, ALiBi or segment ids (as a mask: key s
// hidden from query t unless their ids are equal).
inline bool decode_has_terms(const AttentionParams& p) {
  return p.has_elementwise_terms() || p.q_segment_ids != nullptr;
}

// Whether the call's shape, dtype and options fit the decode kernel (before any workspace or
// device question): bf16/fp16, scale > 0 (the softmax folds the scale after the row max), a
// head dim multiple of 8 up to 256, a soft-cap or the elementwise terms (decode_has_terms) but
// not both, nor segment ids beside ALiBi (each has the decode kernels' instantiations for it),
// few query rows per kv head and enough keys to split.
inline bool decode_shape_fits(const AttentionParams& p) {
  const bool tensor_core_dtype = p.dtype == ElemType::kBFloat16 || p.dtype == ElemType::kFloat16;
  const bool one_variant = !(p.soft_capped() && decode_has_terms(p)) &&
                           !(p.q_segment_ids != nullptr && p.alibi_slopes != nullptr);
  return tensor_core_dtype && p.scale > 0.f && p.head_dim > 0 && p.head_dim % 8 == 0 &&
         p.head_dim <= kDecodeMaxHeadDim && one_variant &&
         p.num_kv_heads > 0 && p.seqlen_q > 0 &&
         decode_rows(p) <= kDecodeMaxRows && p.seqlen_k >= kDecodeMinKeys &&
         p.seqlen_k <= kDecodeMaxKeys;
}

// Whether a call with float8_e4m3fn keys and values (AttentionParams::k_descale) fits the
// decode kernels' e4m3 configurations: a decode shape on the plain kernels (no soft-cap, bias,
// mask, ALiBi or segment ids) whose rows are whole 16-byte chunks (head dim a multiple of 16).
inline bool decode_fp8_kv_fits(const AttentionParams& p) {
  return decode_shape_fits(p) && p.head_dim % 16 == 0 && !p.soft_capped() &&
         !decode_has_terms(p);
}

// Whether a decoding call's bias and / or mask (at least one) can be copied with each K/V tile
// of block_n keys into stage_bytes of shared memory (DecodeBiasAndMask::copy_tile): each term
// the same for every query (T = 1 or a query stride of 0: a serving bias [B, N, 1, S], a
// cache's mask [B, 1, 1, S]), so that a block stages one row per query head of its group, at
// unit stride along the keys, in whole 16-byte pieces (a 16-byte aligned buffer, batch and head
// strides and S of whole pieces: the last piece of a row ends at S, so no piece reads past the
// buffer), and group rows of both fit the stage. Any other call reads its terms element by
// element.
inline bool decode_terms_stage(const AttentionParams& p, int64_t block_n, int64_t stage_bytes) {
  if (p.bias == nullptr && p.mask == nullptr) return false;
  const auto whole = [](int64_t x) { return x % 16 == 0; };
  const auto fits = [&](const void* base, const BroadcastStrides& s, int64_t elem) {
    return base == nullptr ||
           (s.col == 1 && (p.seqlen_q == 1 || s.row == 0) &&
            whole(int64_t(reinterpret_cast<uintptr_t>(base))) && whole(s.batch_outer * elem) &&
            whole(s.batch_inner * elem) && whole(s.head * elem) && whole(p.seqlen_k * elem));
  };
  const int64_t bias_bytes =
      p.bias == nullptr ? 0 : (p.bias_dtype == ElemType::kFloat32 ? 4 : 2);
  const int64_t mask_bytes = p.mask == nullptr ? 0 : 1;
  return fits(p.bias, p.bias_strides, bias_bytes) && fits(p.mask, p.mask_strides, mask_bytes) &&
         p.group_size() * block_n * (bias_bytes + mask_bytes) <= stage_bytes;
}

// The blocks per SM a call's splits aim at (kDecodeBlocksPerSm* above).
inline int64_t decode_blocks_per_sm(const AttentionParams& p) {
  if (p.kv_seqlens != nullptr) return kDecodeBlocksPerSmRagged;
  // e4m3 keys and values (the widening, mma_sync::DecodeFp8Config) and the elementwise terms
  // (a bias, a mask, ALiBi, segment ids: their loads and arithmetic per score) make a block's
  // warps wait on arithmetic, not only on memory, so one slab too takes two blocks per SM,
  // whose warps hide each other's latencies.
  const bool arithmetic = p.k_descale != nullptr || decode_has_terms(p);
  return decode_rows(p) <= kDecodeOneSlabRows && !arithmetic ? kDecodeBlocksPerSmOneSlab
                                                             : kDecodeBlocksPerSmManyRows;
}

// Splits per work unit the occupancy rule asks for on `multiprocessors` SMs: as many blocks as
// blocks_per_sm per SM allows, but no split shorter than kDecodeMinKeysPerSplit keys.
inline int64_t decode_splits_wanted(int64_t work_units, int64_t seqlen_k, int64_t multiprocessors,
                                    int64_t blocks_per_sm) {
  const int64_t by_occupancy = blocks_per_sm * multiprocessors / work_units;
  const int64_t by_length = (seqlen_k + kDecodeMinKeysPerSplit - 1) / kDecodeMinKeysPerSplit;
  const int64_t splits = by_occupancy < by_length ? by_occupancy : by_length;
  return splits > 1 ? splits : 1;
}

// Floats of workspace a plan with `splits` splits uses.
inline int64_t decode_workspace_floats(const AttentionParams& p, int64_t splits) {
  return p.batch * p.num_kv_heads * splits * decode_rows(p) * (p.head_dim + 1);
}

// Fills `plan` and returns true when the call takes the decode kernel on a device with
// `multiprocessors` SMs: the shape fits and the workspace holds at least one split. The split
// count is the occupancy rule's, capped at what the workspace holds, so the kernels never
// write past it.
inline bool make_decode_plan(const AttentionParams& p, int64_t multiprocessors, DecodePlan& plan) {
  if (!decode_shape_fits(p) || p.batch <= 0 || p.decode_workspace == nullptr ||
      multiprocessors <= 0)
    return false;
  const int64_t per_split = decode_workspace_floats(p, 1);
  const int64_t capacity = p.decode_workspace_floats / per_split;
  const int64_t wanted = decode_splits_wanted(p.batch * p.num_kv_heads, p.seqlen_k, multiprocessors,
                                              decode_blocks_per_sm(p));
  plan.splits = wanted < capacity ? wanted : capacity;
  if (plan.splits < 1) return false;
  plan.work_units = p.batch * p.num_kv_heads;
  plan.rows = decode_rows(p);
  plan.head_dim = p.head_dim;
  plan.o_partial = p.decode_workspace;
  plan.lse_partial = p.decode_workspace + plan.work_units * plan.splits * plan.rows * p.head_dim;
  return true;
}

}  // namespace jax_flashattn::mma_sync
