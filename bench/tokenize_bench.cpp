// tokenize_bench: encode speed of the native tokenizer (text/tokenizer.h) on a corpus, one thread
// and many, as rows of the benchmarks' CSV (bench tokenize, metrics mb_per_s and tok_per_s, the
// shape naming tokenizer, threads and corpus). scripts/gpu_tokenize.sh runs it beside Hugging Face
// tokenizers (Python) on the same documents.
//
//   tokenize_bench --tokenizer DIR|tokenizer.json --jsonl docs.jsonl --threads 1,16 --csv bench/results/x.csv
//   tokenize_bench --tokenizer DIR /usr/lib/python3.11 --corpus-name python3.11-stdlib
//
// Documents: the "text" of each line of --jsonl files, or each regular file under the positional
// paths (recursively, sorted; files that are not UTF-8 are skipped and counted). One untimed pass
// first (the word caches warm, as HF's does), then timed passes until --seconds have gone (at least
// 3): the median pass gives the row, p20/p80 its spread. A pass over T threads (kept from pass to
// pass) hands documents out one at a time, largest first, from a shared counter and ends when the
// last one is done.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/report.h"
#include "core/app.h"
#include "core/error.h"
#include "text/tokenizer.h"
#include "text/utf8.h"
#include "core/worker_pool.h"

using namespace dflash;

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  DFLASH_CHECK_IO(in.good(), "opening", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos) return line.substr(line.find(':') + 2);
  return "cpu";
}

double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5)];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Encode speed of the native tokenizer: CSV rows (bench tokenize)."};
  app.name("tokenize_bench");
  std::string log_level = "warn", tokenizer, csv, corpus_name, tokenizer_name;
  std::vector<std::string> jsonl, paths;
  std::vector<int> threads = {1, 16};
  double seconds = 3;
  bool no_fast_path = false;
  add_common_options(app, &log_level);
  app.add_option("--tokenizer", tokenizer, "model directory holding tokenizer.json, or the file")->required();
  app.add_option("--jsonl", jsonl, "JSONL files of {\"text\": ...} rows, one document each");
  app.add_option("paths", paths, "text files or directories (every regular file under them is a document)");
  app.add_option("--threads", threads, "thread counts to time")->delimiter(',')->capture_default_str();
  app.add_option("--seconds", seconds, "timed seconds per thread count (at least 3 passes)")->capture_default_str();
  app.add_flag("--no-fast-path", no_fast_path, "split with Oniguruma even for the Qwen patterns (provider dflash_onig)");
  app.add_option("--csv", csv, "append the rows to this CSV");
  app.add_option("--corpus-name", corpus_name, "the corpus in the rows' shape (default: the first input's name)");
  app.add_option("--tokenizer-name", tokenizer_name, "the tokenizer in the rows' shape (default: its directory or file name)");
  return run_app(app, argc, argv, [&]() -> int {
    const text::Tokenizer tok = text::Tokenizer::from_file(tokenizer, text::TokenizerOptions{.fast_paths = !no_fast_path});
    const std::string provider = no_fast_path ? "dflash_onig" : "dflash";
    std::vector<std::string> docs;
    size_t skipped = 0;
    for (const auto& f : jsonl) {
      std::ifstream in(f, std::ios::binary);
      DFLASH_CHECK_IO(in.good(), "opening", f);
      std::string line;
      int64_t n = 0;
      while (std::getline(in, line)) {
        ++n;
        if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
        const auto j = nlohmann::json::parse(line, nullptr, false);
        DFLASH_CHECK(!j.is_discarded() && j.is_object() && j.contains("text") && j["text"].is_string(),
                     f << ":" << n << ": not a {\"text\": ...} row");
        docs.push_back(j["text"]);
      }
    }
    for (const auto& p : paths) {
      std::vector<std::string> files;
      if (std::filesystem::is_directory(p)) {
        for (const auto& e : std::filesystem::recursive_directory_iterator(p))
          if (e.is_regular_file()) files.push_back(e.path().string());
        std::sort(files.begin(), files.end());
      } else {
        files.push_back(p);
      }
      for (const auto& f : files) {
        std::string t = read_file(f);
        if (text::invalid_utf8_offset(t) != text::kValidUtf8) { ++skipped; continue; }
        docs.push_back(std::move(t));
      }
    }
    DFLASH_CHECK_HINT(!docs.empty(), "tokenize_bench: no documents", "pass --jsonl files or text files / directories");
    size_t bytes = 0;
    for (const auto& d : docs) bytes += d.size();
    if (corpus_name.empty()) corpus_name = std::filesystem::path(!jsonl.empty() ? jsonl[0] : paths[0]).filename().string();
    if (tokenizer_name.empty()) {
      const std::filesystem::path tp(tokenizer);
      tokenizer_name = std::filesystem::is_directory(tp) ? tp.filename().string() : tp.parent_path().filename().string();
    }
    std::printf("tokenize_bench: %zu documents, %.2f MB (%zu files skipped: not UTF-8); %s\n", docs.size(), static_cast<double>(bytes) / 1e6,
                skipped, tok.describe().c_str());

    bench::CsvWriter out(csv, "cpu: " + cpu_name() + ", " + std::to_string(std::thread::hardware_concurrency()) + " threads");
    for (int t : threads) {
      DFLASH_CHECK(t >= 1 && t <= 1024, "--threads " << t << " is out of range");
      // T threads kept from pass to pass (WorkerPool), so each keeps its word cache warm, as
      // the threads of a long tokenize run do.
      WorkerPool pool(t);
      std::atomic<size_t> next{0}, tokens{0};
      // Largest documents first, so no thread is left with a big one at the end of a pass.
      std::vector<size_t> order(docs.size());
      for (size_t k = 0; k < order.size(); ++k) order[k] = k;
      std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return docs[a].size() > docs[b].size(); });
      auto pass = [&]() {
        next = 0;
        tokens = 0;
        const auto t0 = std::chrono::steady_clock::now();
        pool.run([&](int) {
          std::vector<uint32_t> ids;
          size_t mine = 0;
          for (size_t k; (k = next.fetch_add(1)) < docs.size();) {
            ids.clear();
            tok.encode(docs[order[k]], ids);
            mine += ids.size();
          }
          tokens += mine;
        });
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      };
      pass();  // warm-up (untimed)
      std::vector<double> secs;
      double total = 0;
      while (secs.size() < 3 || total < seconds) {
        secs.push_back(pass());
        total += secs.back();
      }
      const double p50 = percentile(secs, 0.5), p20 = percentile(secs, 0.2), p80 = percentile(secs, 0.8);
      const double mb = static_cast<double>(bytes) / 1e6, tk = static_cast<double>(tokens.load());
      const std::string shape = "tokenizer=" + tokenizer_name + ",threads=" + std::to_string(t) + ",corpus=" + corpus_name;
      // Rates: the median pass's rate; p20 / p80 of the rates come from the slow / fast passes.
      out.write({"tokenize", "encode", provider, "encode", "mb_per_s", "MB/s", shape, mb / p50, mb / p80, mb / p20, false});
      out.write({"tokenize", "encode", provider, "encode", "tok_per_s", "tok/s", shape, tk / p50, tk / p80, tk / p20, false});
      std::printf("threads %3d: %8.2f MB/s  %12.0f tok/s  (%zu passes, %zu tokens a pass)\n", t, mb / p50, tk / p50, secs.size(),
                  static_cast<size_t>(tk));
    }
    return 0;
  });
}
