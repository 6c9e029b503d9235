#include "comm/mpi_check.h"

#include "core/error.h"

namespace dflash {

namespace {

struct MpiClass {
  int code;
  const char* name;
  const char* text;
  const char* hint;
};

// The standard error classes dflash can meet, for messages when MPI_Error_string may not be called
// and for hints. Descriptions are ours; while MPI is up its own strings are used instead.
const MpiClass kClasses[] = {
    {MPI_ERR_BUFFER, "MPI_ERR_BUFFER", "invalid buffer pointer", ""},
    {MPI_ERR_COUNT, "MPI_ERR_COUNT", "invalid count argument", "counts are elements, not bytes, and must fit in int"},
    {MPI_ERR_TYPE, "MPI_ERR_TYPE", "invalid datatype", ""},
    {MPI_ERR_TAG, "MPI_ERR_TAG", "invalid tag", ""},
    {MPI_ERR_COMM, "MPI_ERR_COMM", "invalid communicator",
     "the communicator was used before it was created or after it was freed"},
    {MPI_ERR_RANK, "MPI_ERR_RANK", "invalid rank", "check the world size that mpirun -n starts against the config"},
    {MPI_ERR_REQUEST, "MPI_ERR_REQUEST", "invalid request", ""},
    {MPI_ERR_ROOT, "MPI_ERR_ROOT", "invalid root", ""},
    {MPI_ERR_GROUP, "MPI_ERR_GROUP", "invalid group", ""},
    {MPI_ERR_OP, "MPI_ERR_OP", "invalid reduce operation", ""},
    {MPI_ERR_TOPOLOGY, "MPI_ERR_TOPOLOGY", "invalid communicator topology", ""},
    {MPI_ERR_DIMS, "MPI_ERR_DIMS", "invalid topology dimensions", ""},
    {MPI_ERR_ARG, "MPI_ERR_ARG", "invalid argument", ""},
    {MPI_ERR_UNKNOWN, "MPI_ERR_UNKNOWN", "unknown error", ""},
    {MPI_ERR_TRUNCATE, "MPI_ERR_TRUNCATE", "message truncated on receive",
     "the ranks disagree on a message size: are all ranks running the same config and build?"},
    {MPI_ERR_OTHER, "MPI_ERR_OTHER", "known error not in this list", "another rank may have failed; check its log"},
    {MPI_ERR_INTERN, "MPI_ERR_INTERN", "internal MPI error", "another rank may have failed; check its log"},
    {MPI_ERR_IN_STATUS, "MPI_ERR_IN_STATUS", "error code is in status", ""},
    {MPI_ERR_PENDING, "MPI_ERR_PENDING", "pending request", ""},
    {MPI_ERR_NO_MEM, "MPI_ERR_NO_MEM", "out of memory", "the host is out of memory; reduce the batch size"},
    {MPI_ERR_INFO, "MPI_ERR_INFO", "invalid info object", ""},
};

const MpiClass* find_class(int code) {
  for (const MpiClass& c : kClasses)
    if (c.code == code) return &c;
  return nullptr;
}

bool mpi_is_up() {
  int initialized = 0, finalized = 0;
  // Both may be called at any time, before MPI_Init and after MPI_Finalize.
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

}  // namespace

std::string mpi_error_text(int code) {
  if (mpi_is_up()) {
    char buf[MPI_MAX_ERROR_STRING + 1] = {};
    int len = 0;
    if (MPI_Error_string(code, buf, &len) == MPI_SUCCESS && len > 0)
      return std::string(buf, static_cast<size_t>(len));
  }
  if (const MpiClass* c = find_class(code)) return std::string(c->name) + ": " + c->text;
  return "MPI error code " + std::to_string(code);
}

void check_mpi(int code, const char* call, const char* file, int line) {
  if (code == MPI_SUCCESS) return;
  int cls = code;
  if (mpi_is_up() && MPI_Error_class(code, &cls) != MPI_SUCCESS) cls = code;
  const MpiClass* c = find_class(cls);
  raise(file, line, std::string("`") + call + "` failed: " + mpi_error_text(code) + " (code " + std::to_string(code) + ")",
        c ? c->hint : "");
}

}  // namespace dflash
