# check_wgmma_not_serialized.cmake — compiles the fused symmetric kernel (src/cuda/sym_wgmma.cu)
# for sm_90a with ptxas' verbose report and fails where ptxas says it serialized the wgmma
# instructions (C7510-C7520 "Potential Performance Loss"): that costs the kernel about a fifth of
# its speed and shows in no other output. Needs no GPU. Run by ctest (cmake -P) with
#   -DNVCC=<nvcc> -DSOURCE=<sym_wgmma.cu> -DINCLUDES="<dir>;<dir>" -DGENCODE=<-gencode=...>
set(_inc "")
foreach(d IN LISTS INCLUDES)
  list(APPEND _inc "-I${d}")
endforeach()
execute_process(
  COMMAND "${NVCC}" -std=c++20 --expt-relaxed-constexpr -O3 ${GENCODE} ${_inc} -Xptxas -v -c "${SOURCE}" -o /dev/null
  OUTPUT_VARIABLE _out ERROR_VARIABLE _err RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "nvcc failed (${_rc}):\n${_err}")
endif()
string(REGEX MATCHALL "[^\n]*Potential Performance Loss[^\n]*" _loss "${_out}${_err}")
if(_loss)
  string(REPLACE ";" "\n" _loss "${_loss}")
  message(FATAL_ERROR "ptxas serialized wgmma in ${SOURCE}:\n${_loss}")
endif()
string(REGEX MATCHALL "Used [0-9]+ registers" _regs "${_out}${_err}")
message(STATUS "wgmma pipelines intact (${_regs})")
