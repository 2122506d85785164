// CUDA-core forward: float32 arithmetic on every dtype and any head dim. It serves float32
// inputs (exact fp32 products, no TF32) and head dims the tensor-core kernels do not tile.
// Every option is a runtime test here (soft-cap and ALiBi included): this family is not the
// fast path.
//
// One warp per query row. Per block of 32 keys each lane scores one key (a full dot product),
// the warp runs the online-softmax update with shuffles, and then each lane accumulates the
// output columns h = lane, lane + 32, ... from the 32 broadcast probabilities.
#include <cmath>

#include "ffi/cuda/common/alibi.cuh"
#include "ffi/cuda/common/mask.cuh"
#include "ffi/cuda/launch.h"
#include "ffi/cuda/simt/common.cuh"

namespace jax_flashattn::cuda {
namespace {

using namespace simt;

template <typename Elem>
__global__ void __launch_bounds__(kWarps * 32)
    forward_simt_kernel(const __grid_constant__ AttentionParams p) {
  extern __shared__ float smem[];  // per warp: q row [H], o row [H]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t b = blockIdx.x / p.num_heads, n = blockIdx.x % p.num_heads;
  const int64_t t = int64_t(blockIdx.y) * kWarps + warp;
  if (t >= p.seqlen_q) return;
  const int64_t H = p.head_dim;
  const int64_t kv_head = n / p.group_size();
  const Elem* q = static_cast<const Elem*>(p.q) + b * p.q_batch_stride + n * p.q_head_stride +
                  t * p.q_row_stride;
  const Elem* k = static_cast<const Elem*>(p.k) + b * p.kv_batch_stride + kv_head * p.kv_head_stride;
  const Elem* v = static_cast<const Elem*>(p.v) + b * p.kv_batch_stride + kv_head * p.kv_head_stride;
  Elem* out = static_cast<Elem*>(p.out) + b * p.q_batch_stride + n * p.q_head_stride +
              t * p.q_row_stride;
  float* q_row = smem + warp * 2 * H;
  float* o_row = q_row + H;
  for (int64_t h = lane; h < H; h += 32) {
    q_row[h] = to_float(q[h]);
    o_row[h] = 0.f;
  }
  __syncwarp();

  const Visibility vis = Visibility::make_with_segments(p, b, n);
  int64_t lo, hi;
  vis.key_range(t, t + 1, lo, hi);
  variant::VisibleSpans::keys_of_rows(p, b).narrow(t, t + 1, lo, hi);  // ids' or mask's spans
  const float scale_log2 = p.scale * kLog2e;
  const variant::SoftCap soft_cap = variant::SoftCap::make(p);
  const int64_t bias_row =
      p.bias ? p.bias_strides.offset(b, p.batch_inner, n, t, 0) : 0;
  const AlibiLogits alibi = AlibiLogits::make(p, b, n);
  float row_max = -INFINITY, row_sum = 0.f;

  for (int64_t base = lo; base < hi; base += 32) {
    const int64_t s = base + lane;
    float score = -INFINITY;  // log2-domain logit of key s
    if (s < hi && vis.visible(t, s)) {
      const float qk = dot_shared(q_row, k + s * p.kv_row_stride, H);
      const float bias = p.bias ? variant::AdditiveBias::element(
                                      p.bias, p.bias_dtype, bias_row + s * p.bias_strides.col)
                                : 0.f;
      // (softcap(scale q.k) + bias - slope |t + shift - s|) log2(e): the cap in tanhf,
      // float32-accurate as the rest.
      score = soft_cap.present() ? soft_cap.apply(qk * scale_log2) + bias * kLog2e
                                 : fmaf(qk, scale_log2, bias * kLog2e);
      if (p.alibi_slopes != nullptr) score += alibi.log2_term(t, s);
    }
    const float new_max = fmaxf(row_max, warp_max(score));
    const float offset = new_max == -INFINITY ? 0.f : new_max;
    const float correction = row_max == -INFINITY ? 1.f : exp2f(row_max - offset);
    const float prob = score == -INFINITY ? 0.f : exp2f(score - offset);
    row_sum = row_sum * correction + warp_sum(prob);
    row_max = new_max;
    for (int64_t h = lane; h < H; h += 32) o_row[h] *= correction;
    accumulate_rows(o_row, prob, v + base * p.kv_row_stride, p.kv_row_stride, H, lane);
  }

  // row_sum is 0 exactly for a row that saw no key, NaN where a NaN or +inf logit reached it
  // (OnlineSoftmax::finalize).
  const bool seen = row_sum != 0.f;
  const float inv = seen ? 1.f / row_sum : 0.f;
  for (int64_t h = lane; h < H; h += 32) out[h] = from_float<Elem>(o_row[h] * inv);
  if (lane == 0)
    p.lse[(b * p.num_heads + n) * p.seqlen_q + t] =
        seen ? (row_max + log2f(row_sum)) * kLn2 : -INFINITY;
}

template <typename Elem>
cudaError_t launch(const AttentionParams& p, cudaStream_t stream) {
  constexpr auto kernel = forward_simt_kernel<Elem>;
  const int64_t smem = kWarps * 2 * p.head_dim * int64_t(sizeof(float));
  if (smem > kMaxSmemBytes) return cudaErrorInvalidValue;
  if (cudaError_t e = ensure_smem_limit<kernel>(int(kMaxSmemBytes)); e != cudaSuccess) return e;
  const int64_t row_blocks = (p.seqlen_q + kWarps - 1) / kWarps;
  if (row_blocks > 65535 || p.batch * p.num_heads > 0x7fffffff) return cudaErrorInvalidConfiguration;
  kernel<<<dim3(unsigned(p.batch * p.num_heads), unsigned(row_blocks)), kWarps * 32, smem,
           stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_forward_simt(const AttentionParams& p, cudaStream_t stream) {
  switch (p.dtype) {
    case ElemType::kBFloat16: return launch<__nv_bfloat16>(p, stream);
    case ElemType::kFloat16: return launch<__half>(p, stream);
    default: return launch<float>(p, stream);
  }
}

}  // namespace jax_flashattn::cuda
