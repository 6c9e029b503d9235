#pragma once
// Block-attention family: the DFlash drafter's block attention, forward and backward, tensor
// cores (wgmma / mma.sync) and fallback (kernels/cuda/block_attention*.cu). CPU reference:
// cpu::block_attention (kernels/cpu/train_ops.h; the tests give it drafter::mask_allows as the mask).
#include <cstdint>

#include "kernels/cuda/launch.h"

namespace dflash::cuda {

// ---- DFlash block attention ---------------------------------------------------------------------------
// Queries: the R = nb·B block rows (block b's rows are b·B .. b·B+B−1, block offset j = row − b·B);
// keys/values: the context rows of the block's sequence [N, Hkv, d] and the block's own rows
// [R, Hkv, d]. GQA: query head h reads kv head h / (Hq / Hkv). The mask (query j of block b with
// anchor a = anchor[b], sequence s = block_seq[b], context rows cu_seqlens[s] + t):
//   context key t: allowed iff t < a (strictly), and on sliding layers t >= a + j − (window − 1);
//   own-block key jj: full layers all jj; sliding layers jj <= j (and a + jj >= a + j − (window−1));
//   never keys of another block or sequence.
// Blocks are sorted by (sequence, anchor); blocks of sequence s are cu_blocks[s] .. cu_blocks[s+1]−1.
// Every row has at least its own block key, so no row is empty. Masked tiles are skipped; no
// queries × keys mask or score matrix is materialised.
struct BlockAttnParams {
  const void* q = nullptr;   // [R, Hq, d] bf16 (normalised, rotated)
  const void* kc = nullptr;  // [N, Hkv, d]
  const void* vc = nullptr;  // [N, Hkv, d]
  const void* kb = nullptr;  // [R, Hkv, d]
  const void* vb = nullptr;  // [R, Hkv, d]
  void* out = nullptr;       // [R, Hq, d] bf16   (forward: written; backward: read)
  float* lse = nullptr;      // [R, Hq] natural-log sum of exp(scale · q·k) (forward: written; backward: read)
  const int32_t* anchor = nullptr;      // [nb] device
  const int32_t* block_seq = nullptr;   // [nb] device
  const int32_t* cu_seqlens = nullptr;  // [num_seqs + 1] device, context rows
  const int32_t* cu_blocks = nullptr;   // [num_seqs + 1] device, block ranges
  int64_t nb = 0, B = 0, N = 0, num_seqs = 0, max_seqlen = 0, Hq = 0, Hkv = 0, d = 0;
  bool sliding = false;
  int64_t window = 0;  // keys, > 0 when sliding
  float scale = 0.0f;  // 0 means 1/sqrt(d)
  bool force_fallback = false;  // run the plain kernels even where the tensor-core ones apply (tests, bench)
  // Which tensor-core kernels: Auto = wgmma (sm_90a) on an sm_90 GPU at d = 128, else mma.sync.
  FlashImpl impl = FlashImpl::Auto;
};
void block_attention_fwd(const BlockAttnParams& p, Stream s);
// Backward from dout [R, Hq, d] bf16: dq [R, Hq, d], dkc / dvc [N, Hkv, d], dkb / dvb [R, Hkv, d],
// all bf16, all WRITTEN (context rows no query attends get zeros). Deterministic (no float atomics).
// workspace: block_attention_bwd_workspace(p) bytes of device memory (may be 0), computed with the
// same p (impl, force_fallback, max_seqlen): δ [R, Hq] floats and, where the wgmma kernels run, the
// dSᵀ tiles of the two-pass backward, 8 KiB per (block, kv head, 64-row query tile, 64-key tile up
// to ceil(max_seqlen / 64) + ceil(B / 64)) — about 2.2 GB for 512 blocks over 4096 tokens, 8 kv heads.
struct BlockAttnBwdParams {
  BlockAttnParams fwd;
  const void* dout = nullptr;
  void* dq = nullptr;
  void* dkc = nullptr;
  void* dvc = nullptr;
  void* dkb = nullptr;
  void* dvb = nullptr;
  void* workspace = nullptr;
};
int64_t block_attention_bwd_workspace(const BlockAttnParams& p);
void block_attention_bwd(const BlockAttnBwdParams& p, Stream s);
bool block_attention_supported(int64_t d, int sm_major);  // the tensor-core kernels: d in {64, 128}, sm >= 80
// The tensor-core kernel Auto picks for head dim d on CUDA device `device`: "wgmma sm_90a" or "mma.sync".
const char* block_attention_kernel_name(int64_t d, int device);

}  // namespace dflash::cuda
