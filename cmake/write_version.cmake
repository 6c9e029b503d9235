# Script mode: writes OUT from cmake/version.h.in with the current git commit of SRC.
execute_process(COMMAND git rev-parse --short=12 HEAD WORKING_DIRECTORY ${SRC}
                OUTPUT_VARIABLE COMMIT OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE rc)
if(NOT rc EQUAL 0 OR COMMIT STREQUAL "")
  # No git checkout (e.g. a copied tree on the GPU machine): the caller may pass the commit.
  if(DEFINED ENV{DFLASH_GIT_COMMIT} AND NOT "$ENV{DFLASH_GIT_COMMIT}" STREQUAL "")
    set(COMMIT "$ENV{DFLASH_GIT_COMMIT}")
  else()
    set(COMMIT "unknown")
  endif()
else()
  execute_process(COMMAND git status --porcelain --untracked-files=no WORKING_DIRECTORY ${SRC}
                  OUTPUT_VARIABLE dirty OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(NOT dirty STREQUAL "")
    set(COMMIT "${COMMIT}-dirty")
  endif()
endif()
configure_file(${SRC}/cmake/version.h.in ${OUT}.tmp @ONLY)
file(COPY_FILE ${OUT}.tmp ${OUT} ONLY_IF_DIFFERENT)
file(REMOVE ${OUT}.tmp)
