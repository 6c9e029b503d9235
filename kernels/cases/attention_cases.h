#pragma once
// The attention op cases (see op_cases.h): the target's causal flash attention over packed
// sequences (flash_attention_fwd with each FlashImpl, attention_fallback; kernels/cuda/attention*.cu)
// and its decode twins over a KV-cache pool (kv_cache_append, attention_decode_fast / _fallback;
// attention_decode.cu). Per op: a Case (shape, draw, bounds, amounts), Data (the drawn device
// inputs) with params() — the one place the launch struct is filled — and reference() (the CPU op
// on host copies of the same inputs), the variants, and the tables: *_check_cases() for the gpu
// tests, *_perf_case(s) for kernel_bench.
#include <string>
#include <vector>

#include "kernels/cases/op_cases.h"
#include "kernels/cuda/attention.h"

// Tuning knob defined in attention_decode.cu (0 = the launcher's automatic choice), swept by the
// check tables and kernel_bench.
namespace dflash::cuda::tuning {
extern int attn_decode_splits;  // splits of the key range of attention_decode_fast
}  // namespace dflash::cuda::tuning

namespace dflash::cases {

// ---- causal attention (prefill): flash_attention_fwd and attention_fallback ----------------------
struct AttentionCase {
  std::string shape = {};          // kernel_bench's shape label ("" in check tables: describe())
  std::vector<int64_t> lens = {};  // tokens per sequence
  int64_t Hq = 0, Hkv = 0, d = 0;
  float scale_mult = 1.0f;  // softmax scale = scale_mult / sqrt(d) (8: peaky logits)
  float q_std = 1.0f;       // q ~ N(0, q_std), k, v ~ N(0, 1)
  // k / v read in place from the columns of wider rows (as from the model's fused q|k|v
  // projection): rows of 2 Hkv d + 24 elements, k at column 8, v right after it, the rest NaN.
  bool strided_kv = false;
  // out (every variant) against the f32 CPU attention: one bf16 rounding of the output (<= 2^-9 of
  // an element, ~4e-3 of max |ref| after the averaging) and, in the flash kernels, P rounded to
  // bf16 before P·V (2^-9 per term, partly averaging out): expected 2e-3..5e-3.
  static constexpr double out_bound = 1e-2;
  // perf mode: the flash kernels against each other on the same inputs (no CPU reference).
  static constexpr double agree_bound = 2e-2;

  int64_t N() const;
  int64_t max_len() const;
  float scale() const;
  int64_t ldkv() const { return strided_kv ? 2 * Hkv * d + 24 : 0; }  // 0: contiguous [N, Hkv, d]
  // 4 · d · Hq · Σ_seq T(T+1)/2 (QKᵀ and PV over the causal half); bytes: q, out, k, v once (the
  // K / V re-reads per query block hit L2).
  double flops() const;
  double bytes() const;
  std::string describe() const;
};
// flash_attention_fwd with FlashImpl Auto (as the model calls it), MmaSync, Wgmma; the fallback.
extern const Variant<cuda::AttentionParams> kFlash, kFlashMmaSync, kFlashWgmma, kAttentionFallback;
// Every variant that runs head dim d on GPU 0: with a flash kernel for d, Auto and mma.sync, wgmma
// where this build and device have it (sm_90a, d 128 / 256), and the fallback; else the fallback.
std::vector<const Variant<cuda::AttentionParams>*> attention_variants(int64_t d);

struct AttentionData {
  ops::SeqOffsets seqs;
  Tensor q, k, v;  // device bf16 [N, Hq, d], [N, Hkv, d] x 2 (contiguous: what the reference reads)
  Tensor kv_rows;  // strided_kv: device bf16 [N, ldkv] holding the same k, v
  Tensor cu;       // int32 [S + 1]
  cuda::AttentionParams params(const AttentionCase& c, void* out) const;  // impl: the variant's
  Tensor reference(const AttentionCase& c) const;                          // host f32 [N, Hq, d]
};
AttentionData draw(const AttentionCase& c, uint64_t seed);
// Check tables (the gpu tests' groups): every head-ratio x sequence-set pair at head dim d (64,
// 128, 256); peaky softmax; head dims only the fallback takes; long sequences; strided k / v.
std::vector<AttentionCase> attention_sweep_cases(int64_t d);
std::vector<AttentionCase> attention_peaky_cases();
std::vector<AttentionCase> attention_odd_dim_cases();
std::vector<AttentionCase> attention_long_cases();
std::vector<AttentionCase> attention_strided_cases();
// kernel_bench: the 27B shape (Hq 24, Hkv 4, d 256) at T 2048 / 8192 and 16 x 512 packed, and
// d 128 (Hq 32, Hkv 8) at T 8192; quick: the first two.
std::vector<AttentionCase> attention_perf_cases(bool quick);

// ---- decode / verify: kv_cache_append, then attention_decode over the cache pool ------------------
struct DecodeAttentionCase {
  std::string shape = {};
  std::vector<int64_t> lens = {}, past = {};  // new tokens and cached positions per sequence
  int64_t Hq = 0, Hkv = 0, d = 0;
  bool causal = true;
  int64_t window = 0;      // 0: none
  int64_t spare = 3;       // unused pool slots between the used ones (SlotLayout)
  int64_t extra_len = 5;   // cache capacity past the longest sequence: max_len = max(past + T) + extra_len
  int64_t split_keys = 0;  // > 0: absolute splits (batch invariance), key_bound = max(past + T)
  // check: the fast kernel's splits swept: 0 automatic (with the workspace it wants), -1 no
  // workspace (one split), n > 0 forced.
  std::vector<int> splits = {0, -1, 3, 64};
  // Append: bf16 copies, exact. Attention (both variants): bf16 q / K / V, fp32 softmax, P rounded
  // to bf16 for P·V (fast), one bf16 rounding of the output: as the prefill flash kernels, 2e-2.
  static constexpr double out_bound = 2e-2;

  int64_t N() const;
  int64_t S() const { return static_cast<int64_t>(lens.size()); }
  int64_t max_new() const;  // >= every T_s
  int64_t max_len() const;
  int64_t ld() const { return Hq * d + 2 * Hkv * d; }  // the new tokens' fused [q | k | v] rows
  float scale() const;
  double kv_bytes() const;  // the K / V bytes of the attended contexts: Σ_s 2 (past_s + T_s) Hkv d · 2
  std::string describe() const;
  bool fast_ok() const;     // attention_decode_fast takes d on this GPU
};
extern const Variant<cuda::AttentionDecodeParams> kDecodeAttentionFast, kDecodeAttentionFallback;

struct DecodeAttentionData {
  ops::SeqOffsets seqs;
  SlotLayout layout;
  Tensor qkv;                 // device bf16 [N, ld]: the new tokens' fused rows (k / v appended from it)
  Tensor q;                   // device bf16 [N, Hq, d]: the q columns of qkv, contiguous
  Tensor k_cache0, v_cache0;  // device bf16 [pool, max_len, Hkv, d]
  Tensor slots, past, cu;     // int32 [sets * S], [S], [S + 1]
  // kv_cache_append of the new k / v into the caches of slot set `set`.
  cuda::KvAppendParams append_params(const DecodeAttentionCase& c, void* k_cache, void* v_cache, int64_t set = 0) const;
  cuda::AttentionDecodeParams params(const DecodeAttentionCase& c, const void* k_cache, const void* v_cache, void* out,
                                     int64_t set = 0, void* workspace = nullptr, size_t workspace_bytes = 0) const;
  // attention_decode_workspace with `splits` (the knob's value, < 0: none) in force.
  size_t workspace_bytes(const DecodeAttentionCase& c, int splits) const;
  struct Ref {
    Tensor k_cache, v_cache, out;  // host f32 [pool, max_len, Hkv, d] x 2 after the append; [N, Hq, d]
  };
  Ref reference(const DecodeAttentionCase& c) const;  // slot set 0
};
DecodeAttentionData draw(const DecodeAttentionCase& c, uint64_t seed, int64_t sets = 1);
// Target (Hq 24, Hkv 4, d 256, causal) decode / verify at several contexts and batches, the
// drafter (Hq 32, Hkv 8, d 128) full and sliding layers, GVA ratios 1..3, odd T, d 64 / 96, more
// query rows than a CTA holds.
std::vector<DecodeAttentionCase> decode_attention_check_cases();
// kernel_bench's decode shape: `model` "target" (Hq 24, Hkv 4, d 256, causal) or "drafter"
// (Hq 32, Hkv 8, d 128, the block attends itself both ways), B sequences of T new tokens at context
// ctx (past ctx - T, max_len ctx), no spare slots.
DecodeAttentionCase decode_attention_perf_case(const std::string& model, int64_t B, int64_t T, int64_t ctx);

}  // namespace dflash::cases
