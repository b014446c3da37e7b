# Writes OUT, a source file defining strata::bench::kGitRevision: the short
# commit of the tree at SRC, with "-dirty" when tracked files differ from it,
# or "unknown" outside a git checkout. Run at every build (not at configure
# time, which would leave the figure stale after a commit), and rewrites OUT
# only when the revision changed, so an unchanged tree relinks nothing.
execute_process(COMMAND git rev-parse --short HEAD
  WORKING_DIRECTORY ${SRC}
  OUTPUT_VARIABLE rev OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE rc ERROR_QUIET)
if(NOT rc EQUAL 0 OR NOT rev)
  set(rev unknown)
else()
  execute_process(COMMAND git status --porcelain --untracked-files=no
    WORKING_DIRECTORY ${SRC}
    OUTPUT_VARIABLE changes RESULT_VARIABLE rc ERROR_QUIET)
  if(rc EQUAL 0 AND NOT changes STREQUAL "")
    string(APPEND rev "-dirty")
  endif()
endif()
set(content "// Generated at build time by bench/revision.cmake.
namespace strata::bench {
extern const char kGitRevision[];
const char kGitRevision[] = \"${rev}\";
}  // namespace strata::bench
")
set(old "")
if(EXISTS ${OUT})
  file(READ ${OUT} old)
endif()
if(NOT old STREQUAL content)
  file(WRITE ${OUT} "${content}")
endif()
