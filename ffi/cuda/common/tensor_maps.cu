// cuTensorMapEncodeTiled comes from the driver through the runtime's entry-point query, so the
// module links against cudart only and loads wherever the driver does.
#include "ffi/cuda/common/tensor_maps.h"

#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <cstring>

namespace jax_flashattn::wgmma {
namespace {

using EncodeTiled = PFN_cuTensorMapEncodeTiled_v12000;

static_assert(sizeof(TensorMap) == sizeof(CUtensorMap) &&
                  alignof(TensorMap) % alignof(CUtensorMap) == 0,
              "the kernels' TensorMap holds the driver's CUtensorMap");

EncodeTiled encode_tiled() {
  static const EncodeTiled function = [] {
    void* address = nullptr;
    cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t error = cudaGetDriverEntryPointByVersion(
        "cuTensorMapEncodeTiled", &address, 12000, cudaEnableDefault, &status);
#else
    const cudaError_t error =
        cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &address, cudaEnableDefault, &status);
#endif
    const bool found = error == cudaSuccess && status == cudaDriverEntryPointSuccess;
    return found ? reinterpret_cast<EncodeTiled>(address) : nullptr;
  }();
  return function;
}

// The driver's encoder into a CUtensorMap, then its bytes into `map`.
template <typename... Args>
CUresult encode_into(EncodeTiled encoder, TensorMap& map, Args... args) {
  CUtensorMap encoded;
  const CUresult result = encoder(&encoded, args...);
  std::memcpy(&map, &encoded, sizeof encoded);
  return result;
}

constexpr int64_t kElemBytes = 2;
constexpr int64_t kSwizzleBytes = 128;  // the widest box row the 128-byte swizzle allows

// A tensor of `type` elements of `elem_bytes` bytes, boxes of 128 bytes of head dim.
cudaError_t encode(TensorMap& map, CUtensorMapDataType type, int64_t elem_bytes,
                   const void* base, int64_t head_dim, int64_t heads, int64_t rows,
                   int64_t batch, int64_t head_stride, int64_t row_stride, int64_t batch_stride,
                   int box_rows) {
  const EncodeTiled encode_function = encode_tiled();
  if (encode_function == nullptr) return cudaErrorInvalidValue;
  const cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(heads), cuuint64_t(rows),
                              cuuint64_t(batch)};
  const cuuint64_t strides[3] = {cuuint64_t(head_stride * elem_bytes),
                                 cuuint64_t(row_stride * elem_bytes),
                                 cuuint64_t(batch_stride * elem_bytes)};
  const cuuint32_t box[4] = {cuuint32_t(kSwizzleBytes / elem_bytes), 1, cuuint32_t(box_rows), 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  // Out-of-bounds elements (rows past T or S, head dims past H) read as zero and are not
  // written by stores or reductions: the kernel needs no predication on tile edges.
  const CUresult result = encode_into(
      encode_function, map, type, 4, const_cast<void*>(base), dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// An array of `elements` 4-byte elements of `type` as one flat row, read in boxes of `box`
// elements without swizzle.
cudaError_t encode_flat_4byte(TensorMap& map, CUtensorMapDataType type, const void* base,
                              int64_t elements, int box) {
  const EncodeTiled encode_function = encode_tiled();
  if (encode_function == nullptr) return cudaErrorInvalidValue;
  const cuuint64_t dims[1] = {cuuint64_t(elements)};
  // A rank-1 map has no strides to give; the array is passed only so that no pointer is null.
  const cuuint64_t strides[1] = {cuuint64_t((elements * 4 + 15) / 16 * 16)};
  const cuuint32_t box_dims[1] = {cuuint32_t(box)};
  const cuuint32_t element_strides[1] = {1};
  const CUresult result = encode_into(
      encode_function, map, type, 1, const_cast<void*>(base), dims, strides, box_dims,
      element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
      CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t encode_flat_f32(TensorMap& map, const float* base, int64_t elements, int box) {
  return encode_flat_4byte(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, base, elements, box);
}

CUtensorMapDataType elem_type(const AttentionParams& p) {
  return p.dtype == ElemType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                        : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
}

// A [batch, T, N, H] tensor of the call (q, out, d_out) in boxes of `rows` rows.
cudaError_t encode_query_like(TensorMap& map, const AttentionParams& p, const void* base,
                              int rows) {
  return encode(map, elem_type(p), kElemBytes, base, p.head_dim, p.num_heads, p.seqlen_q,
                p.batch, p.q_head_stride, p.q_row_stride, p.q_batch_stride, rows);
}

// A [batch, S, K, H] tensor of the call (k, v, dk, dv) in boxes of `rows` rows.
cudaError_t encode_key_like(TensorMap& map, const AttentionParams& p, const void* base,
                            int rows) {
  return encode(map, elem_type(p), kElemBytes, base, p.head_dim, p.num_kv_heads, p.seqlen_k,
                p.batch, p.kv_head_stride, p.kv_row_stride, p.kv_batch_stride, rows);
}

bool aligned16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

bool strides_aligned16(int64_t head_stride, int64_t row_stride, int64_t batch_stride) {
  return (head_stride * kElemBytes) % 16 == 0 && (row_stride * kElemBytes) % 16 == 0 &&
         (batch_stride * kElemBytes) % 16 == 0;
}

}  // namespace

bool tensor_maps_available() { return encode_tiled() != nullptr; }

bool tma_compatible(const AttentionParams& p) {
  return aligned16(p.q) && aligned16(p.k) && aligned16(p.v) && aligned16(p.out) &&
         strides_aligned16(p.q_head_stride, p.q_row_stride, p.q_batch_stride) &&
         strides_aligned16(p.kv_head_stride, p.kv_row_stride, p.kv_batch_stride);
}

cudaError_t encode_forward_maps(const AttentionParams& p, int q_rows, int kv_rows, int out_rows,
                                ForwardMaps& maps) {
  const cudaError_t errors[4] = {encode_query_like(maps.q, p, p.q, q_rows),
                                 encode_key_like(maps.k, p, p.k, kv_rows),
                                 encode_key_like(maps.v, p, p.v, kv_rows),
                                 encode_query_like(maps.out, p, p.out, out_rows)};
  for (cudaError_t e : errors)
    if (e != cudaSuccess) return e;
  return cudaSuccess;
}

// One-byte q and k: their byte strides are the element strides.
bool e4m3_tma_compatible(const AttentionParams& p) {
  return aligned16(p.q) && aligned16(p.k) && aligned16(p.v) && aligned16(p.out) &&
         p.head_dim % 16 == 0 && p.vt_keys % 16 == 0 &&
         strides_aligned16(p.q_head_stride, p.q_row_stride, p.q_batch_stride) &&
         p.q_head_stride == p.head_dim && p.kv_head_stride == p.head_dim &&
         p.kv_row_stride % 16 == 0 && p.kv_batch_stride % 16 == 0;
}

cudaError_t encode_e4m3_forward_maps(const AttentionParams& p, int q_rows, int kv_rows,
                                     int vt_box_keys, int vt_rows, int out_rows,
                                     ForwardMaps& maps) {
  if (!e4m3_tma_compatible(p) || (vt_box_keys != 128 && vt_box_keys != 64))
    return cudaErrorInvalidValue;
  const EncodeTiled encode_function = encode_tiled();
  if (encode_function == nullptr) return cudaErrorInvalidValue;
  // V^T [batch, K, H, vt_keys], contiguous: boxes of vt_box_keys keys x vt_rows head-dim rows,
  // a row of the box one swizzle span.
  const cuuint64_t dims[4] = {cuuint64_t(p.vt_keys), cuuint64_t(p.head_dim),
                              cuuint64_t(p.num_kv_heads), cuuint64_t(p.batch)};
  const cuuint64_t strides[3] = {cuuint64_t(p.vt_keys), cuuint64_t(p.head_dim * p.vt_keys),
                                 cuuint64_t(p.num_kv_heads * p.head_dim * p.vt_keys)};
  const cuuint32_t box[4] = {cuuint32_t(vt_box_keys), cuuint32_t(vt_rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  if (encode_into(encode_function, maps.v, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4,
                  const_cast<void*>(p.v), dims, strides, box, element_strides,
                  CU_TENSOR_MAP_INTERLEAVE_NONE,
                  vt_box_keys == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
    return cudaErrorInvalidValue;
  const cudaError_t errors[3] = {
      encode(maps.q, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, p.q, p.head_dim, p.num_heads, p.seqlen_q,
             p.batch, p.q_head_stride, p.q_row_stride, p.q_batch_stride, q_rows),
      encode(maps.k, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, p.k, p.head_dim, p.num_kv_heads,
             p.seqlen_k, p.batch, p.kv_head_stride, p.kv_row_stride, p.kv_batch_stride, kv_rows),
      encode_query_like(maps.out, p, p.out, out_rows)};
  for (cudaError_t e : errors)
    if (e != cudaSuccess) return e;
  return cudaSuccess;
}

// The box of a last tile starts below batch x T (S), and is at most 256 ids long.
bool segment_ids_tma_compatible(const AttentionParams& p) {
  constexpr int64_t kLimit = 0x7fffffff - 256;
  return p.q_segment_ids == nullptr ||
         (aligned16(p.q_segment_ids) && aligned16(p.kv_segment_ids) &&
          p.batch * p.seqlen_q <= kLimit && p.batch * p.seqlen_k <= kLimit);
}

cudaError_t encode_key_ids_map(const AttentionParams& p, int box_ids, TensorMap& map) {
  if (p.kv_segment_ids == nullptr || !segment_ids_tma_compatible(p)) return cudaErrorInvalidValue;
  return encode_flat_4byte(map, CU_TENSOR_MAP_DATA_TYPE_INT32, p.kv_segment_ids,
                           p.batch * p.seqlen_k, box_ids);
}

cudaError_t encode_query_ids_map(const AttentionParams& p, int box_ids, TensorMap& map) {
  if (p.q_segment_ids == nullptr || !segment_ids_tma_compatible(p)) return cudaErrorInvalidValue;
  return encode_flat_4byte(map, CU_TENSOR_MAP_DATA_TYPE_INT32, p.q_segment_ids,
                           p.batch * p.seqlen_q, box_ids);
}

cudaError_t encode_kv_maps(const AttentionParams& p, int kv_rows, KVMaps& maps) {
  if (cudaError_t e = encode_key_like(maps.k, p, p.k, kv_rows); e != cudaSuccess) return e;
  return encode_key_like(maps.v, p, p.v, kv_rows);
}

bool backward_tma_compatible(const AttentionParams& p) {
  // Box coordinates are int32: the last box starts below batch x N x T.
  const bool rows_addressable = p.batch * p.num_heads * p.seqlen_q <= 0x7fffffff;
  return rows_addressable && aligned16(p.q) && aligned16(p.k) && aligned16(p.v) &&
         aligned16(p.d_out) && aligned16(p.dk) && aligned16(p.dv) && aligned16(p.dq_accum) &&
         aligned16(p.lse) && aligned16(p.delta) &&
         strides_aligned16(p.q_head_stride, p.q_row_stride, p.q_batch_stride) &&
         strides_aligned16(p.kv_head_stride, p.kv_row_stride, p.kv_batch_stride);
}

cudaError_t encode_backward_maps(const AttentionParams& p, int q_rows, int kv_rows, int dkv_rows,
                                 int dq_rows, BackwardMaps& maps) {
  const int64_t rows = p.batch * p.num_heads * p.seqlen_q;
  const cudaError_t errors[9] = {encode_query_like(maps.q, p, p.q, q_rows),
                                 encode_query_like(maps.d_out, p, p.d_out, q_rows),
                                 encode_key_like(maps.k, p, p.k, kv_rows),
                                 encode_key_like(maps.v, p, p.v, kv_rows),
                                 encode_key_like(maps.dk, p, p.dk, dkv_rows),
                                 encode_key_like(maps.dv, p, p.dv, dkv_rows),
                                 encode_flat_f32(maps.lse, p.lse, rows, q_rows + kFlatAlignElems),
                                 encode_flat_f32(maps.delta, p.delta, rows,
                                                 q_rows + kFlatAlignElems),
                                 // q's layout in float32: strides of 4-byte elements.
                                 encode(maps.dq_accum, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4,
                                        p.dq_accum, p.head_dim, p.num_heads, p.seqlen_q,
                                        p.batch, p.q_head_stride, p.q_row_stride,
                                        p.q_batch_stride, dq_rows)};
  for (cudaError_t e : errors)
    if (e != cudaSuccess) return e;
  return cudaSuccess;
}

}  // namespace jax_flashattn::wgmma
