// The CPU reference target against Hugging Face transformers 5.17 (golden data made by
// tests/reference/make_golden.py on the GPU machine, computed on its CPU in float32 with
// transformers' own pure-torch Qwen3.5 code). Two tiny random checkpoints as transformers saved
// them (bf16 single file; f16 sharded), sequence lengths 1, 37 and 130.
//
// Bound: every captured decoder-layer output within max |ours - hf| / max |hf| <= 1e-5 of
// transformers' float32 output, and of the float64 run ("exact"). Measured values are printed.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "target_model/flops.h"
#include "target_model/model.h"
#include "core/io/safetensors.h"
#include "golden_layers.h"
#include "test_util.h"

using namespace dflash;
using namespace dflash::target;
namespace fs = std::filesystem;

namespace {

const std::string kHf = std::string(DFLASH_TEST_DATA_DIR) + "/hf/";
// The issue asks for 1e-4; we measure <= 2.4e-6 and hold 1e-5, tight enough to catch a RoPE table
// rounded to f16 (1.7e-5), a bug the first golden data set had.
constexpr double kBound = 1e-5;

std::string temp_dir(const std::string& name) {
  fs::path p = fs::temp_directory_path() / ("dflash_golden_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

class Golden : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST_P(Golden, EveryLayerMatchesTransformers) {
  const std::string dir = kHf + GetParam();
  expect_every_layer_matches_golden(dir, dir + "/golden.safetensors", GetParam(), kBound);
}

// Packing several sequences in one batch gives each the result it gets alone.
TEST_P(Golden, BatchOfSequencesEqualsSeparateRuns) {
  const std::string dir = kHf + GetParam();
  TargetConfig cfg = TargetConfig::from_file(dir);
  TargetModel model(cfg, load_weights(cfg, dir, DType::F32, Device::cpu()));
  io::SafetensorsFile golden(dir + "/golden.safetensors");
  std::vector<std::vector<int32_t>> batch;
  for (int T : {37, 1, 130}) batch.push_back(ids_of(golden.tensor("ids." + std::to_string(T))));
  ForwardOptions opt;
  const int64_t last = cfg.num_hidden_layers - 1;
  opt.capture = {0, last};
  ForwardResult r = model.forward(batch, opt);
  ASSERT_EQ(r.offsets, (std::vector<int64_t>{0, 37, 38, 168}));
  for (size_t s = 0; s < batch.size(); ++s) {
    const std::string t = std::to_string(batch[s].size());
    for (int64_t id : {int64_t{0}, last}) {
      Tensor mine = r.layers.at(id).slice(0, r.offsets[s], r.offsets[s + 1]);
      EXPECT_LE(max_rel_err(mine, golden.tensor("layer." + t + "." + std::to_string(id))), kBound)
          << "sequence " << s << " layer " << id;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(HfCheckpoints, Golden, ::testing::Values("tiny_a", "tiny_b"));

// ForwardOptions::skip_unused_layers (the trainer's forward): the layers after the last captured one
// do not run (the counters see layers 0..1 of 4), the captured outputs are those of the whole stack
// bit for bit, and an option that needs the last layer (final_norm) runs them all.
TEST(TargetForward, SkipUnusedLayersStopsAfterTheLastCapturedLayer) {
  const std::string dir = kHf + "tiny_a";
  TargetConfig cfg = TargetConfig::from_file(dir);
  ASSERT_EQ(cfg.num_hidden_layers, 4);
  TargetModel model(cfg, load_weights(cfg, dir, DType::F32, Device::cpu()));
  io::SafetensorsFile golden(dir + "/golden.safetensors");
  const std::vector<int32_t> ids = ids_of(golden.tensor("ids.37"));
  ForwardOptions full;
  full.capture = {0, 1};
  PathCounters all, part;
  full.counters = &all;
  const ForwardResult rf = model.forward({ids}, full);
  ForwardOptions skip = full;
  skip.skip_unused_layers = true;
  skip.counters = &part;
  EXPECT_EQ(layers_to_run(cfg, skip), 2);
  const ForwardResult rs = model.forward({ids}, skip);
  const uint64_t per_layer_all = all.get(Step::Gemm, Path::Cpu), per_layer_part = part.get(Step::Gemm, Path::Cpu);
  EXPECT_EQ(per_layer_all, 4u);
  EXPECT_EQ(per_layer_part, 2u) << "layers 2 and 3 ran though no output needs them";
  for (int64_t id : {int64_t{0}, int64_t{1}}) {
    const Tensor& a = rf.layers.at(id);
    const Tensor& b = rs.layers.at(id);
    ASSERT_EQ(a.nbytes(), b.nbytes());
    EXPECT_EQ(std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()), 0) << "layer " << id;
  }
  skip.final_norm = true;
  EXPECT_EQ(layers_to_run(cfg, skip), 4);
  skip.final_norm = false;
  skip.capture = {};
  EXPECT_EQ(layers_to_run(cfg, skip), 0);
  EXPECT_EQ(layers_to_run(cfg, full), 4) << "without the option every layer runs";
  // The trainer's MFU counts the layers that ran.
  EXPECT_DOUBLE_EQ(forward_flops(cfg, {37}, 4), forward_flops(cfg, {37}));
  EXPECT_LT(forward_flops(cfg, {37}, 2), 0.75 * forward_flops(cfg, {37}));
  EXPECT_GT(forward_flops(cfg, {37}, 2), 0.25 * forward_flops(cfg, {37}));
}

// The multimodal checkpoint layout (model_type qwen3_5 with text_config; tensors under
// model.language_model.*, plus MTP and vision tensors that the target ignores) loads to the same model.
TEST(GoldenLayouts, MultimodalNamesAndConfig) {
  const std::string src = kHf + "tiny_a";
  const std::string dir = temp_dir("mm");
  io::SafetensorsIndex in = io::open_checkpoint(src);
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const std::string& n : in.names())
    tensors.emplace_back(n.rfind("model.", 0) == 0 ? "model.language_model." + n.substr(6) : n, in.tensor(n));
  tensors.emplace_back("mtp.fc.weight", Tensor::zeros({4, 4}, DType::BF16));
  tensors.emplace_back("model.visual.blocks.0.attn.qkv.weight", Tensor::zeros({4, 4}, DType::BF16));
  io::save_sharded(dir, tensors, 200 << 10);
  nlohmann::json text;
  std::ifstream(src + "/config.json") >> text;
  nlohmann::json mm{{"model_type", "qwen3_5"}, {"architectures", {"Qwen3_5ForConditionalGeneration"}},
                    {"text_config", text}, {"vision_config", {{"depth", 1}}}};
  std::ofstream(dir + "/config.json") << mm.dump(1);

  TargetConfig cfg = TargetConfig::from_file(dir);
  EXPECT_EQ(cfg.model_type, "qwen3_5");
  TargetModel model(cfg, load_weights(cfg, dir, DType::F32, Device::cpu()));
  io::SafetensorsFile golden(src + "/golden.safetensors");
  ForwardOptions opt;
  opt.capture = {cfg.num_hidden_layers - 1};
  ForwardResult r = model.forward({ids_of(golden.tensor("ids.37"))}, opt);
  EXPECT_LE(max_rel_err(r.layers.at(cfg.num_hidden_layers - 1), golden.tensor("layer.37.3")), kBound);
  fs::remove_all(dir);
}

// Random weights -> save_checkpoint -> load_weights reproduces the same forward bit for bit, and
// random initialisation is a pure function of (config, seed).
TEST(GoldenLayouts, RandomWeightsRoundTrip) {
  TargetConfig cfg = TargetConfig::from_file(kHf + "tiny_b");
  TargetModel a(cfg, random_weights(cfg, 7, DType::F32, Device::cpu()));
  const std::string dir = temp_dir("rand");
  save_checkpoint(cfg, a.weights(), dir, DType::F32);
  TargetConfig cfg2 = TargetConfig::from_file(dir);
  TargetModel b(cfg2, load_weights(cfg2, dir, DType::F32, Device::cpu()));
  TargetModel c(cfg, random_weights(cfg, 7, DType::F32, Device::cpu()));
  TargetModel d(cfg, random_weights(cfg, 8, DType::F32, Device::cpu()));
  ForwardOptions opt;
  opt.capture = {2, 5};
  std::vector<std::vector<int32_t>> batch{{1, 2, 3, 4, 5, 499}, {7}};
  ForwardResult ra = a.forward(batch, opt), rb = b.forward(batch, opt), rc = c.forward(batch, opt),
                rd = d.forward(batch, opt);
  for (int64_t id : {2, 5}) {
    EXPECT_EQ(max_rel_err(rb.layers.at(id), ra.layers.at(id)), 0.0);
    EXPECT_EQ(max_rel_err(rc.layers.at(id), ra.layers.at(id)), 0.0);
    EXPECT_GT(max_rel_err(rd.layers.at(id), ra.layers.at(id)), 1e-2);
    // Activations stay O(1) through the stack (no blow-up, no collapse).
    double ss = 0;
    for (double v : to_doubles(ra.layers.at(id))) ss += v * v;
    const double rms = std::sqrt(ss / static_cast<double>(ra.layers.at(id).numel()));
    EXPECT_GT(rms, 0.1);
    EXPECT_LT(rms, 100.0);
  }
  fs::remove_all(dir);
}

TEST(GoldenBadInputs, TokenIdOutsideVocabulary) {
  TargetConfig cfg = TargetConfig::from_file(kHf + "tiny_a");
  TargetModel model(cfg, random_weights(cfg, 1, DType::F32, Device::cpu()));
  const std::string e = error_of([&] { model.forward({{1, 2}, {3, 300}}, {}); });
  EXPECT_NE(e.find("token id 300 at sequence 1, position 1"), std::string::npos) << e;
  EXPECT_NE(error_of([&] { model.forward({{1, -5}}, {}); }).find("token id -5"), std::string::npos);
  EXPECT_NE(error_of([&] { model.forward({{}}, {}); }).find("sequence 0 is empty"), std::string::npos);
  ForwardOptions opt;
  opt.capture = {4};
  EXPECT_NE(error_of([&] { model.forward({{1}}, opt); }).find("capture layer id 4"), std::string::npos);
}

TEST(GoldenBadInputs, MissingUnexpectedAndMisshapedTensorsAreListed) {
  const std::string src = kHf + "tiny_a";
  io::SafetensorsIndex in = io::open_checkpoint(src);
  const std::string dir = temp_dir("bad");
  fs::copy_file(src + "/config.json", dir + "/config.json");
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const std::string& n : in.names()) {
    if (n == "model.layers.1.linear_attn.A_log") continue;  // missing
    Tensor t = in.tensor(n);
    if (n == "model.layers.3.self_attn.q_norm.weight") t = Tensor::zeros({31}, DType::BF16);  // wrong shape
    tensors.emplace_back(n, t);
  }
  tensors.emplace_back("model.layers.9.mlp.up_proj.weight", Tensor::zeros({2, 2}, DType::BF16));  // unexpected
  io::save_safetensors(dir + "/model.safetensors", tensors);
  TargetConfig cfg = TargetConfig::from_file(dir);
  const std::string e = error_of([&] { load_weights(cfg, dir, DType::F32, Device::cpu()); });
  EXPECT_NE(e.find("3 problem(s)"), std::string::npos) << e;
  EXPECT_NE(e.find("missing: layers.1.linear_attn.A_log [4]"), std::string::npos) << e;
  EXPECT_NE(e.find("wrong shape: model.layers.3.self_attn.q_norm.weight is [31], expected [32]"), std::string::npos) << e;
  EXPECT_NE(e.find("unexpected: model.layers.9.mlp.up_proj.weight"), std::string::npos) << e;
  fs::remove_all(dir);
}

TEST(GoldenBadInputs, UnsupportedModelTypeAndMissingWeights) {
  const std::string dir = temp_dir("type");
  std::ofstream(dir + "/config.json") << R"({"model_type": "qwen3_5_moe", "hidden_size": 8})";
  EXPECT_NE(error_of([&] { TargetConfig::from_file(dir); }).find("not supported yet"), std::string::npos);
  fs::copy_file(kHf + "tiny_a/config.json", dir + "/config.json", fs::copy_options::overwrite_existing);
  TargetConfig cfg = TargetConfig::from_file(dir);
  const std::string e = error_of([&] { load_weights(cfg, dir, DType::F32, Device::cpu()); });
  EXPECT_NE(e.find(dir), std::string::npos) << e;
  fs::remove_all(dir);
}
