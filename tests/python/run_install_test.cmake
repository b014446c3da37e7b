# cmake -P script: install strata into SCRATCH_DIR/prefix and import the
# package from PYTHON_DIR there, checking that it is that copy and that its
# version is the project's.
file(REMOVE_RECURSE ${SCRATCH_DIR})
set(prefix ${SCRATCH_DIR}/prefix)
execute_process(
  COMMAND ${CMAKE_COMMAND} --install ${STRATA_BUILD_DIR} --prefix ${prefix}
  RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install failed (${rc}): ${err}")
endif()
set(check [=[
import os, sys
import strata
where = os.path.realpath(strata.__file__)
want = os.path.realpath(sys.argv[1])
assert where.startswith(want + os.sep), f"imported {where}, not under {want}"
assert strata.__version__ == sys.argv[2], (strata.__version__, sys.argv[2])
with strata.CpuOptimizer(threads=1) as opt:
    assert opt.algo == "adamw"
print("strata", strata.__version__, "from", os.path.dirname(where))
]=])
execute_process(
  COMMAND ${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH
    PYTHONPATH=${prefix}/${PYTHON_DIR} PYTHONDONTWRITEBYTECODE=1
    ${PYTHON} -c "${check}" ${prefix}/${PYTHON_DIR} ${EXPECTED_VERSION}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "importing the installed package failed (${rc}):\n${out}\n${err}")
endif()
message(STATUS "${out}")
