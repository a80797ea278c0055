"""``Fp8MlaDsaBackend``: the ``fp8mla`` attention backend for DSA models (DeepSeek sparse attention:
DeepSeek-V3.2, GLM-5), a subclass of SGLang's ``DeepseekSparseAttnBackend``.

SGLang's DSA backend (layers/attention/dsa_backend.py) owns three things: the metadata its
indexer reads (per batch, and the CUDA-graph buffers each replay rewrites in place), the choice
between dense MHA and sparse MLA for an extend batch (``use_mha``), and one core attention kernel
per ``--dsa-decode-backend`` / ``--dsa-prefill-backend`` (FlashMLA, FA3, TRT-LLM ...). This
subclass keeps the first two as SGLang runs them and replaces the third: the sparse MLA of decode,
target verify and extend batches runs fp8mla's sparse plans over the layer's pool as it is stored:

  * FlashMLA's 656-byte FP8 rows (SGLang's DSA FP8 pool: 512 e4m3 codes, 4 float32 scales, 64
    bf16 rope values; fp8mla's ``fp8_e4m3_block``), SGLang's raw 576-byte FP8 rows (the layout of
    its TRT-LLM and TileLang DSA kernels; unit scales) or bf16 rows;
  * each query token reads the cache tokens of its row of top-k indices: the indexer's output,
    turned into global token slots by SGLang's own transform (``transform_index_page_table_*``,
    or none when SGLang's fused top-k already emits slots); -1 entries are skipped;
  * no head padding (FlashMLA pads to 64 or 128 heads): fp8mla takes 1-128 heads as they are.

The sparse plan of a batch depends only on its number of query tokens (each token is a request of
one query over its own index list), so decode and verify batches re-use one plan per batch size,
made once (before capture, for a CUDA graph: replays run the same plan on the indices the replay's
indexer writes). Extend batches longer than ``sparse.MAX_PLAN_ROWS`` tokens run in chunks of it.
Extend batches SGLang routes to dense MHA (``use_mha``: short sequences on SM90 / SM100) stay on
SGLang's kernels, as does the indexer. What is not served raises an error naming it.
"""

import torch

# Imported by the plugin's factory for a DSA model only, with SGLang loaded.
from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend

from .. import api
from . import BACKEND_NAME
from .backend import _parallel_attn_tp_size, first_layer, refuse_unserved_runner
from .routing import register_model_routing
from .sparse import SparsePlans

_FP8 = torch.float8_e4m3fn


def _pool_format(pool):
    """fp8mla's format of SGLang's DSA pool (its dtype and the values a token row holds), and
    the run() scales it needs; NotImplementedError naming both for anything else."""
    dim = int(getattr(pool, "kv_cache_dim", 0))
    dtype = pool.dtype
    if dtype == _FP8 and getattr(pool, "dsa_kv_cache_store_fp8", False) and dim == 656:
        return "fp8_e4m3_block", {}
    if dtype == _FP8 and dim == api.DIM_QK:
        return "fp8_e4m3", {"ckv_scale": 1.0, "kpe_scale": 1.0}  # written unscaled
    if dtype == torch.bfloat16 and dim == api.DIM_QK:
        return "bf16", {}
    raise NotImplementedError(
        f"fp8mla DSA backend: a KV pool of dtype {dtype} with {dim} values a token is not read "
        f"by fp8mla (bfloat16 x {api.DIM_QK}, float8_e4m3fn x {api.DIM_QK}, or FlashMLA's "
        f"656-byte float8_e4m3fn rows: --kv-cache-dtype bf16 or fp8_e4m3)")


def _check_runner(model_runner):
    """What fp8mla cannot serve, refused before SGLang's constructor runs."""
    refuse_unserved_runner(model_runner, "fp8mla DSA backend")
    cfg = model_runner.model_config
    heads = cfg.num_attention_heads // _parallel_attn_tp_size()
    if not 1 <= heads <= api.MAX_HEADS:
        raise NotImplementedError(
            f"fp8mla DSA backend: {heads} attention heads a GPU (num_attention_heads "
            f"{cfg.num_attention_heads} / attention TP); fp8mla takes 1..{api.MAX_HEADS}")
    if model_runner.dtype not in (torch.bfloat16, torch.float16):
        raise NotImplementedError(f"fp8mla DSA backend: model dtype {model_runner.dtype}; "
                                  "fp8mla takes bfloat16 queries (float16 on the CPU backend)")
    return _pool_format(model_runner.token_to_kv_pool)


class Fp8MlaDsaBackend(DeepseekSparseAttnBackend):
    """SGLang's DSA backend with its core sparse attention on fp8mla (module docstring)."""

    def __init__(self, model_runner, **kwargs):
        kv_format, scales = _check_runner(model_runner)
        super().__init__(model_runner, **kwargs)
        if self.dsa_index_kpool > 1:
            raise NotImplementedError(
                f"fp8mla DSA backend: index_kpool {self.dsa_index_kpool} (pooled index keys, "
                "whose tail tokens extend the top-k lists) is not supported; fp8mla serves 1")
        if self.hisparse_coordinator is not None:
            raise NotImplementedError("fp8mla DSA backend: HiSparse (--enable-hisparse) is not "
                                      "supported")
        if self._kv_shard_pool is not None:
            raise NotImplementedError("fp8mla DSA backend: sharded KV pools are not supported")
        if self.dcp_size > 1:
            raise NotImplementedError(f"fp8mla DSA backend: attention DCP size {self.dcp_size} "
                                      "is not supported (1)")
        # No SGLang DSA kernel is chosen: its metadata step then builds no FlashMLA schedule, and
        # the top-k transform stays PAGED (indices become global slots, never ragged offsets).
        self.dsa_prefill_impl = self.dsa_decode_impl = BACKEND_NAME
        self.enable_auto_select_prefill_impl = False
        self.kv_format = kv_format
        self.kv_scales = scales
        # sm_scale values to plan for: the model's, and any other a layer ran with.
        self.scalings = {float(model_runner.model_config.scaling)}
        pool_tokens = self.token_to_kv_pool.get_key_buffer(
            first_layer(self.token_to_kv_pool)).shape[0]
        self.sparse = SparsePlans(self.device, pool_tokens, kv_format, model_runner.dtype)
        register_model_routing()

    # ---- metadata: SGLang's, plus the plans of decode and verify batches ----

    def _rows(self, forward_batch):
        """Query tokens of a decode or verify batch (None for other modes)."""
        mode = forward_batch.forward_mode
        bs = int(forward_batch.batch_size)
        if mode.is_decode_or_idle():
            return bs
        if mode.is_target_verify():
            return bs * int(self.speculative_num_draft_tokens)
        return None

    def _prepare(self, forward_batch, pin):
        rows = self._rows(forward_batch)
        if rows:
            for scale in sorted(self.scalings):
                self.sparse.prepare(rows, self.num_q_heads, self.dsa_index_topk, scale, pin=pin)

    def init_forward_metadata(self, forward_batch):
        super().init_forward_metadata(forward_batch)
        self._prepare(forward_batch, pin=False)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        super().init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
        self._prepare(forward_batch, pin=True)

    # ---- forward ----

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None,
                       k_rope=None, topk_indices=None, **kwargs):
        self._refuse(layer, kwargs)
        self._save(layer, forward_batch, k, k_rope, save_kv_cache)
        q_nope, q_pe = self._queries(q, q_rope, layer)
        slots = self._slots(topk_indices, q_nope.shape[0], forward_batch, extend=False)
        return self._attend(q_nope, q_pe, layer, slots)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None,
                       k_rope=None, topk_indices=None, **kwargs):
        if self.use_mha:  # SGLang's dense MHA prefill (its set_dsa_prefill_impl decided)
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache,
                                          q_rope=q_rope, k_rope=k_rope,
                                          topk_indices=topk_indices, **kwargs)
        self._refuse(layer, kwargs)
        self._save(layer, forward_batch, k, k_rope, save_kv_cache)
        q_nope, q_pe = self._queries(q, q_rope, layer)
        slots = self._slots(topk_indices, q_nope.shape[0], forward_batch, extend=True)
        return self._attend(q_nope, q_pe, layer, slots)

    @staticmethod
    def _refuse(layer, kwargs):
        """Inputs SGLang's DSA kernels take that fp8mla does not serve."""
        if getattr(layer, "is_cross_attention", False):
            raise NotImplementedError("fp8mla DSA backend: cross attention is not supported")
        given = sorted(name for name, value in kwargs.items()
                       if value is not None and name != "is_neox")
        if given:
            raise NotImplementedError(
                f"fp8mla DSA backend: {', '.join(given)} not supported (attention sinks and "
                "fused rope belong to other DSA kernels)")

    def _save(self, layer, forward_batch, k, k_rope, save_kv_cache):
        """Writes the new tokens' latent k with SGLang's pool writer (FP8: its quantizer)."""
        if k is None or not save_kv_cache:
            return
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc

        if k_rope is None:  # the concatenated form: k [T, 1, 576]
            k, k_rope = k[..., : api.DIM_CKV], k[..., api.DIM_CKV:]
        self.token_to_kv_pool.set_mla_kv_buffer(layer, KVWriteLoc.for_batch(forward_batch), k,
                                                k_rope)

    @staticmethod
    def _queries(q, q_rope, layer):
        """(q_nope [T, H, 512], q_pe [T, H, 64]) from the split or the concatenated form."""
        if (layer.head_dim, layer.v_head_dim) != (api.DIM_QK, api.DIM_CKV):
            raise ValueError(
                f"fp8mla DSA backend: layer {layer.layer_id} has head_dim {layer.head_dim} and "
                f"v_head_dim {layer.v_head_dim}; the absorbed MLA call has {api.DIM_QK} and "
                f"{api.DIM_CKV}")
        heads = layer.tp_q_head_num
        if q_rope is not None:
            return (q.reshape(-1, heads, api.DIM_CKV),
                    q_rope.reshape(-1, heads, api.DIM_KPE))
        qa = q.reshape(-1, heads, api.DIM_QK)
        return qa[..., : api.DIM_CKV], qa[..., api.DIM_CKV:]

    def _slots(self, topk_indices, rows, forward_batch, extend):
        """Global token slots [rows, topk] (-1: skip) of the layer's top-k indices, as SGLang's
        DSA backend derives them for its kernels."""
        if topk_indices is None:
            raise ValueError("topk_indices: the sparse attention of a DSA layer needs the "
                             "indexer's top-k indices; got None")
        if topk_indices.dim() != 2 or topk_indices.shape[0] > rows:
            raise ValueError(f"topk_indices: expected [<= {rows} query tokens, topk], got shape "
                             f"{tuple(topk_indices.shape)}")
        md = self.forward_metadata
        if self.use_fused_topk:  # SGLang's fused top-k already wrote global slots
            slots = self._get_fused_topk_page_table(self._pad_topk_indices(topk_indices, rows))
        elif not extend:
            from sglang.kernels.ops.attention.dsa.transform_index import (
                transform_index_page_table_decode,
            )

            slots = transform_index_page_table_decode(
                page_table=md.page_table_1,
                topk_indices=self._pad_topk_indices(topk_indices, rows), page_size=1)
        else:
            from sglang.kernels.ops.attention.dsa.transform_index import (
                transform_index_page_table_prefill,
            )

            mode = forward_batch.forward_mode
            slots = transform_index_page_table_prefill(
                page_table=md.page_table_1, topk_indices=topk_indices,
                extend_lens_cpu=md.dsa_extend_seq_lens_list, page_size=1,
                output_num_tokens=rows,
                page_table_is_expanded=mode.is_target_verify() or mode.is_draft_extend_v2(),
                cu_seqlens_q=md.cu_seqlens_q)
        if slots.dtype != torch.int32:
            slots = slots.to(torch.int32)
        return slots.contiguous()

    def _cache(self, layer):
        """(ckv, kpe) of the layer's pool as stored, as pages of one token: the block format's
        whole 656-byte rows (kpe None), else the 512 + 64 views."""
        buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        if self.kv_format == "fp8_e4m3_block":
            return buf.view(torch.uint8), None
        return buf[..., : api.DIM_CKV], buf[..., api.DIM_CKV:]

    @staticmethod
    def _output(rows, heads, like):
        """The attention output [rows, heads, 512], written completely by the kernels."""
        return like.new_empty(rows, heads, api.DIM_CKV)

    def _attend(self, q_nope, q_pe, layer, slots):
        rows, heads = q_nope.shape[0], q_nope.shape[1]
        out = self._output(rows, heads, q_nope)
        if rows:
            self.scalings.add(float(layer.scaling))
            ckv, kpe = self._cache(layer)
            self.sparse.run(q_nope, q_pe, ckv, kpe, out, slots, layer.scaling, **self.kv_scales)
        return out.view(-1, heads * api.DIM_CKV)
