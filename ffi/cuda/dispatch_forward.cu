// Picks the forward kernel for a call: on Hopper the TMA + wgmma kernel where it applies, else
// the mma.sync family for bf16/fp16 with head dims that are a multiple of 8 up to 256 (on the
// smallest instantiated head dim that holds it), the CUDA-core kernel for everything else.
// A scale <= 0 also takes the CUDA-core kernel: the tensor-core softmax takes the row maximum
// before scaling and multiplies masked (-inf) scores by the scale, which needs scale > 0.
// Decoding shapes (few query rows per kv head, a long key sequence; ffi/decode_plan.h) take
// a split-KV decode kernel on every architecture, ahead of the others, when the call's
// workspace holds its splits: on Hopper the wgmma one where it applies
// (wgmma::decode_kernel_applies), else the mma.sync one (soft-capped calls, and calls with a
// bias, boolean mask, ALiBi or segment ids, on their instantiations for those); calls with a
// soft-cap beside those terms keep the normal kernels. Calls with one of a soft-cap,
// segment ids, or the elementwise terms (bias, mask, ALiBi) take the Hopper kernel's
// instantiations for it; with two of them, the mma.sync family. Why in this order:
// docs/decisions/kernel-family-dispatch.md.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <iterator>
#include <type_traits>

#include "ffi/cuda/common/tensor_maps.h"
#include "ffi/cuda/decode/mma_sync_traits.h"
#include "ffi/cuda/decode/wgmma_traits.h"
#include "ffi/cuda/dispatch.h"
#include "ffi/cuda/hopper_availability.h"
#include "ffi/cuda/launch.h"
#include "ffi/cuda/mma_sync/traits.h"
#include "ffi/cuda/wgmma/traits.h"
#include "ffi/decode_plan.h"

namespace jax_flashattn::cuda {
namespace {

template <typename Elem>
cudaError_t launch_sm80_for_head_dim(const AttentionParams& p, bool tma_kv, cudaStream_t stream) {
  return for_head_dim<mma_sync::kHeadDims>(p.head_dim, [&](auto h) {
    return launch_forward_sm80<Elem, decltype(h)::value>(p, tma_kv, stream);
  });
}

template <typename Elem>
cudaError_t launch_sm90_for_head_dim(const AttentionParams& p, cudaStream_t stream) {
  if (p.e4m3_attention)
    return for_head_dim<wgmma::kE4m3HeadDims>(p.head_dim, [&](auto h) {
      return launch_forward_sm90_e4m3<Elem, decltype(h)::value>(p, stream);
    });
  return for_head_dim<wgmma::kHeadDims>(p.head_dim, [&](auto h) {
    return launch_forward_sm90<Elem, decltype(h)::value>(p, stream);
  });
}

// FP8 attention: the Hopper forward's e4m3 configurations, or none.
bool e4m3_sm90_applies(const AttentionParams& p, int device) {
  const int64_t max_head_dim = wgmma::kE4m3HeadDims[std::size(wgmma::kE4m3HeadDims) - 1];
  return p.tile_counter != nullptr && p.k_descale != nullptr && p.v_descale != nullptr &&
         !p.soft_capped() && !p.has_elementwise_terms() && p.q_segment_ids == nullptr &&
         p.page_table == nullptr && p.head_dim % 16 == 0 && p.head_dim <= max_head_dim &&
         wgmma::e4m3_tma_compatible(p) && wgmma::hopper_kernels_apply(p, device);
}

// Calls f(capped, terms), two std::bool_constant, with the decode instantiation the call takes:
// the soft-cap's, the elementwise terms' (bias, mask, ALiBi, segment ids: decode_has_terms;
// never both: decode_shape_fits), or the plain one.
template <typename F>
auto with_decode_variant(const AttentionParams& p, F&& f) {
  if (p.soft_capped()) return f(std::true_type{}, std::false_type{});
  if (mma_sync::decode_has_terms(p)) return f(std::false_type{}, std::true_type{});
  return f(std::false_type{}, std::false_type{});
}

template <typename Elem>
cudaError_t launch_decode_sm90_for_head_dim(const AttentionParams& p,
                                            const mma_sync::DecodePlan& plan,
                                            cudaStream_t stream) {
  if (p.k_descale != nullptr)
    return for_head_dim<wgmma::kDecodeHeadDims>(p.head_dim, [&](auto h) {
      return launch_forward_decode_sm90_fp8<Elem, decltype(h)::value>(p, plan, stream);
    });
  return for_head_dim<wgmma::kDecodeHeadDims>(p.head_dim, [&](auto h) {
    return with_decode_variant(p, [&](auto capped, auto terms) {
      return launch_forward_decode_sm90<Elem, decltype(h)::value, decltype(capped)::value,
                                        decltype(terms)::value>(p, plan, stream);
    });
  });
}

// decode_shape_fits admits head dims up to kDecodeMaxHeadDim, and for_head_dim runs the
// largest instantiation past the list: the two limits must be one.
static_assert(mma_sync::kDecodeHeadDims[std::size(mma_sync::kDecodeHeadDims) - 1] ==
                  mma_sync::kDecodeMaxHeadDim,
              "the mma.sync decode kernel's largest head dim is the decode shape limit");

template <typename Elem>
cudaError_t launch_decode_for_head_dim(const AttentionParams& p, const mma_sync::DecodePlan& plan,
                                       cudaStream_t stream) {
  if (p.k_descale != nullptr)
    return for_head_dim<mma_sync::kDecodeHeadDims>(p.head_dim, [&](auto h) {
      return launch_forward_decode_fp8<Elem, decltype(h)::value>(p, plan, stream);
    });
  return for_head_dim<mma_sync::kDecodeHeadDims>(p.head_dim, [&](auto h) {
    return with_decode_variant(p, [&](auto capped, auto terms) {
      return launch_forward_decode<Elem, decltype(h)::value, decltype(capped)::value,
                                   decltype(terms)::value>(p, plan, stream);
    });
  });
}

// Whether the decode call (on the wgmma kernel with sm90) merges its splits in clusters on CUDA
// device `device`, the current one: asked of the kernel the call runs (soft-capped calls and
// calls with a bias, mask or ALiBi have instantiations of their own, whose residency may
// differ).
template <typename Elem>
bool decode_merges_in_cluster(bool sm90, const AttentionParams& p, const mma_sync::DecodePlan& plan,
                              int device) {
  if (p.k_descale != nullptr) {
    if (sm90)
      return for_head_dim<wgmma::kDecodeHeadDims>(p.head_dim, [&](auto h) {
        return forward_decode_sm90_fp8_merges_in_cluster<Elem, decltype(h)::value>(plan, device);
      });
    return for_head_dim<mma_sync::kDecodeHeadDims>(p.head_dim, [&](auto h) {
      return forward_decode_fp8_merges_in_cluster<Elem, decltype(h)::value>(plan, device);
    });
  }
  return with_decode_variant(p, [&](auto capped, auto terms) {
    constexpr bool kSoftCap = decltype(capped)::value, kTerms = decltype(terms)::value;
    if (sm90)
      return for_head_dim<wgmma::kDecodeHeadDims>(p.head_dim, [&](auto h) {
        return forward_decode_sm90_merges_in_cluster<Elem, decltype(h)::value, kSoftCap, kTerms>(
            p, plan, device);
      });
    return for_head_dim<mma_sync::kDecodeHeadDims>(p.head_dim, [&](auto h) {
      return forward_decode_merges_in_cluster<Elem, decltype(h)::value, kSoftCap, kTerms>(
          p, plan, device);
    });
  });
}

// The decode kernel's plan for this call on CUDA device `device`; false when it does not apply.
bool decode_plan_for(const AttentionParams& p, int device, mma_sync::DecodePlan& plan) {
  int multiprocessors = 0;
  return mma_sync::decode_shape_fits(p) &&
         multiprocessor_count(device, multiprocessors) == cudaSuccess &&
         mma_sync::make_decode_plan(p, multiprocessors, plan);
}

// decode_plan_for for a call that takes decode kernel `kernel` (kDecode or kDecodeSm90), with
// its merge and block shape decided (plan.cluster_merge, plan.splits_per_block): the one place
// the launch and decode_layout ask. One split per block where its clusters are resident or
// the combine is the only way; on the wgmma kernel, two splits per block where that makes the
// clusters resident (an even split count; decode/wgmma_traits.h).
bool decode_plan_with_merge(const AttentionParams& p, int device, ForwardKernel kernel,
                            mma_sync::DecodePlan& plan) {
  if (!decode_plan_for(p, device, plan)) return false;
  const bool sm90 = kernel == ForwardKernel::kDecodeSm90;
  const auto merges = [&](const mma_sync::DecodePlan& candidate) {
    return p.dtype == ElemType::kBFloat16
               ? decode_merges_in_cluster<__nv_bfloat16>(sm90, p, candidate, device)
               : decode_merges_in_cluster<__half>(sm90, p, candidate, device);
  };
  plan.cluster_merge = merges(plan);
  if (sm90 && !plan.cluster_merge && plan.splits % 2 == 0) {
    mma_sync::DecodePlan paired = plan;
    paired.splits_per_block = 2;
    if (merges(paired)) {
      plan = paired;
      plan.cluster_merge = true;
    }
  }
  return true;
}

bool sm90_applies(const AttentionParams& p, int device) {
  const int64_t max_head_dim = wgmma::kHeadDims[std::size(wgmma::kHeadDims) - 1];
  // Instantiations for a soft-cap, for segment ids, and for a bias, mask or ALiBi; not for two
  // of them.
  const int variants = int(p.soft_capped()) + int(p.q_segment_ids != nullptr) +
                       int(p.has_elementwise_terms());
  return p.tile_counter != nullptr && variants <= 1 && wgmma::bias_and_mask_fit(p) &&
         p.head_dim <= max_head_dim &&
         wgmma::tma_compatible(p) && wgmma::segment_ids_tma_compatible(p) &&
         wgmma::hopper_kernels_apply(p, device);
}

}  // namespace

ForwardKernel choose_forward_kernel(const AttentionParams& p, int device) {
  const bool tensor_core_dtype = p.dtype == ElemType::kBFloat16 || p.dtype == ElemType::kFloat16;
  const int64_t max_head_dim = mma_sync::kHeadDims[std::size(mma_sync::kHeadDims) - 1];
  if (!tensor_core_dtype || p.head_dim <= 0 || p.head_dim % 8 != 0 ||
      p.head_dim > max_head_dim || !(p.scale > 0.f))
    return ForwardKernel::kSimt;
  // FP8 attention: the Hopper forward's e4m3 configurations, or none (the handler refuses the
  // call).
  if (p.e4m3_attention)
    return e4m3_sm90_applies(p, device) ? ForwardKernel::kSm90 : ForwardKernel::kSimt;
  if (p.k_descale != nullptr) {
    // e4m3 keys and values: a decode kernel's e4m3 configurations, as for 2-byte keys and
    // values, or none (the handler refuses the call).
    mma_sync::DecodePlan plan;
    if (!mma_sync::decode_fp8_kv_fits(p) || !decode_plan_for(p, device, plan))
      return ForwardKernel::kSimt;
    return wgmma::decode_kernel_applies(p, device) ? ForwardKernel::kDecodeSm90
                                                  : ForwardKernel::kDecode;
  }
  if (mma_sync::DecodePlan plan; decode_plan_for(p, device, plan))
    return wgmma::decode_kernel_applies(p, device) ? ForwardKernel::kDecodeSm90
                                                  : ForwardKernel::kDecode;
  return sm90_applies(p, device) ? ForwardKernel::kSm90 : ForwardKernel::kSm80;
}

DecodeLayout decode_layout(const AttentionParams& p, int device, ForwardKernel kernel) {
  mma_sync::DecodePlan plan;
  if ((kernel != ForwardKernel::kDecode && kernel != ForwardKernel::kDecodeSm90) ||
      !decode_plan_with_merge(p, device, kernel, plan))
    return {};
  return {plan.splits, plan.splits_per_block, plan.cluster_merge};
}

cudaError_t launch_forward(const AttentionParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.num_heads == 0 || p.seqlen_q == 0) return cudaSuccess;
  const bool bf16 = p.dtype == ElemType::kBFloat16;
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  switch (choose_forward_kernel(p, device)) {
    case ForwardKernel::kSm90:
      return bf16 ? launch_sm90_for_head_dim<__nv_bfloat16>(p, stream)
                  : launch_sm90_for_head_dim<__half>(p, stream);
    case ForwardKernel::kSm80: {
      const bool tma_kv = wgmma::tma_loads_apply(p, device);
      return bf16 ? launch_sm80_for_head_dim<__nv_bfloat16>(p, tma_kv, stream)
                  : launch_sm80_for_head_dim<__half>(p, tma_kv, stream);
    }
    case ForwardKernel::kSimt:
      return launch_forward_simt(p, stream);
    case ForwardKernel::kDecode: {
      mma_sync::DecodePlan plan;
      if (!decode_plan_with_merge(p, device, ForwardKernel::kDecode, plan))
        return cudaErrorInvalidValue;
      return bf16 ? launch_decode_for_head_dim<__nv_bfloat16>(p, plan, stream)
                  : launch_decode_for_head_dim<__half>(p, plan, stream);
    }
    case ForwardKernel::kDecodeSm90: {
      mma_sync::DecodePlan plan;
      if (!decode_plan_with_merge(p, device, ForwardKernel::kDecodeSm90, plan))
        return cudaErrorInvalidValue;
      return bf16 ? launch_decode_sm90_for_head_dim<__nv_bfloat16>(p, plan, stream)
                  : launch_decode_sm90_for_head_dim<__half>(p, plan, stream);
    }
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_flashattn::cuda
