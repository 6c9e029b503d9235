#include "core/error.h"

#include <cerrno>
#include <cstring>
#include <string_view>

namespace dflash {

namespace {
std::string compose(const std::string& message, const std::string& hint, const std::string& where, bool show_where) {
  std::string s = message;
  if (show_where && !where.empty()) s += " (at " + where + ")";
  if (!hint.empty()) s += "\n---> HINT: " + hint;
  return s;
}
}  // namespace

// (The base is built from the arguments before they are moved into the members.)
Error::Error(std::string message, std::string hint, std::string where, ErrorKind kind)
    : std::runtime_error(compose(message, hint, where, kind == ErrorKind::Internal)),
      message_(std::move(message)), hint_(std::move(hint)), where_(std::move(where)), kind_(kind) {}

std::string Error::report(bool with_where) const {
  return compose(message_, hint_, where_, with_where || kind_ == ErrorKind::Internal);
}

void raise(const char* file, int line, const std::string& message, const std::string& hint, ErrorKind kind) {
  // Keep "folder/file.cpp": unambiguous in this tree, and short.
  std::string_view f(file);
  size_t last = f.rfind('/');
  if (last != std::string_view::npos && last > 0) {
    size_t prev = f.rfind('/', last - 1);
    f = f.substr(prev == std::string_view::npos ? 0 : prev + 1);
  }
  throw Error(message, hint, std::string(f) + ":" + std::to_string(line), kind);
}

void check_io(bool ok, const char* file, int line, const std::string& op, const std::string& path) {
  if (ok) return;
  int e = errno;
  std::string hint;
  if (e == ENOENT) hint = "check that the path exists and is spelled correctly";
  else if (e == EACCES) hint = "check the file permissions";
  else if (e == ENOSPC) hint = "the disk is full; free space or choose another directory";
  raise(file, line, op + " '" + path + "' failed: " + (e ? std::strerror(e) : "unexpected end of file or short transfer"), hint,
        ErrorKind::User);
}

}  // namespace dflash
