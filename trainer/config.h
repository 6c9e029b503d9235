#pragma once
// dflash_train's configuration: a YAML file (sections model, data, parallel, training, kernels,
// checkpoint, logging) plus `--set key.path=value` overrides from the command line.
//
// Every mistake a user can make here is caught before any GPU work, with the source (file and
// line, or the --set argument), the full key path and the expected form:
//   configs/x.yaml:12: training.lr must be a positive number, got 'fast'
//   configs/x.yaml:3: unknown key 'model.drafter.blok_size'; valid keys of 'model.drafter': ...
// Parsing checks each value's type and range; validate(world_size) the relations between values;
// validate_against(target) what needs the target's config.json (vocabulary, layers, tp).
//
// Defaults are the DFlash recipe (block 16, 512 anchors, gamma 7, lr 6e-4, 4% warmup, cosine,
// AdamW with weight decay 0 and betas (0.9, 0.95), grad clip 1.0, 5 drafter layers).
// Relative paths are relative to the working directory dflash_train is started in.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "drafter/config.h"
#include "target_model/config.h"
#include "target_model/fast_path.h"
#include "target_model/generate.h"
#include "target_model/runtime.h"

namespace dflash::trainer {

struct TargetSection {  // model.target: a Hugging Face directory, or a config.json with random weights
  std::string path;             // HF model directory (config.json + *.safetensors)
  std::string config;           // a config.json; needs random_weights (there are no weights)
  bool random_weights = false;  // initialize the target randomly (benches, demos)
  int64_t seed = 0;             // seed of the random weights
  target::Precision precision = target::Precision::Auto;  // auto | bf16 | fp8 (target_model/config.h)
  bool fp8_experts = false;  // MoE targets on GPUs: the routed experts stored in FP8 (TargetSource::fp8_experts)
  bool operator==(const TargetSection&) const = default;
  target::TargetSource source() const {  // what target::load_target_shard / TargetRuntime load
    target::TargetSource s{path, config, random_weights, static_cast<uint64_t>(seed), precision};
    s.fp8_experts = fp8_experts;
    return s;
  }
};

// What the drafter's linear layers train in: bf16 (the GPU's bf16 GEMMs; the CPU backend's
// kernels.cpu_drafter arithmetic) or fp8 (block-scaled e4m3 forward and backward: simulated on the CPU
// backend, drafter/ref_math.h linear_fp8; on GPUs drafter/fp8_cuda.h, sm_90 and sizes multiples of 128).
enum class DrafterPrecision { Bf16, Fp8 };
// The FP8 weight gradient dw += dyᵀ·x: x's tiles along the tokens (the reduction dim) 128 x 1 (DeepSeek-V3's
// recipe; cuBLASLt's vector x vector mode), or 128 x 128 blocks (its vector x block mode, the forward's);
// auto: the blocks (fp8_wgrad_x_blocks below).
enum class Fp8WgradTiles { Auto, Columns, Blocks };

struct DrafterSection {  // model.drafter: a config.json, a warm start, or the fields below
  std::string config;      // a DFlash drafter config.json (or a directory holding one)
  std::string warm_start;  // an exported drafter directory to continue from (weights + config.json)
  // Used when neither config nor warm_start is given; the rest comes from the target (DrafterConfig::for_target).
  int64_t num_layers = 5;
  int64_t block_size = 16;
  std::optional<int64_t> mask_token_id;   // required with the fields (a token id of the target's vocabulary)
  std::vector<int64_t> target_layer_ids;  // empty = z-lab's default for num_layers
  // The drafter's attention and MLP shape; unset = the target's (DrafterConfig::for_target).
  std::optional<int64_t> num_attention_heads, num_key_value_heads, head_dim, intermediate_size;
  DrafterPrecision precision = DrafterPrecision::Bf16;  // the training step's linears (not the exported weights)
  // The LM-head cross-entropy's two GEMMs (logits, the hidden states' gradient) through the frozen head:
  // bf16, or block-scaled e4m3 (kernels/cuda/loss.h, the FP8 form of linear_ce; simulated on the CPU).
  DrafterPrecision lm_head_precision = DrafterPrecision::Bf16;
  // With precision fp8: the weight gradient's x operand as 128 x 1 tiles (128x1) or 128 x 128 blocks (128x128,
  // and auto, the default since session 29: the GEMM at 1,087-1,182 TFLOP/s instead of 752-902 on an H100, the
  // loss curve on real text within 1.2% of the bf16 one; docs/training.md). Simulated on the CPU, the same
  // tiles on the GPU.
  Fp8WgradTiles fp8_wgrad_x_tiles = Fp8WgradTiles::Auto;
  bool operator==(const DrafterSection&) const = default;
};
// Whether the FP8 drafter's weight gradients take x in 128 x 128 blocks (false for a bf16 drafter).
inline bool fp8_wgrad_x_blocks(const DrafterSection& d) {
  return d.precision == DrafterPrecision::Fp8 && d.fp8_wgrad_x_tiles != Fp8WgradTiles::Columns;
}

struct ModelSection {
  TargetSection target;
  DrafterSection drafter;
  bool operator==(const ModelSection&) const = default;
};

struct SynthSection {  // data.synth: a synthetic corpus made on first use (dflash_data synth)
  bool enabled = false;
  std::string path;            // "" = <logging.run_dir>/data/synth.h5
  int64_t num_sequences = 2000;
  int64_t min_length = 64;     // tokens per sequence
  int64_t max_length = 256;
  int64_t seed = 0;
  int64_t vocab_size = 0;      // token ids drawn from [0, vocab_size); 0 = the target's vocabulary
                               // (without the mask token when it is the vocabulary's last id)
  bool operator==(const SynthSection&) const = default;
};

// data.prepare: how data.train (a JSONL of conversations) becomes token ids and loss masks (dflash_data
// prepare, data/prepare.h) on first use. The result is reused while the input, the tokenizer, its chat
// template and these options are unchanged (a key file beside it records them); a change prepares again.
struct PrepareSection {
  std::string path;             // "" = <logging.run_dir>/data/prepared.h5
  std::string think = "in";     // in | out: the <think>...</think> block inside or outside the loss
  bool last_turn_only = false;  // supervise only the last assistant message of each row
  std::optional<bool> enable_thinking;  // passed to the chat template; null = the template's default
  int64_t max_length = 0;       // longer rows are truncated to it and counted; 0 = data.max_length
  bool skip_bad = false;        // bad rows are counted and reported instead of stopping the run
  std::string chat_template;    // a .jinja file to render with instead of the tokenizer's own ("" = its own)
  // Every row a prompt (dflash_data prepare --prompts): conversations without their trailing assistant
  // turns and with the generation prompt, text rows as they are; a prompt set whose responses
  // data.regenerate makes (which it then needs).
  bool prompts_only = false;
  bool operator==(const PrepareSection&) const = default;
};

// data.regenerate: the responses of the training data replaced by the target's own before training
// (dflash_data regenerate, data/regenerate.h), made on first use and reused after (a file made with
// other settings is refused, naming the difference).
struct RegenerateSection {
  bool enabled = false;
  std::string path;               // "" = <logging.run_dir>/data/regenerated.h5
  int64_t max_new_tokens = 512;   // per response
  double temperature = 0;         // 0 = greedy
  double top_p = 1;
  int64_t seed = 0;               // sampling seed
  // Token ids ("151645") or token text ("<|im_end|>", through tokenizer_dir()'s tokenizer);
  // null: the target's own eos ids (text/stop_tokens.h: tokenizer_dir()'s generation_config.json,
  // config.json, tokenizer_config.json); []: none (every response runs max_new_tokens).
  std::optional<std::vector<std::string>> stop_tokens;
  int64_t num_prompts = 0;        // the first N sequences (0 = all)
  int64_t max_prompt_len = 0;     // longer prompts are skipped and counted (0 = none)
  int64_t slots = 64;             // sequences in flight per TP group
  int64_t step_tokens = target::kRegenerateStepTokens;  // > 0: chunked prefill inside the decode steps; 0: separate prefills
  bool operator==(const RegenerateSection&) const = default;
};

struct DataSection {
  std::vector<std::string> files;  // HDF5 dflash.tokens.v1 files; entries may be globs ("shards/*.h5")
  std::string train;               // a JSONL of conversations (messages / conversations / text rows), prepared on first use
  std::string tokenizer;           // data.train's tokenizer directory; "" = model.target.path
  int64_t max_length = 4096;       // tokens per sequence after truncation/packing
  SynthSection synth;
  PrepareSection prepare;
  RegenerateSection regenerate;
  bool operator==(const DataSection&) const = default;
};

// Where the target and the drafter run: on one GPU per rank (NCCL between ranks), or on the CPU
// reference (MPI collectives; small models, CI and the demo). auto = cuda when this build has the
// CUDA backend and the node has a GPU for each of its ranks, else cpu.
enum class Backend { Auto, Cpu, Cuda };
const char* backend_name(Backend b);

struct ParallelSection {
  int64_t tp = 1;           // tensor-parallel size of the target; divides the number of ranks
  int64_t ep = 1;           // MoE targets: expert groups within a TP group (divides tp and num_experts; target_model/tp.h)
  double timeout_s = 600;   // a collective that takes longer aborts the job
  Backend device = Backend::Auto;
  bool operator==(const ParallelSection&) const = default;
};

enum class Schedule { Cosine, Linear, Constant };
const char* schedule_name(Schedule s);

struct TrainingSection {
  int64_t batch_size = 1;     // sequences per micro-batch per TP group
  int64_t micro_batches = 1;  // gradient accumulation steps per optimizer step
  int64_t num_anchors = 512;  // anchor blocks sampled per sequence
  // Anchor blocks per drafter forward+backward pass (0 = all of a micro-batch's blocks in one pass): a
  // micro-batch's blocks in passes over the same target features, gradients summed (drafter/batch.h
  // for_each_block_pass: the same gradient), the drafter's activations those of one pass.
  int64_t blocks_per_pass = 0;
  double gamma = 7;           // loss decay over block positions
  std::optional<int64_t> epochs;     // exactly one of epochs and max_steps
  std::optional<int64_t> max_steps;
  double lr = 6e-4;
  double warmup_ratio = 0.04;  // of the total steps, in [0, 1)
  Schedule schedule = Schedule::Cosine;
  double min_lr = 0;
  double weight_decay = 0;
  std::vector<double> betas = {0.9, 0.95};
  double eps = 1e-8;
  double grad_clip = 1.0;  // max global grad norm; 0 = no clipping
  int64_t seed = 0;
  int64_t skip_nonfinite_limit = 5;  // this many non-finite steps in a row stop the run
  bool operator==(const TrainingSection&) const = default;
};

struct KernelsSection {  // the fast-path policy of the target's kernels
  target::KernelPolicy conv = target::KernelPolicy::Auto;
  target::KernelPolicy delta_rule = target::KernelPolicy::Auto;
  target::KernelPolicy attention = target::KernelPolicy::Auto;
  bool require_fast_path = false;
  // The CPU backend's drafter step: F32 (float, the threaded GEMM of kernels/cpu/gemm.h; the default)
  // or F64 (the double reference: every cross-layout test at 1e-9 runs it).
  drafter::DrafterMath cpu_drafter = drafter::DrafterMath::F32;
  bool operator==(const KernelsSection&) const = default;
};

struct CheckpointSection {
  std::string dir;               // "" = <logging.run_dir>/checkpoints
  int64_t interval = 1000;       // optimizer steps between checkpoints
  int64_t keep_last = 3;         // complete checkpoints kept
  std::string resume = "auto";   // auto (newest complete one, if any) | never | a checkpoint directory
  bool at_end = true;            // also write one when the run finishes (benchmark runs turn it off)
  bool operator==(const CheckpointSection&) const = default;
};

struct LoggingSection {
  int64_t interval = 10;               // optimizer steps between log lines
  std::string run_dir = "runs/dflash";  // logs, metrics.jsonl, fast_path.json
  bool progress_bar = true;            // drawn only when stderr is a terminal
  bool operator==(const LoggingSection&) const = default;
};

// Where a key's value came from (the settings table shows it). Implied: reset because a --set chose
// an alternative that excludes it (TrainConfig::apply_override).
enum class Origin { Default, File, Override, Implied };

class TrainConfig {
 public:
  ModelSection model;
  DataSection data;
  ParallelSection parallel;
  TrainingSection training;
  KernelsSection kernels;
  CheckpointSection checkpoint;
  LoggingSection logging;

  std::string source;  // where it was read from ("configs/tiny.yaml"), for messages

  // Parses YAML text / a YAML file, then applies `overrides` ("key.path=value") in order.
  // Checks keys, types and ranges (throws dflash::Error); call validate() for the relations.
  static TrainConfig from_string(const std::string& yaml, const std::string& source,
                                 const std::vector<std::string>& overrides = {});
  static TrainConfig from_file(const std::string& path, const std::vector<std::string>& overrides = {});
  // configs/tiny.yaml as compiled into the library (the default when dflash_train gets no file).
  static TrainConfig embedded_default(const std::vector<std::string>& overrides = {});
  static const char* embedded_default_yaml();
  // configs/tiny/config.json (the default config's target), compiled in; used when the default
  // config runs outside the repository root, where its relative path does not resolve.
  static const char* embedded_tiny_target_json();
  static constexpr const char* kEmbeddedSource = "<embedded configs/tiny.yaml>";
  static constexpr const char* kTinyTargetPath = "configs/tiny/config.json";

  // `--set key.path=value`: value is a YAML scalar or flow sequence ("[1, 16, 31]"); "null"
  // unsets an optional key (training.epochs / training.max_steps).
  // What is --set wins over the alternatives the file (or the defaults) chose, unless those are --set
  // too: model.target.path resets model.target.config and random_weights (a config.json the reverse,
  // with random weights); the three sources of data exclude each other: data.files, data.synth.enabled:
  // true and data.train each reset the other two, and a switch away from the file's source of data
  // turns the file's data.regenerate off (the embedded default's regenerates synthetic prompts);
  // training.epochs and max_steps, model.drafter.config and warm_start replace each other. Each reset
  // is listed in notes() and shown as "implied" in the settings table.
  void apply_override(const std::string& assignment);
  const std::vector<std::string>& notes() const { return notes_; }

  // Relations between values: target/drafter sources, epochs vs max_steps, min_lr vs lr, data
  // files vs synth vs train (and data.train's tokenizer), kernel policies vs require_fast_path, and tp dividing `world_size`. Also re-checks
  // every value's range (for configs changed in code).
  void validate(int world_size) const;
  // What needs the target's config.json: tp divides its heads, target_layer_ids within its
  // layers, mask_token_id within its vocabulary, and (drafter config / warm start) the drafter's
  // hidden size, vocabulary and target layer count matching it. Reads model.drafter's config.json if named.
  void validate_against(const target::TargetConfig& target) const;

  // The drafter this config trains on `target` (reads model.drafter.config / warm_start's
  // config.json when given; otherwise DrafterConfig::for_target with the fields). Checked against target.
  drafter::DrafterConfig drafter_config(const target::TargetConfig& target) const;
  target::KernelPolicies kernel_policies() const;
  std::string checkpoint_dir() const;  // checkpoint.dir or <run_dir>/checkpoints
  std::string synth_path() const;      // data.synth.path or <run_dir>/data/synth.h5
  std::string regenerate_path() const; // data.regenerate.path or <run_dir>/data/regenerated.h5
  std::string prepare_path() const;    // data.prepare.path or <run_dir>/data/prepared.h5
  // data.train's tokenizer: data.tokenizer, else the target's model directory ("" when neither:
  // validate() refuses that).
  std::string tokenizer_dir() const;
  int64_t prepare_max_length() const;  // data.prepare.max_length or data.max_length
  // data.files with globs expanded (sorted, duplicates removed); throws when a pattern matches nothing.
  std::vector<std::string> expand_data_files() const;

  // The effective config as YAML (every key, for the run directory); from_string of it gives an equal config.
  std::string to_yaml() const;
  // A table: key | value | from (default, file, --set) | default (when the value differs from it).
  std::string settings_table() const;
  Origin origin(const std::string& key) const;
  // Every key path, in the order of to_yaml ("model.target.path", ..., "logging.progress_bar").
  static std::vector<std::string> keys();

  // Equal values (source and origins are not compared).
  bool operator==(const TrainConfig& o) const;

 private:
  void resolve_alternatives(const std::string& key, const std::string& where);
  std::map<std::string, Origin> origins_;
  std::vector<std::string> notes_;  // "--set data.files=x.h5: data.synth.enabled = false instead of true (from ...)"
  // The file's source of data (data.files, data.synth or data.train): a --set that switches to
  // another one turns the file's data.regenerate off.
  enum class DataSource { Files, Synth, Train };
  DataSource file_source_ = DataSource::Files;
};

}  // namespace dflash::trainer
