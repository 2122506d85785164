# The CUDA part: found or skipped per JAX_FLASHATTN_CUDA, architectures per
# JAX_FLASHATTN_CUDA_ARCHS, linked statically against cudart so the module needs only the driver.
include(CheckLanguage)

if(JAX_FLASHATTN_CUDA STREQUAL "OFF")
  message(STATUS "jax_flashattn: CUDA kernels disabled (JAX_FLASHATTN_CUDA=OFF)")
  return()
endif()

# Pick the architectures before enable_language(CUDA), which would otherwise probe its own.
if(JAX_FLASHATTN_CUDA_ARCHS)
  set(_archs "${JAX_FLASHATTN_CUDA_ARCHS}")
elseif(DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(_archs "${CMAKE_CUDA_ARCHITECTURES}")
else()
  execute_process(COMMAND nvidia-smi --query-gpu=compute_cap --format=csv,noheader
                  OUTPUT_VARIABLE _caps RESULT_VARIABLE _smi_failed ERROR_QUIET
                  OUTPUT_STRIP_TRAILING_WHITESPACE)
  set(_archs "")
  if(NOT _smi_failed AND _caps)
    string(REPLACE "\n" ";" _caps "${_caps}")
    foreach(_cap IN LISTS _caps)
      string(REPLACE "." "" _arch "${_cap}")
      # Hopper's wgmma/setmaxnreg exist only in the arch-specific sm_90a target.
      if(_arch STREQUAL "90")
        set(_arch "90a")
      endif()
      list(APPEND _archs "${_arch}")
    endforeach()
    list(REMOVE_DUPLICATES _archs)
  endif()
  if(NOT _archs)
    set(_archs "80;90a")
  endif()
endif()
set(CMAKE_CUDA_ARCHITECTURES "${_archs}")

check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  if(JAX_FLASHATTN_CUDA STREQUAL "ON")
    message(FATAL_ERROR "jax_flashattn: JAX_FLASHATTN_CUDA=ON but no CUDA compiler was found")
  endif()
  message(STATUS "jax_flashattn: no CUDA compiler found, building the CPU kernels only")
  return()
endif()
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
message(STATUS "jax_flashattn: CUDA kernels for architectures ${CMAKE_CUDA_ARCHITECTURES}")

# One translation unit per (element type, head dim) of the mma.sync forward, so a parallel
# build compiles them side by side.
set(_instantiations "")
foreach(_elem_pair "bf16;__nv_bfloat16" "fp16;__half")
  list(GET _elem_pair 0 _tag)
  list(GET _elem_pair 1 ELEM)
  foreach(HEAD_DIM 32 64 96 128 192 256)
    set(_file "${CMAKE_CURRENT_BINARY_DIR}/instantiations/forward_sm80_${_tag}_hd${HEAD_DIM}.cu")
    configure_file(ffi/cuda/instantiations/forward_sm80.cu.in "${_file}" @ONLY)
    list(APPEND _instantiations "${_file}")
  endforeach()
  # The Hopper forward per head dim of sm90::kHeadDims (an empty kernel outside sm_90a).
  foreach(HEAD_DIM 64 128 256)
    set(_file "${CMAKE_CURRENT_BINARY_DIR}/instantiations/forward_sm90_${_tag}_hd${HEAD_DIM}.cu")
    configure_file(ffi/cuda/instantiations/forward_sm90.cu.in "${_file}" @ONLY)
    list(APPEND _instantiations "${_file}")
  endforeach()
  # The split-KV decode forward per head dim of sm80::kDecodeHeadDims.
  foreach(HEAD_DIM 64 128 256)
    set(_file "${CMAKE_CURRENT_BINARY_DIR}/instantiations/decode_sm80_${_tag}_hd${HEAD_DIM}.cu")
    configure_file(ffi/cuda/instantiations/decode_sm80.cu.in "${_file}" @ONLY)
    list(APPEND _instantiations "${_file}")
  endforeach()
  # The Hopper decode forward per head dim of sm90::kDecodeHeadDims (an empty kernel outside
  # sm_90a).
  foreach(HEAD_DIM 64 128)
    set(_file "${CMAKE_CURRENT_BINARY_DIR}/instantiations/decode_sm90_${_tag}_hd${HEAD_DIM}.cu")
    configure_file(ffi/cuda/instantiations/decode_sm90.cu.in "${_file}" @ONLY)
    list(APPEND _instantiations "${_file}")
  endforeach()
  # The mma.sync backward (dK/dV pass and dQ pass) per head dim of sm80::kBackwardHeadDims.
  foreach(HEAD_DIM 32 64 96 128)
    set(_file "${CMAKE_CURRENT_BINARY_DIR}/instantiations/backward_sm80_${_tag}_hd${HEAD_DIM}.cu")
    configure_file(ffi/cuda/instantiations/backward_sm80.cu.in "${_file}" @ONLY)
    list(APPEND _instantiations "${_file}")
  endforeach()
  # The Hopper backward per head dim of sm90::kBackwardHeadDims (an empty kernel outside sm_90a).
  foreach(HEAD_DIM 64 128)
    set(_file "${CMAKE_CURRENT_BINARY_DIR}/instantiations/backward_sm90_${_tag}_hd${HEAD_DIM}.cu")
    configure_file(ffi/cuda/instantiations/backward_sm90.cu.in "${_file}" @ONLY)
    list(APPEND _instantiations "${_file}")
  endforeach()
endforeach()

# The CUDA kernels and their dispatch (nothing from XLA: see flashattn_cpu_kernels), and the
# handlers, which decode XLA's call frames.
add_library(flashattn_cuda_kernels STATIC
  ffi/cuda/dispatch_forward.cu
  ffi/cuda/dispatch_backward.cu
  ffi/cuda/copy_bandwidth.cu
  ffi/cuda/simt/forward_simt.cu
  ffi/cuda/simt/backward_simt.cu
  ffi/cuda/sm90/tensor_maps.cu
  ${_instantiations})
target_link_libraries(flashattn_cuda_kernels PUBLIC flashattn_cpu_kernels CUDA::cudart_static)
add_library(flashattn_cuda STATIC ffi/handlers_cuda.cu)
target_link_libraries(flashattn_cuda PUBLIC flashattn_cpu flashattn_cuda_kernels)
# The Hopper kernels run only from an sm_90a image: the dispatcher offers them when the build
# has one ("90a", "90a-real", "90a-virtual") and no plain sm_90 image the driver might load
# instead (whose copy of those kernels is empty).
set(_has_90a FALSE)
set(_has_90 FALSE)
foreach(_arch IN LISTS CMAKE_CUDA_ARCHITECTURES)
  if(_arch MATCHES "^90a($|-)")
    set(_has_90a TRUE)
  elseif(_arch MATCHES "^90($|-)")
    set(_has_90 TRUE)
  endif()
endforeach()
if(_has_90a AND NOT _has_90)
  target_compile_definitions(flashattn_cuda_kernels PRIVATE JAX_FLASHATTN_HAS_SM90A)
endif()
foreach(_target flashattn_cuda_kernels flashattn_cuda)
  target_compile_options(${_target} PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -Xptxas=-warn-spills>)
endforeach()

target_link_libraries(_jax_flashattn PRIVATE flashattn_cuda)
# Commas, not CMake's semicolons, which a compiler command line would split on.
string(REPLACE ";" "," _archs_csv "${CMAKE_CUDA_ARCHITECTURES}")
target_compile_definitions(_jax_flashattn PRIVATE
  JAX_FLASHATTN_WITH_CUDA JAX_FLASHATTN_CUDA_ARCHS="${_archs_csv}")
