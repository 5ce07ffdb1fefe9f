# SPDX-License-Identifier: Apache-2.0
"""A stand-in for FlashAttention-3's `flash_attn_interface` module (hopper/), so that FA3's
own hopper/test_flash_attn.py runs against sparseprefill: FA3's signatures and return
conventions mapped onto sparseprefill.flash_attn_interface, with policy Dense() (the suite
checks dense attention). scripts/python_check.sh puts this folder on sys.path."""

from sparseprefill import flash_attn_interface as _sp

flash_attn_combine = _sp.flash_attn_combine
get_scheduler_metadata = _sp.get_scheduler_metadata
flash_attn_with_kvcache = _sp.flash_attn_with_kvcache  # FA3's own argument order already


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                    pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    # FA3 returns (out, lse) with return_attn_probs.
    return _sp.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                               softcap=softcap, deterministic=deterministic, qv=qv, q_descale=q_descale,
                               k_descale=k_descale, v_descale=v_descale, attention_chunk=attention_chunk,
                               num_splits=num_splits, pack_gqa=pack_gqa, sm_margin=sm_margin,
                               return_softmax_lse=return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None,
                           k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                           num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0,
                           return_attn_probs=False):
    return _sp.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                      softcap=softcap, deterministic=deterministic, seqused_q=seqused_q,
                                      seqused_k=seqused_k, qv=qv, q_descale=q_descale, k_descale=k_descale,
                                      v_descale=v_descale, attention_chunk=attention_chunk,
                                      num_splits=num_splits, pack_gqa=pack_gqa, sm_margin=sm_margin,
                                      return_softmax_lse=return_attn_probs)
