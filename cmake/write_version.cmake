# Script mode: writes OUT from cmake/version.h.in with the commit of SRC. DFLASH_GIT_COMMIT in the
# environment wins (a copied tree on the GPU machine may carry a stale .git, or none); otherwise
# git's HEAD, marked -dirty when tracked files differ from it.
if(DEFINED ENV{DFLASH_GIT_COMMIT} AND NOT "$ENV{DFLASH_GIT_COMMIT}" STREQUAL "")
  set(COMMIT "$ENV{DFLASH_GIT_COMMIT}")
else()
  execute_process(COMMAND git rev-parse --short=12 HEAD WORKING_DIRECTORY ${SRC}
                  OUTPUT_VARIABLE COMMIT OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0 OR COMMIT STREQUAL "")
    set(COMMIT "unknown")
  else()
    execute_process(COMMAND git status --porcelain --untracked-files=no WORKING_DIRECTORY ${SRC}
                    OUTPUT_VARIABLE dirty OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(NOT dirty STREQUAL "")
      set(COMMIT "${COMMIT}-dirty")
    endif()
  endif()
endif()
configure_file(${SRC}/cmake/version.h.in ${OUT}.tmp @ONLY)
file(COPY_FILE ${OUT}.tmp ${OUT} ONLY_IF_DIFFERENT)
file(REMOVE ${OUT}.tmp)
