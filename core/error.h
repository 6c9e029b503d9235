#pragma once
// dflash::Error: the one exception type. It carries where it was raised (file:line), what failed,
// and optionally a hint a user can act on. `main` functions print it once and exit non-zero.
#include <sstream>
#include <stdexcept>
#include <string>

namespace dflash {

class Error : public std::runtime_error {
 public:
  Error(std::string message, std::string hint = {}, std::string where = {});
  const std::string& message() const { return message_; }
  const std::string& hint() const { return hint_; }
  const std::string& where() const { return where_; }
  // "message (at file:line)\n---> HINT: hint" as printed by main.
  std::string report() const;

 private:
  std::string message_, hint_, where_;
};

[[noreturn]] void raise(const char* file, int line, const std::string& message, const std::string& hint = {});

// Throws dflash::Error with the message (an ostream expression) when an invariant a user can break fails.
#define DFLASH_CHECK(cond, msg)                                                     \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::ostringstream dflash_oss_;                                                \
      dflash_oss_ << msg;                                                            \
      ::dflash::raise(__FILE__, __LINE__, dflash_oss_.str());                        \
    }                                                                                \
  } while (0)

#define DFLASH_CHECK_HINT(cond, msg, hint)                                           \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::ostringstream dflash_oss_, dflash_hint_;                                  \
      dflash_oss_ << msg;                                                            \
      dflash_hint_ << hint;                                                          \
      ::dflash::raise(__FILE__, __LINE__, dflash_oss_.str(), dflash_hint_.str());    \
    }                                                                                \
  } while (0)

#define DFLASH_FAIL(msg)                                                             \
  do {                                                                               \
    std::ostringstream dflash_oss_;                                                  \
    dflash_oss_ << msg;                                                              \
    ::dflash::raise(__FILE__, __LINE__, dflash_oss_.str());                          \
  } while (0)

#define DFLASH_FAIL_HINT(msg, hint)                                                  \
  do {                                                                               \
    std::ostringstream dflash_oss_, dflash_hint_;                                    \
    dflash_oss_ << msg;                                                              \
    dflash_hint_ << hint;                                                            \
    ::dflash::raise(__FILE__, __LINE__, dflash_oss_.str(), dflash_hint_.str());      \
  } while (0)

// File I/O: throws with the path, the operation and strerror(errno) when `ok` is false.
void check_io(bool ok, const char* file, int line, const std::string& op, const std::string& path);
#define DFLASH_CHECK_IO(ok, op, path) ::dflash::check_io((ok), __FILE__, __LINE__, (op), (path))

}  // namespace dflash
