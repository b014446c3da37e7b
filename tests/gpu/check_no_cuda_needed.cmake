# Fails when the ELF file LIB lists a CUDA library in DT_NEEDED.
find_program(READELF readelf REQUIRED)
execute_process(COMMAND ${READELF} -d ${LIB} OUTPUT_VARIABLE dyn
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "readelf -d ${LIB} failed")
endif()
if(NOT dyn MATCHES "NEEDED")
  message(FATAL_ERROR "no NEEDED entries in ${LIB}: not a dynamic library?")
endif()
string(REGEX MATCHALL "\\[lib(cudart|cublas|cublasLt|cuda|nccl)[^]]*\\]" bad
  "${dyn}")
if(bad)
  message(FATAL_ERROR "${LIB} needs ${bad}; CUDA must stay optional")
endif()
message(STATUS "${LIB}: no CUDA library in DT_NEEDED")
