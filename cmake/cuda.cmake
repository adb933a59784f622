# cmake/cuda.cmake — the CUDA backend of dion3 (included by the top-level CMakeLists when
# -DDION3_CUDA=ON): enables CUDA, adds src/cuda/*.cu to the library's objects (`dion3_objects`),
# links cuBLAS/cuBLASLt, and builds the CUDA benchmark programs (bench/cuda_*.cu;
# dion3-cuda-sym-bench compares the fused symmetric kernel sym_wgmma.cu with cuBLAS).
#
# Architectures: Hopper's sm_90a by default (wgmma needs the "a" target, written with -gencode).
# Override with -DDION3_CUDA_GENCODE="-gencode=..." or with
# -DCMAKE_CUDA_ARCHITECTURES=<list> (then CMake's own flags are used instead).
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES OR CMAKE_CUDA_ARCHITECTURES STREQUAL "")
  # Leave CMake's architecture flags off and pass our -gencode explicitly.
  set(CMAKE_CUDA_ARCHITECTURES OFF)
  set(DION3_CUDA_GENCODE "-gencode=arch=compute_90a,code=sm_90a" CACHE STRING
      "nvcc -gencode flags of the CUDA backend")
else()
  set(DION3_CUDA_GENCODE "" CACHE STRING "nvcc -gencode flags of the CUDA backend")
endif()

enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
# C++20 for device code too (targets inherit CXX_STANDARD 20). Older CMake (3.25) has no CUDA20
# dialect flags for nvcc 13: supply them.
if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
endif()
set(_dion3_cuda_flags --expt-relaxed-constexpr -lineinfo)

set(DION3_CUDA_SOURCES
  ${CMAKE_CURRENT_SOURCE_DIR}/src/cuda/cuda_backend.cu
  ${CMAKE_CURRENT_SOURCE_DIR}/src/cuda/step_kernels.cu
  ${CMAKE_CURRENT_SOURCE_DIR}/src/cuda/column_kernels.cu
  ${CMAKE_CURRENT_SOURCE_DIR}/src/cuda/elementwise_kernels.cu
  ${CMAKE_CURRENT_SOURCE_DIR}/src/cuda/symmetric.cu
  ${CMAKE_CURRENT_SOURCE_DIR}/src/cuda/sym_wgmma.cu
)
target_sources(dion3_objects PRIVATE ${DION3_CUDA_SOURCES})
separate_arguments(_dion3_gencode UNIX_COMMAND "${DION3_CUDA_GENCODE}")
# `dion3_objects` was created before this file ran, so it did not pick up CMAKE_CUDA_ARCHITECTURES.
set_target_properties(dion3_objects PROPERTIES CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}")
target_compile_options(dion3_objects PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${_dion3_gencode} ${_dion3_cuda_flags}>)
target_compile_definitions(dion3_objects PUBLIC DION3_HAVE_CUDA=1)
target_link_libraries(dion3_objects PUBLIC CUDA::cudart CUDA::cublas CUDA::cublasLt)
list(APPEND DION3_LINK_DEPS CUDA::cudart CUDA::cublas CUDA::cublasLt)
# NCCL for the native GPU communicator (src/comm/nccl.cpp), where the toolkit or the system has it.
# DION3_NCCL_ROOT: a prefix with include/nccl.h and lib/libnccl.so[.2] (e.g. the nvidia-nccl wheel's).
find_path(DION3_NCCL_INCLUDE nccl.h HINTS ${DION3_NCCL_ROOT}/include ${CUDAToolkit_INCLUDE_DIRS} /usr/include)
find_library(DION3_NCCL_LIBRARY NAMES nccl libnccl.so.2
             HINTS ${DION3_NCCL_ROOT}/lib ${CUDAToolkit_LIBRARY_DIR} /usr/lib/x86_64-linux-gnu)
if(DION3_NCCL_INCLUDE AND DION3_NCCL_LIBRARY)
  target_include_directories(dion3_objects PUBLIC ${DION3_NCCL_INCLUDE})
  target_link_libraries(dion3_objects PUBLIC ${DION3_NCCL_LIBRARY})
  list(APPEND DION3_LINK_DEPS ${DION3_NCCL_LIBRARY})
  target_compile_definitions(dion3_objects PUBLIC DION3_HAVE_NCCL=1)
  message(STATUS "dion3: NCCL communicator (${DION3_NCCL_LIBRARY})")
else()
  message(STATUS "dion3: no NCCL found; the NCCL communicator is not built")
endif()

# Flags for other CUDA targets (tests, benchmarks) that compile .cu files.
function(dion3_cuda_target tgt)
  set_target_properties(${tgt} PROPERTIES CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}")
  target_compile_options(${tgt} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${_dion3_gencode} ${_dion3_cuda_flags}>)
endfunction()

# A CUDA benchmark program: its sources under bench/, the library and the CUDA runtime.
function(dion3_cuda_bench tgt)
  list(TRANSFORM ARGN PREPEND ${CMAKE_CURRENT_SOURCE_DIR}/bench/)
  add_executable(${tgt} ${ARGN})
  target_include_directories(${tgt} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/bench ${CMAKE_CURRENT_SOURCE_DIR}/src)
  target_link_libraries(${tgt} PRIVATE dion3 CUDA::cudart)
  dion3_cuda_target(${tgt})
endfunction()

if(DION3_BENCH)
  dion3_cuda_bench(dion3-cuda-bench cuda_orth_bench.cu)
  dion3_cuda_bench(dion3-cuda-sym-bench cuda_sym_bench.cu)
  dion3_cuda_bench(dion3-cuda-step-bench cuda_step_bench.cu model_shapes.cpp)
  dion3_cuda_bench(dion3-cuda-overlap-probe cuda_overlap_probe.cu)
  dion3_cuda_bench(dion3-cuda-pass-bench cuda_pass_bench.cu model_shapes.cpp)
  dion3_cuda_bench(dion3-cuda-power-probe cuda_power_probe.cu)
  target_link_libraries(dion3-cuda-power-probe PRIVATE CUDA::cublas ${CMAKE_DL_LIBS})
  target_link_libraries(dion3-cuda-step-bench PRIVATE ${CMAKE_DL_LIBS})
endif()

# The CUTLASS experiment (bench/cuda_cutlass_bench.cu), only where CUTLASS's headers are given:
# -DDION3_CUTLASS_INCLUDE=.deps/cutlass/include after tools/fetch-cutlass.
set(DION3_CUTLASS_INCLUDE "" CACHE PATH "CUTLASS/CuTe headers for dion3-cuda-cutlass-bench (empty: not built)")
if(DION3_BENCH AND DION3_CUTLASS_INCLUDE)
  if(NOT EXISTS "${DION3_CUTLASS_INCLUDE}/cutlass/cutlass.h" OR NOT EXISTS "${DION3_CUTLASS_INCLUDE}/cutlass/util/packed_stride.hpp")
    message(FATAL_ERROR "DION3_CUTLASS_INCLUDE=${DION3_CUTLASS_INCLUDE} holds no CUTLASS headers (run tools/fetch-cutlass; "
                        "give an absolute path)")
  endif()
  dion3_cuda_bench(dion3-cuda-cutlass-bench cuda_cutlass_bench.cu)
  target_include_directories(dion3-cuda-cutlass-bench SYSTEM PRIVATE ${DION3_CUTLASS_INCLUDE})
  target_link_libraries(dion3-cuda-cutlass-bench PRIVATE CUDA::cublas)
endif()
