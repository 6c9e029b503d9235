// dflash_train's YAML config: the shipped configs, --set overrides, unknown keys, wrong types,
// inconsistent values (each with the key path and the expected form), to_yaml round trip and the
// settings table.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "drafter/config.h"
#include "target_model/config.h"
#include "target_model/flops.h"
#include "test_util.h"
#include "trainer/config.h"
#include "trainer/faults.h"
#include "trainer/memory_plan.h"
#include "trainer/metrics.h"
#include "drafter/model.h"
#include "drafter/weights.h"
#include "target_model/tp.h"
#include "target_model/weights.h"
#include "target_model/fast_path.h"

using namespace dflash;
using namespace dflash::trainer;
using ::testing::HasSubstr;

namespace {

const std::string kRoot = std::string(DFLASH_TEST_DATA_DIR) + "/../..";
const std::string kTinyYaml = kRoot + "/configs/tiny.yaml";
const std::string kQwenYaml = kRoot + "/configs/qwen3.6-27b.yaml";

target::TargetConfig tiny_target() { return target::TargetConfig::from_file(kRoot + "/configs/tiny/config.json"); }
target::TargetConfig qwen_target() { return target::TargetConfig::from_file(kRoot + "/configs/qwen3.6-27b/config.json"); }

// A minimal valid config (the rest at defaults), plus `extra` YAML appended at the top level.
const char* kMinimal = R"(
model:
  target: {config: t.json, random_weights: true}
  drafter: {num_layers: 2, block_size: 8, mask_token_id: 10}
data:
  synth: {enabled: true}
training:
  max_steps: 10
)";

TrainConfig minimal(const std::vector<std::string>& overrides = {}) {
  return TrainConfig::from_string(kMinimal, "min.yaml", overrides);
}

std::string parse_error(const std::string& yaml) {
  return error_of([&] { TrainConfig::from_string(yaml, "x.yaml"); });
}
std::string set_error(const std::string& assignment) {
  return error_of([&] { minimal({assignment}); });
}
std::string validate_error(const std::vector<std::string>& overrides, int world = 1) {
  return error_of([&] { minimal(overrides).validate(world); });
}

}  // namespace

TEST(TrainConfig, DefaultsAreTheDFlashRecipe) {
  const TrainConfig c;
  EXPECT_EQ(c.model.drafter.num_layers, 5);
  EXPECT_EQ(c.model.drafter.block_size, 16);
  EXPECT_EQ(c.training.num_anchors, 512);
  EXPECT_EQ(c.training.gamma, 7);
  EXPECT_EQ(c.training.lr, 6e-4);
  EXPECT_EQ(c.training.warmup_ratio, 0.04);
  EXPECT_EQ(c.training.schedule, Schedule::Cosine);
  EXPECT_EQ(c.training.weight_decay, 0);
  EXPECT_EQ(c.training.betas, (std::vector<double>{0.9, 0.95}));
  EXPECT_EQ(c.training.grad_clip, 1.0);
  EXPECT_EQ(c.checkpoint.resume, "auto");
  EXPECT_EQ(c.kernel_policies().conv, target::KernelPolicy::Auto);
  EXPECT_EQ(TrainConfig::keys().front(), "model.target.path");
  EXPECT_EQ(TrainConfig::keys().back(), "logging.progress_bar");
}

TEST(TrainConfig, TinyYamlParsesAndValidates) {
  const TrainConfig c = TrainConfig::from_file(kTinyYaml);
  EXPECT_NO_THROW(c.validate(1));
  EXPECT_NO_THROW(c.validate(2));
  const target::TargetConfig t = tiny_target();
  EXPECT_NO_THROW(c.validate_against(t));
  const drafter::DrafterConfig d = c.drafter_config(t);
  EXPECT_EQ(d.num_hidden_layers, 2);
  EXPECT_EQ(d.block_size, 8);
  EXPECT_EQ(d.mask_token_id, 4095);
  EXPECT_EQ(d.hidden_size, t.hidden_size);
  EXPECT_EQ(d.target_layer_ids, (std::vector<int64_t>{1, 5}));
  EXPECT_TRUE(c.data.synth.enabled);
  EXPECT_EQ(c.data.max_length, 256);
  EXPECT_EQ(c.training.max_steps, 300);
  EXPECT_FALSE(c.training.epochs.has_value());
  EXPECT_EQ(c.synth_path(), "runs/tiny/data/synth.h5");
  EXPECT_EQ(c.checkpoint_dir(), "runs/tiny/checkpoints");
  EXPECT_EQ(c.origin("model.drafter.num_layers"), Origin::File);
}

TEST(TrainConfig, EmbeddedDefaultIsTinyYaml) {
  EXPECT_EQ(TrainConfig::embedded_default(), TrainConfig::from_file(kTinyYaml));
  EXPECT_EQ(TrainConfig::embedded_default({"training.max_steps=7"}).training.max_steps, 7);
}

TEST(TrainConfig, QwenYamlIsTheRecipe) {
  const TrainConfig c = TrainConfig::from_file(kQwenYaml);
  EXPECT_NO_THROW(c.validate(8));
  const target::TargetConfig t = qwen_target();
  EXPECT_NO_THROW(c.validate_against(t));
  const drafter::DrafterConfig d = c.drafter_config(t);
  EXPECT_EQ(d.num_hidden_layers, 5);
  EXPECT_EQ(d.block_size, 16);
  EXPECT_EQ(d.mask_token_id, 248070);
  EXPECT_EQ(d.target_layer_ids, (std::vector<int64_t>{1, 16, 31, 46, 61}));
  // z-lab's Qwen3.5-27B drafter shape (not the target's 24 x 4 gated heads of 256): 1.73 B
  // parameters, its 3.22 GiB bf16 checkpoint, and head_dim 128 runs the tensor-core attention.
  EXPECT_EQ(d.num_attention_heads, 32);
  EXPECT_EQ(d.num_key_value_heads, 8);
  EXPECT_EQ(d.head_dim, 128);
  EXPECT_EQ(d.intermediate_size, 17408);
  {
    drafter::DrafterWeights w;
    w.layers.resize(5);
    int64_t params = 0;
    for (const auto& e : w.entries(d)) params += shape_numel(e.shape);
    EXPECT_NEAR(static_cast<double>(params) * 2 / (1 << 30), 3.22, 0.01);
  }
  EXPECT_EQ(c.data.max_length, 4096);
  EXPECT_EQ(c.training.num_anchors, 512);
  EXPECT_EQ(c.training.gamma, 7);
  EXPECT_EQ(c.training.lr, 6e-4);
  EXPECT_EQ(c.training.warmup_ratio, 0.04);
  EXPECT_EQ(c.training.schedule, Schedule::Cosine);
  EXPECT_EQ(c.training.weight_decay, 0);
  EXPECT_EQ(c.training.grad_clip, 1.0);
  EXPECT_TRUE(c.kernels.require_fast_path);
  // tp=2 of 8 ranks divides the 27B's heads.
  const TrainConfig tp2 = TrainConfig::from_file(kQwenYaml, {"parallel.tp=2"});
  EXPECT_NO_THROW(tp2.validate(8));
  EXPECT_NO_THROW(tp2.validate_against(t));
  // Regeneration is on: DFlash drafters learn the target's own responses.
  EXPECT_TRUE(c.data.regenerate.enabled);
  EXPECT_EQ(c.data.regenerate.temperature, 0);
  EXPECT_EQ(c.data.regenerate.max_new_tokens, 2048);
  EXPECT_EQ(c.regenerate_path(), "runs/qwen3.6-27b/data/regenerated.h5");
  // The shape-only variant, spelled out and as the file's header comment gives it (a config.json
  // replaces the path and implies random weights).
  const TrainConfig shapes = TrainConfig::from_file(
      kQwenYaml, {"model.target.path=", "model.target.config=configs/qwen3.6-27b/config.json",
                  "model.target.random_weights=true"});
  EXPECT_NO_THROW(shapes.validate(2));
  const TrainConfig short_shapes = TrainConfig::from_file(kQwenYaml, {"model.target.config=configs/qwen3.6-27b/config.json"});
  EXPECT_EQ(short_shapes, shapes);
  EXPECT_EQ(short_shapes.origin("model.target.path"), Origin::Implied);
  EXPECT_EQ(short_shapes.origin("model.target.random_weights"), Origin::Implied);
  // Other shards keep the regeneration; the synthetic corpus of the GPU scripts turns it off (it was
  // configured for data.files).
  EXPECT_TRUE(TrainConfig::from_file(kQwenYaml, {"data.files=[other/*.h5]"}).data.regenerate.enabled);
  const TrainConfig synth = TrainConfig::from_file(kQwenYaml, {"data.files=[]", "data.synth.enabled=true"});
  EXPECT_FALSE(synth.data.regenerate.enabled);
  EXPECT_NO_THROW(synth.validate(1));
  EXPECT_TRUE(TrainConfig::from_file(kQwenYaml, {"data.synth.enabled=true", "data.regenerate.enabled=true"}).data.regenerate.enabled);
}

// "My own model, my own data": the model path and the data files are all the embedded default needs;
// what is --set wins over the default's alternatives (its random-weights tiny target, its synthetic,
// regenerated corpus), unless those are --set too.
TEST(TrainConfig, SetPathsWinOverTheDefaultsAlternatives) {
  const TrainConfig c = TrainConfig::embedded_default({"model.target.path=/models/m", "data.files=[d.h5]"});
  EXPECT_EQ(c.model.target.path, "/models/m");
  EXPECT_EQ(c.model.target.config, "");
  EXPECT_FALSE(c.model.target.random_weights);
  EXPECT_EQ(c.data.files, (std::vector<std::string>{"d.h5"}));
  EXPECT_FALSE(c.data.synth.enabled);
  EXPECT_FALSE(c.data.regenerate.enabled);
  EXPECT_NO_THROW(c.validate(1));
  EXPECT_NO_THROW(c.validate_against(tiny_target()));
  for (const char* k : {"model.target.config", "model.target.random_weights", "data.synth.enabled", "data.regenerate.enabled"})
    EXPECT_EQ(c.origin(k), Origin::Implied) << k;
  EXPECT_EQ(c.origin("model.target.path"), Origin::Override);
  ASSERT_EQ(c.notes().size(), 4u);
  EXPECT_EQ(c.notes()[0], "--set model.target.path=/models/m: model.target.config = \"\" instead of "
                          "\"configs/tiny/config.json\" (from <embedded configs/tiny.yaml>)");
  EXPECT_EQ(c.notes()[3], "--set data.files=[d.h5]: data.regenerate.enabled = false instead of true (from <embedded configs/tiny.yaml>)");
  const std::string t = c.settings_table();
  EXPECT_THAT(t, ::testing::ContainsRegex("\n  data.synth.enabled +false +implied\n"));
  EXPECT_THAT(t, HasSubstr("implied by --set (what was --set wins over the config's alternatives):\n  --set model.target.path"));

  // What is --set too, before or after, stays (and a contradiction is reported as before).
  for (const std::vector<std::string>& sets : {std::vector<std::string>{"data.files=[d.h5]", "data.regenerate.enabled=true"},
                                               std::vector<std::string>{"data.regenerate.enabled=true", "data.files=[d.h5]"}}) {
    const TrainConfig r = TrainConfig::embedded_default(sets);
    EXPECT_TRUE(r.data.regenerate.enabled);
    EXPECT_FALSE(r.data.synth.enabled);
    EXPECT_NO_THROW(r.validate(1));
  }
  // data.synth.enabled=false given by hand: the regeneration configured for the synthetic prompts goes too.
  EXPECT_FALSE(TrainConfig::embedded_default({"data.synth.enabled=false", "data.files=[d.h5]"}).data.regenerate.enabled);
  // An empty value selects nothing, so it resets nothing.
  EXPECT_EQ(TrainConfig::embedded_default({"data.files=[]"}), TrainConfig::embedded_default());
  EXPECT_TRUE(TrainConfig::embedded_default({"model.target.path="}).notes().empty());
  // The other pairs: epochs / max_steps, drafter config / warm start, synth over data files.
  const TrainConfig e = TrainConfig::embedded_default({"training.epochs=2"});
  EXPECT_FALSE(e.training.max_steps.has_value());
  EXPECT_NO_THROW(e.validate(1));
  EXPECT_FALSE(TrainConfig::from_string("training: {epochs: 2}", "e.yaml", {"training.max_steps=5"}).training.epochs.has_value());
  EXPECT_EQ(TrainConfig::from_string("model: {drafter: {config: d.json}}", "d.yaml", {"model.drafter.warm_start=w"}).model.drafter.config, "");
  EXPECT_EQ(TrainConfig::from_string("model: {drafter: {warm_start: w}}", "d.yaml", {"model.drafter.config=d.json"}).model.drafter.warm_start, "");
  EXPECT_TRUE(TrainConfig::from_string("data: {files: [a.h5]}", "f.yaml", {"data.synth.enabled=true"}).data.files.empty());
}

// configs/my-model.yaml: the commented example for your own model and data, valid for a
// Qwen3.6-shaped target, with the two paths its header names set from the command line.
TEST(TrainConfig, MyModelYamlIsValid) {
  const TrainConfig c = TrainConfig::from_file(kRoot + "/configs/my-model.yaml",
                                               {"model.target.path=/models/MyModel", "data.files=[data/train.h5]"});
  EXPECT_NO_THROW(c.validate(1));
  EXPECT_NO_THROW(c.validate(8));
  EXPECT_NO_THROW(c.validate_against(qwen_target()));
  EXPECT_TRUE(c.notes().empty());  // nothing to displace: the file names a model and data files
  EXPECT_TRUE(c.data.regenerate.enabled);
  EXPECT_FALSE(c.data.synth.enabled);
  EXPECT_EQ(c.training.epochs, 6);
  EXPECT_EQ(c.drafter_config(qwen_target()).num_hidden_layers, 5);
  EXPECT_EQ(c.logging.run_dir, "runs/my-model");
}

// The ETA counts this start's own steps after its first: start-up (here 43 s of regeneration) and a
// resumed run's earlier steps are not steps of this start.
TEST(StepRate, EtaFromThisStartsStepsOnly) {
  StepRate r;
  EXPECT_TRUE(std::isnan(r.eta_s(0, 43.0, 300)));
  r.step_done(1, 43.5);  // the first step ends 43.5 s after the start
  EXPECT_TRUE(std::isnan(r.eta_s(1, 43.5, 300)));
  for (int64_t s = 2; s <= 10; ++s) r.step_done(s, 43.5 + 0.5 * static_cast<double>(s - 1));
  // 9 steps in 4.5 s: 0.5 s a step, 290 left. (Elapsed / step would say 48 / 10 * 290 = 1392 s.)
  EXPECT_DOUBLE_EQ(r.eta_s(10, 48.0, 300), 145.0);
  EXPECT_EQ(r.eta_s(300, 200.0, 300), 0.0);
  // Resumed at step 200: its first step is 201.
  StepRate q;
  q.step_done(201, 5.0);
  q.step_done(210, 9.5);
  EXPECT_DOUBLE_EQ(q.eta_s(210, 9.5, 300), 45.0);
}

TEST(TrainConfig, SetOverrides) {
  const TrainConfig c = minimal({"training.lr=3e-4", "model.drafter.block_size=4", "model.drafter.target_layer_ids=[1, 3]",
                                 "data.files=[a.h5, \"b c.h5\"]", "training.schedule=linear", "kernels.conv=fallback",
                                 "logging.progress_bar=off", "training.betas=[0.8,0.99]", "checkpoint.resume=runs/x/step_100"});
  EXPECT_EQ(c.training.lr, 3e-4);
  EXPECT_EQ(c.model.drafter.block_size, 4);
  EXPECT_EQ(c.model.drafter.target_layer_ids, (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(c.data.files, (std::vector<std::string>{"a.h5", "b c.h5"}));
  EXPECT_EQ(c.training.schedule, Schedule::Linear);
  EXPECT_EQ(c.kernel_policies().conv, target::KernelPolicy::Fallback);
  EXPECT_FALSE(c.logging.progress_bar);
  EXPECT_EQ(c.training.betas, (std::vector<double>{0.8, 0.99}));
  EXPECT_EQ(c.checkpoint.resume, "runs/x/step_100");
  EXPECT_EQ(c.origin("training.lr"), Origin::Override);
  EXPECT_EQ(c.origin("model.drafter.block_size"), Origin::Override);
  EXPECT_EQ(c.origin("model.drafter.num_layers"), Origin::File);
  EXPECT_EQ(c.origin("training.gamma"), Origin::Default);
  // A single string is a one-element list; null unsets an optional key; later --set wins.
  EXPECT_EQ(minimal({"data.files=x.h5"}).data.files, (std::vector<std::string>{"x.h5"}));
  const TrainConfig e = minimal({"training.max_steps=null", "training.epochs=2", "training.epochs=3"});
  EXPECT_FALSE(e.training.max_steps.has_value());
  EXPECT_EQ(e.training.epochs, 3);
  EXPECT_NO_THROW(e.validate(1));
}

TEST(TrainConfig, SetOverrideErrors) {
  std::string e = set_error("training.lrr=1");
  EXPECT_THAT(e, HasSubstr("--set training.lrr=1: unknown key 'training.lrr'; valid keys of 'training': batch_size,"));
  EXPECT_THAT(e, HasSubstr("did you mean 'training.lr'?"));
  e = set_error("model.drafter.blok_size=4");
  EXPECT_THAT(e, HasSubstr("unknown key 'model.drafter.blok_size'; valid keys of 'model.drafter': config, warm_start,"));
  EXPECT_THAT(e, HasSubstr("did you mean 'model.drafter.block_size'?"));
  EXPECT_THAT(set_error("trainig.lr=1"), HasSubstr("unknown key 'trainig.lr'; valid top-level sections: model, data, "
                                                   "parallel, training, kernels, checkpoint, logging"));
  EXPECT_THAT(set_error("training=1"), HasSubstr("'training' is a section; set one of its keys: training.batch_size,"));
  EXPECT_THAT(set_error("training.lr"), HasSubstr("--set training.lr: expected key.path=value"));
  EXPECT_THAT(set_error("training.lr=fast"),
              HasSubstr("--set training.lr=fast: training.lr must be a positive number, got 'fast'"));
  EXPECT_THAT(set_error("model.drafter.target_layer_ids=[1, x]"),
              HasSubstr("model.drafter.target_layer_ids must be a list of target layer ids (integers >= 0"));
  EXPECT_THAT(set_error("model.drafter.target_layer_ids=[1, 2"), HasSubstr("the value is not valid YAML"));
  EXPECT_THAT(set_error("parallel.tp=0"), HasSubstr("parallel.tp must be a positive integer, got '0'"));
}

TEST(TrainConfig, UnknownKeysNameTheKeyPathAndLine) {
  std::string e = parse_error("model:\n  drafter:\n    num_layers: 2\n    blok_size: 4\n");
  EXPECT_THAT(e, HasSubstr("x.yaml:4: unknown key 'model.drafter.blok_size'; valid keys of 'model.drafter': config, "
                           "warm_start, num_layers, block_size, mask_token_id, target_layer_ids"));
  e = parse_error("training:\n  lr: 1e-3\nfoo: 1\n");
  EXPECT_THAT(e, HasSubstr("x.yaml:3: unknown key 'foo'; valid top-level sections: model, data,"));
  EXPECT_THAT(parse_error("data:\n  synth:\n    enable: true\n"),
              HasSubstr("unknown key 'data.synth.enable'; valid keys of 'data.synth': enabled, path,"));
  EXPECT_THAT(parse_error("training:\n  lr: 1e-3\n  lr: 2e-3\n"), HasSubstr("x.yaml:3: key 'training.lr' appears twice"));
  EXPECT_THAT(parse_error("training: [1, 2]\n"), HasSubstr("training must be a section (a map with keys batch_size,"));
  EXPECT_THAT(parse_error("- a\n- b\n"), HasSubstr("x.yaml: the config must be a YAML map of sections"));
  EXPECT_THAT(parse_error("training:\n  lr: [1\n"), HasSubstr("not valid YAML"));
  // An empty document or section keeps the defaults.
  EXPECT_EQ(TrainConfig::from_string("", "empty.yaml"), TrainConfig());
  EXPECT_EQ(TrainConfig::from_string("training:\n", "empty.yaml"), TrainConfig());
}

TEST(TrainConfig, WrongTypesNameTheKeyAndTheExpectedForm) {
  EXPECT_THAT(parse_error("training:\n  lr: fast\n"), HasSubstr("x.yaml:2: training.lr must be a positive number, got 'fast'"));
  EXPECT_THAT(parse_error("training:\n  lr: -1\n"), HasSubstr("training.lr must be a positive number, got '-1'"));
  EXPECT_THAT(parse_error("training:\n  lr: .nan\n"), HasSubstr("training.lr must be a positive number, got '.nan'"));
  EXPECT_THAT(parse_error("model:\n  drafter:\n    block_size: 1.5\n"),
              HasSubstr("model.drafter.block_size must be an integer >= 2, got '1.5'"));
  EXPECT_THAT(parse_error("parallel:\n  tp: \"2\"\n"), HasSubstr("parallel.tp must be a positive integer, got '\"2\"'"));
  EXPECT_THAT(parse_error("kernels:\n  require_fast_path: maybe\n"),
              HasSubstr("kernels.require_fast_path must be true or false, got 'maybe'"));
  EXPECT_THAT(parse_error("kernels:\n  conv: turbo\n"), HasSubstr("kernels.conv must be one of auto, fast, fallback, got 'turbo'"));
  EXPECT_THAT(parse_error("training:\n  schedule: step\n"),
              HasSubstr("training.schedule must be one of cosine, linear, constant, got 'step'"));
  EXPECT_THAT(parse_error("training:\n  betas: [0.9]\n"), HasSubstr("training.betas must be a list of two numbers in [0, 1), got '[0.9]'"));
  EXPECT_THAT(parse_error("training:\n  betas: [0.9, 1.5]\n"), HasSubstr("training.betas must be a list of two numbers"));
  EXPECT_THAT(parse_error("training:\n  epochs: 0\n"), HasSubstr("training.epochs must be a number of epochs (a positive integer) or null, got '0'"));
  EXPECT_THAT(parse_error("data:\n  files: {a: 1}\n"), HasSubstr("data.files must be a list of HDF5 files or globs (strings), got '{a: 1}'"));
  EXPECT_THAT(parse_error("model:\n  drafter:\n    mask_token_id: -3\n"),
              HasSubstr("model.drafter.mask_token_id must be a token id (a non-negative integer) or null, got '-3'"));
  EXPECT_THAT(parse_error("model:\n  target:\n    path: [a, b]\n"),
              HasSubstr("model.target.path must be a Hugging Face model directory (a string), got '[a, b]'"));
  EXPECT_THAT(parse_error("checkpoint:\n  resume: \"\"\n"),
              HasSubstr("checkpoint.resume must be auto, never or a checkpoint directory, got '\"\"'"));
  EXPECT_THAT(parse_error("training:\n  warmup_ratio: 1.0\n"), HasSubstr("training.warmup_ratio must be a number in [0, 1), got '1.0'"));
  EXPECT_THAT(parse_error("checkpoint:\n  keep_last: 0\n"), HasSubstr("checkpoint.keep_last must be a positive integer, got '0'"));
}

TEST(TrainConfig, InconsistentValues) {
  EXPECT_NO_THROW(minimal().validate(1));
  // tp and the world size (the same words as comm::make_layout).
  EXPECT_THAT(validate_error({"parallel.tp=3"}, 2), HasSubstr("min.yaml: parallel.tp = 3 does not divide the world size 2"));
  EXPECT_NO_THROW(minimal({"parallel.tp=2"}).validate(4));
  // The target: exactly one source; a bare config needs random weights.
  EXPECT_THAT(validate_error({"model.target.path=/models/x", "model.target.config=t.json"}),
              HasSubstr("set exactly one of model.target.path and model.target.config (both are set)"));
  EXPECT_THAT(error_of([] { TrainConfig::from_string("model: {target: {path: m, config: t.json}}", "b.yaml").validate(1); }),
              HasSubstr("b.yaml: model.target: set exactly one of model.target.path and model.target.config (both are set)"));
  EXPECT_THAT(validate_error({"model.target.config="}), HasSubstr("(neither is set)"));
  EXPECT_THAT(validate_error({"model.target.random_weights=false"}),
              HasSubstr("model.target.config names only an architecture, so model.target.random_weights must be true"));
  // The drafter: fields given next to a config file must agree with it (checked when it is read);
  // the fields alone need a mask token.
  EXPECT_NO_THROW(minimal({"model.drafter.warm_start=runs/x/export"}).validate(1));
  {
    const std::string ref = std::string(DFLASH_TEST_DATA_DIR) + "/drafter_ref";  // 2 layers, block 4, mask 60
    target::TargetConfig t;
    t.hidden_size = 32, t.vocab_size = 61, t.num_hidden_layers = 10;
    TrainConfig ok = minimal({"model.drafter.warm_start=" + ref, "model.drafter.block_size=4", "model.drafter.mask_token_id=60"});
    EXPECT_EQ(ok.drafter_config(t).num_hidden_layers, 2);
    EXPECT_THAT(error_of([&] { minimal({"model.drafter.warm_start=" + ref, "model.drafter.num_layers=3"}).drafter_config(t); }),
                HasSubstr("model.drafter.num_layers = 3 disagrees with model.drafter.warm_start"));
    EXPECT_THAT(error_of([&] { minimal({"model.drafter.config=" + ref, "model.drafter.block_size=4", "model.drafter.mask_token_id=7"}).drafter_config(t); }),
                HasSubstr("model.drafter.mask_token_id = 7 disagrees with model.drafter.config"));
    EXPECT_THAT(error_of([&] { minimal({"model.drafter.config=" + ref, "model.drafter.block_size=4", "model.drafter.mask_token_id=60", "model.drafter.head_dim=64"}).drafter_config(t); }),
                HasSubstr("model.drafter.head_dim = 64 disagrees with model.drafter.config"));
  }
  EXPECT_THAT(error_of([] { TrainConfig::from_string("model:\n  target: {config: t.json, random_weights: true}\n"
                                                     "  drafter: {config: d.json, warm_start: w}\n"
                                                     "data: {synth: {enabled: true}}\ntraining: {max_steps: 1}\n", "d.yaml")
                                .validate(1); }),
              HasSubstr("model.drafter.config and model.drafter.warm_start are exclusive"));
  EXPECT_THAT(validate_error({"model.drafter.mask_token_id=null"}), HasSubstr("model.drafter.mask_token_id must be set"));
  EXPECT_THAT(validate_error({"model.drafter.target_layer_ids=[1, 1]"}),
              HasSubstr("model.drafter.target_layer_ids[1] = 1 appears twice"));
  EXPECT_THAT(validate_error({"data.max_length=8"}), HasSubstr("data.max_length (8) must be greater than model.drafter.block_size (8)"));
  // Steps: exactly one of epochs and max_steps.
  EXPECT_THAT(validate_error({"training.epochs=2", "training.max_steps=3"}),
              HasSubstr("set exactly one of training.epochs and training.max_steps (both are set)"));
  EXPECT_THAT(validate_error({"training.max_steps=null"}), HasSubstr("(neither is set)"));
  EXPECT_THAT(validate_error({"training.min_lr=1e-3"}), HasSubstr("training.min_lr (0.001) must be <= training.lr (6e-4)"));
  // Data: one source.
  EXPECT_THAT(validate_error({"data.synth.enabled=false"}),
              HasSubstr("data.files is empty, data.train is not set and data.synth.enabled is false"));
  EXPECT_THAT(validate_error({"data.files=[a.h5]", "data.synth.enabled=true"}),
              HasSubstr("data.files and data.synth.enabled: true are exclusive"));
  EXPECT_THAT(validate_error({"data.synth.min_length=300"}),
              HasSubstr("data.synth.min_length (300) must be <= data.synth.max_length (256)"));
  EXPECT_THAT(validate_error({"kernels.require_fast_path=true", "kernels.delta_rule=fallback"}),
              HasSubstr("kernels.require_fast_path: true contradicts kernels.delta_rule: fallback"));
  // The FP8 drafter simulation runs on the CPU backend's f32 step, not its double reference.
  EXPECT_THAT(validate_error({"model.drafter.precision=fp8", "parallel.device=cpu", "kernels.cpu_drafter=f64"}),
              HasSubstr("model.drafter.precision: fp8 contradicts kernels.cpu_drafter: f64"));
  EXPECT_THAT(validate_error({"model.drafter.precision=fp16"}), HasSubstr("model.drafter.precision"));
  EXPECT_THAT(validate_error({"model.drafter.lm_head_precision=fp8", "parallel.device=cpu", "kernels.cpu_drafter=f64"}),
              HasSubstr("model.drafter.lm_head_precision: fp8 contradicts kernels.cpu_drafter: f64"));
  EXPECT_THAT(validate_error({"model.drafter.lm_head_precision=int8"}), HasSubstr("model.drafter.lm_head_precision"));
  EXPECT_THAT(validate_error({"model.drafter.fp8_wgrad_x_tiles=128x128"}),
              HasSubstr("model.drafter.fp8_wgrad_x_tiles: 128x128 applies to FP8 linears, but model.drafter.precision is bf16"));
  EXPECT_THAT(validate_error({"model.drafter.fp8_wgrad_x_tiles=64x64"}), HasSubstr("model.drafter.fp8_wgrad_x_tiles"));
  // auto (the default): 128 x 128 blocks for an FP8 drafter, nothing for a bf16 one; 128x1 the other tiles.
  EXPECT_EQ(minimal().model.drafter.fp8_wgrad_x_tiles, Fp8WgradTiles::Auto);
  EXPECT_FALSE(fp8_wgrad_x_blocks(minimal().model.drafter));
  EXPECT_TRUE(fp8_wgrad_x_blocks(minimal({"model.drafter.precision=fp8"}).model.drafter));
  EXPECT_FALSE(fp8_wgrad_x_blocks(minimal({"model.drafter.precision=fp8", "model.drafter.fp8_wgrad_x_tiles=128x1"}).model.drafter));
  EXPECT_TRUE(fp8_wgrad_x_blocks(minimal({"model.drafter.precision=fp8", "model.drafter.fp8_wgrad_x_tiles=128x128"}).model.drafter));
  EXPECT_NO_THROW(minimal({"model.drafter.fp8_wgrad_x_tiles=128x1"}).validate(1));  // (no effect on a bf16 drafter)
  // Ranges are checked again for configs changed in code.
  TrainConfig c = minimal();
  c.model.drafter.block_size = 1;
  EXPECT_THAT(error_of([&] { c.validate(1); }), HasSubstr("model.drafter.block_size must be an integer >= 2, got '1'"));
  c = minimal();
  c.training.warmup_ratio = 1.0;
  EXPECT_THAT(error_of([&] { c.validate(1); }), HasSubstr("training.warmup_ratio must be a number in [0, 1), got '1'"));
  c = minimal();
  c.checkpoint.keep_last = 0;
  EXPECT_THAT(error_of([&] { c.validate(1); }), HasSubstr("checkpoint.keep_last must be a positive integer, got '0'"));
}

// data.train: a JSONL of conversations, the third source of data, with its tokenizer and prepare options.
TEST(TrainConfig, TrainFromText) {
  const TrainConfig d;
  EXPECT_EQ(d.data.train, "");
  EXPECT_EQ(d.data.prepare.think, "in");
  EXPECT_FALSE(d.data.prepare.last_turn_only);
  EXPECT_FALSE(d.data.prepare.enable_thinking.has_value());
  EXPECT_EQ(d.prepare_path(), "runs/dflash/data/prepared.h5");
  EXPECT_EQ(d.prepare_max_length(), 4096);  // data.max_length

  const char* yaml = R"(
model:
  target: {path: /models/m}
  drafter: {mask_token_id: 10}
data:
  train: chats.jsonl
  max_length: 512
  prepare: {think: out, last_turn_only: true, enable_thinking: false, max_length: 300, skip_bad: true, chat_template: t.jinja}
training: {max_steps: 10}
)";
  TrainConfig c = TrainConfig::from_string(yaml, "t.yaml");
  EXPECT_NO_THROW(c.validate(1));
  EXPECT_EQ(c.data.train, "chats.jsonl");
  EXPECT_EQ(c.tokenizer_dir(), "/models/m");  // the target's directory
  EXPECT_EQ(c.data.prepare.think, "out");
  EXPECT_TRUE(c.data.prepare.last_turn_only);
  EXPECT_EQ(c.data.prepare.enable_thinking, std::optional<bool>(false));
  EXPECT_EQ(c.prepare_max_length(), 300);
  EXPECT_TRUE(c.data.prepare.skip_bad);
  EXPECT_EQ(c.data.prepare.chat_template, "t.jinja");
  EXPECT_EQ(TrainConfig::from_string(c.to_yaml(), "again.yaml"), c);
  EXPECT_EQ(TrainConfig::from_string(yaml, "t.yaml", {"data.tokenizer=tok"}).tokenizer_dir(), "tok");
  EXPECT_FALSE(TrainConfig::from_string(yaml, "t.yaml", {"data.prepare.enable_thinking=null"}).data.prepare.enable_thinking);
  EXPECT_THAT(parse_error("data:\n  prepare: {think: maybe}\n"), HasSubstr("data.prepare.think must be one of in, out, got 'maybe'"));
  EXPECT_THAT(parse_error("data:\n  prepare: {enable_thinking: 2}\n"),
              HasSubstr("data.prepare.enable_thinking must be true, false or null (null = the chat template's default), got '2'"));

  // One source of data.
  EXPECT_THAT(error_of([&] { TrainConfig::from_string(yaml, "t.yaml", {"data.files=[a.h5]", "data.train=x.jsonl"}).validate(1); }),
              HasSubstr("data.files and data.train are exclusive"));
  EXPECT_THAT(validate_error({"data.train=x.jsonl", "data.synth.enabled=true", "data.tokenizer=tok"}),
              HasSubstr("data.train and data.synth.enabled: true are exclusive"));
  // A random-weights config.json target has no tokenizer: the message names both keys.
  EXPECT_THAT(error_of([] { TrainConfig::embedded_default({"data.train=x.jsonl"}).validate(1); }),
              HasSubstr("data.train needs a tokenizer: data.tokenizer is not set and model.target has no model directory"));
  EXPECT_NO_THROW(TrainConfig::embedded_default({"data.train=x.jsonl", "data.tokenizer=tok"}).validate(1));
  EXPECT_THAT(error_of([] { TrainConfig::embedded_default({"data.train=x.jsonl", "data.tokenizer=tok", "data.prepare.path=./x.jsonl"}).validate(1); }),
              HasSubstr("data.prepare.path './x.jsonl' is data.train itself"));
  EXPECT_THAT(error_of([] {
                TrainConfig::embedded_default({"data.train=x.jsonl", "data.tokenizer=tok", "data.regenerate.enabled=true",
                                               "data.prepare.path=runs/tiny/data/regenerated.h5"})
                    .validate(1);
              }),
              HasSubstr("data.prepare.path and data.regenerate.path are the same file"));
  // A prompt set (data.prepare.prompts_only) has nothing to train on unless the target writes the responses.
  EXPECT_THAT(error_of([] {
                TrainConfig::embedded_default({"data.train=x.jsonl", "data.tokenizer=tok", "data.prepare.prompts_only=true"})
                    .validate(1);
              }),
              HasSubstr("data.prepare.prompts_only: true makes prompts without responses"));
  EXPECT_NO_THROW(TrainConfig::embedded_default({"data.train=x.jsonl", "data.tokenizer=tok", "data.prepare.prompts_only=true",
                                                 "data.regenerate.enabled=true"})
                      .validate(1));

  // --set data.train wins over the embedded default's synthetic corpus, and (configured for it) its regeneration.
  const TrainConfig e = TrainConfig::embedded_default({"data.train=x.jsonl"});
  EXPECT_FALSE(e.data.synth.enabled);
  EXPECT_FALSE(e.data.regenerate.enabled);
  EXPECT_EQ(e.origin("data.synth.enabled"), Origin::Implied);
  EXPECT_EQ(e.origin("data.regenerate.enabled"), Origin::Implied);
  EXPECT_TRUE(TrainConfig::embedded_default({"data.train=x.jsonl", "data.regenerate.enabled=true"}).data.regenerate.enabled);
  EXPECT_TRUE(TrainConfig::embedded_default({"data.regenerate.enabled=true", "data.train=x.jsonl"}).data.regenerate.enabled);
  // The other sources displace data.train, and a file's data.train keeps its regeneration only while it is the source.
  const TrainConfig f = TrainConfig::from_string(
      "model: {target: {path: /m}, drafter: {mask_token_id: 1}}\ndata: {train: a.jsonl, regenerate: {enabled: true}}\n"
      "training: {max_steps: 1}\n", "r.yaml", {"data.files=[b.h5]"});
  EXPECT_EQ(f.data.train, "");
  EXPECT_EQ(f.origin("data.train"), Origin::Implied);
  EXPECT_FALSE(f.data.regenerate.enabled);
  EXPECT_NO_THROW(f.validate(1));
  const TrainConfig g = TrainConfig::from_string(
      "model: {target: {path: /m}, drafter: {mask_token_id: 1}}\ndata: {train: a.jsonl, regenerate: {enabled: true}}\n"
      "training: {max_steps: 1}\n", "r.yaml", {"data.train=c.jsonl"});
  EXPECT_TRUE(g.data.regenerate.enabled);
  EXPECT_EQ(TrainConfig::from_string(yaml, "t.yaml", {"data.synth.enabled=true"}).data.train, "");
}

TEST(TrainConfig, InconsistentWithTheTarget) {
  const target::TargetConfig t = tiny_target();  // vocab 4096, 8 layers, 4 attention heads
  EXPECT_NO_THROW(minimal().validate_against(t));
  EXPECT_THAT(error_of([&] { minimal({"model.drafter.mask_token_id=4096"}).validate_against(t); }),
              HasSubstr("model.drafter.mask_token_id = 4096 is outside the target's vocabulary [0, 4096)"));
  EXPECT_THAT(error_of([&] { minimal({"model.drafter.target_layer_ids=[1, 8]"}).validate_against(t); }),
              HasSubstr("model.drafter.target_layer_ids[1] = 8 is outside the target's layers [0, 8)"));
  EXPECT_THAT(error_of([&] { minimal({"parallel.tp=3"}).validate_against(t); }),
              HasSubstr("parallel.tp = 3 does not divide the model's num_attention_heads 4"));
  EXPECT_EQ(minimal({"model.drafter.target_layer_ids=[2, 4, 6]"}).drafter_config(t).target_layer_ids,
            (std::vector<int64_t>{2, 4, 6}));
  // The drafter's attention / MLP shape: the target's unless given.
  {
    const drafter::DrafterConfig same = minimal().drafter_config(t);
    EXPECT_EQ(same.num_attention_heads, t.num_attention_heads);
    EXPECT_EQ(same.head_dim, t.head_dim);
    const drafter::DrafterConfig own =
        minimal({"model.drafter.num_attention_heads=8", "model.drafter.num_key_value_heads=2", "model.drafter.head_dim=16",
                 "model.drafter.intermediate_size=96"})
            .drafter_config(t);
    EXPECT_EQ(own.num_attention_heads, 8);
    EXPECT_EQ(own.num_key_value_heads, 2);
    EXPECT_EQ(own.head_dim, 16);
    EXPECT_EQ(own.intermediate_size, 96);
    EXPECT_THAT(error_of([&] {
                  minimal({"model.drafter.num_attention_heads=6", "model.drafter.num_key_value_heads=4"}).drafter_config(t);
                }),
                HasSubstr("the drafter made from model.drafter: "));
    EXPECT_THAT(error_of([] { minimal({"model.drafter.head_dim=1"}); }),
                HasSubstr("model.drafter.head_dim must be a head dimension (null = the target's) (an integer >= 2) or null"));
  }

  // A drafter config.json made for another target: hidden size / vocabulary mismatch.
  const std::string dir = ::testing::TempDir() + "dflash_train_config_drafter";
  std::filesystem::create_directories(dir);
  {
    std::ofstream(dir + "/config.json") << drafter::DrafterConfig::for_target(qwen_target(), 5, 248070).to_json().dump();
  }
  const TrainConfig w = TrainConfig::from_string(
      "model:\n  target: {config: t.json, random_weights: true}\n  drafter: {warm_start: " + dir +
          "}\ndata: {synth: {enabled: true}}\ntraining: {max_steps: 1}\n",
      "w.yaml");
  EXPECT_NO_THROW(w.validate(1));
  EXPECT_THAT(error_of([&] { w.validate_against(t); }),
              HasSubstr("model.drafter.warm_start (" + dir + "): the drafter's hidden_size 5120 does not match the target's 256"));
  EXPECT_NO_THROW(w.validate_against(qwen_target()));
  EXPECT_EQ(w.drafter_config(qwen_target()).mask_token_id, 248070);
}

TEST(TrainConfig, ToYamlRoundTrips) {
  for (const TrainConfig& c :
       {TrainConfig::from_file(kTinyYaml), TrainConfig::from_file(kQwenYaml), TrainConfig(),
        minimal({"training.max_steps=null", "training.epochs=3", "training.lr=1.25e-5", "logging.run_dir='runs/a \"b\"\\c: d'",
                 "data.files=[\"x*.h5\", 'y: z.h5']", "model.drafter.target_layer_ids=[0, 2]", "training.gamma=0.3",
                 "parallel.timeout_s=1e9", "kernels.attention=fast", "training.schedule=constant", "model.target.path=123"})}) {
    const std::string y = c.to_yaml();
    const TrainConfig back = TrainConfig::from_string(y, "effective.yaml");
    EXPECT_EQ(back, c) << y;
    auto body = [](const std::string& s) { return s.substr(s.find('\n')); };  // after the "# ... (from source)" line
    EXPECT_EQ(body(back.to_yaml()), body(y));
  }
  const std::string y = TrainConfig::from_file(kQwenYaml).to_yaml();
  EXPECT_THAT(y, HasSubstr("\ntraining:\n  batch_size: 1\n"));
  EXPECT_THAT(y, HasSubstr("\n    target_layer_ids: [1, 16, 31, 46, 61]\n"));
  EXPECT_THAT(y, HasSubstr("\n  lr: 6e-4\n"));
  EXPECT_THAT(y, HasSubstr("\n  epochs: 6\n  max_steps: null\n"));
}

TEST(TrainConfig, SettingsTableMarksOverrides) {
  const TrainConfig c = TrainConfig::from_file(kTinyYaml, {"training.lr=5e-4", "parallel.tp=1"});
  const std::string t = c.settings_table();
  auto line_of = [&](const std::string& key) {
    const size_t at = t.find("  " + key + " ");
    if (at == std::string::npos) return std::string();
    return t.substr(at, t.find('\n', at) - at);
  };
  EXPECT_THAT(t, HasSubstr("settings (" + kTinyYaml + ")"));
  EXPECT_THAT(line_of("training.lr"), ::testing::MatchesRegex(" *training.lr +5e-4 +--set +6e-4"));
  EXPECT_THAT(line_of("parallel.tp"), ::testing::MatchesRegex(" *parallel.tp +1 +--set"));  // equal to the default
  EXPECT_THAT(line_of("model.drafter.num_layers"), ::testing::MatchesRegex(" *model.drafter.num_layers +2 +file +5"));
  EXPECT_THAT(line_of("training.num_anchors"), ::testing::MatchesRegex(" *training.num_anchors +32 +file +512"));
  EXPECT_THAT(line_of("data.synth.path"), ::testing::MatchesRegex(" *data.synth.path +\"\" +file"));
  EXPECT_THAT(line_of("training.epochs"), ::testing::MatchesRegex(" *training.epochs +null +default"));
  for (const std::string& k : TrainConfig::keys()) EXPECT_FALSE(line_of(k).empty()) << k;
}

TEST(TrainConfig, ExpandsDataFileGlobs) {
  const std::string dir = ::testing::TempDir() + "dflash_train_config_glob";
  std::filesystem::create_directories(dir);
  for (const char* f : {"b.h5", "a.h5", "c.txt"}) std::ofstream(dir + "/" + f) << "x";
  TrainConfig c = minimal();
  c.data.files = {dir + "/*.h5", dir + "/a.h5"};
  EXPECT_EQ(c.expand_data_files(), (std::vector<std::string>{dir + "/a.h5", dir + "/b.h5"}));
  c.data.files = {dir + "/*.bin"};
  EXPECT_THAT(error_of([&] { c.expand_data_files(); }), HasSubstr("data.files[0] pattern '" + dir + "/*.bin' matches no file"));
  c.data.files = {dir + "/missing.h5"};
  EXPECT_THAT(error_of([&] { c.expand_data_files(); }), HasSubstr("data.files[0] '" + dir + "/missing.h5' does not exist"));
}

// The GPU memory plan of the Qwen3.6-27B recipe: the drafter state is 18 bytes per parameter (bf16
// weights, fp32 masters, two moments, gradients), the target's bf16 shard halves with tp=2 apart
// from the replicated embedding and LM head, the estimate grows with tokens and blocks, and it holds
// the block-attention backward's workspace.
TEST(MemoryPlan, Qwen27bRecipe) {
  const TrainConfig q = TrainConfig::from_file(kRoot + "/configs/qwen3.6-27b.yaml");
  const target::TargetConfig t = qwen_target();
  const drafter::DrafterConfig d = q.drafter_config(t);
  drafter::DrafterWeights w;
  w.layers.resize(static_cast<size_t>(d.num_hidden_layers));
  int64_t params = 0;
  for (const auto& e : w.entries(d)) params += shape_numel(e.shape);
  const MemoryPlan one = gpu_memory_plan(target::local_config(t, 1), d, 4096, 4096, 512, 2048);
  EXPECT_DOUBLE_EQ(one.drafter_state, 18.0 * static_cast<double>(params));
  EXPECT_DOUBLE_EQ(one.target_weights, 2.0 * static_cast<double>(t.parameter_count()));
  const MemoryPlan two = gpu_memory_plan(target::local_config(t, 2), d, 4096, 4096, 256, 2048);
  const double replicated = 2.0 * 2 * static_cast<double>(t.vocab_size * t.hidden_size);
  EXPECT_NEAR(two.target_weights, (one.target_weights - replicated) / 2 + replicated, 0.01 * one.target_weights);
  EXPECT_LT(two.drafter_activations, one.drafter_activations);
  EXPECT_GT(gpu_memory_plan(target::local_config(t, 1), d, 8192, 4096, 1024, 2048).total(), one.total());
  // The attention backward's workspace: 512 blocks x 8 kv heads x 1 query tile x (64 + 1) key tiles
  // of 8 KiB (the wgmma path's dSᵀ tiles, measured 2 GiB more peak memory on the H200) + δ.
  EXPECT_DOUBLE_EQ(one.attn_workspace, 512.0 * 8 * 65 * 8192 + 512.0 * 16 * 32 * 4);
  // ~1.7 B drafter parameters; the whole plan fits an H200 (139.8 GiB) with tp=1.
  EXPECT_GT(params, 1'500'000'000);
  EXPECT_LT(one.total(), 139.8 * (1 << 30));
  std::printf("Qwen3.6-27B recipe, tp=1:\n%s\n", one.table(139.8 * (1 << 30)).c_str());
  // The FP8 drafter (model.drafter.precision: fp8) adds its linears' codes and their transposes (2 bytes a
  // parameter) and the widest backward's quantized operands (gate|up's gradient in both encodings,
  // yn's transposed codes: 8192 rows x (4 x 17408 + 5120) bytes); measured on the H200 at 4096 tokens
  // with the fp8 target: 86.1 GiB peak against 80.3 with the bf16 drafter (bench/results/h200-check-92d72c3).
  const MemoryPlan f8 = gpu_memory_plan(target::local_config(t, 1), d, 4096, 4096, 512, 2048, true, true);
  const MemoryPlan b8 = gpu_memory_plan(target::local_config(t, 1), d, 4096, 4096, 512, 2048, true, false);
  EXPECT_DOUBLE_EQ(f8.drafter_state - b8.drafter_state, 2.0 * static_cast<double>(params));
  EXPECT_DOUBLE_EQ(f8.drafter_activations - b8.drafter_activations, 8192.0 * (4 * 17408 + 5120));
  EXPECT_LT(f8.total() * (1 + kMemoryPlanMargin), 139.8 * (1 << 30));
  // The FP8 LM head (model.drafter.lm_head_precision: fp8) holds the head's codes and their transpose (2 bytes a
  // value: 2.37 GiB) and the FP8 form's CE workspace (a 2048-row chunk's fp32 logits and gradient codes:
  // ~2.4 GiB, against the bf16 form's ~2.8); measured on the H200 at 4096 tokens: 86.1 GiB peak against 84.2
  // (bench/results/h200-fp8head-5d8af27).
  const MemoryPlan h8 = gpu_memory_plan(target::local_config(t, 1), d, 4096, 4096, 512, 2048, true, true, false, true);
  const double V = static_cast<double>(t.vocab_size), H = static_cast<double>(d.hidden_size);
  EXPECT_GT(h8.ce_workspace - f8.ce_workspace, 2.0 * V * H - 2048.0 * V * 2);
  EXPECT_LT(h8.ce_workspace - f8.ce_workspace, 2.0 * V * H);
  EXPECT_EQ(h8.drafter_state, f8.drafter_state);
  EXPECT_LT(h8.total() * (1 + kMemoryPlanMargin), 139.8 * (1 << 30));
}

// The start-up refusal (issue 32): on an H200 (139.8 GiB, 139.2 free as at start-up) the 27B recipe
// fits with the plan's 10% headroom; with 4 x the anchors (2048 blocks) or 4 sequences of 16384
// tokens it does not, and the message gives the figures, the table and what to change. The plan
// against the peaks measured on the H200 (bench/results/h200-0630575 q27_1gpu 95.8 GiB,
// h200x2-fb4e956-train q27_2gpu_tp2 67.2 GiB, peak allocated): below each, within the headroom.
TEST(MemoryPlan, RefusesWhatDoesNotFitNamingTheFiguresAndWhatToChange) {
  const TrainConfig q = TrainConfig::from_file(kRoot + "/configs/qwen3.6-27b.yaml");
  const target::TargetConfig t = qwen_target();
  const drafter::DrafterConfig d = q.drafter_config(t);
  const double gib = 1024.0 * 1024.0 * 1024.0, total = 139.8 * gib, free = 139.2 * gib;
  const int64_t L = q.data.max_length, A = q.training.num_anchors;
  const MemoryPlan recipe = gpu_memory_plan(target::local_config(t, 1), d, L, L, A, 2048);
  EXPECT_NO_THROW(check_memory_plan_fits(recipe, free, total, "cuda:0"));
  const MemoryPlan anchors = gpu_memory_plan(target::local_config(t, 1), d, L, L, 4 * A, 2048);
  const std::string e = error_of([&] { check_memory_plan_fits(anchors, free, total, "cuda:0"); });
  EXPECT_THAT(e, HasSubstr("GPU training on cuda:0 does not fit: the memory plan needs "));
  EXPECT_THAT(e, HasSubstr("% headroom) but 139.20 GiB are free"));
  EXPECT_THAT(e, HasSubstr("drafter activations"));
  EXPECT_THAT(e, HasSubstr("total (estimate)"));
  EXPECT_THAT(e, HasSubstr("lower training.num_anchors or training.batch_size"));
  const MemoryPlan longseq = gpu_memory_plan(target::local_config(t, 1), d, 4 * 16384, 16384, 4 * A, 2048);
  EXPECT_THAT(error_of([&] { check_memory_plan_fits(longseq, free, total, "cuda:0"); }), HasSubstr("does not fit"));
  // tp=2 halves the target's weights: the 4 x anchors recipe still does not fit one H200 per rank,
  // the recipe does.
  const MemoryPlan tp2 = gpu_memory_plan(target::local_config(t, 2), d, L, L, (A + 1) / 2, 2048);
  EXPECT_NO_THROW(check_memory_plan_fits(tp2, free, total, "cuda:0"));
  for (const auto& [plan, peak] : {std::pair{recipe, 95.8}, std::pair{tp2, 67.2}}) {
    EXPECT_LT(plan.total() / gib, peak);
    EXPECT_GT(plan.total() * (1 + kMemoryPlanMargin) / gib, peak);
    std::printf("plan %.2f GiB, measured peak %.1f GiB (%.1f%%)\n", plan.total() / gib, peak,
                100.0 * (plan.total() / gib - peak) / peak);
  }
  // After the first step the GPU backend compares its peak with the plan and warns where the plan was low
  // (session 29's FP8 drafter recipe on an H100: 68.08 GiB planned, 77.07 measured).
  EXPECT_EQ(memory_plan_shortfall(recipe.total(), 0.99 * recipe.total()), "");
  EXPECT_EQ(memory_plan_shortfall(recipe.total(), recipe.total()), "");
  EXPECT_EQ(memory_plan_shortfall(70.85 * gib, 71.74 * gib), "");  // (the same recipe after 1fa7c68: +1.3%)
  EXPECT_EQ(memory_plan_shortfall(100 * gib, 104.9 * gib), "");
  EXPECT_NE(memory_plan_shortfall(100 * gib, 105.5 * gib).find("by 5.50 GiB (100.00 planned, 105.50 measured, +5.5%)"),
            std::string::npos);
  EXPECT_EQ(memory_plan_shortfall(68.08 * gib, 77.07 * gib),
            "the memory plan underestimated this run's first step by 8.99 GiB (68.08 planned, 77.07 measured, "
            "+13.2%): more than half of its start-up check's 10% headroom, so the check may pass runs that do not "
            "fit");
}

// Sequence length as a scale axis (issue 31): the 27B recipe's plan at 4096..32768 tokens, one
// sequence per step, with the recipe's 512 anchors and with the anchors kept at the recipe's density
// (one per 8 tokens). What grows with the length: the target's per-token buffers and captures and the
// drafter's context rows (linear: the delta rule keeps its state in registers, flash attention stores
// no scores), and the block-attention backward's dS tiles (blocks x key tiles: linear at 512 anchors,
// quadratic when the anchors grow with the length). The recipe fits one H200 with the plan's headroom
// at every length in both precisions; at the kept density it stops fitting at 16384 tokens, and fits
// again with training.blocks_per_pass = 512.
TEST(MemoryPlan, SequenceLengthAxis) {
  const TrainConfig q = TrainConfig::from_file(kRoot + "/configs/qwen3.6-27b.yaml");
  const target::TargetConfig t = target::local_config(qwen_target(), 1);
  const drafter::DrafterConfig d = q.drafter_config(t);
  const double gib = 1024.0 * 1024.0 * 1024.0, free = 139.2 * gib, total = 139.8 * gib;
  std::printf("seq     anchors precision  target_w target_act drafter_state drafter_act  ce  attn_ws  total  fits\n");
  MemoryPlan prev[2];
  for (const int64_t L : {4096, 8192, 16384, 32768}) {
    for (const bool fp8 : {false, true}) {
      for (const int64_t A : L == 4096 ? std::vector<int64_t>{512} : std::vector<int64_t>{512, L / 8}) {
        const MemoryPlan p = gpu_memory_plan(t, d, L, L, A, 2048, fp8);
        bool fits = true;
        try {
          check_memory_plan_fits(p, free, total, "cuda:0");
        } catch (const Error&) {
          fits = false;
        }
        std::printf("%-7lld %-7lld %-9s %9.2f %10.2f %13.2f %11.2f %4.2f %8.2f %6.2f  %s\n", static_cast<long long>(L),
                    static_cast<long long>(A), fp8 ? "fp8" : "bf16", p.target_weights / gib, p.target_activations / gib,
                    p.drafter_state / gib, p.drafter_activations / gib, p.ce_workspace / gib, p.attn_workspace / gib,
                    p.total() / gib, fits ? "yes" : "NO");
        if (A == 512) {
          EXPECT_TRUE(fits) << L << " tokens, " << (fp8 ? "fp8" : "bf16");
          MemoryPlan& pr = prev[fp8];
          if (L > 4096) {  // doubling the length doubles what grows with it, and nothing else moves
            EXPECT_DOUBLE_EQ(p.target_weights, pr.target_weights);
            EXPECT_DOUBLE_EQ(p.drafter_state, pr.drafter_state);
            EXPECT_DOUBLE_EQ(p.ce_workspace, pr.ce_workspace);
            EXPECT_NEAR(p.target_activations, 2 * pr.target_activations, 1e-6 * p.target_activations);
            EXPECT_GT(p.drafter_activations, pr.drafter_activations);
            EXPECT_GT(p.attn_workspace, 1.9 * pr.attn_workspace);
          }
          pr = p;
        } else if (L >= 16384) {
          EXPECT_FALSE(fits) << L << " tokens at " << A << " anchors";
        }
      }
    }
  }
  // training.blocks_per_pass = 512 brings the L/8 anchors back to the plan of 512 blocks: 32768 tokens with
  // 4096 anchors fit (the drafter's context rows, the only part of it that grows, are in the plan).
  TrainConfig c = q;
  c.data.max_length = 32768;
  c.training.num_anchors = 4096;
  EXPECT_EQ(blocks_per_drafter_pass(c, 1), 4096);
  EXPECT_EQ(blocks_per_drafter_pass(c, 2), 2048);
  c.training.blocks_per_pass = 512;
  EXPECT_EQ(blocks_per_drafter_pass(c, 1), 512);
  c.training.num_anchors = 300;
  EXPECT_EQ(blocks_per_drafter_pass(c, 1), 300);
  EXPECT_EQ(blocks_per_drafter_pass(c, 2), 150);
  c.training.num_anchors = 4096;
  for (const bool fp8 : {false, true}) {
    const MemoryPlan p = gpu_memory_plan(t, d, 32768, 32768, blocks_per_drafter_pass(c, 1), 2048, fp8);
    EXPECT_NO_THROW(check_memory_plan_fits(p, free, total, "cuda:0"));
    std::printf("32768   4096 in passes of 512, %s: %.2f GiB\n", fp8 ? "fp8" : "bf16", p.total() / gib);
  }
}

// The cost of a trained token against the sequence length (issue 31; docs/training.md's table): the
// target forward's FLOPs per token are a constant (every linear, the delta rule's state math: the 48
// GatedDeltaNet layers are linear in tokens) plus the 16 attention layers' QKᵀ and PV, which grow by
// 2·Hq·d per token for each token of the sequence (quadratic in all); the drafter's step, with the
// recipe's 512 anchors per sequence, costs a constant per sequence (its blocks) plus its context rows
// and the blocks' attention over the context before each anchor (~L/2 keys). Printed, with the step
// time each length would take at the 4096-token step's measured rates (fp8 target 0.227 s, drafter
// 0.203 s: bench/results/h200-issue19-13173c4) if every FLOP ran at the same speed.
TEST(TrainFlops, SequenceLengthAxis) {
  const TrainConfig q = TrainConfig::from_file(kRoot + "/configs/qwen3.6-27b.yaml");
  const target::TargetConfig t = qwen_target();
  const drafter::DrafterConfig d = q.drafter_config(t);
  const double n_attn = static_cast<double>(t.count_layers(target::LayerType::FullAttention));
  const double per_tok_per_tok = n_attn * 2.0 * static_cast<double>(t.num_attention_heads * t.head_dim);
  auto drafter_flops = [&](int64_t L, int64_t A) {
    drafter::DrafterBatch b;
    b.context = Tensor::empty({L, 1}, DType::F32);  // (step_flops reads the context's rows only)
    for (int64_t i = 0; i < A; ++i)  // anchors spread evenly over the sequence, as the uniform draw is on average
      b.blocks.push_back({0, static_cast<int64_t>((static_cast<double>(i) + 0.5) * static_cast<double>(L - d.block_size) /
                                                  static_cast<double>(A))});
    return drafter::step_flops(d, b, true);
  };
  const double t4 = target::forward_flops(t, {4096}), d4 = drafter_flops(4096, 512);
  std::printf("seq    target GFLOP/tok  attn-core share  drafter GFLOP/tok (512 anchors | L/8)  step at 4096's rates (512 anchors | L/8)\n");
  double prev = 0;
  for (const int64_t L : {4096, 8192, 16384, 32768}) {
    const double tf = target::forward_flops(t, {L}), per_tok = tf / static_cast<double>(L);
    const double core = per_tok_per_tok * static_cast<double>(L + 1);  // per token
    if (prev > 0) {  // doubling L adds exactly the attention core's growth to the cost of a token
      EXPECT_NEAR(per_tok - prev, per_tok_per_tok * static_cast<double>(L / 2), 1e-9 * per_tok);
    }
    prev = per_tok;
    const double df = drafter_flops(L, 512), dd = drafter_flops(L, L / 8);
    // + the optimizer and the host (0.021 s a step whatever the length)
    const double step = 0.227 * tf / t4 + 0.203 * df / d4 + 0.021, step_d = 0.227 * tf / t4 + 0.203 * dd / d4 + 0.021;
    std::printf("%-6lld %16.2f %15.1f%% %18.2f | %-5.2f %8.3f s = %.0f tok/s | %.3f s = %.0f tok/s\n", static_cast<long long>(L),
                per_tok / 1e9, 100.0 * core / per_tok, df / static_cast<double>(L) / 1e9, dd / static_cast<double>(L) / 1e9,
                step, static_cast<double>(L) / step, step_d, static_cast<double>(L) / step_d);
  }
  // 32768 tokens: the attention core is 11.6% of the target's FLOPs of a token (1.6% at 4096).
  const double at32 = per_tok_per_tok * 32769 / (target::forward_flops(t, {32768}) / 32768);
  EXPECT_GT(at32, 0.11);
  EXPECT_LT(at32, 0.12);
}

// DFLASH_FAULT_CUDA_ERROR=OP:STEP[:KIND] (the GPU backend's CUDA-error hook): parsed, malformed
// values refused naming the value; a step's error names the rank and the step.
TEST(Faults, CudaErrorHookParsesAndNamesTheStep) {
  EXPECT_FALSE(parse_cuda_fault(nullptr).enabled());
  EXPECT_FALSE(parse_cuda_fault("").enabled());
  const CudaFault f = parse_cuda_fault("drafter:6");
  EXPECT_TRUE(f.enabled());
  EXPECT_EQ(f.op, "drafter");
  EXPECT_EQ(f.step, 6);
  EXPECT_EQ(f.kind, "launch");
  EXPECT_TRUE(f.at(6, "drafter"));
  EXPECT_FALSE(f.at(5, "drafter"));
  EXPECT_FALSE(f.at(6, "target"));
  const CudaFault g = parse_cuda_fault("optimizer:12:trap");
  EXPECT_EQ(g.op, "optimizer");
  EXPECT_EQ(g.step, 12);
  EXPECT_EQ(g.kind, "trap");
  EXPECT_EQ(parse_cuda_fault("target:1").op, "target");
  EXPECT_THAT(error_of([] { parse_cuda_fault("drafter"); }), HasSubstr("DFLASH_FAULT_CUDA_ERROR='drafter' has no ':STEP'"));
  EXPECT_THAT(error_of([] { parse_cuda_fault("lmhead:3"); }), HasSubstr("'lmhead' is not an op"));
  EXPECT_THAT(error_of([] { parse_cuda_fault("drafter:0"); }), HasSubstr("'0' is not a step >= 1"));
  EXPECT_THAT(error_of([] { parse_cuda_fault("drafter:x6"); }), HasSubstr("'x6' is not a step >= 1"));
  EXPECT_THAT(error_of([] { parse_cuda_fault("drafter:6:boom"); }), HasSubstr("'boom' is not a kind"));
  EXPECT_THAT(error_of([] { parse_cuda_fault("drafter:6:boom"); }), HasSubstr("OP target, drafter or optimizer"));
  EXPECT_EQ(step_failure_message(1, 6, "drafter forward+backward: cudaErrorLaunchFailure"),
            "rank 1, step 6: drafter forward+backward: cudaErrorLaunchFailure");
}

// The memory plan of an MoE target (the HF-made tiny qwen3_5_moe: H 64, 8 experts of 32, top 2,
// shared expert 48): the weights hold every expert, router and shared expert (2 bytes each, what the
// loader checks against the checkpoint), and a token's MLP-block activations are the router's fp32
// logits and probabilities, its top-k ids and weights, per chosen expert the gathered input, gate|up,
// product and output (bf16) and the shared expert's gate|up and product: counted by hand here.
TEST(MemoryPlan, MoeBlock) {
  const target::TargetConfig t = target::TargetConfig::from_file(kRoot + "/tests/data/hf_moe/tiny_moe/config.json");
  ASSERT_TRUE(t.is_moe());
  const drafter::DrafterConfig d = drafter::DrafterConfig::for_target(t, 1, 255, 4);
  EXPECT_EQ(d.intermediate_size, 3 * 64);  // an MoE target has no dense width: 3 x hidden
  int64_t stored = 0;
  for (const target::TensorSpec& s : target::expected_tensors(t)) stored += shape_numel(s.shape);
  const int64_t per_layer_mlp = 8 * 64 + 8 * 3 * 64 * 32 + 3 * 64 * 48 + 64;  // router, experts, shared, its gate
  EXPECT_EQ(t.mlp_parameters(), per_layer_mlp);
  EXPECT_EQ(t.parameter_count(), stored);
  const MemoryPlan p = gpu_memory_plan(t, d, 100, 100, 8, 2048);
  EXPECT_DOUBLE_EQ(p.target_weights, 2.0 * static_cast<double>(stored));
  const double per_token = 4.0 * 2 * 8 + (4 + 4) * 2 + 2.0 * 2 * (64 + 2 * 32 + 32 + 64) + 2.0 * 3 * 48 + 4;
  EXPECT_DOUBLE_EQ(mlp_activation_bytes_per_token(t), per_token);
  EXPECT_DOUBLE_EQ(per_token, 1268.0);
  // Linear in tokens, and the MLP block's share is its per-token bytes.
  const MemoryPlan p2 = gpu_memory_plan(t, d, 200, 100, 8, 2048);
  const double gdn_proj = static_cast<double>(std::max(t.gdn_conv_dim() + 2 * t.gdn_value_dim() + 2 * t.linear_num_value_heads,
                                                       t.attn_q_proj_rows() + 2 * t.num_key_value_heads * t.head_dim));
  const double other = 2.0 * (4 * 64 + gdn_proj + static_cast<double>(t.gdn_conv_dim())) + 2.0 * 64 * d.num_context_layers() * 2;
  EXPECT_DOUBLE_EQ(p2.target_activations - p.target_activations, 100 * (per_token + other));
  // A dense target's MLP block: gate|up and product, bf16.
  EXPECT_DOUBLE_EQ(mlp_activation_bytes_per_token(tiny_target()), 2.0 * 3 * tiny_target().intermediate_size);
}

// The Qwen3.6-35B-A3B recipe (configs/qwen3.6-35b-a3b.yaml): its drafter is z-lab's published one
// (8 layers, MLP 6144 = 3 x hidden, the default for an MoE target), the random-weight target config
// reads as 35B parameters with ~3B active, the CUDA backend refuses it by name, and the memory plan's
// figures (one rank, tp=1) are printed.
TEST(MemoryPlan, Qwen35bA3bRecipe) {
  const TrainConfig q = TrainConfig::from_file(kRoot + "/configs/qwen3.6-35b-a3b.yaml");
  const target::TargetConfig t = target::TargetConfig::from_file(kRoot + "/configs/qwen3.6-35b-a3b/config.json");
  ASSERT_TRUE(t.is_moe());
  EXPECT_EQ(t.num_hidden_layers, 40);
  EXPECT_EQ(t.count_layers(target::LayerType::FullAttention), 10);
  EXPECT_GT(t.parameter_count(), 34e9);
  EXPECT_LT(t.parameter_count(), 36e9);
  EXPECT_GT(t.active_parameter_count(), 2.5e9);
  EXPECT_LT(t.active_parameter_count(), 3.5e9);
  const drafter::DrafterConfig d = q.drafter_config(t);
  EXPECT_EQ(d.num_hidden_layers, 8);
  EXPECT_EQ(d.block_size, 16);
  EXPECT_EQ(d.mask_token_id, 248070);
  EXPECT_EQ(d.target_layer_ids, (std::vector<int64_t>{1, 10, 19, 28, 37}));
  EXPECT_EQ(d.intermediate_size, 6144);
  EXPECT_EQ(drafter::DrafterConfig::for_target(t, 8, 248070, 16).intermediate_size, 6144);
  const MemoryPlan one = gpu_memory_plan(target::local_config(t, 1), d, 4096, 4096, 512, 2048);
  EXPECT_DOUBLE_EQ(one.target_weights, 2.0 * static_cast<double>(t.parameter_count()));
  // Per token: 2 x 256 fp32 router scores, 8 x (ids, weights), 8 x (2 x 2048 + 3 x 512) bf16, shared 3 x 512 bf16.
  EXPECT_DOUBLE_EQ(mlp_activation_bytes_per_token(t), 8.0 * 256 + 8 * 8 + 2.0 * 8 * (2 * 2048 + 3 * 512) + 2.0 * 3 * 512 + 4);
  std::printf("Qwen3.6-35B-A3B recipe, tp=1 (target in bf16):\n%s\n", one.table(139.8 * (1 << 30)).c_str());
#ifdef DFLASH_WITH_CUDA
  // The GPU runs the MoE blocks in bf16 (kernels/cuda/moe.h); FP8 MoE is refused by name.
  EXPECT_EQ(target::make_plan(t, Device::cuda(0), target::KernelPolicies{}, 9, target::Precision::Bf16).moe_kernel,
            "moe_grouped_mma");
  const std::string e = error_of([&] { target::make_plan(t, Device::cuda(0), target::KernelPolicies{}, 9, target::Precision::Fp8); });
  EXPECT_THAT(e, HasSubstr("FP8 MoE layers do not run on the GPU yet"));
  // Expert parallel on GPUs: each rank's plan names its share of the experts.
  const target::FastPathPlan ep8 =
      target::make_plan(target::local_config(t, 8, 8), Device::cuda(0), target::KernelPolicies{}, 9, target::Precision::Bf16);
  EXPECT_EQ(ep8.moe_kernel, "moe_grouped_mma");
  EXPECT_THAT(ep8.moe, HasSubstr("expert parallel: 32 of the 256 experts on each rank (ep 8)"));
#endif
  // FP8 experts (model.target.fp8_experts): the experts' bytes halve (plus block scales), one layer's
  // bf16 copy joins the activations (the prefill's wgmma calls read it); on one H100 (79.1 GiB usable)
  // the recipe then fits.
  const MemoryPlan fx = gpu_memory_plan(target::local_config(t, 1), d, 4096, 4096, 512, 2048, false, false, true);
  EXPECT_NEAR(fx.target_experts, one.target_experts * (0.5 + 2.0 / (128.0 * 128.0)), 1.0);
  EXPECT_NEAR(one.target_weights - fx.target_weights, one.target_experts - fx.target_experts, 1.0);
  EXPECT_NEAR(fx.target_activations - one.target_activations, t.expert_bytes_per_layer(2.0), 1.0);
  EXPECT_LT(fx.total(), 79.1 * (1 << 30));
  EXPECT_GT(one.total(), 79.1 * (1 << 30));
  std::printf("Qwen3.6-35B-A3B recipe, tp=1, FP8 experts:\n%s\n", fx.table(79.1 * (1 << 30)).c_str());
  // Expert parallelism (parallel.tp = parallel.ep = 2, 4, 8: each rank holds 256 / ep whole experts,
  // attention and GatedDeltaNet split tp ways): the routed experts' bf16 bytes per rank are
  // 40 layers x 256 / ep experts x 3 x 2048 x 512 x 2 B, and the plan is printed per layout.
  const double experts_all = 40.0 * 256 * 3 * 2048 * 512 * 2;
  EXPECT_DOUBLE_EQ(one.target_experts, experts_all);
  for (int ep : {2, 4, 8}) {
    const target::TargetConfig l = target::local_config(t, ep, ep);
    const int64_t blocks = (q.training.batch_size * q.training.num_anchors + ep - 1) / ep;
    const MemoryPlan p = gpu_memory_plan(l, d, 4096, 4096, blocks, 2048);
    EXPECT_DOUBLE_EQ(p.target_experts, experts_all / ep);
    EXPECT_LT(p.target_weights, one.target_weights / ep + 2.0 * 2 * 248320 * 2048);  // + the replicated embedding and head
    std::printf("Qwen3.6-35B-A3B recipe, tp=%d ep=%d (per rank):\n%s\n", ep, ep, p.table(139.8 * (1 << 30)).c_str());
  }
}

// parallel.ep: a positive integer dividing parallel.tp (validate), and the target's num_experts;
// more than 1 only for an MoE target (validate_against); each message names the field.
TEST(TrainConfig, ExpertParallelIsChecked) {
  EXPECT_THAT(set_error("parallel.ep=0"), HasSubstr("parallel.ep must be a positive integer, got '0'"));
  EXPECT_NO_THROW(minimal({"parallel.tp=2", "parallel.ep=2"}).validate(2));
  EXPECT_THAT(validate_error({"parallel.tp=2", "parallel.ep=4"}, 4),
              HasSubstr("min.yaml: parallel.ep = 4 does not divide parallel.tp = 2"));
  const target::TargetConfig moe = target::TargetConfig::from_file(kRoot + "/tests/data/hf_moe/tiny_moe/config.json");
  EXPECT_NO_THROW(minimal({"parallel.tp=2", "parallel.ep=2", "model.drafter.target_layer_ids=[1]",
                           "model.drafter.mask_token_id=1"}).validate_against(moe));
  const target::TargetConfig dense = tiny_target();
  EXPECT_THAT(error_of([&] { minimal({"parallel.tp=2", "parallel.ep=2"}).validate_against(dense); }),
              HasSubstr("parallel.ep = 2: "));
  EXPECT_THAT(error_of([&] { minimal({"parallel.tp=2", "parallel.ep=2"}).validate_against(dense); }),
              HasSubstr("is a dense model (no experts to split)"));
  EXPECT_THAT(error_of([&] { minimal({"model.target.fp8_experts=true"}).validate_against(dense); }),
              HasSubstr("model.target.fp8_experts: "));
  EXPECT_NO_THROW(minimal({"model.target.fp8_experts=true", "model.drafter.target_layer_ids=[1]",
                           "model.drafter.mask_token_id=1"}).validate_against(moe));
  target::TargetConfig six = moe;
  six.num_experts = 6;
  six.linear_num_key_heads = six.linear_num_value_heads = six.num_attention_heads = 4;
  six.num_key_value_heads = 4;
  EXPECT_THAT(error_of([&] { minimal({"parallel.tp=4", "parallel.ep=4", "model.drafter.target_layer_ids=[1]",
                                      "model.drafter.mask_token_id=1"}).validate_against(six); }),
              HasSubstr("parallel.ep = 4 does not divide the model's num_experts 6"));
}

// data.regenerate.stop_tokens: null = the target's own eos ids, [] = none, else ids and token text;
// a number that is not a token id is refused; the effective YAML reads back the same.
TEST(TrainConfig, RegenerateStopTokensTakeIdsTextOrNull) {
  EXPECT_FALSE(minimal().data.regenerate.stop_tokens.has_value());
  EXPECT_FALSE(minimal({"data.regenerate.stop_tokens=null"}).data.regenerate.stop_tokens.has_value());
  EXPECT_EQ(minimal({"data.regenerate.stop_tokens=[]"}).data.regenerate.stop_tokens, std::vector<std::string>{});
  const TrainConfig c = minimal({"data.regenerate.stop_tokens=[151645, \"<|im_end|>\"]"});
  EXPECT_EQ(c.data.regenerate.stop_tokens, (std::vector<std::string>{"151645", "<|im_end|>"}));
  EXPECT_EQ(TrainConfig::from_string(c.to_yaml(), "effective.yaml"), c);
  EXPECT_EQ(TrainConfig::from_string(minimal().to_yaml(), "effective.yaml"), minimal());
  for (const char* bad : {"data.regenerate.stop_tokens=[-1]", "data.regenerate.stop_tokens=[1.5]", "data.regenerate.stop_tokens=151645"})
    EXPECT_THAT(set_error(bad), HasSubstr("data.regenerate.stop_tokens")) << bad;
  EXPECT_THAT(error_of([] { minimal({"data.regenerate.stop_tokens=[4096]"}).validate_against(tiny_target()); }),
              HasSubstr("data.regenerate.stop_tokens[0] = 4096 is outside the target's vocabulary [0, 4096)"));
  EXPECT_NO_THROW(minimal({"data.regenerate.stop_tokens=[4095, \"<|im_end|>\"]"}).validate_against(tiny_target()));
}
