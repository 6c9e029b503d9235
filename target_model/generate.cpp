#include "target_model/generate.h"

#include <algorithm>
#include <chrono>
#include <deque>

#include "core/error.h"

namespace dflash::target {

void GenStats::add(const GenStats& o) {
  sequences += o.sequences, prompt_tokens += o.prompt_tokens, generated += o.generated;
  prefills += o.prefills, decode_steps += o.decode_steps, decode_rows += o.decode_rows;
  mixed_steps += o.mixed_steps, mixed_prompt_tokens += o.mixed_prompt_tokens;
  prefill_s += o.prefill_s, decode_s += o.decode_s;
}

void check_generate_config(const GenerateConfig& c, int64_t vocab) {
  DFLASH_CHECK_HINT(c.max_new_tokens >= 1, "generation: max new tokens = " << c.max_new_tokens << " must be >= 1",
                    "ask for at least one new token");
  DFLASH_CHECK_HINT(c.prefill_tokens >= 1, "generation: prefill tokens = " << c.prefill_tokens << " must be >= 1",
                    "the prompt tokens one prefill extend may take (at least one prompt always goes in)");
  DFLASH_CHECK_HINT(c.step_tokens >= 0, "generation: step tokens = " << c.step_tokens << " must be >= 0",
                    "0 prefills prompts in their own extends; N > 0 runs chunked prefill inside the decode steps, "
                    "N tokens per step (e.g. 512)");
  for (int32_t t : c.stop_tokens)
    DFLASH_CHECK_HINT(t >= 0 && t < vocab, "generation: stop token " << t << " is outside the vocabulary [0, " << vocab << ")",
                      "stop tokens are ids of the target's tokenizer (e.g. its eos_token_id)");
  if (c.sample) ops::check_sample_params(*c.sample);
}

namespace {

using clock = std::chrono::steady_clock;
double since(clock::time_point t0) { return std::chrono::duration<double>(clock::now() - t0).count(); }

struct Running {
  size_t request = 0;
  std::vector<int32_t> tokens;  // generated so far (empty: the prompt is still being prefilled)
  int64_t prefilled = 0;        // prompt tokens in the slot (step_tokens > 0)
};

}  // namespace

GenStats generate_batch(Decoder& dec, const std::vector<GenRequest>& requests, const GenerateConfig& c,
                        const std::function<void(GenResult&&)>& on_done,
                        const std::function<void(const GenStats&)>& progress) {
  check_generate_config(c, dec.config().vocab_size);
  // A request's cap on new tokens: its own, or the config's.
  const auto cap = [&](size_t i) { return requests[i].max_new_tokens > 0 ? requests[i].max_new_tokens : c.max_new_tokens; };
  for (size_t i = 0; i < requests.size(); ++i) {
    const int64_t n = static_cast<int64_t>(requests[i].prompt.size());
    DFLASH_CHECK_HINT(n >= 1, "generation: request " << i << " (id " << requests[i].id << ") has an empty prompt",
                      "every prompt needs at least one token");
    DFLASH_CHECK_HINT(requests[i].max_new_tokens >= 0,
                      "generation: request " << i << " (id " << requests[i].id << ") asks for " << requests[i].max_new_tokens
                                             << " new tokens",
                      "a request's max_new_tokens is >= 1, or 0 for the config's");
    DFLASH_CHECK_HINT(n + cap(i) <= dec.max_len(),
                      "generation: request " << i << " (id " << requests[i].id << "): its " << n << "-token prompt + "
                                             << cap(i) << " new tokens exceed the decoder's " << dec.max_len()
                                             << " tokens per slot",
                      "size the decoder for the longest prompt + max new tokens");
  }
  const auto is_stop = [&](int32_t t) { return std::find(c.stop_tokens.begin(), c.stop_tokens.end(), t) != c.stop_tokens.end(); };
  GenStats st;
  std::vector<std::optional<Running>> slot(static_cast<size_t>(dec.num_slots()));
  std::deque<int32_t> free;
  for (int32_t s = 0; s < dec.num_slots(); ++s) free.push_back(s);
  size_t next_request = 0;
  int64_t running = 0;

  // Appends t to the slot's sequence; a finished sequence goes to on_done and frees the slot.
  const auto push = [&](int32_t s, int32_t t) {
    Running& r = *slot[static_cast<size_t>(s)];
    r.tokens.push_back(t);
    const bool stopped = is_stop(t);
    if (!stopped && static_cast<int64_t>(r.tokens.size()) < cap(r.request)) return;
    GenResult out;
    out.index = r.request;
    out.id = requests[r.request].id;
    out.tokens = std::move(r.tokens);
    out.stopped = stopped;
    ++st.sequences;
    st.prompt_tokens += static_cast<int64_t>(requests[r.request].prompt.size());
    st.generated += static_cast<int64_t>(out.tokens.size());
    slot[static_cast<size_t>(s)].reset();
    free.push_back(s);
    --running;
    on_done(std::move(out));
  };
  // The next request into the first free slot (emptied); returns the slot.
  const auto admit = [&] {
    const int32_t s = free.front();
    free.pop_front();
    dec.reset(s);
    slot[static_cast<size_t>(s)] = Running{next_request++, {}, 0};
    ++running;
    return s;
  };
  const auto options = [&](const std::vector<int32_t>& slots) {
    ExtendOptions o;
    o.last_only = true;
    if (c.sample) {
      o.sample = &*c.sample;
      for (int32_t s : slots) o.sample_streams.push_back(requests[slot[static_cast<size_t>(s)]->request].id);
    }
    return o;
  };

  if (c.step_tokens > 0) {
    // Chunked prefill inside the decode steps: free slots take the next prompts at once; each step
    // decodes every sequence with a first token and gives the rest of the budget to the prompts
    // being prefilled, oldest first.
    std::deque<int32_t> filling;  // slots whose prompts are not all in, in the order they came
    while (next_request < requests.size() || running > 0) {
      while (!free.empty() && next_request < requests.size()) filling.push_back(admit());
      std::vector<int32_t> slots;
      std::vector<std::vector<int32_t>> tokens;
      std::vector<bool> emits;  // the step's row j gives slot j a token (decoding, or its prompt's last piece)
      for (int32_t s = 0; s < dec.num_slots(); ++s) {
        const auto& r = slot[static_cast<size_t>(s)];
        if (!r || r->tokens.empty()) continue;
        slots.push_back(s);
        tokens.push_back({r->tokens.back()});
        emits.push_back(true);
      }
      const int64_t decoding = static_cast<int64_t>(slots.size());
      // The step's budget. While the sequences decoding outnumber the prompts waiting in their slots with
      // none of their tokens in, the pieces ride on a step that mostly decodes: step_tokens in all. Else
      // (the start, a wave that ended together, many slots freed at once) the step is mostly prefill and
      // takes up to max(step_tokens, prefill_tokens) tokens, the decode rows riding along: fed step_tokens
      // a step, a wave's later prompts would start (and end) many steps after its first, and the steps of
      // that tail would decode half their slots.
      int64_t fresh = 0;
      for (int32_t s : filling) fresh += slot[static_cast<size_t>(s)]->prefilled == 0;
      const bool packed = !filling.empty() && (decoding == 0 || fresh >= decoding);
      int64_t left = (packed ? std::max(c.step_tokens, c.prefill_tokens) : c.step_tokens) - decoding, pieces = 0;
      for (auto it = filling.begin(); it != filling.end() && left > 0;) {
        Running& r = *slot[static_cast<size_t>(*it)];
        const auto& p = requests[r.request].prompt;
        const int64_t n = std::min<int64_t>(left, static_cast<int64_t>(p.size()) - r.prefilled);
        slots.push_back(*it);
        tokens.emplace_back(p.begin() + r.prefilled, p.begin() + r.prefilled + n);
        r.prefilled += n;
        left -= n;
        pieces += n;
        const bool done = r.prefilled == static_cast<int64_t>(p.size());
        emits.push_back(done);
        it = done ? filling.erase(it) : std::next(it);
      }
      const auto t0 = clock::now();
      const ExtendResult r = dec.extend(slots, tokens, options(slots));
      if (decoding > 0) {
        st.decode_s += since(t0);
        ++st.decode_steps;
        st.decode_rows += decoding;
        if (pieces > 0) ++st.mixed_steps, st.mixed_prompt_tokens += pieces;
      } else {
        st.prefill_s += since(t0);
        ++st.prefills;
      }
      for (size_t j = 0; j < slots.size(); ++j)
        if (emits[j]) push(slots[j], r.next[j]);
      if (progress) progress(st);
    }
    return st;
  }

  while (next_request < requests.size() || running > 0) {
    if (!free.empty() && next_request < requests.size()) {
      // Prefill: the next prompts into free slots, packed into one extend.
      std::vector<int32_t> slots;
      std::vector<std::vector<int32_t>> prompts;
      int64_t tokens = 0;
      while (!free.empty() && next_request < requests.size()) {
        const auto& p = requests[next_request].prompt;
        if (!slots.empty() && tokens + static_cast<int64_t>(p.size()) > c.prefill_tokens) break;
        slots.push_back(admit());
        prompts.push_back(p);
        tokens += static_cast<int64_t>(p.size());
      }
      const auto t0 = clock::now();
      const ExtendResult r = dec.extend(slots, prompts, options(slots));
      st.prefill_s += since(t0);
      ++st.prefills;
      for (size_t j = 0; j < slots.size(); ++j) push(slots[j], r.next[j]);
      if (progress) progress(st);
      continue;  // fill every free slot before the next decode step
    }
    std::vector<int32_t> slots;
    std::vector<std::vector<int32_t>> last;
    for (int32_t s = 0; s < dec.num_slots(); ++s)
      if (slot[static_cast<size_t>(s)]) {
        slots.push_back(s);
        last.push_back({slot[static_cast<size_t>(s)]->tokens.back()});
      }
    const auto t0 = clock::now();
    const ExtendResult r = dec.extend(slots, last, options(slots));
    st.decode_s += since(t0);
    ++st.decode_steps;
    st.decode_rows += static_cast<int64_t>(slots.size());
    for (size_t j = 0; j < slots.size(); ++j) push(slots[j], r.next[j]);
    if (progress) progress(st);
  }
  return st;
}

}  // namespace dflash::target
