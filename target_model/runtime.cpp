#include "target_model/runtime.h"

#include "core/error.h"
#include "core/log.h"
#include "target_model/model.h"
#if DFLASH_WITH_CUDA
#include "target_model/model_cuda.h"
#endif

namespace dflash::target {

#if !DFLASH_WITH_CUDA
class CudaTargetModel {};  // never made without CUDA (the unique_ptr needs a complete type)
#endif

void TargetSource::check(const std::string& model_opt, const std::string& config_opt) const {
  DFLASH_REQUIRE_HINT(!model_dir.empty() || (random_weights && !config_path.empty()), "no target given",
                    "pass " << model_opt << " DIR, or " << config_opt << " FILE with random weights");
  DFLASH_REQUIRE_HINT(model_dir.empty() || !random_weights, model_opt << " and random weights are exclusive",
                    "give a checkpoint directory or a config with random weights, not both");
}

TargetConfig TargetSource::read_config() const { return TargetConfig::from_file(random_weights ? config_path : model_dir); }

std::string TargetSource::describe() const {
  return (random_weights ? "random weights (seed " + std::to_string(seed) + ") of " + config_path : model_dir) +
         (fp8_experts ? " (FP8 experts)" : "");
}

std::string TargetSource::identity(const TargetConfig& full) const {
  const bool fp8 = resolve_precision(precision, full) == Precision::Fp8;
  return describe() + ": " + full.summary() + (fp8 ? ", precision fp8" : "");
}

TargetWeights load_target_shard(const TargetSource& source, const TargetConfig& full, Device device, const TpShard& shard) {
  const DType dtype = device.is_cpu() ? DType::F32 : DType::BF16;
  if (const std::string note = full.state_dtype_note(); !note.empty()) spdlog::warn("{}", note);
  DFLASH_REQUIRE_HINT(!source.fp8_experts || full.is_moe(),
                      "FP8 experts (--fp8-experts, model.target.fp8_experts): " << full.source
                                                                               << " is a dense model (no experts to store in FP8)",
                      "drop them; precision fp8 is the dense FP8 target");
  DFLASH_REQUIRE_HINT(!source.fp8_experts || device.is_cuda(),
                      "FP8 experts (--fp8-experts, model.target.fp8_experts) are a GPU storage of bf16 weights, not for "
                          << device.str(),
                      "drop them on the CPU (the CPU reference runs its experts in f32)");
  TargetWeights w = source.random_weights ? random_weights_tp(full, source.seed, dtype, device, shard, source.precision)
                                          : load_weights_tp(full, source.model_dir, dtype, device, shard, source.precision);
  if (source.fp8_experts) {
    // An FP8 checkpoint's experts keep its own codes (quantized with its own scales); otherwise the
    // experts are quantized per block.
    std::string why;
    const std::vector<MoeExpertScales> scales =
        source.random_weights ? std::vector<MoeExpertScales>{} : read_moe_expert_scales(full, source.model_dir, shard, &why);
    if (!source.random_weights)
      spdlog::info("FP8 experts: {}", scales.empty() ? "quantized per 128 x 128 block (the checkpoint's own codes not used: " +
                                                           why + ")"
                                                     : std::string("the checkpoint's own codes and scales"));
    store_moe_experts_fp8(w, &scales);
  }
  return w;
}

TargetRuntime::TargetRuntime(const TargetSource& source, const TargetConfig& full, Device device, int tp, int tp_rank,
                             comm::Communicator* tp_comm, bool require_fast_path, int ep)
    : device_(device), local_(target::local_config(full, tp, ep)) {
  const TpShard shard{tp_rank, tp, ep};
  if (device.is_cpu()) {
    DFLASH_REQUIRE_HINT(!require_fast_path, "require_fast_path: the CPU backend is the f32 reference, which has no fast path",
                      "run on a GPU (--device cuda)");
    check_cpu_reference_fits(local_, full, "the CPU reference is for small models; run big targets with --device cuda");
    TargetWeights w = load_target_shard(source, full, device, shard);
    cpu_ = std::make_unique<TargetModel>(local_, std::move(w), tp_comm);
    return;
  }
#if DFLASH_WITH_CUDA
  check_device_visible(device);
  const int sm = cuda_device_info(device.index).major;
  const KernelPolicies pol = KernelPolicies::all(KernelPolicy::Auto, require_fast_path);
  const Precision precision = resolve_precision(source.precision, full);
  FastPathPlan plan = make_plan(local_, device, pol, sm, precision);
  decode_plan_ = make_decode_plan(local_, device, pol, sm, precision);
  plans_ = "prefill: " + plan.summary() + "; decode: " + decode_plan_.summary();
  for (const std::string& f : plan.fallbacks()) spdlog::warn("prefill fallback: {}", f);
  for (const std::string& f : decode_plan_.fallbacks()) spdlog::warn("decode fallback: {}", f);
  TargetWeights w = load_target_shard(source, full, device, shard);
  cuda_ = std::make_unique<CudaTargetModel>(local_, std::move(w), plan, tp_comm);
#else
  DFLASH_REJECT_HINT("device " << device.str() << ": this build has no CUDA backend", "reconfigure with -DDFLASH_CUDA=ON");
#endif
}

TargetRuntime::~TargetRuntime() = default;

const TargetWeights& TargetRuntime::weights() const {
#if DFLASH_WITH_CUDA
  if (cuda_) return cuda_->weights();
#endif
  return cpu_->weights();
}

void TargetRuntime::set_cuda_graphs(bool on) {
  if (device_.is_cpu()) return;  // the CPU reference has no graphs
  decode_plan_.cuda_graphs = on;
  const size_t at = plans_.find("; decode: ");
  if (at != std::string::npos) plans_ = plans_.substr(0, at) + "; decode: " + decode_plan_.summary();
}

std::unique_ptr<Decoder> TargetRuntime::make_decoder(int64_t num_slots, int64_t max_len) {
#if DFLASH_WITH_CUDA
  if (cuda_) return make_cuda_decoder(*cuda_, num_slots, max_len, decode_plan_);
#endif
  return make_cpu_decoder(*cpu_, num_slots, max_len);
}

}  // namespace dflash::target
