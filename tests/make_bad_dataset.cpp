// Writes a dflash.tokens.v1 file with one planted defect, for tests/train_test.sh (baddata): the
// trainer must refuse it at start-up naming the file, the dataset and the sequence.
//   make_bad_dataset KIND OUT.h5 [VOCAB]
// KIND: id_out_of_range  sequence 13, position 5 holds id VOCAB + 7 (the attribute says VOCAB)
//       mask_value       sequence 13, position 5 has loss_mask 2
//       no_supervised    every loss_mask is 0
//       few_anchors      sequences 0..5 of 20 have no two consecutive supervised tokens (30%)
// Every other sequence is valid: 20 sequences of 24 tokens, ids < VOCAB (default 4096), masks 0 x 4, 1 x 20.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "raw_dataset.h"

int main(int argc, char** argv) {
  using namespace dflash::data;
  if (argc < 3) {
    std::fprintf(stderr, "usage: make_bad_dataset id_out_of_range|mask_value|no_supervised|few_anchors OUT.h5 [VOCAB]\n");
    return 2;
  }
  const std::string kind = argv[1], out = argv[2];
  RawFile r;
  r.vocab = argc > 3 ? std::atoll(argv[3]) : 4096;
  const int S = 20, L = 24;
  r.offsets = {0};
  for (int s = 0; s < S; ++s) {
    for (int t = 0; t < L; ++t) {
      r.ids.push_back(static_cast<int32_t>((s * 131 + t * 17) % (r.vocab - 1)));
      uint8_t m = t >= 4 ? 1 : 0;
      if (kind == "no_supervised") m = 0;
      if (kind == "few_anchors" && s < 6) m = t % 2;
      r.mask.push_back(m);
    }
    r.offsets.push_back(r.offsets.back() + L);
  }
  const size_t at = 13 * L + 5;
  if (kind == "id_out_of_range") r.ids[at] = static_cast<int32_t>(r.vocab + 7);
  else if (kind == "mask_value") r.mask[at] = 2;
  else if (kind != "no_supervised" && kind != "few_anchors") {
    std::fprintf(stderr, "make_bad_dataset: unknown kind '%s'\n", kind.c_str());
    return 2;
  }
  try {
    write_raw(out, r);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make_bad_dataset: %s\n", e.what());
    return 1;
  }
  std::printf("wrote %s (%s)\n", out.c_str(), kind.c_str());
  return 0;
}
