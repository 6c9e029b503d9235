// What both training backends load and make the same way (backend.h).
#include "trainer/backend.h"

#include "drafter/weights.h"
#include "target_model/runtime.h"

namespace dflash::trainer {

target::TargetWeights load_target(const BackendSetup& s, Device device) {
  return target::load_target_shard(s.cfg->model.target.source(), s.target, device,
                                   target::TpShard{s.layout.tp_rank, s.layout.tp_size, static_cast<int>(s.cfg->parallel.ep)});
}

drafter::DrafterWeights initial_drafter_weights(const BackendSetup& s, Device device) {
  const TrainConfig& cfg = *s.cfg;
  return cfg.model.drafter.warm_start.empty()
             ? drafter::DrafterWeights::random(s.drafter, static_cast<uint64_t>(cfg.training.seed), 0.02f, DType::F32, device)
             : drafter::import_hf(cfg.model.drafter.warm_start, DType::F32).weights;
}

AdamWHyper adamw_hyper(const TrainConfig& cfg) {
  const auto& tr = cfg.training;
  return AdamWHyper{tr.betas.at(0), tr.betas.at(1), tr.eps, tr.weight_decay};
}

}  // namespace dflash::trainer
