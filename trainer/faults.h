#pragma once
// The GPU-side fault hooks of the trainer and the messages of a failed step (host code, testable
// without a GPU): DFLASH_FAULT_CUDA_ERROR (a CUDA error raised inside a step, for the fault matrix;
// never for production runs), the rank / step / op prefix of an error raised by a step, and the
// memory plan's start-up refusal.
#include <cstdint>
#include <string>

#include "trainer/memory_plan.h"

namespace dflash::trainer {

// DFLASH_FAULT_CUDA_ERROR=OP:STEP[:KIND]: at the 1-based STEP the GPU backend makes one CUDA
// launch fail inside OP (target: the target's forward; drafter: the drafter's forward + backward;
// optimizer: the AdamW update). KIND launch (default): a launch with an invalid configuration,
// reported at the launch; trap: a kernel that traps on the device (a sticky error, as a faulting
// kernel gives), reported at the next synchronization.
struct CudaFault {
  std::string op, kind = "launch";
  int64_t step = -1;
  bool enabled() const { return step > 0; }
  bool at(int64_t s, const char* o) const { return step == s && op == o; }
};
// value: the variable's text (nullptr or "" = no fault). A malformed value is a user error naming it.
CudaFault parse_cuda_fault(const char* value);

// What a step that threw reports: "rank R, step S: MESSAGE" (the message names the op where the
// backend knows it: "drafter forward+backward: ...").
std::string step_failure_message(int rank, int64_t step, const std::string& message);

// The memory plan's headroom: a run is refused at start-up unless plan.total() x (1 + margin) fits
// in the free device memory. Measured on the H200 (bench/results, docs/reliability.md): the plan is
// 1-3% below the allocator's peak, and the caching allocator reserves ~8% more than it hands out.
constexpr double kMemoryPlanMargin = 0.10;
// Throws a user error with the plan's table and what to change when the plan does not fit in
// free_bytes of device `device` (total_bytes: its size, for the table's shares).
void check_memory_plan_fits(const MemoryPlan& plan, double free_bytes, double total_bytes, const std::string& device);
// The first step's measured peak against the plan's total (bytes): "" when the peak is within half of the
// start-up check's headroom above the plan, else the warning the GPU backend logs (a low plan lets the
// start-up check pass runs that may not fit: session 29's FP8 drafter recipe, 68.08 GiB planned, 77.07
// measured; after its fix, 70.85 planned and 71.74 measured, +1.3%, is no warning).
std::string memory_plan_shortfall(double plan_bytes, double peak_bytes);

}  // namespace dflash::trainer
