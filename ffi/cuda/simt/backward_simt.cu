// CUDA-core backward: float32 arithmetic on every dtype and head dim, deterministic (no
// atomics, except for a dbias summed over broadcast dims, and dslopes' partial sums, which
// have one writer per slot). P is recomputed from the saved lse, never stored:
//   P_ts = exp(softcap(scale q_t.k_s) + bias_ts - slope |t + shift - s| - lse_t),
//   D_t = dO_t.O_t,  dS_ts = P_ts (dO_t.v_s - D_t)  (dbias),
//   dslope = -sum_{t, s} |t + shift - s| dS_ts,  dS'_ts = dS_ts softcap'(scale q_t.k_s),
//   dq_t = scale sum_s dS'_ts k_s,  dk_s = scale sum_{n in group, t} dS'_ts q_t,
//   dv_s = sum_{n in group, t} P_ts dO_t
// (softcap the identity, softcap' 1, without a cap; the ALiBi term 0 without slopes).
// Two kernels: a warp per query row computes dq (and the dbias row), a warp per key row
// computes dk and dv over the query heads of its group (and, a block of kWarps keys at a time,
// dslopes), so every output has one writer (but a dbias summed over broadcast dims, whose
// elements take float32 atomic adds).
#include <cmath>

#include "ffi/cuda/common/alibi.cuh"
#include "ffi/cuda/common/mask.cuh"
#include "ffi/cuda/common/ptx.cuh"
#include "ffi/cuda/launch.h"
#include "ffi/cuda/simt/common.cuh"

namespace jax_flashattn::cuda {
namespace {

using namespace simt;

// Pointers of one (batch, query head) and the recomputation of one element of P and dS.
template <typename Elem>
struct HeadView {
  const Elem *q, *k, *v, *out, *d_out;
  const float* lse;
  int64_t bias_offset;
  Visibility vis;
  variant::SoftCap soft_cap;
  variant::Alibi alibi;

  __device__ HeadView(const AttentionParams& p, int64_t b, int64_t n)
      : vis(Visibility::make_with_segments(p, b, n)),
        soft_cap(variant::SoftCap::make(p)),
        alibi(variant::Alibi::make(p, b, n)) {
    const int64_t kv_head = n / p.group_size();
    const int64_t q_offset = b * p.q_batch_stride + n * p.q_head_stride;
    const int64_t kv_offset = b * p.kv_batch_stride + kv_head * p.kv_head_stride;
    q = static_cast<const Elem*>(p.q) + q_offset;
    out = static_cast<const Elem*>(p.out) + q_offset;
    d_out = static_cast<const Elem*>(p.d_out) + q_offset;
    k = static_cast<const Elem*>(p.k) + kv_offset;
    v = static_cast<const Elem*>(p.v) + kv_offset;
    lse = p.lse + (b * p.num_heads + n) * p.seqlen_q;
    bias_offset = p.bias ? p.bias_strides.offset(b, p.batch_inner, n, 0, 0) : 0;
  }

  // P_ts given q_t.k_s; 0 where (t, s) is hidden or row t saw nothing (lse = -inf). `slope`
  // gets softcap' there (1 without a cap; its value where P is 0 is never used).
  __device__ float prob(const AttentionParams& p, int64_t t, int64_t s, float qk,
                        float& slope) const {
    slope = 1.f;
    if (!vis.visible(t, s) || lse[t] == -INFINITY) return 0.f;
    // The bias and ALiBi's term, both added after the cap.
    float bias =
        p.bias ? variant::AdditiveBias::element(
                     p.bias, p.bias_dtype,
                     bias_offset + t * p.bias_strides.row + s * p.bias_strides.col)
               : 0.f;
    if (p.alibi_slopes != nullptr) bias += alibi.term(t, s);
    if (!soft_cap.present()) return expf(fmaf(qk, p.scale, bias) - lse[t]);
    const float capped = soft_cap.apply(qk * p.scale * kLog2e);  // base 2
    slope = soft_cap.slope(capped);
    return expf(fmaf(capped, kLn2, bias) - lse[t]);
  }
};

template <typename Elem>
__global__ void __launch_bounds__(kWarps * 32)
    backward_dq_kernel(const __grid_constant__ AttentionParams p) {
  extern __shared__ float smem[];  // per warp: q row, dO row, dq row, each [H]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t b = blockIdx.x / p.num_heads, n = blockIdx.x % p.num_heads;
  const int64_t t = int64_t(blockIdx.y) * kWarps + warp;
  if (t >= p.seqlen_q) return;
  const int64_t H = p.head_dim;
  const HeadView<Elem> view(p, b, n);
  float* q_row = smem + warp * 3 * H;
  float* do_row = q_row + H;
  float* dq_row = do_row + H;
  float partial_d = 0.f;
  for (int64_t h = lane; h < H; h += 32) {
    q_row[h] = to_float(view.q[t * p.q_row_stride + h]);
    do_row[h] = to_float(view.d_out[t * p.q_row_stride + h]);
    dq_row[h] = 0.f;
    partial_d = fmaf(do_row[h], to_float(view.out[t * p.q_row_stride + h]), partial_d);
  }
  const float d_t = warp_sum(partial_d);
  __syncwarp();

  float* dbias_row =
      p.dbias ? p.dbias + p.dbias_strides.offset(b, p.batch_inner, n, t, 0) : nullptr;
  int64_t lo, hi;
  view.vis.key_range(t, t + 1, lo, hi);
  variant::VisibleSpans::keys_of_rows(p, b).narrow(t, t + 1, lo, hi);  // ids' or mask's spans
  // A dbias with one writer per element is stored whole, so its row is walked whole (params.h).
  const bool store_row = dbias_row && !p.dbias_accumulates;
  const int64_t begin = store_row ? 0 : lo, end = store_row ? p.seqlen_k : hi;
  for (int64_t base = begin; base < end; base += 32) {
    const int64_t s = base + lane;
    float ds = 0.f, slope = 1.f;
    if (s >= lo && s < hi) {
      const Elem* key = view.k + s * p.kv_row_stride;
      const float prob = view.prob(p, t, s, dot_shared(q_row, key, H), slope);
      if (prob != 0.f) ds = prob * (dot_shared(do_row, view.v + s * p.kv_row_stride, H) - d_t);
    }
    if (dbias_row && s < end) {
      float* element = dbias_row + s * p.dbias_strides.col;
      if (store_row)
        *element = ds;
      else
        ptx::red_add_f32(element, ds);
    }
    accumulate_rows(dq_row, ds * slope * p.scale, view.k + base * p.kv_row_stride,
                    p.kv_row_stride, H, lane);
  }
  Elem* dq = static_cast<Elem*>(p.dq) + b * p.q_batch_stride + n * p.q_head_stride +
             t * p.q_row_stride;
  for (int64_t h = lane; h < H; h += 32) dq[h] = from_float<Elem>(dq_row[h]);
}

// dslopes of the dk/dv kernel: one writer per (block, head), thread 0 of the block, which adds
// the block's sum over its keys: block y's keys [kWarps y, kWarps y + kWarps) start in granule
// kWarps y / kDslopesGranule, whose blocks are writers y % (kDslopesGranule / kWarps).
static_assert(kDslopesGranule % kWarps == 0 && kDslopesGranule / kWarps <= kDslopesWriters,
              "a block's keys lie in one granule, whose blocks each have a writer index");

// Adds the block's sum of |t + shift - s| dS_ts over head n's pairs of its keys (distance_ds,
// each lane's share) into head n's dslopes, negated (dslopes_slots). Every thread of the block
// calls it, for the same heads in the same order. The sum is the same on every run: each warp's
// shuffle sum goes to sums (2 kWarps floats of shared memory) and thread 0 adds them in warp
// order. sums alternates halves between heads: thread 0 reads head n's half before the barrier
// of head n + 1, which the writes of head n + 2 to the same half follow.
__device__ void add_block_dslopes(const AttentionParams& p, int64_t b, int64_t n,
                                  float distance_ds, float* sums) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* half = sums + (n % 2) * kWarps;
  distance_ds = warp_sum(distance_ds);
  if (lane == 0) half[warp] = distance_ds;
  __syncthreads();
  if (threadIdx.x != 0) return;
  float sum = 0.f;
  for (int w = 0; w < kWarps; ++w) sum += half[w];
  const int64_t slot =
      dslopes_slot(int64_t(blockIdx.y) * kWarps, int(blockIdx.y % (kDslopesGranule / kWarps)));
  ptx::red_add_f32(p.dslopes + (b * p.num_heads + n) * dslopes_slots(p.seqlen_k) + slot, -sum);
}

// kDslopes: also dslopes (p.dslopes != nullptr), in an instantiation of its own: with its
// per-head barriers in the one kernel, ptxas (nvcc 13.0) gave every call's kernel 126
// registers instead of 64, half the resident blocks.
template <typename Elem, bool kDslopes>
__global__ void __launch_bounds__(kWarps * 32)
    backward_dkdv_kernel(const __grid_constant__ AttentionParams p) {
  // Per warp: k row, v row, dk row, dv row, each [H]; then, with kDslopes, add_block_dslopes's
  // sums.
  extern __shared__ float smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t b = blockIdx.x / p.num_kv_heads, kv_head = blockIdx.x % p.num_kv_heads;
  const int64_t s = int64_t(blockIdx.y) * kWarps + warp;
  // A warp past the last key has no rows; with kDslopes it stays, for the block's barriers.
  const bool has_key = s < p.seqlen_k;
  if (!kDslopes && !has_key) return;
  const int64_t H = p.head_dim;
  float* k_row = smem + warp * 4 * H;
  float* v_row = k_row + H;
  float* dk_row = v_row + H;
  float* dv_row = dk_row + H;
  float* dslopes_sums = smem + kWarps * 4 * H;
  const int64_t kv_offset = b * p.kv_batch_stride + kv_head * p.kv_head_stride + s * p.kv_row_stride;
  for (int64_t h = lane; has_key && h < H; h += 32) {
    k_row[h] = to_float(static_cast<const Elem*>(p.k)[kv_offset + h]);
    v_row[h] = to_float(static_cast<const Elem*>(p.v)[kv_offset + h]);
    dk_row[h] = dv_row[h] = 0.f;
  }
  __syncwarp();

  // Rows t that may see key s: its entry's lengths and window (moved per entry under
  // align_window_to_lengths); prob() tests each row again.
  int64_t t_lo = 0, t_hi = 0;
  if (has_key) {
    variant::KeyWindow<int64_t>::make(p, b).query_range(s, s + 1, t_lo, t_hi);
    variant::VisibleSpans::rows_of_keys(p, b).narrow(s, s + 1, t_lo, t_hi);  // ids' or mask's spans
  }
  const int64_t group = p.group_size();
  for (int64_t n = kv_head * group; n < (kv_head + 1) * group; ++n) {
    const HeadView<Elem> view(p, b, n);
    float distance_ds = 0.f;  // this lane's share of sum_t |t + shift - s| dS_ts
    for (int64_t base = t_lo; base < t_hi; base += 32) {
      const int64_t t = base + lane;
      float prob = 0.f, ds = 0.f, slope = 1.f;
      if (t < t_hi) {
        const Elem* q_t = view.q + t * p.q_row_stride;
        prob = view.prob(p, t, s, dot_shared(k_row, q_t, H), slope);
        if (prob != 0.f) {
          const Elem* do_t = view.d_out + t * p.q_row_stride;
          ds = prob * (dot_shared(v_row, do_t, H) - dot_global(do_t, view.out + t * p.q_row_stride, H));
          if constexpr (kDslopes)
            distance_ds = fmaf(view.alibi.distance(t, s), ds, distance_ds);
        }
      }
      accumulate_rows(dv_row, prob, view.d_out + base * p.q_row_stride, p.q_row_stride, H, lane);
      accumulate_rows(dk_row, ds * slope * p.scale, view.q + base * p.q_row_stride,
                      p.q_row_stride, H, lane);
    }
    if constexpr (kDslopes) add_block_dslopes(p, b, n, distance_ds, dslopes_sums);
  }
  for (int64_t h = lane; has_key && h < H; h += 32) {
    static_cast<Elem*>(p.dk)[kv_offset + h] = from_float<Elem>(dk_row[h]);
    static_cast<Elem*>(p.dv)[kv_offset + h] = from_float<Elem>(dv_row[h]);
  }
}

template <typename Elem>
cudaError_t launch(const AttentionParams& p, cudaStream_t stream) {
  constexpr auto dq_kernel = backward_dq_kernel<Elem>;
  constexpr auto dkdv_kernel = backward_dkdv_kernel<Elem, false>;
  constexpr auto dkdv_dslopes_kernel = backward_dkdv_kernel<Elem, true>;
  const bool dslopes = p.dslopes != nullptr;
  const int64_t dq_smem = kWarps * 3 * p.head_dim * int64_t(sizeof(float));
  const int64_t dkdv_smem =
      (kWarps * 4 * p.head_dim + (dslopes ? 2 * kWarps : 0)) * int64_t(sizeof(float));
  if (dkdv_smem > kMaxSmemBytes) return cudaErrorInvalidValue;
  if (cudaError_t e = ensure_smem_limit<dq_kernel>(int(kMaxSmemBytes)); e != cudaSuccess) return e;
  if (cudaError_t e = dslopes ? ensure_smem_limit<dkdv_dslopes_kernel>(int(kMaxSmemBytes))
                              : ensure_smem_limit<dkdv_kernel>(int(kMaxSmemBytes));
      e != cudaSuccess)
    return e;
  const int64_t q_blocks = (p.seqlen_q + kWarps - 1) / kWarps;
  const int64_t kv_blocks = (p.seqlen_k + kWarps - 1) / kWarps;
  if (q_blocks > 65535 || kv_blocks > 65535 || p.batch * p.num_heads > 0x7fffffff)
    return cudaErrorInvalidConfiguration;
  dq_kernel<<<dim3(unsigned(p.batch * p.num_heads), unsigned(q_blocks)), kWarps * 32, dq_smem,
              stream>>>(p);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  (dslopes ? dkdv_dslopes_kernel : dkdv_kernel)<<<
      dim3(unsigned(p.batch * p.num_kv_heads), unsigned(kv_blocks)), kWarps * 32, dkdv_smem,
      stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_backward_simt(const AttentionParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.seqlen_q == 0 || p.seqlen_k == 0) return cudaSuccess;
  switch (p.dtype) {
    case ElemType::kBFloat16: return launch<__nv_bfloat16>(p, stream);
    case ElemType::kFloat16: return launch<__half>(p, stream);
    default: return launch<float>(p, stream);
  }
}

}  // namespace jax_flashattn::cuda
