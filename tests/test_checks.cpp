// Error checks (dflash, MPI, HDF5, and CUDA/cuBLAS/NCCL when built), the bf16/f16 conversions and
// the Philox known-answer vectors. Runs without a GPU and without MPI_Init.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "comm/mpi_check.h"
#include "data/hdf5_check.h"
#include "core/app.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"

#ifdef DFLASH_WITH_CUDA
#include "core/cuda/check.h"
#endif

namespace dflash {
namespace {

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Runs `f`, expects a dflash::Error, returns it.
template <typename F>
Error catch_error(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "expected dflash::Error";
  return Error("no error");
}

std::string missing_path(const char* name) {
  return (std::filesystem::temp_directory_path() / ("dflash_test_checks_missing_dir") / name).string();
}

// ---------------------------------------------------------------------------------------------
// dflash checks

TEST(Checks, CheckCarriesMessageWhereAndHint) {
  int n = 3;
  Error e = catch_error([&] { DFLASH_CHECK(n == 4, "n is " << n << ", expected 4"); });
  EXPECT_EQ(e.message(), "n is 3, expected 4");
  EXPECT_TRUE(has(e.where(), "tests/test_checks.cpp:")) << e.where();
  EXPECT_TRUE(e.hint().empty());

  Error h = catch_error([&] { DFLASH_CHECK_HINT(false, "bad", "do " << "this"); });
  EXPECT_EQ(h.hint(), "do this");
  EXPECT_TRUE(has(h.what(), "bad (at tests/test_checks.cpp:")) << h.what();
  EXPECT_TRUE(has(h.what(), "\n---> HINT: do this")) << h.what();

  EXPECT_NO_THROW(DFLASH_CHECK(n == 3, "unused"));
  Error f = catch_error([] { DFLASH_FAIL("failed " << 42); });
  EXPECT_EQ(f.message(), "failed 42");
}

// A user error (a config key, a flag, a path, a bad file) reads as a message to the user: no source
// location unless asked for (the debug log level); internal errors keep theirs.
TEST(Checks, UserErrorsReadWithoutTheSourceLocation) {
  const int n = 3;
  Error u = catch_error([&] { DFLASH_REQUIRE_HINT(n == 4, "--count " << n << " must be 4", "pass " << "--count 4"); });
  EXPECT_TRUE(u.is_user_error());
  EXPECT_EQ(u.message(), "--count 3 must be 4");
  EXPECT_EQ(std::string(u.what()), "--count 3 must be 4\n---> HINT: pass --count 4");
  EXPECT_EQ(u.report(), u.what());
  EXPECT_TRUE(has(u.where(), "tests/test_checks.cpp:")) << u.where();  // kept for the debug log level
  EXPECT_TRUE(has(u.report(true), "--count 3 must be 4 (at tests/test_checks.cpp:")) << u.report(true);
  EXPECT_TRUE(has(u.report(true), "\n---> HINT: pass --count 4")) << u.report(true);
  EXPECT_NO_THROW(DFLASH_REQUIRE(n == 3, "unused"));

  Error r = catch_error([] { DFLASH_REJECT("bad flag " << 7); });
  EXPECT_TRUE(r.is_user_error());
  EXPECT_EQ(std::string(r.what()), "bad flag 7");
  Error rh = catch_error([] { DFLASH_REJECT_HINT("bad", "fix it"); });
  EXPECT_EQ(std::string(rh.what()), "bad\n---> HINT: fix it");
  EXPECT_TRUE(catch_error([] { DFLASH_REQUIRE(false, "x"); }).is_user_error());

  // Internal errors (DFLASH_CHECK / DFLASH_FAIL) name their source in every report.
  Error i = catch_error([&] { DFLASH_CHECK(n == 4, "invariant"); });
  EXPECT_FALSE(i.is_user_error());
  EXPECT_TRUE(has(i.report(), "invariant (at tests/test_checks.cpp:")) << i.report();
  EXPECT_EQ(i.report(), i.what());
  EXPECT_EQ(i.report(true), i.report());
  EXPECT_FALSE(catch_error([] { DFLASH_FAIL("x"); }).is_user_error());

  // A copy keeps the kind (errors are carried across ranks and log sinks by copy).
  const Error copy = u;
  EXPECT_TRUE(copy.is_user_error());
  EXPECT_EQ(std::string(copy.what()), u.what());
}

// Every program and every subcommand takes --version and --log-level (core/app.h add_subcommand).
TEST(App, SubcommandsTakeTheCommonOptions) {
  auto make = [](std::string* level) {
    auto app = std::make_unique<CLI::App>("test");
    add_common_options(*app, level);
    add_subcommand(*app, "validate", "check files", level);
    app->require_subcommand(1);
    return app;
  };
  for (const char* line : {"validate --log-level debug", "--log-level debug validate"}) {
    std::string level = "info";
    make(&level)->parse(line, false);
    EXPECT_EQ(level, "debug") << line;
  }
  for (const char* line : {"validate --version", "--version"}) {
    std::string level = "info";
    EXPECT_THROW(make(&level)->parse(line, false), CLI::CallForVersion) << line;
  }
}

TEST(Checks, CheckIoNamesPathAndStrerror) {
  const std::string path = missing_path("nope.bin");
  Error e = catch_error([&] {
    std::FILE* f = std::fopen(path.c_str(), "rb");
    DFLASH_CHECK_IO(f != nullptr, "open", path);
  });
  EXPECT_TRUE(has(e.message(), path)) << e.what();
  EXPECT_TRUE(has(e.message(), "No such file or directory")) << e.what();
  EXPECT_TRUE(has(e.message(), "open")) << e.what();
  EXPECT_FALSE(e.hint().empty());
  EXPECT_TRUE(e.is_user_error());  // a path: the user's to fix
}

// ---------------------------------------------------------------------------------------------
// MPI (never initialized here: Open MPI aborts if MPI_Error_string runs before MPI_Init, so the
// check must fall back to its own table)

int fake_mpi_call(int rc) { return rc; }

TEST(MpiCheck, FabricatedCodeWithoutInit) {
  int initialized = 1;
  MPI_Initialized(&initialized);
  ASSERT_EQ(initialized, 0);

  Error e = catch_error([] { check_mpi(MPI_ERR_COMM, "MPI_Barrier(comm)", __FILE__, __LINE__); });
  EXPECT_TRUE(has(e.message(), "`MPI_Barrier(comm)` failed")) << e.what();
  EXPECT_TRUE(has(e.message(), "MPI_ERR_COMM")) << e.what();
  EXPECT_TRUE(has(e.message(), "invalid communicator")) << e.what();
  EXPECT_TRUE(has(e.where(), "test_checks.cpp:")) << e.where();
  EXPECT_FALSE(e.hint().empty());

  EXPECT_NO_THROW(check_mpi(MPI_SUCCESS, "MPI_Barrier(comm)", __FILE__, __LINE__));
  EXPECT_NO_THROW(DFLASH_MPI_CHECK(fake_mpi_call(MPI_SUCCESS)));
  Error m = catch_error([] { DFLASH_MPI_CHECK(fake_mpi_call(MPI_ERR_TRUNCATE)); });
  EXPECT_TRUE(has(m.message(), "fake_mpi_call(MPI_ERR_TRUNCATE)")) << m.what();
  EXPECT_TRUE(has(m.message(), "MPI_ERR_TRUNCATE")) << m.what();

  // A code outside the table still gives a message with the number.
  EXPECT_TRUE(has(mpi_error_text(987654), "987654"));
}

// ---------------------------------------------------------------------------------------------
// HDF5

TEST(Hdf5Check, MissingFileGivesOneMessageWithReason) {
  const std::string path = missing_path("tokens.h5");
  testing::internal::CaptureStderr();
  Error e = catch_error([&] {
    hid_t f = DFLASH_H5_CHECK(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), "opening dataset '" << path << "'");
    H5Fclose(f);
  });
  std::string err_out = testing::internal::GetCapturedStderr();
  EXPECT_EQ(err_out, "") << "HDF5 printed its own error stack";
  EXPECT_TRUE(has(e.message(), "opening dataset '" + path + "'")) << e.what();
  EXPECT_TRUE(has(e.message(), "H5Fopen(path.c_str()")) << e.what();
  // HDF5's innermost reason: the low-level open with the OS error.
  EXPECT_TRUE(has(e.message(), "No such file or directory")) << e.what();
  EXPECT_TRUE(has(e.where(), "test_checks.cpp:")) << e.where();
  EXPECT_TRUE(has(e.hint(), "path")) << e.what();
}

// A JSONL file where an HDF5 dataset is expected (dflash_train's data.files, dflash_data validate):
// a user error whose hint names the conversion.
TEST(Hdf5Check, NotAnHdf5FileNamesConvert) {
  const std::string path = (std::filesystem::temp_directory_path() / "dflash_test_checks_rows.jsonl").string();
  std::ofstream(path) << "{\"input_ids\": [1, 2], \"loss_mask\": [0, 1]}\n";
  Error e = catch_error([&] {
    H5Handle f(DFLASH_H5_CHECK(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), "opening dataset file '" << path << "'"),
               H5Fclose);
  });
  EXPECT_TRUE(has(e.message(), "signature")) << e.what();
  EXPECT_TRUE(has(e.hint(), "dflash_data convert")) << e.what();
  EXPECT_TRUE(e.is_user_error());
  EXPECT_FALSE(has(e.what(), "(at ")) << e.what();
  std::filesystem::remove(path);
}

TEST(Hdf5Check, ReturnsValueAndHandlesClose) {
  const std::string path = (std::filesystem::temp_directory_path() / "dflash_test_checks.h5").string();
  {
    H5Handle file(DFLASH_H5_CHECK(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), "creating " << path),
                  H5Fclose);
    ASSERT_TRUE(file.valid());
    hsize_t dims[1] = {4};
    H5Handle space(DFLASH_H5_CHECK(H5Screate_simple(1, dims, nullptr), "dataspace"), H5Sclose);
    H5Handle ds(DFLASH_H5_CHECK(H5Dcreate2(file, "/x", H5T_NATIVE_INT32, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                                "creating /x in " << path),
                H5Dclose);
    int32_t v[4] = {1, 2, 3, 4};
    DFLASH_H5_CHECK(H5Dwrite(ds, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, v), "writing /x");

    // Opening a dataset that is not there names the dataset; the handles above still close.
    Error e = catch_error([&] {
      H5Handle missing(DFLASH_H5_CHECK(H5Dopen2(file, "/input_ids", H5P_DEFAULT), "opening /input_ids in " << path),
                       H5Dclose);
    });
    EXPECT_TRUE(has(e.message(), "opening /input_ids in " + path)) << e.what();

    H5Handle moved = std::move(ds);
    EXPECT_FALSE(ds.valid());
    EXPECT_TRUE(moved.valid());
    moved.close("/x");
    EXPECT_FALSE(moved.valid());
  }
  // Every handle was closed: the file can be opened again exclusively.
  H5Handle again(DFLASH_H5_CHECK(H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), "reopening " << path), H5Fclose);
  EXPECT_TRUE(again.valid());
  EXPECT_EQ(H5Fget_obj_count(again, H5F_OBJ_ALL), 1);
  again.reset();
  std::filesystem::remove(path);
}

// ---------------------------------------------------------------------------------------------
// bf16 / f16 conversions

uint16_t bf16_of_bits(uint32_t u) { return f32_to_bf16(bits_to_f32(u)); }

TEST(Dtype, Bf16RoundsToNearestEven) {
  EXPECT_EQ(bf16_of_bits(0x3F800000u), 0x3F80);  // 1.0
  EXPECT_EQ(bf16_of_bits(0x3F808000u), 0x3F80);  // tie, even below
  EXPECT_EQ(bf16_of_bits(0x3F818000u), 0x3F82);  // tie, even above
  EXPECT_EQ(bf16_of_bits(0x3F808001u), 0x3F81);  // just above the tie
  EXPECT_EQ(bf16_of_bits(0x3F807FFFu), 0x3F80);  // just below the tie
  EXPECT_EQ(bf16_of_bits(0xBF818000u), 0xBF82);  // negative tie
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(f32_to_bf16(-std::numeric_limits<float>::infinity()), 0xFF80);
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::max()), 0x7F80);  // overflow rounds to inf
  EXPECT_EQ(bf16_of_bits(0x7F7F7FFFu), 0x7F7F);                        // largest that stays finite
  EXPECT_EQ(f32_to_bf16(-0.0f), 0x8000);
  // Subnormals: bf16 keeps f32's exponent range, so they round like everything else.
  EXPECT_EQ(bf16_of_bits(0x00000001u), 0x0000);
  EXPECT_EQ(bf16_of_bits(0x00018000u), 0x0002);
  EXPECT_EQ(bf16_of_bits(0x00008000u), 0x0000);
  EXPECT_EQ(bf16_of_bits(0x00008001u), 0x0001);
  EXPECT_EQ(bf16_to_f32(0x0001), std::ldexp(1.0f, -133));
  // NaN stays NaN, also a signalling NaN whose payload sits in the low bits only.
  for (uint32_t nan : {0x7FC00000u, 0x7F800001u, 0xFF800001u, 0x7FFFFFFFu}) {
    uint16_t b = bf16_of_bits(nan);
    EXPECT_TRUE(std::isnan(bf16_to_f32(b))) << std::hex << nan;
    EXPECT_EQ(b & 0x8000, (nan >> 16) & 0x8000);
  }
}

TEST(Dtype, F16RoundsToNearestEven) {
  auto h = [](float f) { return f32_to_f16(f); };
  EXPECT_EQ(h(1.0f), 0x3C00);
  EXPECT_EQ(h(1.0f + std::ldexp(1.0f, -11)), 0x3C00);      // tie, even below
  EXPECT_EQ(h(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);  // tie, even above
  EXPECT_EQ(h(-2.0f), 0xC000);
  EXPECT_EQ(h(65504.0f), 0x7BFF);
  EXPECT_EQ(h(65519.0f), 0x7BFF);
  EXPECT_EQ(h(65520.0f), 0x7C00);  // tie between 65504 and 2^16: even is inf
  EXPECT_EQ(h(1e10f), 0x7C00);
  EXPECT_EQ(h(-std::numeric_limits<float>::infinity()), 0xFC00);
  EXPECT_EQ(h(-0.0f), 0x8000);
  // Subnormals.
  EXPECT_EQ(h(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(h(std::ldexp(1.0f, -25)), 0x0000);      // tie with 0: even
  EXPECT_EQ(h(3 * std::ldexp(1.0f, -25)), 0x0002);  // tie between 1 and 2 ulps: even
  EXPECT_EQ(h(std::ldexp(1.0f, -26)), 0x0000);
  EXPECT_EQ(h(1023 * std::ldexp(1.0f, -24)), 0x03FF);
  EXPECT_EQ(h(std::ldexp(1.0f, -14)), 0x0400);
  EXPECT_EQ(h(std::ldexp(1.0f, -14) - std::ldexp(1.0f, -25)), 0x0400);  // tie rounds up into the normals
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_f32(0x83FF), -1023 * std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_f32(0xFC00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7C01)));
  EXPECT_TRUE(std::isnan(f16_to_f32(h(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(f16_to_f32(h(bits_to_f32(0x7F800001u)))));
}

TEST(Dtype, HalfTypesRoundTripExactly) {
  for (uint32_t i = 0; i < 65536; ++i) {
    auto b = static_cast<uint16_t>(i);
    float fb = bf16_to_f32(b);
    if (!std::isnan(fb)) {
      EXPECT_EQ(f32_to_bf16(fb), b) << std::hex << i;
    }
    float fh = f16_to_f32(b);
    if (std::isnan(fh)) {
      EXPECT_EQ(b & 0x7C00, 0x7C00) << std::hex << i;
    } else {
      EXPECT_EQ(f32_to_f16(fh), b) << std::hex << i;
    }
  }
}

// Reference rounding in double: round to a multiple of the format's ulp at x's binade with
// nearbyint (round half to even in the default rounding mode); overflow past `max` gives inf.
float reference_round(float x, int mant_bits, int min_exp, double max) {
  if (x == 0 || std::isinf(x)) return x;
  int e = std::max(std::ilogb(x), min_exp);
  double ulp = std::ldexp(1.0, e - mant_bits);
  double r = std::nearbyint(static_cast<double>(x) / ulp) * ulp;
  if (std::abs(r) > max) return std::copysign(std::numeric_limits<float>::infinity(), x);
  return static_cast<float>(r);
}

TEST(Dtype, RandomValuesMatchReferenceRounding) {
  std::mt19937 gen(1234);
  const double bf16_max = std::ldexp(255.0 / 128.0, 127), f16_max = 65504.0;
  for (int i = 0; i < 400000; ++i) {
    uint32_t u = gen();
    // Half of the draws land in f16's exponent range (incl. its subnormals), the rest anywhere.
    if (i & 1) u = (u & 0x807FFFFFu) | ((100u + gen() % 46u) << 23);
    float x = bits_to_f32(u);
    if (std::isnan(x)) continue;
    EXPECT_EQ(f32_to_bits(bf16_to_f32(f32_to_bf16(x))), f32_to_bits(reference_round(x, 7, -126, bf16_max)))
        << "bf16 of bits 0x" << std::hex << u;
    EXPECT_EQ(f32_to_bits(f16_to_f32(f32_to_f16(x))), f32_to_bits(reference_round(x, 10, -14, f16_max)))
        << "f16 of bits 0x" << std::hex << u;
    if (HasFailure()) break;
  }
}

// ---------------------------------------------------------------------------------------------
// Philox4x32-10 known answers (Random123 kat_vectors)

TEST(Rng, Philox4x32KnownAnswers) {
  struct Kat {
    rng::U32x4 ctr;
    uint32_t k0, k1;
    rng::U32x4 expect;
  };
  const Kat kats[] = {
      {{0, 0, 0, 0}, 0, 0, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
      {{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, 0xffffffffu, 0xffffffffu,
       {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
      {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, 0xa4093822u, 0x299f31d0u,
       {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
  };
  for (const Kat& k : kats) {
    rng::U32x4 got = rng::philox4x32_10(k.ctr, k.k0, k.k1);
    EXPECT_EQ(got.x, k.expect.x);
    EXPECT_EQ(got.y, k.expect.y);
    EXPECT_EQ(got.z, k.expect.z);
    EXPECT_EQ(got.w, k.expect.w);
  }
}

TEST(Rng, UniformAndNormalAreSane) {
  double sum = 0, sum2 = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    float u = rng::uniform(7, 3, static_cast<uint64_t>(i));
    ASSERT_GE(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    float z = rng::normal(7, 3, static_cast<uint64_t>(i));
    ASSERT_TRUE(std::isfinite(z));
    sum += z;
    sum2 += double(z) * z;
  }
  EXPECT_NEAR(sum / n, 0.0, 0.01);
  EXPECT_NEAR(sum2 / n, 1.0, 0.02);
  // Different streams and seeds give different values.
  EXPECT_NE(rng::bits(7, 3, 0), rng::bits(7, 4, 0));
  EXPECT_NE(rng::bits(7, 3, 0), rng::bits(8, 3, 0));
}

// ---------------------------------------------------------------------------------------------
// CUDA / cuBLAS / NCCL checks with fabricated status codes (no GPU or driver needed)

#ifdef DFLASH_WITH_CUDA
cudaError_t fake_cuda_call(cudaError_t e) { return e; }

TEST(CudaCheck, FabricatedCudaErrors) {
  Error oom = catch_error([] { cuda::throw_cuda_error(cudaErrorMemoryAllocation, "cudaMalloc(&p, n)", __FILE__, __LINE__); });
  EXPECT_TRUE(has(oom.message(), "`cudaMalloc(&p, n)` failed")) << oom.what();
  EXPECT_TRUE(has(oom.message(), "cudaErrorMemoryAllocation")) << oom.what();
  EXPECT_TRUE(has(oom.message(), "out of memory")) << oom.what();
  EXPECT_TRUE(has(oom.hint(), "reduce the batch size or sequence length")) << oom.what();
  EXPECT_TRUE(has(oom.where(), "test_checks.cpp:")) << oom.where();

  for (cudaError_t e : {cudaErrorNoDevice, cudaErrorInsufficientDriver}) {
    Error d = catch_error([&] { DFLASH_CUDA_CHECK(fake_cuda_call(e)); });
    EXPECT_TRUE(has(d.message(), cudaGetErrorName(e))) << d.what();
    EXPECT_TRUE(has(d.message(), "fake_cuda_call(e)")) << d.what();
    EXPECT_TRUE(has(d.hint(), "nvidia-smi")) << d.what();
    EXPECT_TRUE(has(d.hint(), "CUDA_VISIBLE_DEVICES")) << d.what();
  }

  Error arch = catch_error([] { DFLASH_CUDA_CHECK(fake_cuda_call(cudaErrorNoKernelImageForDevice)); });
  EXPECT_TRUE(has(arch.hint(), "CMAKE_CUDA_ARCHITECTURES")) << arch.what();
  Error ill = catch_error([] { DFLASH_CUDA_CHECK(fake_cuda_call(cudaErrorIllegalAddress)); });
  EXPECT_TRUE(has(ill.message(), "sticky")) << ill.what();
  EXPECT_TRUE(has(ill.hint(), "compute-sanitizer")) << ill.what();

  EXPECT_NO_THROW(DFLASH_CUDA_CHECK(fake_cuda_call(cudaSuccess)));
  EXPECT_FALSE(DFLASH_CUDA_WARN(fake_cuda_call(cudaErrorInvalidValue)));
  EXPECT_TRUE(DFLASH_CUDA_WARN(fake_cuda_call(cudaSuccess)));
}

TEST(CudaCheck, FabricatedCublasAndNcclErrors) {
  Error b = catch_error([] { DFLASH_CUBLAS_CHECK(CUBLAS_STATUS_NOT_SUPPORTED); });
  EXPECT_TRUE(has(b.message(), "CUBLAS_STATUS_NOT_SUPPORTED")) << b.what();
  EXPECT_FALSE(b.hint().empty());
  Error ba = catch_error([] { cuda::throw_cublas_error(CUBLAS_STATUS_ALLOC_FAILED, "cublasLtMatmul(...)", __FILE__, __LINE__); });
  EXPECT_TRUE(has(ba.message(), "`cublasLtMatmul(...)` failed: CUBLAS_STATUS_ALLOC_FAILED")) << ba.what();
  EXPECT_TRUE(has(ba.hint(), "out of memory")) << ba.what();

  Error n = catch_error([] { cuda::throw_nccl_error(ncclRemoteError, "ncclAllReduce(...)", __FILE__, __LINE__); });
  EXPECT_TRUE(has(n.message(), "`ncclAllReduce(...)` failed: ncclRemoteError")) << n.what();
  EXPECT_TRUE(has(n.message(), ncclGetErrorString(ncclRemoteError))) << n.what();
  EXPECT_TRUE(has(n.hint(), "other ranks")) << n.what();
  Error u = catch_error([] { DFLASH_NCCL_CHECK(ncclInvalidUsage); });
  EXPECT_TRUE(has(u.message(), "ncclInvalidUsage")) << u.what();
  EXPECT_TRUE(has(u.hint(), "NCCL_DEBUG")) << u.what();
}
#endif  // DFLASH_WITH_CUDA

}  // namespace
}  // namespace dflash
