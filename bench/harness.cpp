#include "bench/harness.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <fstream>

#include "dflash/version.h"
#include "kernels/cuda/check.h"
#include "kernels/error.h"

namespace dflash::bench {

namespace {
double quantile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0;
  const double pos = q * static_cast<double>(sorted.size() - 1);
  const size_t lo = static_cast<size_t>(pos);
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - static_cast<double>(lo));
}
}  // namespace

Stats summarize(std::vector<double> samples, const std::vector<double>& round_medians, double noisy_threshold) {
  Stats s;
  std::sort(samples.begin(), samples.end());
  s.samples = samples;
  s.p50 = quantile(samples, 0.5);
  s.p20 = quantile(samples, 0.2);
  s.p80 = quantile(samples, 0.8);
  s.min = samples.empty() ? 0 : samples.front();
  s.max = samples.empty() ? 0 : samples.back();
  if (round_medians.size() > 1) {
    auto [mn, mx] = std::minmax_element(round_medians.begin(), round_medians.end());
    s.round_spread = (*mx - *mn) / std::max(*mn, 1e-12);
    s.noisy = s.round_spread > noisy_threshold;
  }
  return s;
}

std::vector<double> time_cuda(void* stream, int warmup, int iters, const std::function<void()>& fn) {
  auto st = static_cast<cudaStream_t>(stream);
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<cudaEvent_t> ev(static_cast<size_t>(iters) + 1);
  for (auto& e : ev) DFLASH_CUDA_CHECK(cudaEventCreate(&e));
  DFLASH_CUDA_CHECK(cudaEventRecord(ev[0], st));
  for (int i = 0; i < iters; ++i) {
    fn();
    DFLASH_CUDA_CHECK(cudaEventRecord(ev[static_cast<size_t>(i) + 1], st));
  }
  DFLASH_CUDA_CHECK(cudaEventSynchronize(ev.back()));
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    float t = 0;
    DFLASH_CUDA_CHECK(cudaEventElapsedTime(&t, ev[static_cast<size_t>(i)], ev[static_cast<size_t>(i) + 1]));
    ms.push_back(t);
  }
  for (auto& e : ev) cudaEventDestroy(e);
  return ms;
}

std::string utc_timestamp() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

CsvWriter::CsvWriter(std::string path, std::string gpu_name)
    : path_(std::move(path)), gpu_(std::move(gpu_name)), timestamp_(utc_timestamp()) {
  const bool fresh = !std::filesystem::exists(path_) || std::filesystem::file_size(path_) == 0;
  if (std::filesystem::path(path_).has_parent_path()) std::filesystem::create_directories(std::filesystem::path(path_).parent_path());
  std::ofstream out(path_, std::ios::app);
  DFLASH_CHECK_IO(out.good(), "opening CSV", path_);
  if (fresh) out << "bench,kernel,provider,mode,metric,unit,shape,p50,p20,p80,noisy,gpu,commit,timestamp\n";
}

void CsvWriter::write(const Row& r) {
  std::ofstream out(path_, std::ios::app);
  DFLASH_CHECK_IO(out.good(), "appending to CSV", path_);
  auto q = [](const std::string& s) { return "\"" + s + "\""; };
  out << r.bench << "," << r.kernel << "," << r.provider << "," << r.mode << "," << r.metric << "," << r.unit << ","
      << q(r.shape) << "," << r.p50 << "," << r.p20 << "," << r.p80 << "," << (r.noisy ? 1 : 0) << "," << q(gpu_) << ","
      << kGitCommit << "," << timestamp_ << "\n";
  DFLASH_CHECK_IO(out.good(), "appending to CSV", path_);
}

}  // namespace dflash::bench
