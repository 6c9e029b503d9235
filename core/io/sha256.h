#pragma once
// SHA-256 (FIPS 180-4) of bytes and of files, as lowercase hex: content keys of cached data (the
// prepared text of dflash_train's data.train) that must change whenever the bytes do.
#include <cstdint>
#include <string>
#include <string_view>

namespace dflash::io {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t bytes);
  void update(std::string_view s) { update(s.data(), s.size()); }
  std::string hex();  // finishes the hash (the object is spent after it)

 private:
  void block(const unsigned char* p);
  uint32_t h_[8];
  unsigned char buf_[64];
  size_t used_ = 0;      // bytes in buf_
  uint64_t total_ = 0;   // bytes hashed
};

std::string sha256_hex(std::string_view bytes);
// The file's SHA-256, read in 1 MiB chunks. Throws naming the file when it cannot be read.
std::string sha256_file(const std::string& path);

}  // namespace dflash::io
