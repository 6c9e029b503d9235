#include "data/synth.h"

#include <algorithm>

#include "core/error.h"
#include "core/rng.h"

namespace dflash::data {

namespace {
constexpr uint64_t kSynthTag = 0x73796e7468636f72ull;  // "synthcor"
}  // namespace

void check_synth_options(const SynthOptions& o) {
  DFLASH_REQUIRE(o.sequences >= 1, "synth: --sequences = " << o.sequences << " must be >= 1");
  DFLASH_REQUIRE_HINT(o.min_length >= 3, "synth: --min-len = " << o.min_length << " must be >= 3",
                    "a sequence needs a prompt token and two supervised tokens");
  DFLASH_REQUIRE(o.max_length >= o.min_length,
               "synth: --max-len = " << o.max_length << " is smaller than --min-len = " << o.min_length);
  DFLASH_REQUIRE(o.vocab_size >= 2 && o.vocab_size <= (int64_t{1} << 31),
               "synth: --vocab-size = " << o.vocab_size << " must be in [2, 2^31]");
}

Sequence synth_sequence(const SynthOptions& o, int64_t i) {
  const uint64_t stream = rng::mix64(kSynthTag ^ rng::mix64(static_cast<uint64_t>(i)));
  uint64_t k = 0;
  auto draw = [&](uint64_t n) -> int64_t {  // uniform in [0, n), 64 random bits
    const uint64_t hi = rng::bits(o.seed, stream, k++), lo = rng::bits(o.seed, stream, k++);
    return static_cast<int64_t>(((hi << 32) | lo) % n);
  };
  const int64_t V = o.vocab_size;
  const int64_t len = o.min_length + draw(static_cast<uint64_t>(o.max_length - o.min_length + 1));
  const int64_t kind = draw(3);
  const int64_t d = 1 + draw(static_cast<uint64_t>(std::min<int64_t>(16, V - 1)));
  const int64_t a = draw(static_cast<uint64_t>(V));
  const int64_t period = 2 + draw(7);
  std::vector<int64_t> pattern(static_cast<size_t>(period));
  for (auto& p : pattern) p = draw(static_cast<uint64_t>(V));
  const int64_t prompt = 1 + draw(static_cast<uint64_t>(std::max<int64_t>(1, std::min<int64_t>(len / 4, 16))));

  Sequence s;
  s.ids.resize(static_cast<size_t>(len));
  s.mask.resize(static_cast<size_t>(len));
  for (int64_t t = 0; t < len; ++t) {
    int64_t v = 0;
    if (kind == 0) v = (a + t * d) % V;
    else if (kind == 1) v = pattern[t % period];
    else v = (pattern[t % period] + (t / period) * d) % V;
    s.ids[t] = static_cast<int32_t>(v);
    s.mask[t] = t >= std::min(prompt, len - 2) ? 1 : 0;
  }
  return s;
}

void write_synth(const std::string& path, const SynthOptions& o, WriterOptions writer) {
  check_synth_options(o);
  DatasetWriter w(path, o.vocab_size, writer);
  for (int64_t i = 0; i < o.sequences; ++i) w.append(synth_sequence(o, i));
  w.finish();
}

}  // namespace dflash::data
