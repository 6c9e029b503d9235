// dump_drafter_logits OUT_DIR: two small random drafters (one with sliding layers, one all full
// attention) exported with drafter::export_hf, and for fixed inputs what dflash's CPU reference
// drafter computes for them, for tests/reference/check_automodel.py to compare with the exported
// PyTorch module (transformers' AutoModel) and, where available, z-lab's DFlashDraftModel.
//
// OUT_DIR/<variant>/drafter/            the export (config.json, model.safetensors, modeling_dflash.py)
// OUT_DIR/<variant>/reference.safetensors
//   context [N, k·H] f32   captured target features, two sequences packed (offsets [3] i64)
//   tokens [N] i32, blocks [nb, 2] i64 (sequence, anchor), embed_tokens / lm_head [V, H] f32
//   final_hidden [nb·B, H] f64   the drafter's final-normed block rows (drafter::forward_backward)
//   logits [nb·B, V] f64         final_hidden · lm_head^T
// The weights are rounded to bf16 before the forward, so the export holds exactly the weights
// the reference used; everything after that is float64.
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "core/app.h"
#include "core/io/safetensors.h"
#include "core/log.h"
#include "core/random.h"
#include "drafter/model.h"
#include "drafter/weights.h"
#include "small_drafter.h"

namespace {

using namespace dflash;
using namespace dflash::drafter;

Tensor normal(const Shape& shape, uint64_t stream, float mean, float stddev) {
  Tensor t = Tensor::zeros(shape, DType::F32);
  fill_normal(t, {20261202, stream, 0}, mean, stddev);
  return t;
}

void dump(const DrafterConfig& c, const std::string& dir) {
  // Weights with spread (attention far from uniform), norms around 1, then rounded to bf16.
  DrafterWeights w = DrafterWeights::zeros(c, DType::F32);
  uint64_t stream = 100;
  for (auto& e : w.entries(c))
    *e.tensor = normal(e.shape, ++stream, e.is_norm ? 1.0f : 0.0f, e.is_norm ? 0.1f : 0.15f)
                    .to_dtype(DType::BF16)
                    .to_dtype(DType::F32);
  FrozenTarget t{normal({c.vocab_size, c.hidden_size}, 1, 0.0f, 1.0f),
                 normal({c.vocab_size, c.hidden_size}, 2, 0.0f, 0.5f)};
  DrafterBatch b;
  b.seqs.offsets = {0, 26, 39};
  const int64_t N = b.seqs.offsets.back();
  b.context = normal({N, c.context_dim()}, 3, 0.0f, 1.0f);
  for (int64_t i = 0; i < N; ++i) b.tokens.push_back(static_cast<int32_t>((i * 13 + 5) % (c.vocab_size - 1)));
  b.loss_mask.assign(static_cast<size_t>(N), 1);
  // Anchor 0 has no context; (1, 9) runs past the end of its sequence; the anchors of sequence 0
  // ascend, so check_automodel.py can also feed its context through a KV cache, piece by piece.
  b.blocks = {{0, 0}, {0, 4}, {0, 11}, {0, 20}, {1, 2}, {1, 9}};
  Tensor final_hidden;
  forward_backward(c, w, t, b, StepOptions{}, nullptr, nullptr, &final_hidden);

  const int64_t R = final_hidden.size(0), H = c.hidden_size, V = c.vocab_size;
  Tensor logits = Tensor::zeros({R, V}, DType::F64);
  const Tensor head = t.lm_head.to_dtype(DType::F64);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < V; ++v) {
      double s = 0;
      for (int64_t k = 0; k < H; ++k) s += final_hidden.data<double>()[r * H + k] * head.data<double>()[v * H + k];
      logits.data<double>()[r * V + v] = s;
    }
  Tensor tokens = Tensor::empty({N}, DType::I32), offsets = Tensor::empty({3}, DType::I64);
  Tensor blocks = Tensor::empty({static_cast<int64_t>(b.blocks.size()), 2}, DType::I64);
  for (int64_t i = 0; i < N; ++i) tokens.data<int32_t>()[i] = b.tokens[i];
  for (int64_t i = 0; i < 3; ++i) offsets.data<int64_t>()[i] = b.seqs.offsets[i];
  for (size_t i = 0; i < b.blocks.size(); ++i) {
    blocks.data<int64_t>()[2 * i] = b.blocks[i].seq;
    blocks.data<int64_t>()[2 * i + 1] = b.blocks[i].anchor;
  }
  std::filesystem::create_directories(dir);
  export_hf(dir + "/drafter", c, w);
  io::save_safetensors(dir + "/reference.safetensors",
                       {{"context", b.context}, {"tokens", tokens}, {"offsets", offsets}, {"blocks", blocks},
                        {"embed_tokens", t.embed_tokens}, {"lm_head", t.lm_head}, {"final_hidden", final_hidden},
                        {"logits", logits}},
                       {{"block_size", std::to_string(c.block_size)}, {"mask_token_id", std::to_string(c.mask_token_id)}});
  spdlog::info("dump_drafter_logits: {}: {}", dir, c.summary());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Export two small random DFlash drafters and dflash's logits for fixed inputs"};
  std::string out, log_level;
  app.add_option("out_dir", out, "output directory")->required();
  add_common_options(app, &log_level);
  return run_app(app, argc, argv, [&] {
    dump(fixtures::small_drafter_config({AttnType::Sliding, AttnType::Full, AttnType::Sliding}), out + "/mixed");
    dump(fixtures::small_drafter_config({AttnType::Full, AttnType::Full, AttnType::Full}), out + "/full");
    return 0;
  });
}
