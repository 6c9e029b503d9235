#pragma once
// dflash::Error: the one exception type. It carries what failed, where it was raised (file:line),
// optionally a hint a user can act on, and its kind: a user error (the input was wrong: a config key,
// a flag, a path, a bad file) or an internal one (a bug, a CUDA / NCCL / MPI failure). `main`
// functions print it once and exit non-zero (core/app.h run_app): a user error as a message to the
// user, without the source location; an internal error with it. At the debug log level every error
// shows its file:line.
//
//   DFLASH_REQUIRE(cond, msg) / DFLASH_REQUIRE_HINT(cond, msg, hint)   the input is wrong (user error)
//   DFLASH_REJECT(msg) / DFLASH_REJECT_HINT(msg, hint)                 the same, unconditionally
//   DFLASH_CHECK(cond, msg) / DFLASH_CHECK_HINT(cond, msg, hint)       an invariant of the code (internal)
//   DFLASH_FAIL(msg) / DFLASH_FAIL_HINT(msg, hint)                     the same, unconditionally
//   DFLASH_CHECK_IO(ok, op, path)                                      a file operation (user error: path, permissions, disk)
// `msg` and `hint` are ostream expressions.
#include <sstream>
#include <stdexcept>
#include <string>

namespace dflash {

enum class ErrorKind {
  Internal,  // a bug or a failure below us (CUDA, NCCL, MPI): the source location helps whoever fixes it
  User,      // the input was wrong: the message and the hint say what to change
};

class Error : public std::runtime_error {
 public:
  Error(std::string message, std::string hint = {}, std::string where = {}, ErrorKind kind = ErrorKind::Internal);
  const std::string& message() const { return message_; }
  const std::string& hint() const { return hint_; }
  const std::string& where() const { return where_; }
  ErrorKind kind() const { return kind_; }
  bool is_user_error() const { return kind_ == ErrorKind::User; }
  // As printed by main: "message (at file:line)\n---> HINT: hint"; the location only for an
  // internal error, or for any error when `with_where` (the debug log level). what() is report().
  std::string report(bool with_where = false) const;

 private:
  std::string message_, hint_, where_;
  ErrorKind kind_;
};

// Throws dflash::Error at file:line ("folder/file.cpp:123").
[[noreturn]] void raise(const char* file, int line, const std::string& message, const std::string& hint = {},
                        ErrorKind kind = ErrorKind::Internal);

#define DFLASH_RAISE_(kind, msg, hint)                                                          \
  do {                                                                                          \
    std::ostringstream dflash_oss_;  /* one declaration each: a comma here would split the */  \
    std::ostringstream dflash_hint_; /* argument of a macro around a check (EXPECT_NO_THROW) */ \
    dflash_oss_ << msg;                                                                         \
    dflash_hint_ << hint;                                                                       \
    ::dflash::raise(__FILE__, __LINE__, dflash_oss_.str(), dflash_hint_.str(), (kind));         \
  } while (0)
#define DFLASH_ERROR_IF_NOT_(cond, kind, msg, hint) \
  do {                                              \
    if (!(cond)) DFLASH_RAISE_(kind, msg, hint);    \
  } while (0)

// An invariant of the code: a failure is a bug (or a failure of a library below us).
#define DFLASH_CHECK(cond, msg) DFLASH_ERROR_IF_NOT_(cond, ::dflash::ErrorKind::Internal, msg, "")
#define DFLASH_CHECK_HINT(cond, msg, hint) DFLASH_ERROR_IF_NOT_(cond, ::dflash::ErrorKind::Internal, msg, hint)
#define DFLASH_FAIL(msg) DFLASH_RAISE_(::dflash::ErrorKind::Internal, msg, "")
#define DFLASH_FAIL_HINT(msg, hint) DFLASH_RAISE_(::dflash::ErrorKind::Internal, msg, hint)

// Input validation: a failure is the user's to fix (a config key, a flag, a path, a bad file).
#define DFLASH_REQUIRE(cond, msg) DFLASH_ERROR_IF_NOT_(cond, ::dflash::ErrorKind::User, msg, "")
#define DFLASH_REQUIRE_HINT(cond, msg, hint) DFLASH_ERROR_IF_NOT_(cond, ::dflash::ErrorKind::User, msg, hint)
#define DFLASH_REJECT(msg) DFLASH_RAISE_(::dflash::ErrorKind::User, msg, "")
#define DFLASH_REJECT_HINT(msg, hint) DFLASH_RAISE_(::dflash::ErrorKind::User, msg, hint)

// File I/O: throws a user error with the path, the operation and strerror(errno) when `ok` is false.
void check_io(bool ok, const char* file, int line, const std::string& op, const std::string& path);
#define DFLASH_CHECK_IO(ok, op, path) ::dflash::check_io((ok), __FILE__, __LINE__, (op), (path))

}  // namespace dflash
