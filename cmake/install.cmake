# cmake/install.cmake — `cmake --install`: the public headers, libdion3.so.<soversion> and libdion3.a,
# the CMake package (find_package(dion3): dion3::dion3, dion3::dion3_static) and dion3.pc for
# pkg-config. Both are relocatable: they locate the prefix from where they are installed.
include(CMakePackageConfigHelpers)

set(DION3_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/dion3)
install(TARGETS dion3 dion3_shared EXPORT dion3Targets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY include/dion3 DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(FILES LICENSE README.md DESTINATION ${CMAKE_INSTALL_DOCDIR})
install(EXPORT dion3Targets NAMESPACE dion3:: DESTINATION ${DION3_CMAKE_DIR})
configure_package_config_file(cmake/dion3Config.cmake.in ${CMAKE_CURRENT_BINARY_DIR}/dion3Config.cmake
                              INSTALL_DESTINATION ${DION3_CMAKE_DIR})
# Before 1.0 a minor release may break the API.
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/dion3ConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/dion3Config.cmake ${CMAKE_CURRENT_BINARY_DIR}/dion3ConfigVersion.cmake
        DESTINATION ${DION3_CMAKE_DIR})

# dion3.pc. Libs.private: what linking the static library needs besides it, as -L/-l flags.
function(dion3_pc_link_flags out)
  set(flags)
  foreach(item ${ARGN})
    if(item MATCHES "^(.*)/lib([^/]+)\\.(so|a)(\\.[0-9.]+)?$")
      if(NOT CMAKE_MATCH_1 IN_LIST CMAKE_C_IMPLICIT_LINK_DIRECTORIES)
        list(APPEND flags "-L${CMAKE_MATCH_1}")
      endif()
      list(APPEND flags "-l${CMAKE_MATCH_2}")
    elseif(item MATCHES "^-")
      list(APPEND flags "${item}")
    elseif(item)
      list(APPEND flags "-l${item}")
    endif()
  endforeach()
  set(${out} ${flags} PARENT_SCOPE)
endfunction()
set(_pc_libs ${BLAS_LIBRARIES} ${BLAS_LINKER_FLAGS})
if(OpenMP_CXX_FOUND)
  list(APPEND _pc_libs ${OpenMP_CXX_FLAGS})
endif()
if(MPI_C_FOUND)
  list(APPEND _pc_libs ${MPI_C_LIBRARIES})
endif()
set(DION3_PC_CUDA "")
if(DION3_CUDA)
  set(DION3_PC_CUDA " and CUDA")
  list(APPEND _pc_libs -L${CUDAToolkit_LIBRARY_DIR} cudart cublas cublasLt)
  if(DION3_NCCL_INCLUDE AND DION3_NCCL_LIBRARY)
    list(APPEND _pc_libs ${DION3_NCCL_LIBRARY})
  endif()
endif()
list(APPEND _pc_libs stdc++ m)
dion3_pc_link_flags(_pc_flags ${_pc_libs})
list(REMOVE_DUPLICATES _pc_flags)
list(JOIN _pc_flags " " DION3_PC_LIBS_PRIVATE)
file(RELATIVE_PATH DION3_PC_TO_PREFIX /prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig /prefix)
configure_file(cmake/dion3.pc.in ${CMAKE_CURRENT_BINARY_DIR}/dion3.pc @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/dion3.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
