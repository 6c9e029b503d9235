#pragma once
// data.train: a JSONL of conversations prepared (dflash_data prepare, data/prepare.h) into
// <run_dir>/data/prepared.h5 on first use and reused after, as data.regenerate's output is.
//
// Beside the file lies its key, <prepared>.key.json: what it was made from: the input (absolute
// path, bytes, mtime and SHA-256), the tokenizer (its directory and the SHA-256 of tokenizer.json,
// tokenizer_config.json and chat_template.jinja, which hold the chat template) and the options.
// A start whose key equals the file's (the paths and the mtime aside: content decides) reuses it;
// any difference prepares again, naming it. The input is hashed only when its path, size or mtime
// moved (an unchanged size and mtime keep the recorded hash, as make and rsync trust them); a file
// touched but not changed is reused and its key updated.
//
// Nothing half-written survives a crash: the key goes first, prepare_jsonl writes the file
// atomically, the new key is written (atomically) last, so a file without a matching key is made again.
// Data regenerated from an earlier prepared file (data.regenerate's output and parts, whose
// manifests name the prepared file) is removed when the file is made again.
#include <string>

#include <nlohmann/json.hpp>

#include "trainer/config.h"

namespace dflash::trainer {

// Start-up checks of data.train before anything is written: the input is a file, the tokenizer
// directory holds a tokenizer.json, and this build has the tokenizer (text/). Throws naming the key.
void check_train_text(const TrainConfig& cfg);

// The key of the prepared file this config asks for. `previous` (a key read from disk, or null):
// when its input has the same path, size and mtime, its hash is taken instead of reading the input.
nlohmann::json prepared_key(const TrainConfig& cfg, const nlohmann::json& previous = nullptr);

// The first difference between two keys ("input.sha256: was ..., now ..."), "" when they match.
// The paths, the input's mtime and the summary are not compared.
std::string prepared_key_difference(const nlohmann::json& was, const nlohmann::json& now);

struct PreparedText {
  std::string path;    // the prepared file
  bool reused = false;  // it was there with a matching key
  std::string log;     // what was done, for the run's log (several lines when prepared)
};

// Makes or reuses cfg.prepare_path() (one process: dflash_train's rank 0, the others wait).
PreparedText prepare_train_text(const TrainConfig& cfg);

}  // namespace dflash::trainer
