#pragma once
// Reading fields of a JSON object (a config.json) with errors that name the file and the full key
// path ("config.json: field 'text_config.hidden_size' must be a positive integer, got \"big\"").
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

#include "core/error.h"

namespace dflash::io {

class JsonFields {
 public:
  // `prefix` is the key path of `obj` in its document ("" or "text_config."); `missing_hint` is the
  // hint shown when a required field is absent.
  JsonFields(const nlohmann::json& obj, std::string source, std::string prefix, std::string missing_hint = {})
      : obj_(obj), source_(std::move(source)), prefix_(std::move(prefix)), hint_(std::move(missing_hint)) {}

  bool has(const char* key) const { return obj_.contains(key) && !obj_.at(key).is_null(); }
  std::string path(const char* key) const { return prefix_ + key; }

  const nlohmann::json& require(const char* key) const {
    DFLASH_CHECK_HINT(has(key), source_ << ": required field '" << path(key) << "' is missing", hint_);
    return obj_.at(key);
  }
  int64_t integer(const char* key, int64_t min_value) const {
    const nlohmann::json& v = require(key);
    DFLASH_CHECK(v.is_number_integer() && v.get<int64_t>() >= min_value,
                 source_ << ": field '" << path(key) << "' must be "
                         << (min_value == 1 ? std::string("a positive integer") : "an integer >= " + std::to_string(min_value))
                         << ", got " << v.dump());
    return v.get<int64_t>();
  }
  int64_t integer_or(const char* key, int64_t min_value, int64_t dflt) const {
    return has(key) ? integer(key, min_value) : dflt;
  }
  int64_t positive_int(const char* key) const { return integer(key, 1); }
  int64_t positive_int_or(const char* key, int64_t dflt) const { return integer_or(key, 1, dflt); }
  double positive_or(const char* key, double dflt) const {
    if (!has(key)) return dflt;
    const nlohmann::json& v = obj_.at(key);
    DFLASH_CHECK(v.is_number() && v.get<double>() > 0,
                 source_ << ": field '" << path(key) << "' must be a positive number, got " << v.dump());
    return v.get<double>();
  }
  bool bool_or(const char* key, bool dflt) const {
    if (!has(key)) return dflt;
    const nlohmann::json& v = obj_.at(key);
    DFLASH_CHECK(v.is_boolean(), source_ << ": field '" << path(key) << "' must be true or false, got " << v.dump());
    return v.get<bool>();
  }
  std::string string_or(const char* key, const std::string& dflt) const {
    if (!has(key)) return dflt;
    const nlohmann::json& v = obj_.at(key);
    DFLASH_CHECK(v.is_string(), source_ << ": field '" << path(key) << "' must be a string, got " << v.dump());
    return v.get<std::string>();
  }

 private:
  const nlohmann::json& obj_;
  std::string source_, prefix_, hint_;
};

}  // namespace dflash::io
