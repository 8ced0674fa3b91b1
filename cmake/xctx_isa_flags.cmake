# The per-file ISA flags of the run-time dispatched CPU kernels in kernels/cpu/ and its rooms: each file named
# *_<isa>.cpp is compiled for that ISA and entered only after the matching cpu::has_*() check, so
# the binary stays portable. Source-file properties are per directory: every directory whose
# targets compile these files (the top level, fuzz/) calls xctx_apply_isa_flags().
#   *_avx2.cpp     AVX2 + FMA + F16C                                    cpu::has_avx2()
#   *_avx512.cpp   + AVX-512 F/BW/VL/DQ + VBMI + VNNI                   cpu::has_avx512()
#   *_amx.cpp      the AVX-512 set (no VBMI) + AMX-TILE + AMX-INT8       cpu::has_amx()
#   *_avxvnni.cpp  AVX2 + AVX-VNNI (256-bit VEX dot products)           cpu::has_avx_vnni()
function(xctx_apply_isa_flags kernels_dir)
  set(avx2 -mavx2 -mfma -mf16c)
  set(avx512 ${avx2} -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni)
  foreach(pair "avx2|${avx2}" "avx512|${avx512};-mavx512vbmi" "amx|${avx512};-mamx-tile;-mamx-int8"
               "avxvnni|${avx2};-mavxvnni")
    string(REPLACE "|" ";" parts "${pair}")
    list(POP_FRONT parts suffix)
    file(GLOB sources CONFIGURE_DEPENDS ${kernels_dir}/*_${suffix}.cpp ${kernels_dir}/*/*_${suffix}.cpp)
    set_property(SOURCE ${sources} APPEND PROPERTY COMPILE_OPTIONS ${parts})
  endforeach()
endfunction()
