#pragma once
// The emulated MoE kernels' names (tests/test_moe_emulated.cpp includes moe.cu, tests/
// test_moe_decode_emulated.cpp moe_decode.cu, tests/test_moe_wgmma_emulated.cpp moe_sm90.cu, under DFLASH_CUDA_EMULATION): renamed, so that they sit
// beside the library's real definitions in one test binary; then kernels/cuda/moe.h declares them.
#define moe_decode_block moe_decode_block_emulated
#define moe_topk moe_topk_emulated
#define moe_permute moe_permute_emulated
#define moe_route_small moe_route_small_emulated
#define moe_grouped_gemm moe_grouped_gemm_emulated
#define moe_combine moe_combine_emulated
#define moe_gather moe_gather_emulated
#define moe_block moe_block_emulated
#define moe_max_tiles moe_max_tiles_emulated
#define moe_workspace_bytes moe_workspace_bytes_emulated
#define moe_impl_name moe_impl_name_emulated
#define moe_narrow_tiles moe_narrow_tiles_emulated
#define moe_deep_tiles moe_deep_tiles_emulated
#define moe_deep16_tiles moe_deep16_tiles_emulated
#define moe_deep16_short moe_deep16_short_emulated
#define moe_fuse_shared moe_fuse_shared_emulated
#define moe_fp8_dequantize_first moe_fp8_dequantize_first_emulated
#define moe_wgmma moe_wgmma_emulated
#define moe_grouped_gemm_wgmma moe_grouped_gemm_wgmma_emulated
#define moe_wgmma_supported moe_wgmma_supported_emulated
#define moe_fp8_scratch moe_fp8_scratch_emulated
#define moe_decode_topk_first moe_decode_topk_first_emulated
#define moe_dequantize_experts moe_dequantize_experts_emulated
#define moe_experts_scratch_bytes moe_experts_scratch_bytes_emulated
#define moe_quantize_experts moe_quantize_experts_emulated
#define moe_quantize_experts_scaled moe_quantize_experts_scaled_emulated
#include "kernels/cuda/moe.h"
