# Backend helpers. The CPU backend is always built (it is part of xctx_kernels); the CUDA parts
# are added by xctx_add_cuda_parts().

function(xctx_resolve_cuda)
  set(use OFF)
  if(XCTX_CUDA STREQUAL "AUTO" OR XCTX_CUDA STREQUAL "ON")
    if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
      set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc CACHE FILEPATH "" FORCE)
    endif()
    include(CheckLanguage)
    check_language(CUDA)
    if(CMAKE_CUDA_COMPILER)
      set(use ON)
    elseif(XCTX_CUDA STREQUAL "ON")
      message(FATAL_ERROR "XCTX_CUDA=ON but no nvcc was found (looked on PATH and /usr/local/cuda)")
    endif()
  endif()
  set(XCTX_USE_CUDA ${use} PARENT_SCOPE)
  message(STATUS "xctx: CUDA backend ${use}")
endfunction()

# Adds the CUDA parts: xctx_kernels_cuda (kernels/cuda/*.cu: the CUDA backend, on the kernels
# interface) and xctx_comm_nccl (comm/nccl.cu: the NCCL communicator), linked by the registry.
# A macro, not a function: enable_language() must run in the directory scope, or the CUDA
# rule variables it defines (CMAKE_CUDA_COMPILE_OBJECT, ...) vanish with the function scope.
# The default architectures are set before enable_language(), which would otherwise fill in
# the compiler's own default.
macro(xctx_add_cuda_parts)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES OR CMAKE_CUDA_ARCHITECTURES STREQUAL "")
    set(CMAKE_CUDA_ARCHITECTURES 80 90 CACHE STRING "CUDA architectures of the xctx kernels" FORCE)
  endif()
  # Shared cudart for every target from here on (tests link the CUDA objects with the C++
  # linker), matching CUDA::cudart below; otherwise cudart_static is linked alongside it.
  set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  # CMake < 3.26 knows no C++20 flag for nvcc (CUDA_STANDARD 20 then fails to generate); nvcc
  # >= 12 accepts -std=c++20, so teach it.
  if(NOT DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION OR CMAKE_CUDA20_STANDARD_COMPILE_OPTION STREQUAL "")
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  endif()
  find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64 REQUIRED)
  file(GLOB xctx_cu_sources CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/kernels/cuda/*.cu)
  xctx_add_part(kernels_cuda SOURCES ${xctx_cu_sources} USES xctx_kernels CUDA::cudart CUDA::cublas)
  xctx_add_part(comm_nccl SOURCES ${PROJECT_SOURCE_DIR}/comm/nccl.cu USES xctx_comm xctx_kernels CUDA::cudart
                ${NCCL_LIBRARY})
  foreach(xctx_cuda_part xctx_kernels_cuda xctx_comm_nccl)
    set_target_properties(${xctx_cuda_part} PROPERTIES CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON
      CUDA_EXTENSIONS OFF CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}" POSITION_INDEPENDENT_CODE ON
      CUDA_SEPARABLE_COMPILATION OFF)
    target_compile_options(${xctx_cuda_part} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo>)
  endforeach()
endmacro()
