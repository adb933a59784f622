# check_sym_wgmma_ptxas.cmake — compiles the fused symmetric kernel (src/cuda/sym_wgmma.cu) for
# sm_90a with ptxas' verbose report and fails where ptxas says it serialized the wgmma
# instructions (C7510-C7520 "Potential Performance Loss": that costs the kernel about a fifth of
# its speed and shows in no other output), or where the kernel launches with more than 168 registers
# per thread (its 384-thread blocks then fail to launch). Needs no GPU. Run by ctest (cmake -P) with
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
if(NOT _regs)
  message(FATAL_ERROR "no register report from ptxas:\n${_out}${_err}")
endif()
foreach(r IN LISTS _regs)
  string(REGEX MATCH "[0-9]+" n "${r}")
  if(n GREATER 168)
    message(FATAL_ERROR "sym_wgmma kernel uses ${n} registers: a 384-thread block cannot launch above 168")
  endif()
endforeach()
message(STATUS "wgmma pipelines intact, registers within 168 (${_regs})")
