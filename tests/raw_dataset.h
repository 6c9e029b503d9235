#pragma once
// A dflash.tokens.v1 file written with the raw HDF5 C API (no validation), so that any defect can be
// planted: used by test_data and by tests/make_bad_dataset (the end-to-end bad-data checks).
#include <hdf5.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "data/hdf5_check.h"

namespace dflash::data {

// A file written with the raw C API, so that any defect can be planted.
struct RawFile {
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;
  std::vector<int64_t> offsets;
  std::optional<std::string> format = std::string(kFormat);
  int64_t vocab = 16;
};

inline void write_raw(const std::string& path, const RawFile& r) {
  H5Handle f(DFLASH_H5_CHECK(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), "create"), H5Fclose);
  auto put = [&](const char* name, hid_t type, const void* data, size_t n) {
    const hsize_t dim = n;
    H5Handle space(DFLASH_H5_CHECK(H5Screate_simple(1, &dim, nullptr), "space"), H5Sclose);
    H5Handle ds(DFLASH_H5_CHECK(H5Dcreate2(f, name, type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), "ds"), H5Dclose);
    if (n) DFLASH_H5_CHECK(H5Dwrite(ds, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data), "write");
  };
  put("/input_ids", H5T_NATIVE_INT32, r.ids.data(), r.ids.size());
  put("/loss_mask", H5T_NATIVE_UINT8, r.mask.data(), r.mask.size());
  put("/offsets", H5T_NATIVE_INT64, r.offsets.data(), r.offsets.size());
  H5Handle scalar(DFLASH_H5_CHECK(H5Screate(H5S_SCALAR), "scalar"), H5Sclose);
  if (r.format) {
    H5Handle str(DFLASH_H5_CHECK(H5Tcopy(H5T_C_S1), "str"), H5Tclose);
    DFLASH_H5_CHECK(H5Tset_size(str, r.format->size()), "size");
    H5Handle a(DFLASH_H5_CHECK(H5Acreate2(f, "format", str, scalar, H5P_DEFAULT, H5P_DEFAULT), "attr"), H5Aclose);
    DFLASH_H5_CHECK(H5Awrite(a, str, r.format->c_str()), "write attr");
  }
  H5Handle v(DFLASH_H5_CHECK(H5Acreate2(f, "vocab_size", H5T_NATIVE_INT64, scalar, H5P_DEFAULT, H5P_DEFAULT), "attr"),
             H5Aclose);
  DFLASH_H5_CHECK(H5Awrite(v, H5T_NATIVE_INT64, &r.vocab), "write attr");
}

}  // namespace dflash::data
