# Whether and for which interpreter the Python package (python/) is built.
# Sets STRATA_PYTHON_ENABLED, Python3_EXECUTABLE and
# STRATA_PYTHON_INSTALL_DIR (relative to the install prefix).
set(STRATA_BUILD_PYTHON AUTO CACHE STRING
  "Build the Python package: AUTO (when pybind11 and the interpreter's headers are found), ON, OFF")
set_property(CACHE STRATA_BUILD_PYTHON PROPERTY STRINGS AUTO ON OFF)
set(STRATA_PYTHON_EXECUTABLE "" CACHE FILEPATH
  "python3 the package is built for ('' = search python3 on PATH, then /usr/bin/python3, preferring one that imports torch)")
set(STRATA_PYTHON_INSTALL_DIR "" CACHE PATH
  "Where cmake --install puts the package, relative to the prefix ('' = the interpreter's platlib)")

set(STRATA_PYTHON_ENABLED OFF)

# Says why the package is not built: an error when it was asked for.
function(strata_python_skip why)
  if(STRATA_BUILD_PYTHON STREQUAL "ON")
    message(FATAL_ERROR "strata: STRATA_BUILD_PYTHON=ON but ${why}")
  endif()
  message(STATUS "strata: Python package not built: ${why} "
    "(-DSTRATA_BUILD_PYTHON=OFF silences this)")
endfunction()

# 1 in `out` when `py` has Python.h (its development headers), 2 when it also
# imports torch, 0 otherwise.
function(strata_python_probe py out)
  execute_process(COMMAND ${py} -c
    "import os, sysconfig; raise SystemExit(0 if os.path.exists(os.path.join(sysconfig.get_path('include'), 'Python.h')) else 1)"
    RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET)
  if(NOT rc EQUAL 0)
    set(${out} 0 PARENT_SCOPE)
    return()
  endif()
  execute_process(COMMAND ${py} -c "import torch"
    RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET)
  if(rc EQUAL 0)
    set(${out} 2 PARENT_SCOPE)
  else()
    set(${out} 1 PARENT_SCOPE)
  endif()
endfunction()

if(STRATA_BUILD_PYTHON STREQUAL "OFF")
  return()
elseif(STRATA_SANITIZE AND STRATA_BUILD_PYTHON STREQUAL "AUTO")
  message(STATUS "strata: Python package not built under STRATA_SANITIZE "
    "(python would need the sanitizer runtime preloaded; "
    "-DSTRATA_BUILD_PYTHON=ON builds it anyway)")
  return()
endif()

set(py_exe "${STRATA_PYTHON_EXECUTABLE}")
if(NOT py_exe)
  find_program(py_on_path python3 NO_CACHE)
  set(best 0)
  foreach(candidate ${py_on_path} /usr/bin/python3)
    if(EXISTS ${candidate})
      strata_python_probe(${candidate} score)
      if(score GREATER best)
        set(best ${score})
        set(py_exe ${candidate})
      endif()
    endif()
  endforeach()
  if(NOT py_exe)
    strata_python_skip("no python3 with its development headers (Python.h) was found: install python3-dev (scripts/install-deps.sh) or set STRATA_PYTHON_EXECUTABLE")
    return()
  endif()
endif()

set(Python3_EXECUTABLE ${py_exe})
find_package(Python3 COMPONENTS Interpreter Development.Module)
if(NOT Python3_FOUND)
  strata_python_skip("${py_exe} lacks its development files (Python.h): install python3-dev")
  return()
endif()
find_package(pybind11 2.6 CONFIG QUIET)
if(NOT pybind11_FOUND)
  strata_python_skip("pybind11 was not found: install pybind11-dev (scripts/install-deps.sh)")
  return()
endif()

if(STRATA_PYTHON_INSTALL_DIR)
  set(py_dir ${STRATA_PYTHON_INSTALL_DIR})
else()
  # The interpreter's platlib when it lies under the prefix (Debian's
  # /usr/local/lib/python3.X/dist-packages for the default prefix), so that
  # --prefix moves it along; else the conventional lib/python3.X/site-packages.
  execute_process(COMMAND ${Python3_EXECUTABLE} -c
    "import sysconfig; print(sysconfig.get_path('platlib'))"
    OUTPUT_VARIABLE platlib OUTPUT_STRIP_TRAILING_WHITESPACE)
  cmake_path(IS_PREFIX CMAKE_INSTALL_PREFIX "${platlib}" NORMALIZE under_prefix)
  if(platlib AND under_prefix)
    cmake_path(RELATIVE_PATH platlib BASE_DIRECTORY ${CMAKE_INSTALL_PREFIX}
      OUTPUT_VARIABLE py_dir)
  else()
    set(py_dir
      lib/python${Python3_VERSION_MAJOR}.${Python3_VERSION_MINOR}/site-packages)
  endif()
endif()
set(STRATA_PYTHON_INSTALL_DIR_RESOLVED ${py_dir})
set(STRATA_PYTHON_ENABLED ON)
message(STATUS "strata: Python package for ${Python3_EXECUTABLE} "
  "(${Python3_VERSION}, pybind11 ${pybind11_VERSION}), installed into "
  "<prefix>/${py_dir}")
