"""Limits of the fused decode, in one place.

They mirror what the fused kernels are written for: a step of at most MAX_TOKENS tokens,
paged caches with SPARSE_BLOCK-token blocks, TOPK_BLOCKS selected blocks per index head,
contexts up to MAX_CONTEXT tokens and block tables up to MAX_BLOCK_TABLE_WIDTH entries.
"""

MAX_TOKENS = 16
SPARSE_BLOCK = 128
TOPK_BLOCKS = 16
MAX_CONTEXT = 2**20
MAX_BLOCK_TABLE_WIDTH = MAX_CONTEXT // SPARSE_BLOCK  # 8192
MX_BLOCK = 32  # elements that share one E8M0 scale in MXFP8 / MXFP4
E8M0_BIAS = 127
N_DENSE_LAYERS = 3  # MiniMax-M3: layers 0..2 dense, the rest sparse MoE
