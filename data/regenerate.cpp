#include "data/regenerate.h"

#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/io/files.h"
#include "core/log.h"

namespace dflash::data {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using clock = std::chrono::steady_clock;

std::string parts_dir(const RegenerateOptions& o) { return o.out + ".parts"; }
std::string part_path(const RegenerateOptions& o, int64_t k) {
  return (fs::path(parts_dir(o)) / fmt::format("part-{:06d}.h5", k)).string();
}

// What the parts are made with: everything that changes their tokens. Slots, the device and the
// world layout are not in it (a restart may use other ones).
json manifest(const RegenerateOptions& o, const Dataset& ds, int64_t n) {
  json inputs = json::array();
  for (const FileInfo& f : ds.files())
    inputs.push_back({{"path", fs::absolute(f.path).lexically_normal().string()}, {"sequences", f.num_sequences},
                      {"tokens", f.num_tokens}});
  json dec{{"max_new_tokens", o.gen.max_new_tokens}, {"stop_tokens", o.gen.stop_tokens}};
  if (o.gen.sample)
    dec["sampling"] = {{"temperature", o.gen.sample->temperature}, {"top_p", o.gen.sample->top_p}, {"seed", o.gen.sample->seed}};
  else
    dec["sampling"] = "greedy";
  return json{{"format", "dflash.regenerate.v1"}, {"inputs", inputs},           {"sequences", n},
              {"max_prompt_len", o.max_prompt_len}, {"part_size", o.part_size}, {"target", o.target_identity},
              {"decoding", dec}};
}

// The first field where two manifests differ, as "field: was A, now B".
std::string difference(const json& was, const json& now, const std::string& path = "") {
  if (was.is_object() && now.is_object()) {
    for (auto it = now.begin(); it != now.end(); ++it) {
      const std::string p = path.empty() ? it.key() : path + "." + it.key();
      if (!was.contains(it.key())) return p + ": missing in the parts' manifest";
      const std::string d = difference(was[it.key()], it.value(), p);
      if (!d.empty()) return d;
    }
    return {};
  }
  if (was != now) return fmt::format("{}: the parts were made with {}, this run has {}", path, was.dump(), now.dump());
  return {};
}

class Progress {
 public:
  Progress(bool on, int64_t total, int64_t done) : on_(on), tty_(::isatty(STDERR_FILENO) != 0), total_(total), base_(done) {}
  void update(int64_t done, int64_t generated, double elapsed, int groups) {
    if (!on_) return;
    const auto now = clock::now();
    if (!tty_ && now - last_ < std::chrono::seconds(15)) return;
    last_ = now;
    // This group's count times the groups: an estimate with data parallelism.
    const int64_t all = std::min(total_, base_ + done * groups);
    const double rate = elapsed > 0 ? static_cast<double>(generated * groups) / elapsed : 0;
    const double per_seq = done > 0 ? elapsed / static_cast<double>(done * groups) : 0;
    const double eta = per_seq * static_cast<double>(total_ - all);
    const std::string eta_s = done > 0 ? fmt::format("{:.0f} s", eta) : "?";
    std::fprintf(stderr, "%sregenerate: %s%lld/%lld sequences (%.0f%%), %s%lld new tokens, %.0f tok/s, eta %s%s",
                 tty_ ? "\r\033[K" : "", groups > 1 ? "~" : "", static_cast<long long>(all), static_cast<long long>(total_),
                 total_ ? 100.0 * static_cast<double>(all) / static_cast<double>(total_) : 100.0, groups > 1 ? "~" : "",
                 static_cast<long long>(generated * groups), rate, eta_s.c_str(), tty_ ? "" : "\n");
    std::fflush(stderr);
    drawn_ = tty_;
  }
  void clear() {
    if (drawn_) std::fprintf(stderr, "\r\033[K");
    drawn_ = false;
  }

 private:
  bool on_, tty_, drawn_ = false;
  int64_t total_, base_;
  clock::time_point last_{};
};

std::string manifest_beside(const RegenerateOptions& o) { return o.out + ".json"; }

std::optional<json> read_json(const std::string& path, const std::string& what_to_remove) {
  if (!fs::exists(path)) return std::nullopt;
  try {
    std::ifstream f(path);
    return json::parse(f);
  } catch (const std::exception& e) {
    DFLASH_REJECT_HINT("regenerate: " << path << " cannot be read: " << e.what(),
                     "remove " << what_to_remove << " to make it again");
  }
}

}  // namespace

bool regenerated_file_matches(const RegenerateOptions& o) {
  if (!fs::exists(o.out)) return false;
  const Dataset ds(o.inputs);
  const int64_t n = o.num_prompts < 0 ? ds.num_sequences() : std::min(o.num_prompts, ds.num_sequences());
  const std::optional<json> was = read_json(manifest_beside(o), o.out);
  return was && difference(*was, manifest(o, ds, n)).empty();
}

int64_t regenerate_max_len(const RegenerateOptions& o) {
  const Dataset ds(o.inputs);
  const int64_t n = o.num_prompts < 0 ? ds.num_sequences() : std::min(o.num_prompts, ds.num_sequences());
  int64_t longest = 1;
  for (int64_t i = 0; i < n; ++i) longest = std::max(longest, ds.length(i));
  if (o.max_prompt_len > 0) longest = std::min(longest, o.max_prompt_len);
  return longest + o.gen.max_new_tokens;
}

RegenerateSummary regenerate(target::Decoder& dec, const RegenerateOptions& o, const RegenerateLayout& lay) {
  const auto t0 = clock::now();
  const auto barrier = [&] {
    if (lay.barrier) lay.barrier();
  };
  DFLASH_REQUIRE_HINT(!o.out.empty(), "regenerate: no output file given", "pass --out FILE.h5");
  DFLASH_REQUIRE_HINT(o.part_size >= 1, "regenerate: part size " << o.part_size << " must be >= 1",
                    "a part is the sequences written (and resumed) together");
  target::check_generate_config(o.gen, dec.config().vocab_size);
  const Dataset ds(o.inputs);
  DFLASH_REQUIRE_HINT(ds.vocab_size() <= dec.config().vocab_size,
                    "regenerate: the inputs have vocab_size " << ds.vocab_size() << ", larger than the target's vocabulary of "
                                                              << dec.config().vocab_size,
                    "tokenize the prompts with the target's tokenizer");
  for (const FileInfo& f : ds.files())
    DFLASH_REQUIRE_HINT(fs::absolute(f.path).lexically_normal() != fs::absolute(o.out).lexically_normal(),
                      "regenerate: the output " << o.out << " is also an input", "write the regenerated data to a new file");
  RegenerateSummary sum;
  sum.sequences = o.num_prompts < 0 ? ds.num_sequences() : std::min(o.num_prompts, ds.num_sequences());
  DFLASH_REQUIRE_HINT(sum.sequences > 0, "regenerate: the inputs hold no sequences", "check the input files");
  const int64_t K = (sum.sequences + o.part_size - 1) / o.part_size;
  sum.parts = K;
  const int64_t slot_len = dec.max_len() - o.gen.max_new_tokens;
  DFLASH_CHECK(slot_len >= 1, "regenerate: the decoder's " << dec.max_len() << " tokens per slot leave no room for a prompt beside "
                                                          << o.gen.max_new_tokens << " new tokens");

  // ---- the manifest: made by the leader, checked by every rank on a restart ----
  const json want = manifest(o, ds, sum.sequences);
  if (fs::exists(o.out)) {
    const std::optional<json> was = read_json(manifest_beside(o), o.out);
    const std::string d = was ? difference(*was, want) : "it has no manifest " + manifest_beside(o);
    DFLASH_REQUIRE_HINT(d.empty(), "regenerate: the output " << o.out << " exists and was not made with these settings (" << d << ")",
                      "remove it (and " << manifest_beside(o) << ") to make it again, or write to another file");
    sum.reused = true;
    const Dataset done({o.out});
    sum.written = done.num_sequences();
    return sum;
  }
  const std::string mpath = (fs::path(parts_dir(o)) / "manifest.json").string();
  if (const std::optional<json> was = read_json(mpath, parts_dir(o))) {
    const std::string d = difference(*was, want);
    DFLASH_REQUIRE_HINT(d.empty(), "regenerate: " << parts_dir(o) << " holds parts of another regeneration (" << d << ")",
                      "run with the same inputs, target and decoding options to continue it, or remove "
                          << parts_dir(o) << " (or choose another --out) to start afresh");
  }
  barrier();
  if ((lay.leader || lay.writer) && !fs::exists(mpath)) {
    // Every writer writes the same text under its own name, then renames it into place (atomic).
    fs::create_directories(parts_dir(o));
    const std::string mine = mpath + "." + std::to_string(::getpid());
    io::write_file_atomic(mine, want.dump(2) + "\n");
    fs::rename(mine, mpath);
  }
  barrier();

  // ---- this group's parts ----
  int64_t resumed_seqs = 0;
  for (int64_t k = 0; k < K; ++k)
    if (fs::exists(part_path(o, k))) {
      ++sum.parts_resumed;
      resumed_seqs += std::min(o.part_size, sum.sequences - k * o.part_size);
    }
  if (lay.leader && sum.parts_resumed > 0)
    spdlog::info("regenerate: resuming: {} of {} parts are already in {}", sum.parts_resumed, K, parts_dir(o));
  Progress bar(lay.leader && o.progress, sum.sequences, resumed_seqs);
  const auto t_gen = clock::now();
  target::GenStats done;  // this group's finished parts
  for (int64_t k = lay.group; k < K; k += lay.num_groups) {
    if (fs::exists(part_path(o, k))) continue;
    const int64_t first = k * o.part_size, end = std::min(sum.sequences, first + o.part_size);
    std::vector<target::GenRequest> reqs;
    std::vector<Sequence> prompts_only;  // per request: the prompt (ids) to write before the response
    for (int64_t i = first; i < end; ++i) {
      Sequence s = ds.sequence(i);
      std::vector<int32_t> p = prompt_of(s);
      if (p.empty()) continue;                                                            // counted at the join
      if (o.max_prompt_len > 0 && static_cast<int64_t>(p.size()) > o.max_prompt_len) continue;  // counted at the join
      DFLASH_REQUIRE_HINT(static_cast<int64_t>(p.size()) <= slot_len,
                        "regenerate: sequence " << i << "'s prompt has " << p.size() << " tokens; the slots hold " << slot_len
                                                << " + " << o.gen.max_new_tokens << " new ones",
                        "size the decoder with regenerate_max_len");
      reqs.push_back({static_cast<uint64_t>(i), std::move(p)});
    }
    std::vector<target::GenResult> results(reqs.size());
    const target::GenStats st = target::generate_batch(
        dec, reqs, o.gen, [&](target::GenResult&& r) { results[r.index] = std::move(r); },
        [&](const target::GenStats& now) {
          bar.update(done.sequences + now.sequences, done.generated + now.generated,
                     std::chrono::duration<double>(clock::now() - t_gen).count(), lay.num_groups);
        });
    done.add(st);
    sum.gen.add(st);
    if (lay.writer) {
      fs::create_directories(parts_dir(o));
      DatasetWriter w(part_path(o, k), dec.config().vocab_size, o.writer);
      for (size_t j = 0; j < reqs.size(); ++j) {
        Sequence out;
        out.ids = reqs[j].prompt;
        out.mask.assign(out.ids.size(), 0);
        out.ids.insert(out.ids.end(), results[j].tokens.begin(), results[j].tokens.end());
        out.mask.resize(out.ids.size(), 1);
        w.append(out);
      }
      w.finish();
      // Test hook: a kill -9 after this many parts of this process are on disk (tests/regenerate_test.sh).
      static int64_t written_parts = 0;
      if (const char* e = std::getenv("DFLASH_FAULT_KILL_AFTER_PARTS"); e && ++written_parts >= std::atoll(e)) {
        bar.clear();
        std::fprintf(stderr, "regenerate: DFLASH_FAULT_KILL_AFTER_PARTS=%s: killed after part %lld\n", e, static_cast<long long>(k));
        std::raise(SIGKILL);
      }
    }
  }
  bar.clear();
  barrier();

  // ---- the join (leader) ----
  if (lay.leader) {
    std::vector<std::string> parts;
    for (int64_t k = 0; k < K; ++k) {
      DFLASH_CHECK_HINT(fs::exists(part_path(o, k)), "regenerate: part " << k << " (" << part_path(o, k) << ") is missing after every rank finished",
                        "run the regeneration again: it makes the missing parts");
      parts.push_back(part_path(o, k));
    }
    {
      DatasetWriter w(o.out, dec.config().vocab_size, o.writer);
      int64_t k = 0;
      for (const std::string& p : parts) {
        const Dataset part({p});
        const int64_t first = k * o.part_size, end = std::min(sum.sequences, first + o.part_size);
        int64_t j = 0;
        for (int64_t i = first; i < end; ++i) {  // the input's sequences, to count what was skipped
          const Sequence in = ds.sequence(i);
          const size_t plen = prompt_of(in).size();
          if (plen == 0) {
            ++sum.skipped_empty;
            continue;
          }
          if (o.max_prompt_len > 0 && static_cast<int64_t>(plen) > o.max_prompt_len) {
            ++sum.skipped_long;
            continue;
          }
          DFLASH_CHECK_HINT(j < part.num_sequences(), "regenerate: " << p << " holds " << part.num_sequences()
                                                                  << " sequences, fewer than its prompts",
                            "remove it and run the regeneration again");
          const Sequence s = part.sequence(j++);
          DFLASH_CHECK_HINT(std::equal(s.ids.begin(), s.ids.begin() + static_cast<std::ptrdiff_t>(std::min(plen, s.ids.size())),
                                       in.ids.begin()) && s.ids.size() > plen,
                            "regenerate: sequence " << i << " in " << p << " does not start with its prompt",
                            "remove " << parts_dir(o) << " and run the regeneration again");
          sum.prompt_tokens += static_cast<int64_t>(plen);
          sum.generated += static_cast<int64_t>(s.ids.size() - plen);
          if (!o.gen.stop_tokens.empty() &&
              std::find(o.gen.stop_tokens.begin(), o.gen.stop_tokens.end(), s.ids.back()) != o.gen.stop_tokens.end())
            ++sum.stopped;
          w.append(s);
          ++sum.written;
        }
        DFLASH_CHECK_HINT(j == part.num_sequences(), "regenerate: " << p << " holds more sequences than its prompts",
                          "remove it and run the regeneration again");
        ++k;
      }
      DFLASH_REQUIRE_HINT(sum.written > 0, "regenerate: no sequence has a prompt to regenerate ("
                                             << sum.skipped_empty << " are supervised from their first token, "
                                             << sum.skipped_long << " have prompts longer than --max-prompt-len)",
                        "a prompt is the tokens before the first loss_mask = 1");
      w.finish();
    }
    io::write_file_atomic(manifest_beside(o), want.dump(2) + "\n");
    std::error_code ec;
    fs::remove_all(parts_dir(o), ec);
    if (ec) spdlog::warn("regenerate: could not remove {}: {}", parts_dir(o), ec.message());
    sum.joined = true;
  }
  barrier();
  sum.seconds = std::chrono::duration<double>(clock::now() - t0).count();
  return sum;
}

std::string format_summary(const RegenerateSummary& s, const RegenerateOptions& o) {
  if (s.reused)
    return fmt::format("regenerated {} is already complete ({} sequences, made with these settings): nothing to do", o.out,
                       s.written);
  std::string r = fmt::format("regenerated {}: {} sequences ({} prompt tokens + {} new tokens, {:.1f} new per sequence", o.out,
                              s.written, s.prompt_tokens, s.generated,
                              s.written ? static_cast<double>(s.generated) / static_cast<double>(s.written) : 0.0);
  if (!o.gen.stop_tokens.empty()) r += fmt::format(", {} ended at a stop token", s.stopped);
  r += ")";
  if (s.skipped_empty) r += fmt::format("\n  skipped {} sequence(s) supervised from their first token (no prompt)", s.skipped_empty);
  if (s.skipped_long) r += fmt::format("\n  skipped {} prompt(s) longer than {} tokens", s.skipped_long, o.max_prompt_len);
  if (s.parts_resumed) r += fmt::format("\n  {} of {} parts were on disk from an earlier run", s.parts_resumed, s.parts);
  if (s.gen.sequences > 0)
    r += fmt::format("\n  this run: {} sequences, {} new tokens in {:.1f} s = {:.0f} tok/s per TP group (prefill {:.1f} s, decode {:.1f} s, "
                     "{:.1f} sequences per decode step)",
                     s.gen.sequences, s.gen.generated, s.gen.seconds(),
                     s.gen.seconds() > 0 ? static_cast<double>(s.gen.generated) / s.gen.seconds() : 0.0, s.gen.prefill_s,
                     s.gen.decode_s, s.gen.occupancy());
  return r;
}

}  // namespace dflash::data
