#pragma once
// Attention family: the target's causal flash attention (prefill, tensor cores and fallback) and
// its decode / verify twins over a KV-cache pool (kernels/cuda/attention*.cu). CPU reference:
// ops::causal_attention, ops::attention_decode (kernels/ops.h).
#include <cstddef>
#include <cstdint>

#include "kernels/cuda/launch.h"

namespace dflash::cuda {

// ---- Causal attention -----------------------------------------------------------------------------
// out[N, Hq, d] = softmax(scale · q kᵀ + causal mask within each sequence) v, GQA: query head h
// reads kv head h / (Hq / Hkv). q [N, Hq, d] contiguous bf16; k / v [N, Hkv, d] with token rows
// ldk / ldv elements apart (0 = Hkv·d, contiguous; e.g. the columns of a fused q|k|v projection),
// heads contiguous within a row; fp32 softmax.
// Which flash kernel runs (FlashImpl, launch.h): Auto = wgmma on an sm_90 device (when this build has
// its sm_90a code and the head dim is 128 or 256), else mma.sync; the other two force one (kernel_bench, tests).
struct AttentionParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  const int32_t* cu_seqlens = nullptr;  // [num_seqs + 1]
  int64_t num_seqs = 0, max_seqlen = 0, N = 0, Hq = 0, Hkv = 0, d = 0;
  int64_t ldk = 0, ldv = 0;  // token row strides of k / v in elements; 0 = Hkv·d
  float scale = 0.0f;
  FlashImpl impl = FlashImpl::Auto;  // flash_attention_fwd only
};
// Flash-style (no T×T matrix in memory), tensor cores. Supports d in {64, 128, 256}, sm >= 80.
void flash_attention_fwd(const AttentionParams& p, Stream s);
bool flash_attention_supported(int64_t d, int sm_major);
// Whether the wgmma (sm_90a) kernel can run head dim d on CUDA device `device`, and the name of the
// kernel Auto picks there ("wgmma sm_90a" or "mma.sync").
bool flash_attention_wgmma_available(int64_t d, int device);
const char* flash_attention_kernel_name(int64_t d, int device);
// Plain kernel for any d and architecture (one query row per block, online softmax).
void attention_fallback(const AttentionParams& p, Stream s);

// ---- Decode / verify (conventions in launch.h) -----------------------------------------------------
// KV-cache append: the new tokens' k / v (token rows ldk / ldv elements apart, e.g. columns of a
// fused q|k|v projection; the Hkv·d values of a row contiguous) into the cache pool k_cache /
// v_cache [num_slots, max_len, Hkv, d] bf16 at positions past_len[s] .. past_len[s] + T_s - 1.
struct KvAppendParams {
  const void* k = nullptr;
  int64_t ldk = 0;  // 0 = Hkv·d
  const void* v = nullptr;
  int64_t ldv = 0;  // 0 = Hkv·d
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  const int32_t* slots = nullptr;
  const int32_t* past_len = nullptr;
  const int32_t* cu_seqlens = nullptr;
  int64_t num_seqs = 0, N = 0, Hkv = 0, d = 0, max_len = 0, num_slots = 0, max_new = 0 /* >= every T_s */;
};
// One CTA per (token index < max_new, sequence), 16-byte copies when the rows allow them.
void kv_cache_append(const KvAppendParams& p, Stream s);

// Attention of the T_s new queries of each sequence over its slot's KV cache (new K / V already
// appended), GQA (query head h reads kv head h / (Hq / Hkv)), bf16 cache, fp32 softmax. Query t of
// seq s is at position p = past_len[s] + t; key position kp is attended when kp < past_len[s] + T_s
// and (causal ? kp <= p : true) and (window > 0 ? kp >= p - (window - 1) : true).
// q, out [N, Hq, d] contiguous bf16. max_new bounds every T_s (the grid is sized by it).
struct AttentionDecodeParams {
  const void* q = nullptr;
  const void* k_cache = nullptr;  // [num_slots, max_len, Hkv, d]
  const void* v_cache = nullptr;
  void* out = nullptr;
  const int32_t* slots = nullptr;
  const int32_t* past_len = nullptr;
  const int32_t* cu_seqlens = nullptr;
  int64_t num_seqs = 0, N = 0, Hq = 0, Hkv = 0, d = 0, max_len = 0, num_slots = 0, max_new = 0;
  bool causal = true;
  int64_t window = 0;  // 0 = none
  float scale = 0.0f;
  void* workspace = nullptr;  // split-KV partials (fast kernel); may be null
  size_t workspace_bytes = 0;
  // Batch invariance (speculative decoding must reproduce greedy decoding bit for bit): > 0 cuts
  // the keys into splits of split_keys (a multiple of 64) at absolute positions, so a query's keys
  // are summed in the same splits, tiles and order whatever T and past_len are (the extra splits and
  // tiles a longer call covers add exact zeros); key_bound >= every past_len + T_s (the host knows
  // it) sizes the grid, and the workspace must hold attention_decode_workspace(p). 0: splits chosen
  // for speed, which depend on T.
  int64_t split_keys = 0;
  int64_t key_bound = 0;
};
// Flash-decoding on tensor cores (mma.sync): one CTA per (sequence, kv head, block of up to 128
// query rows = tokens x the kv head's query heads, split of the key range); the K / V tiles are read
// once per (kv head, split) and shared by all query rows of the group; the splits' partials (fp32)
// are combined by a second kernel. Supports d in {64, 128, 256}, sm >= 80. The number of splits is
// chosen from the grid's size and capped by what fits in the workspace (none: one split, no
// combine), so any workspace is correct and attention_decode_workspace(p) bytes is the fastest.
void attention_decode_fast(const AttentionDecodeParams& p, Stream s);
bool attention_decode_fast_supported(int64_t d, int sm_major);
size_t attention_decode_workspace(const AttentionDecodeParams& p);
// One CTA per (query token, query head), fp32 dot products on CUDA cores, any d.
void attention_decode_fallback(const AttentionDecodeParams& p, Stream s);
// "flash-decoding mma.sync" or "fallback".
const char* attention_decode_kernel_name(int64_t d, int sm_major);

}  // namespace dflash::cuda
