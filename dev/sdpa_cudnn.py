# SPDX-License-Identifier: Apache-2.0
"""The cuDNN peer of dev/fwd_sm90_dense.cu on its shape (torch SDPA, cuDNN backend): h_q=32,
h_kv=8 (K/V repeated per group, as cuDNN SDPA wants), d=128, bf16, causal, batch 1; median of
triton's do_bench (L2 flushed between runs); TFLOP/s over the causal pairs, as the kernel counts."""
import sys

import torch
import torch.nn.functional as F
import triton.testing as tt
from torch.nn.attention import SDPBackend, sdpa_kernel

sizes = [int(a) for a in sys.argv[1:]] or [8192, 16384, 32768]
print(f"{'peer':<6} {'s':>7} {'ms':>9} {'TFLOP/s':>9}")
for s in sizes:
    q = torch.randn(1, 32, s, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, s, 128, device="cuda", dtype=torch.bfloat16).repeat_interleave(4, 1)
    v = torch.randn(1, 8, s, 128, device="cuda", dtype=torch.bfloat16).repeat_interleave(4, 1)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        fn()
        torch.cuda.synchronize()
        ms = tt.do_bench(fn, warmup=25, rep=100, return_mode="median")
    print(f"{'cudnn':<6} {s:>7} {ms:>9.3f} {4 * 32 * 128 * s * (s + 1) / 2 / ms / 1e9:>9.1f}")
