#include "data/hdf5_check.h"

#include "core/error.h"

namespace dflash {

namespace {

herr_t take_innermost(unsigned n, const H5E_error2_t* err, void* data) {
  // Walked upward, entry 0 is the innermost: the function that first detected the error.
  if (n != 0) return 0;
  auto* out = static_cast<H5ErrorDetail*>(data);
  if (err->desc && *err->desc) {
    out->message = err->desc;
  } else {
    char minor[256] = {};
    if (H5Eget_msg(err->min_num, nullptr, minor, sizeof minor) > 0) out->message = minor;
  }
  for (char& c : out->message)
    if (c == '\n') c = ' ';
  if (err->func_name) out->function = err->func_name;
  return 0;
}

bool contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

std::string hint_for(const std::string& m) {
  if (contains(m, "errno = 2,")) return "check that the path exists and is spelled correctly";
  if (contains(m, "errno = 13,")) return "check the file permissions";
  if (contains(m, "errno = 28,")) return "the disk is full; free space or choose another directory";
  if (contains(m, "signature not found"))
    return "the file is not an HDF5 file, or is truncated: data files are dflash.tokens.v1 HDF5; make one from JSONL "
           "token rows with `dflash_data convert rows.jsonl --vocab-size V --out data.h5`, or rebuild a truncated one";
  if (contains(m, "lock"))
    return "another process may have the file open for writing; on network filesystems without locking "
           "set HDF5_USE_FILE_LOCKING=FALSE";
  return "";
}

}  // namespace

void h5_silence_errors() {
  thread_local bool silenced = false;
  if (silenced) return;
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  silenced = true;
}

H5ErrorDetail h5_innermost_error() {
  H5ErrorDetail d;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_UPWARD, take_innermost, &d);
  H5Eclear2(H5E_DEFAULT);
  return d;
}

void throw_h5_error(const char* call, const std::string& what, const H5ErrorDetail& detail, const char* file,
                    int line) {
  std::string msg = "HDF5 error";
  if (!what.empty()) msg += " while " + what;
  msg += ": `" + std::string(call) + "` failed: ";
  if (detail.message.empty()) msg += "HDF5 left no error message";
  else msg += detail.message;
  if (!detail.function.empty()) msg += " [in " + detail.function + "]";
  // A failure with a known cause (a missing or unreadable path, a full disk, not an HDF5 file) is the
  // user's to fix; any other is reported with its source location.
  const std::string hint = hint_for(detail.message);
  raise(file, line, msg, hint, hint.empty() ? ErrorKind::Internal : ErrorKind::User);
}

void H5Handle::reset() noexcept {
  if (id_ >= 0 && closer_) {
    h5_silence_errors();
    closer_(id_);
    H5Eclear2(H5E_DEFAULT);
  }
  id_ = H5I_INVALID_HID;
}

void H5Handle::close(const std::string& what) {
  if (id_ < 0 || !closer_) return;
  hid_t id = release();
  DFLASH_H5_CHECK(closer_(id), "closing " << what);
}

}  // namespace dflash
