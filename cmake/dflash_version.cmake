# The git commit is embedded at build time (re-read on every build, written only when it changes) so
# that `--version`, logs and benchmark rows name the code that produced them.
if(DFLASH_WITH_CUDA)
  set(DFLASH_WITH_CUDA_INT 1)
else()
  set(DFLASH_WITH_CUDA_INT 0)
endif()
set(DFLASH_VERSION_HEADER ${CMAKE_BINARY_DIR}/generated/dflash/version.h)
add_custom_target(dflash_version_header
  COMMAND ${CMAKE_COMMAND} -DSRC=${CMAKE_SOURCE_DIR} -DOUT=${DFLASH_VERSION_HEADER}
          -DVERSION=${PROJECT_VERSION} -DARCHS=${CMAKE_CUDA_ARCHITECTURES} -DWITH_CUDA=${DFLASH_WITH_CUDA_INT}
          -P ${CMAKE_SOURCE_DIR}/cmake/write_version.cmake
  BYPRODUCTS ${DFLASH_VERSION_HEADER}
  COMMENT "Embedding git commit")
