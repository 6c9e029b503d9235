#pragma once
// Checked HDF5 calls and RAII handles.
//
//   H5Handle file(DFLASH_H5_CHECK(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT),
//                                 "opening dataset file '" << path << "'"),
//                 H5Fclose);
//
// HDF5 calls return a negative herr_t/hid_t/htri_t/hssize_t on failure. DFLASH_H5_CHECK(expr, what)
// evaluates to expr's value and throws dflash::Error on a negative one, naming the call, `what` (an
// ostream expression: the file and dataset), file:line and the innermost message of HDF5's error
// stack (the place the failure was detected, e.g. "unable to open file: name = '...', errno = 2,
// error message = 'No such file or directory'"). HDF5's own printing of the error stack to stderr
// is turned off first (h5_silence_errors), so the user sees one message.
#include <hdf5.h>

#include <sstream>
#include <string>

namespace dflash {

// Turns off HDF5's automatic error-stack printing for this thread (HDF5 keeps that setting per
// thread in thread-safe builds). Idempotent and cheap; DFLASH_H5_CHECK calls it before every call.
void h5_silence_errors();

struct H5ErrorDetail {
  std::string message;   // description of the innermost error; empty when the stack was empty
  std::string function;  // the HDF5 function that detected it, e.g. "H5FD__sec2_open"
};
// Reads the innermost entry of this thread's default error stack, then clears the stack.
H5ErrorDetail h5_innermost_error();

// Throws dflash::Error for the failed `call` (source text) while doing `what`.
[[noreturn]] void throw_h5_error(const char* call, const std::string& what, const H5ErrorDetail& detail,
                                 const char* file, int line);

// Owns one HDF5 identifier and closes it with the matching function (H5Fclose, H5Dclose, H5Sclose,
// H5Tclose, H5Pclose, H5Aclose, H5Gclose) when destroyed, also while an exception unwinds. A
// negative id holds nothing. Move-only.
class H5Handle {
 public:
  using Closer = herr_t (*)(hid_t);
  H5Handle() = default;
  H5Handle(hid_t id, Closer closer) : id_(id), closer_(closer) {}
  ~H5Handle() { reset(); }
  H5Handle(H5Handle&& o) noexcept : id_(o.id_), closer_(o.closer_) { o.id_ = H5I_INVALID_HID; }
  H5Handle& operator=(H5Handle&& o) noexcept {
    if (this != &o) {
      reset();
      id_ = o.id_;
      closer_ = o.closer_;
      o.id_ = H5I_INVALID_HID;
    }
    return *this;
  }
  H5Handle(const H5Handle&) = delete;
  H5Handle& operator=(const H5Handle&) = delete;

  hid_t get() const { return id_; }
  operator hid_t() const { return id_; }  // pass straight to HDF5 calls
  bool valid() const { return id_ >= 0; }
  // Gives up ownership without closing.
  hid_t release() {
    hid_t id = id_;
    id_ = H5I_INVALID_HID;
    return id;
  }
  // Closes now, ignoring errors (the destructor's path).
  void reset() noexcept;
  // Closes now and throws on failure: use it for files written to, where a failed close can mean
  // data never reached the disk. `what` names the object in the error.
  void close(const std::string& what);

 private:
  hid_t id_ = H5I_INVALID_HID;
  Closer closer_ = nullptr;
};

}  // namespace dflash

#define DFLASH_H5_CHECK(expr, what)                                                   \
  ([&]() {                                                                            \
    ::dflash::h5_silence_errors();                                                    \
    auto dflash_h5_rc_ = (expr);                                                      \
    if (dflash_h5_rc_ < 0) {                                                          \
      const ::dflash::H5ErrorDetail dflash_h5_detail_ = ::dflash::h5_innermost_error(); \
      std::ostringstream dflash_h5_what_;                                             \
      dflash_h5_what_ << what;                                                        \
      ::dflash::throw_h5_error(#expr, dflash_h5_what_.str(), dflash_h5_detail_, __FILE__, __LINE__); \
    }                                                                                 \
    return dflash_h5_rc_;                                                             \
  }())
