"""Signatures of the GPU libraries' functions the 'flash' and 'te' kernels call, per release.

Transcribed from the libraries' public source at each release tag (signatures only, as data):
- TransformerEngine (github.com/NVIDIA/TransformerEngine), ``transformer_engine/pytorch/cpp_extensions/
  fused_attn.py``: ``fused_attn_fwd`` / ``fused_attn_bwd`` and whether the module has ``SoftmaxType``
  (2.8 on); ``transformer_engine/pytorch/csrc/extensions.h``: the positional arguments (space-separated
  names) of the pybind11 function ``get_fused_attn_backend``, TE's backend query. 2.19 from the
  ``release_v2.19`` branch (2.19.0). 2.20 changed the query to one ``FusedAttentionParams`` object returning
  ``(backend, message)``: transcribed from the change that introduced it (TE commit d374a3df0, July 2026,
  ``csrc/extensions/attention.cpp`` and ``dot_product_attention/utils.py``); the 2.20 tag itself was not in
  the stored sources, whose main branch read 2.20.0.dev0 with the 19-argument query.
- flash-attn (github.com/Dao-AILab/flash-attention), ``flash_attn/flash_attn_interface.py``:
  ``flash_attn_varlen_func`` and ``_flash_attn_varlen_backward``; from 2.7.0 the latter is a
  ``torch.library.custom_op`` (``custom_op``) and returns ``softmax_d`` alone instead of
  ``(dq, dk, dv, softmax_d)``.

tests/test_gpu_signatures.py builds fake libraries with exactly these signatures, so a change in what
the kernels pass (or a release they do not handle) fails on CPU.
"""

# the 19 positional arguments of get_fused_attn_backend from 2.12 to 2.19
TE_QUERY_2_12 = ('is_training q_dtype kv_dtype qkv_layout bias_type attn_mask_type softmax_type p_dropout '
                 'num_attn_heads num_gqa_groups max_seqlen_q max_seqlen_kv head_dim_qk head_dim_v '
                 'window_size_left window_size_right return_max_logit cuda_graph deterministic')
# fused_attn_fwd / fused_attn_bwd are unchanged from 2.15 to 2.20
TE_2_15_FWD = (
    '(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, fake_dtype, '
    'fused_attention_backend, attn_bias=None, cu_seqlens_q_padded=None, '
    'cu_seqlens_kv_padded=None, page_table_k=None, page_table_v=None, s_quantizer=None, '
    "o_quantizer=None, attn_scale=None, dropout=0.0, fast_zero_fill=True, qkv_layout='sbh3d', "
    "o_format='sbhd', qkv_scale_inv_format=None, attn_bias_type='no_bias', "
    "attn_mask_type='padding', softmax_type='vanilla', window_size=(-1, -1), "
    'bottom_right_diagonal=None, rng_gen=None, softmax_offset=None, return_max_logit=False, '
    'cuda_graph=False)')
TE_2_15_BWD = (
    '(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o, fake_dtype, '
    'aux_ctx_tensors, fused_attention_backend, cu_seqlens_q_padded=None, '
    'cu_seqlens_kv_padded=None, s_quantizer=None, dp_quantizer=None, dqkv_quantizer=None, '
    "attn_scale=None, dropout=0.0, fast_zero_fill=True, qkv_layout='sbh3d', o_format='sbhd', "
    "do_format='sbhd', dqkv_layout='sbh3d', qkv_scale_inv_format=None, do_scale_inv_format=None, "
    "attn_bias_type='no_bias', attn_mask_type='padding', softmax_type='vanilla', window_size=(-1, "
    '-1), bottom_right_diagonal=None, deterministic=False, cuda_graph=False)')

#: 2.15 to 2.19 share these signatures (each release read; 2.19 from its release branch).
TE_2_15_TO_2_19 = dict(softmax_type=True, get_fused_attn_backend=TE_QUERY_2_12, fused_attn_fwd=TE_2_15_FWD,
                       fused_attn_bwd=TE_2_15_BWD)
TE_RELEASES = {
    "2.0": dict(
        softmax_type=False,
        get_fused_attn_backend=(
            'q_dtype kv_dtype qkv_layout bias_type attn_mask_type p_dropout num_attn_heads '
            'num_gqa_groups max_seqlen_q max_seqlen_kv head_dim_qk head_dim_v window_size_left '
            'window_size_right'),
        fused_attn_fwd=(
            '(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, fake_dtype, '
            'fused_attention_backend, attn_bias=None, cu_seqlens_q_padded=None, '
            'cu_seqlens_kv_padded=None, s_quantizer=None, o_quantizer=None, attn_scale=None, dropout=0.0, '
            "fast_zero_fill=True, qkv_layout='sbh3d', attn_bias_type='no_bias', attn_mask_type='padding', "
            'window_size=(-1, -1), rng_gen=None)'),
        fused_attn_bwd=(
            '(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o, fake_dtype, '
            'dqkv_dtype, aux_ctx_tensors, fused_attention_backend, cu_seqlens_q_padded=None, '
            'cu_seqlens_kv_padded=None, s_quantizer=None, dp_quantizer=None, dqkv_quantizer=None, '
            "attn_scale=None, dropout=0.0, fast_zero_fill=True, qkv_layout='sbh3d', "
            "attn_bias_type='no_bias', attn_mask_type='padding', window_size=(-1, -1), "
            'deterministic=False)'),
    ),
    "2.2": dict(
        softmax_type=False,
        get_fused_attn_backend=(
            'q_dtype kv_dtype qkv_layout bias_type attn_mask_type p_dropout num_attn_heads '
            'num_gqa_groups max_seqlen_q max_seqlen_kv head_dim_qk head_dim_v window_size_left '
            'window_size_right'),
        fused_attn_fwd=(
            '(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, fake_dtype, '
            'fused_attention_backend, attn_bias=None, cu_seqlens_q_padded=None, '
            'cu_seqlens_kv_padded=None, page_table_k=None, page_table_v=None, s_quantizer=None, '
            "o_quantizer=None, attn_scale=None, dropout=0.0, fast_zero_fill=True, qkv_layout='sbh3d', "
            "attn_bias_type='no_bias', attn_mask_type='padding', window_size=(-1, -1), rng_gen=None)"),
        fused_attn_bwd=(
            '(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o, fake_dtype, '
            'dqkv_dtype, aux_ctx_tensors, fused_attention_backend, cu_seqlens_q_padded=None, '
            'cu_seqlens_kv_padded=None, s_quantizer=None, dp_quantizer=None, dqkv_quantizer=None, '
            "attn_scale=None, dropout=0.0, fast_zero_fill=True, qkv_layout='sbh3d', "
            "attn_bias_type='no_bias', attn_mask_type='padding', window_size=(-1, -1), "
            'deterministic=False)'),
    ),
    "2.5": dict(
        softmax_type=False,
        get_fused_attn_backend=(
            'is_training q_dtype kv_dtype qkv_layout bias_type attn_mask_type p_dropout num_attn_heads '
            'num_gqa_groups max_seqlen_q max_seqlen_kv head_dim_qk head_dim_v window_size_left '
            'window_size_right'),
        fused_attn_fwd=(
            '(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, fake_dtype, '
            'fused_attention_backend, attn_bias=None, cu_seqlens_q_padded=None, '
            'cu_seqlens_kv_padded=None, page_table_k=None, page_table_v=None, s_quantizer=None, '
            "o_quantizer=None, attn_scale=None, dropout=0.0, fast_zero_fill=True, qkv_layout='sbh3d', "
            "attn_bias_type='no_bias', attn_mask_type='padding', window_size=(-1, -1), rng_gen=None)"),
        fused_attn_bwd=(
            '(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o, fake_dtype, '
            'dqkv_dtype, aux_ctx_tensors, fused_attention_backend, cu_seqlens_q_padded=None, '
            'cu_seqlens_kv_padded=None, s_quantizer=None, dp_quantizer=None, dqkv_quantizer=None, '
            "attn_scale=None, dropout=0.0, fast_zero_fill=True, qkv_layout='sbh3d', "
            "attn_bias_type='no_bias', attn_mask_type='padding', window_size=(-1, -1), "
            'deterministic=False)'),
    ),
    "2.8": dict(
        softmax_type=True,
        get_fused_attn_backend=(
            'is_training q_dtype kv_dtype qkv_layout bias_type attn_mask_type softmax_type p_dropout '
            'num_attn_heads num_gqa_groups max_seqlen_q max_seqlen_kv head_dim_qk head_dim_v '
            'window_size_left window_size_right'),
        fused_attn_fwd=(
            '(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, fake_dtype, '
            'fused_attention_backend, attn_bias=None, cu_seqlens_q_padded=None, '
            'cu_seqlens_kv_padded=None, page_table_k=None, page_table_v=None, s_quantizer=None, '
            "o_quantizer=None, attn_scale=None, dropout=0.0, fast_zero_fill=True, qkv_layout='sbh3d', "
            "attn_bias_type='no_bias', attn_mask_type='padding', softmax_type='vanilla', window_size=(-1, "
            '-1), rng_gen=None, softmax_offset=None)'),
        fused_attn_bwd=(
            '(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o, fake_dtype, '
            'dqkv_dtype, aux_ctx_tensors, fused_attention_backend, cu_seqlens_q_padded=None, '
            'cu_seqlens_kv_padded=None, s_quantizer=None, dp_quantizer=None, dqkv_quantizer=None, '
            "attn_scale=None, dropout=0.0, fast_zero_fill=True, qkv_layout='sbh3d', "
            "attn_bias_type='no_bias', attn_mask_type='padding', softmax_type='vanilla', window_size=(-1, "
            '-1), deterministic=False)'),
    ),
    "2.9": dict(
        softmax_type=True,
        get_fused_attn_backend=(
            'is_training q_dtype kv_dtype qkv_layout bias_type attn_mask_type softmax_type p_dropout '
            'num_attn_heads num_gqa_groups max_seqlen_q max_seqlen_kv head_dim_qk head_dim_v '
            'window_size_left window_size_right return_max_logit'),
        fused_attn_fwd=(
            '(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, fake_dtype, '
            'fused_attention_backend, attn_bias=None, cu_seqlens_q_padded=None, '
            'cu_seqlens_kv_padded=None, page_table_k=None, page_table_v=None, s_quantizer=None, '
            "o_quantizer=None, attn_scale=None, dropout=0.0, fast_zero_fill=True, qkv_layout='sbh3d', "
            "attn_bias_type='no_bias', attn_mask_type='padding', softmax_type='vanilla', window_size=(-1, "
            '-1), rng_gen=None, softmax_offset=None, return_max_logit=False)'),
        fused_attn_bwd=(
            '(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o, fake_dtype, '
            'dqkv_dtype, aux_ctx_tensors, fused_attention_backend, cu_seqlens_q_padded=None, '
            'cu_seqlens_kv_padded=None, s_quantizer=None, dp_quantizer=None, dqkv_quantizer=None, '
            "attn_scale=None, dropout=0.0, fast_zero_fill=True, qkv_layout='sbh3d', "
            "attn_bias_type='no_bias', attn_mask_type='padding', softmax_type='vanilla', window_size=(-1, "
            '-1), deterministic=False)'),
    ),
    "2.10": dict(
        softmax_type=True,
        get_fused_attn_backend=(
            'is_training q_dtype kv_dtype qkv_layout bias_type attn_mask_type softmax_type p_dropout '
            'num_attn_heads num_gqa_groups max_seqlen_q max_seqlen_kv head_dim_qk head_dim_v '
            'window_size_left window_size_right return_max_logit cuda_graph'),
        fused_attn_fwd=(
            '(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, fake_dtype, '
            'fused_attention_backend, attn_bias=None, cu_seqlens_q_padded=None, '
            'cu_seqlens_kv_padded=None, page_table_k=None, page_table_v=None, s_quantizer=None, '
            "o_quantizer=None, attn_scale=None, dropout=0.0, fast_zero_fill=True, qkv_layout='sbh3d', "
            "attn_bias_type='no_bias', attn_mask_type='padding', softmax_type='vanilla', window_size=(-1, "
            '-1), rng_gen=None, softmax_offset=None, return_max_logit=False, cuda_graph=False)'),
        fused_attn_bwd=(
            '(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o, fake_dtype, '
            'dqkv_dtype, aux_ctx_tensors, fused_attention_backend, cu_seqlens_q_padded=None, '
            'cu_seqlens_kv_padded=None, s_quantizer=None, dp_quantizer=None, dqkv_quantizer=None, '
            "attn_scale=None, dropout=0.0, fast_zero_fill=True, qkv_layout='sbh3d', "
            "attn_bias_type='no_bias', attn_mask_type='padding', softmax_type='vanilla', window_size=(-1, "
            '-1), deterministic=False, cuda_graph=False)'),
    ),
    "2.12": dict(
        softmax_type=True,
        get_fused_attn_backend=TE_QUERY_2_12,
        fused_attn_fwd=(
            '(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, fake_dtype, '
            'fused_attention_backend, attn_bias=None, cu_seqlens_q_padded=None, '
            'cu_seqlens_kv_padded=None, page_table_k=None, page_table_v=None, s_quantizer=None, '
            "o_quantizer=None, attn_scale=None, dropout=0.0, fast_zero_fill=True, qkv_layout='sbh3d', "
            "attn_bias_type='no_bias', attn_mask_type='padding', softmax_type='vanilla', window_size=(-1, "
            '-1), bottom_right_diagonal=None, rng_gen=None, softmax_offset=None, return_max_logit=False, '
            'cuda_graph=False)'),
        fused_attn_bwd=(
            '(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o, fake_dtype, '
            'dqkv_dtype, aux_ctx_tensors, fused_attention_backend, cu_seqlens_q_padded=None, '
            'cu_seqlens_kv_padded=None, s_quantizer=None, dp_quantizer=None, dqkv_quantizer=None, '
            "attn_scale=None, dropout=0.0, fast_zero_fill=True, qkv_layout='sbh3d', "
            "attn_bias_type='no_bias', attn_mask_type='padding', softmax_type='vanilla', window_size=(-1, "
            '-1), bottom_right_diagonal=None, deterministic=False, cuda_graph=False)'),
    ),
    "2.15": TE_2_15_TO_2_19,
    "2.18": TE_2_15_TO_2_19,
    "2.19": TE_2_15_TO_2_19,
    "2.20": dict(
        softmax_type=True,
        # one FusedAttentionParams object (transformer_engine/pytorch/attention/dot_product_attention/utils.py,
        # a dataclass whose fields all have defaults; the C++ side reads each by name), returning
        # (backend, reject_message)
        get_fused_attn_backend='params',
        fused_attention_params=(
            'is_training deterministic cuda_graph return_max_logit attn_mask_type bias_type window_size_left '
            'window_size_right bottom_right_diagonal softmax_type scaling_mode dropout attn_scale qkv_dtype o_dtype '
            'do_dtype dqkv_dtype qkv_layout o_format do_format dqkv_layout qkv_scale_inv_format '
            'do_scale_inv_format batch_size num_attn_heads num_gqa_groups head_dim_qk head_dim_v max_seqlen_q '
            'max_seqlen_kv num_tokens_q num_tokens_kv num_pages_k num_pages_v page_size_k page_size_v '
            'max_pages_per_seq_k max_pages_per_seq_v bias_batch_size bias_num_heads bias_seqlen_q bias_seqlen_kv'),
        fused_attn_fwd=TE_2_15_FWD,
        fused_attn_bwd=TE_2_15_BWD,
    ),
}

FLASH_RELEASES = {
    "2.6.0": dict(
        custom_op=False,
        flash_attn_varlen_func=(
            '(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, '
            'softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, '
            'deterministic=False, return_attn_probs=False, block_table=None)'),
        _flash_attn_varlen_backward=(
            '(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, '
            'max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, '
            'deterministic, rng_state=None)'),
    ),
    "2.6.3": dict(
        custom_op=False,
        flash_attn_varlen_func=(
            '(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, '
            'softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, '
            'deterministic=False, return_attn_probs=False, block_table=None)'),
        _flash_attn_varlen_backward=(
            '(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, '
            'max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, '
            'deterministic, rng_state=None)'),
    ),
    "2.7.0": dict(
        custom_op=True,
        flash_attn_varlen_func=(
            '(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, '
            'softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, '
            'deterministic=False, return_attn_probs=False, block_table=None)'),
        _flash_attn_varlen_backward=(
            '(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, '
            'max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right, '
            'softcap, alibi_slopes, deterministic, rng_state=None)'),
    ),
    "2.7.4": dict(
        custom_op=True,
        flash_attn_varlen_func=(
            '(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, '
            'softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, '
            'deterministic=False, return_attn_probs=False, block_table=None)'),
        _flash_attn_varlen_backward=(
            '(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, '
            'max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right, '
            'softcap, alibi_slopes, deterministic, rng_state=None, zero_tensors=False)'),
    ),
    "2.8.3": dict(
        custom_op=True,
        flash_attn_varlen_func=(
            '(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, '
            'softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, '
            'deterministic=False, return_attn_probs=False, block_table=None)'),
        _flash_attn_varlen_backward=(
            '(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, '
            'max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right, '
            'softcap, alibi_slopes, deterministic, rng_state=None, zero_tensors=False)'),
    ),
}

#: PyTorch's fused varlen flash attention, per release (the 'torch_flash' kernel):
#: ``varlen_attn``: the public ``torch.nn.attention.varlen.varlen_attn`` (None: not in that release), read from
#: the release's API reference (docs.pytorch.org/docs/<release>/nn.attention.varlen.html; 2.9 = the "stable"
#: page of Oct 2025, 2.10 = the page built from main before the 2.10 branch, the 2.10 tag itself not read)
#: and, for 2.13, from the installed torch 2.13.0 (``inspect.signature``); ``aten_fwd`` / ``aten_bwd``: the
#: schemas of ``aten::_flash_attention_forward`` / ``_flash_attention_backward`` (native_functions.yaml;
#: 2.13 from the installed operator's ``_schema``; earlier releases from the schema as quoted by projects that
#: pin it per release: ``block_table`` / ``num_splits`` arrived with the public function's paged-KV
#: parameters, 2.12). PyTorch 2.11 is not transcribed: its sources were not available here.
_ATEN_FWD_BASE = (
    "_flash_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? cum_seq_q, Tensor? cum_seq_k, "
    "SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, bool return_debug_mask, *, float? scale=None, "
    "SymInt? window_size_left=None, SymInt? window_size_right=None, Tensor? seqused_k=None, "
    "Tensor? alibi_slopes=None{extra}) -> (Tensor output, Tensor softmax_logsumexp, Tensor rng_state, "
    "Tensor unused, Tensor debug_attn_mask)")
_ATEN_BWD = (
    "_flash_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
    "Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, "
    "bool is_causal, Tensor rng_state, Tensor unused, *, float? scale=None, SymInt? window_size_left=None, "
    "SymInt? window_size_right=None) -> (Tensor, Tensor, Tensor)")
_VARLEN_PAGED = (
    "(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1), "
    "enable_gqa=False, seqused_k=None, block_table=None, num_splits=None)")

TORCH_RELEASES = {
    "2.9": dict(
        varlen_attn="(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None)",
        aten_fwd=_ATEN_FWD_BASE.format(extra=""), aten_bwd=_ATEN_BWD),
    "2.10": dict(
        varlen_attn=("(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, "
                     "window_size=(-1, -1))"),
        aten_fwd=_ATEN_FWD_BASE.format(extra=""), aten_bwd=_ATEN_BWD),
    "2.12": dict(
        varlen_attn=_VARLEN_PAGED,
        aten_fwd=_ATEN_FWD_BASE.format(extra=", Tensor? block_table=None, int? num_splits=None"), aten_bwd=_ATEN_BWD),
    "2.13": dict(
        varlen_attn=_VARLEN_PAGED,
        aten_fwd=_ATEN_FWD_BASE.format(extra=", Tensor? block_table=None, int? num_splits=None"), aten_bwd=_ATEN_BWD),
}
