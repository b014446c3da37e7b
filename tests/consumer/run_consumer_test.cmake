# cmake -P script: install strata into SCRATCH_DIR/prefix, then configure,
# build and run tests/consumer against it (the C++ consumer and the C99
# trainer), once through find_package and once through pkg-config.
file(REMOVE_RECURSE ${SCRATCH_DIR})
set(prefix ${SCRATCH_DIR}/prefix)

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out
    ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  message(STATUS "${out}")
endfunction()

run(${CMAKE_COMMAND} --install ${STRATA_BUILD_DIR} --prefix ${prefix})
run(${CMAKE_COMMAND} -S ${CONSUMER_SOURCE_DIR} -B ${SCRATCH_DIR}/build
    -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build ${SCRATCH_DIR}/build)
foreach(exe consumer train)
  run(${CMAKE_COMMAND} -E env LD_LIBRARY_PATH=${prefix}/lib
      ${SCRATCH_DIR}/build/${exe})
endforeach()

# pkg-config: compile the same consumer by hand from strata.pc's flags.
find_program(PKG_CONFIG pkg-config REQUIRED)
find_program(CXX NAMES c++ g++ REQUIRED)
find_program(CC NAMES cc gcc REQUIRED)
file(GLOB pcdir ${prefix}/lib*/pkgconfig)
execute_process(COMMAND ${CMAKE_COMMAND} -E env PKG_CONFIG_PATH=${pcdir}
  ${PKG_CONFIG} --cflags --libs strata
  OUTPUT_VARIABLE flags OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "pkg-config --cflags --libs strata failed")
endif()
separate_arguments(flags UNIX_COMMAND "${flags}")
run(${CXX} -std=c++20 ${CONSUMER_SOURCE_DIR}/main.cc ${flags}
    -o ${SCRATCH_DIR}/consumer-pc)
run(${CMAKE_COMMAND} -E env LD_LIBRARY_PATH=${prefix}/lib
    ${SCRATCH_DIR}/consumer-pc)
# The C API needs no C++ to call: the trainer is built by the C compiler.
run(${CC} -std=c99 -pedantic-errors -Wall -Wextra -Werror
    ${CONSUMER_SOURCE_DIR}/train.c ${flags} -lm -o ${SCRATCH_DIR}/train-pc)
run(${CMAKE_COMMAND} -E env LD_LIBRARY_PATH=${prefix}/lib
    ${SCRATCH_DIR}/train-pc)
