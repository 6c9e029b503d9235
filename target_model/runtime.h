#pragma once
// The frozen target as the decoding tools load it (dflash_eval, dflash_data regenerate, the
// generation benchmark): a Hugging Face checkpoint or seeded random weights, this rank's TP shard,
// on the CPU reference (f32) or a GPU (bf16 with the fast-path plans), and decoders on it.
#include <cstdint>
#include <memory>
#include <string>

#include "core/device.h"
#include "target_model/config.h"
#include "target_model/decode.h"
#include "target_model/fast_path.h"
#include "target_model/tp.h"
#include "target_model/weights.h"

namespace dflash::comm {
class Communicator;
}

namespace dflash::target {

class TargetModel;
class CudaTargetModel;

// Where the target comes from: a model directory, or a config.json with seeded random weights.
struct TargetSource {
  std::string model_dir;
  std::string config_path;
  bool random_weights = false;
  uint64_t seed = 0;
  Precision precision = Precision::Auto;  // what the projections run in (weights.h)
  // MoE targets on a GPU: the routed experts stored in FP8 after loading (store_moe_experts_fp8:
  // W8A16, half their memory and of a decode step's expert reads; a bf16 or random target's experts
  // are quantized per 128 x 128 block, an FP8 checkpoint's re-quantized from their bf16 values).
  bool fp8_experts = false;
  // Checks that exactly one source is given (naming the options as `model_opt` / `config_opt` say).
  void check(const std::string& model_opt = "--model", const std::string& config_opt = "--config") const;
  TargetConfig read_config() const;   // the full model's architecture
  std::string describe() const;       // "DIR" or "random weights (seed S) of FILE"
  // What a regeneration's manifest records of the target: describe(), the architecture, and the
  // precision when it is fp8 (bf16 runs keep the identity they had before FP8 existed).
  std::string identity(const TargetConfig& full) const;
};

// This rank's shard of the target's weights from `source` (a checkpoint or seeded random weights,
// at the source's precision): f32 for the CPU reference, bf16 on a GPU. Every tool and both trainer
// backends load the target through this.
TargetWeights load_target_shard(const TargetSource& source, const TargetConfig& full, Device device, const TpShard& shard);

class TargetRuntime {
 public:
  // Loads this rank's shard (tp_comm: the TP group, or null for tp = 1). On a GPU the prefill and
  // decode plans are made for the GPU's architecture; require_fast_path refuses a fallback in
  // either (and the CPU backend, which has no fast path).
  // ep: the MoE block's expert groups within the TP group (tp.h; 1 for a dense target).
  TargetRuntime(const TargetSource& source, const TargetConfig& full, Device device, int tp, int tp_rank,
                comm::Communicator* tp_comm, bool require_fast_path, int ep = 1);
  ~TargetRuntime();
  TargetRuntime(const TargetRuntime&) = delete;
  TargetRuntime& operator=(const TargetRuntime&) = delete;

  Device device() const { return device_; }
  const TargetConfig& local_config() const { return local_; }
  const TargetWeights& weights() const;
  // "prefill: <plan>; decode: <plan>" on a GPU, "" on the CPU.
  const std::string& plans() const { return plans_; }
  TargetModel* cpu_model() { return cpu_.get(); }
  CudaTargetModel* cuda_model() { return cuda_.get(); }

  std::unique_ptr<Decoder> make_decoder(int64_t num_slots, int64_t max_len);
  // The decode plan later decoders get (benches build decoders of variants of it with make_cuda_decoder).
  const FastPathPlan& decode_plan() const { return decode_plan_; }
  // Whether later decoders' decode / verify steps replay CUDA graphs (default: on a GPU; the tools'
  // --no-cuda-graphs turns them off). Updates plans().
  void set_cuda_graphs(bool on);

 private:
  Device device_;
  TargetConfig local_;
  std::string plans_;
  std::unique_ptr<TargetModel> cpu_;
  std::unique_ptr<CudaTargetModel> cuda_;
  FastPathPlan decode_plan_;
};

}  // namespace dflash::target
