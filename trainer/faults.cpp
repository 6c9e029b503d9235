#include "trainer/faults.h"

#include <cstdlib>

#include <spdlog/fmt/fmt.h>

#include "core/error.h"

namespace dflash::trainer {

CudaFault parse_cuda_fault(const char* value) {
  CudaFault f;
  if (value == nullptr || *value == '\0') return f;
  const std::string v = value;
  const char* form = "use DFLASH_FAULT_CUDA_ERROR=OP:STEP[:KIND] with OP target, drafter or optimizer, STEP >= 1 and "
                     "KIND launch or trap (e.g. drafter:6:trap), or unset it";
  const size_t c1 = v.find(':');
  DFLASH_REQUIRE_HINT(c1 != std::string::npos, "DFLASH_FAULT_CUDA_ERROR='" << v << "' has no ':STEP'", form);
  const size_t c2 = v.find(':', c1 + 1);
  f.op = v.substr(0, c1);
  const std::string step = v.substr(c1 + 1, c2 == std::string::npos ? std::string::npos : c2 - c1 - 1);
  if (c2 != std::string::npos) f.kind = v.substr(c2 + 1);
  DFLASH_REQUIRE_HINT(f.op == "target" || f.op == "drafter" || f.op == "optimizer",
                      "DFLASH_FAULT_CUDA_ERROR='" << v << "': '" << f.op << "' is not an op", form);
  DFLASH_REQUIRE_HINT(f.kind == "launch" || f.kind == "trap",
                      "DFLASH_FAULT_CUDA_ERROR='" << v << "': '" << f.kind << "' is not a kind", form);
  char* end = nullptr;
  const long long s = std::strtoll(step.c_str(), &end, 10);
  DFLASH_REQUIRE_HINT(!step.empty() && end && *end == '\0' && s >= 1,
                      "DFLASH_FAULT_CUDA_ERROR='" << v << "': '" << step << "' is not a step >= 1", form);
  f.step = s;
  return f;
}

std::string step_failure_message(int rank, int64_t step, const std::string& message) {
  return fmt::format("rank {}, step {}: {}", rank, step, message);
}

void check_memory_plan_fits(const MemoryPlan& plan, double free_bytes, double total_bytes, const std::string& device) {
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  const double need = plan.total() * (1.0 + kMemoryPlanMargin);
  DFLASH_REQUIRE_HINT(need <= free_bytes,
                      "GPU training on " << device << " does not fit: the memory plan needs "
                                         << fmt::format("{:.2f} GiB ({:.2f} GiB + {:.0f}% headroom)", need / kGiB,
                                                        plan.total() / kGiB, 100 * kMemoryPlanMargin)
                                         << " but " << fmt::format("{:.2f}", free_bytes / kGiB) << " GiB are free:\n"
                                         << plan.table(total_bytes),
                      "raise parallel.tp (the target's weights split), lower training.num_anchors or "
                      "training.batch_size (the drafter's activations), data.max_length (the target's activations), "
                      "or use fewer drafter layers");
}

std::string memory_plan_shortfall(double plan_bytes, double peak_bytes) {
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  // The start-up check keeps kMemoryPlanMargin free beyond the plan: a peak above the plan by less than
  // half of that still leaves the check its purpose (the plan's line beside it shows the gap).
  if (peak_bytes <= plan_bytes * (1.0 + kMemoryPlanMargin / 2)) return "";
  return fmt::format("the memory plan underestimated this run's first step by {:.2f} GiB ({:.2f} planned, {:.2f} "
                     "measured, +{:.1f}%): more than half of its start-up check's {:.0f}% headroom, so the check may "
                     "pass runs that do not fit",
                     (peak_bytes - plan_bytes) / kGiB, plan_bytes / kGiB, peak_bytes / kGiB,
                     100 * (peak_bytes / plan_bytes - 1), 100 * kMemoryPlanMargin);
}

}  // namespace dflash::trainer
