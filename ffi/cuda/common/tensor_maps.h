// TMA tensor maps of a forward or backward call, encoded on the host for each launch (a few
// microseconds, no device memory: they travel as __grid_constant__ kernel parameters).
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "ffi/params.h"

namespace jax_flashattn::wgmma {

// A TMA tensor map as the kernels take it: the driver's CUtensorMap, 128 opaque bytes (aligned
// to 128 as CUDA 13 declares it; 64, as TMA requires, in CUDA 12), which tensor_maps.cu encodes
// and copies in (checking that the two agree). A type of our own so that the kernels'
// translation units need not include the driver API's cuda.h.
struct alignas(128) TensorMap {
  unsigned long long opaque[16];
};

// q and out [batch, T, N, H], k and v [batch, S, K, H], each viewed as the 4-D tensor
// {H, heads, rows, batch} (innermost first) and read or written in boxes of 64 head-dim
// elements x 1 head x `rows` rows x 1 batch entry with the 128-byte swizzle.
struct ForwardMaps {
  TensorMap q, k, v, out;
};

// Calls with segment ids: also the key ids (int32 [batch, S]) as one flat row of batch x S ids
// (a row stride of S ids is not 16-byte aligned for every S), read in boxes of box_ids ids that
// start at a 16-byte boundary (a flat box's rule, kFlatAlignElems below). The Hopper forward
// loads each key tile's ids beside its K, so that its consumers test them in shared memory.
struct ForwardMapsWithIds : ForwardMaps {
  TensorMap kv_ids;
};

template <bool kSegmentIds>
using ForwardMapsFor = std::conditional_t<kSegmentIds, ForwardMapsWithIds, ForwardMaps>;

// Whether TMA can address the call's segment ids (none: true): 16-byte aligned bases, and
// batch x T and batch x S ids addressable by int32 box coordinates.
bool segment_ids_tma_compatible(const AttentionParams& p);

// The key ids' (the query ids') map in boxes of box_ids ids. Fail like encode_forward_maps,
// and where segment_ids_tma_compatible does not hold.
cudaError_t encode_key_ids_map(const AttentionParams& p, int box_ids, TensorMap& map);
cudaError_t encode_query_ids_map(const AttentionParams& p, int box_ids, TensorMap& map);

// Whether TMA can address the call's tensors: 16-byte aligned base addresses and strides.
bool tma_compatible(const AttentionParams& p);

// Whether the driver provides cuTensorMapEncodeTiled (looked up once).
bool tensor_maps_available();

// Box rows per map: q_rows for q, kv_rows for k and v, out_rows for out. Fails with
// cudaErrorInvalidValue when the driver lacks cuTensorMapEncodeTiled or rejects a map.
cudaError_t encode_forward_maps(const AttentionParams& p, int q_rows, int kv_rows, int out_rows,
                                ForwardMaps& maps);

// FP8 attention (params.h's e4m3_attention): whether TMA can address its tensors (16-byte
// aligned bases and strides, q and k with contiguous heads), and its maps: q and k of
// float8_e4m3fn in the view above (boxes of 128 head-dim bytes), v as V^T [batch, K, H,
// vt_keys] in boxes of vt_box_keys keys (128, in the 128-byte swizzle, or 64, in the 64-byte
// one) x vt_rows head-dim rows, out of `dtype` as above.
bool e4m3_tma_compatible(const AttentionParams& p);
cudaError_t encode_e4m3_forward_maps(const AttentionParams& p, int q_rows, int kv_rows,
                                     int vt_box_keys, int vt_rows, int out_rows,
                                     ForwardMaps& maps);

// k and v alone, in the same view, for the mma.sync forward's K/V tile loads on Hopper
// (mma_sync::forward_kernel with kTmaKV), in boxes of kv_rows rows.
struct KVMaps {
  TensorMap k, v;
};

cudaError_t encode_kv_maps(const AttentionParams& p, int kv_rows, KVMaps& maps);

// The backward's maps, in the same view: q and d_out (loads), k and v (loads), dk and dv
// (stores, which clip rows past S and head dims past H). lse and delta (float32 [batch, N, T])
// are viewed as one flat row of batch x N x T elements: a row stride of T floats is not 16-byte
// aligned for every T, which a 2-D map needs. A box must also start 16 bytes into the row
// (other starts raise an illegal instruction on H100), so boxes are q_rows + kFlatAlignElems
// long and start at the tile's first row rounded down to kFlatAlignElems; what lies around
// the tile's rows (the rows before, the next head's first rows, zeros past the whole tensor)
// belongs to queries the kernel's masks give P = 0 (docs/decisions/backward-kernels.md).
// dq_accum, the float32 dQ accumulator in q's layout, takes reductions (adds) of boxes of 32
// head-dim elements (128 bytes) x 1 head x dq_rows rows x 1 batch entry, with the 128-byte
// swizzle.
inline constexpr int kFlatAlignElems = 4;  // 16 bytes of float32

// A tile's segment ids as one flat box (ForwardMapsWithIds, BackwardMapsWithIds): kTileIds ids
// and the kFlatAlignElems before them at most; the bytes TMA writes, and the bytes a
// shared-memory stage takes for them (a TMA destination is 128-byte aligned).
template <int kTileIds>
struct FlatIdBox {
  static constexpr int kIds = kTileIds + kFlatAlignElems;
  static constexpr int kBytes = kIds * 4;
  static constexpr int kStageBytes = (kBytes + 127) / 128 * 128;
  static_assert(kIds <= 256 && kBytes % 16 == 0, "one TMA box of 16-byte units");
};

// The box of calls without segment ids: no ids, no bytes.
struct NoIdBox {
  static constexpr int kIds = 0, kBytes = 0, kStageBytes = 0;
};

struct BackwardMaps {
  TensorMap q, d_out, k, v, dk, dv, lse, delta, dq_accum;
};

// Calls with segment ids: also the query ids, flat as ForwardMapsWithIds's key ids, which the
// backward loads beside each Q tile.
struct BackwardMapsWithIds : BackwardMaps {
  TensorMap q_ids;
};

template <bool kSegmentIds>
using BackwardMapsFor = std::conditional_t<kSegmentIds, BackwardMapsWithIds, BackwardMaps>;

// Whether TMA can address the backward's tensors (q, d_out, k, v, dk, dv, lse, delta and the
// float32 dQ accumulator): 16-byte aligned base addresses and strides, and lse's batch x N x T
// elements addressable by int32 box coordinates.
bool backward_tma_compatible(const AttentionParams& p);

// Box rows per map: q_rows for q and d_out (q_rows + kFlatAlignElems for lse and delta),
// kv_rows for k and v, dkv_rows for dk and dv, dq_rows for dq_accum.
cudaError_t encode_backward_maps(const AttentionParams& p, int q_rows, int kv_rows, int dkv_rows,
                                 int dq_rows, BackwardMaps& maps);

}  // namespace jax_flashattn::wgmma
