#pragma once
// Checked MPI calls: DFLASH_MPI_CHECK(MPI_Bcast(...)) throws dflash::Error with the call text,
// file:line and MPI's description of the return code.
//
// MPI only returns error codes on communicators whose error handler is MPI_ERRORS_RETURN; with the
// default MPI_ERRORS_ARE_FATAL the library aborts inside the call, before any check runs. Set
// MPI_ERRORS_RETURN on the communicators dflash uses so that failures arrive here.
#include <mpi.h>

#include <string>

namespace dflash {

// Throws for any code other than MPI_SUCCESS; `call` is the call's source text. Non-inline and
// taking the code, so a test can feed it a fabricated code without initializing MPI.
void check_mpi(int code, const char* call, const char* file, int line);

// "MPI_ERR_COMM: invalid communicator". Uses MPI_Error_string while MPI is initialized (it may not be
// called before MPI_Init or after MPI_Finalize: Open MPI aborts), else dflash's own table.
std::string mpi_error_text(int code);

}  // namespace dflash

#define DFLASH_MPI_CHECK(call)                                                       \
  do {                                                                               \
    const int dflash_mpi_rc_ = (call);                                               \
    if (dflash_mpi_rc_ != MPI_SUCCESS)                                               \
      ::dflash::check_mpi(dflash_mpi_rc_, #call, __FILE__, __LINE__);                \
  } while (0)
