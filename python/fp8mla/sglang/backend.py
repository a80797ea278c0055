"""``Fp8MlaAttnBackend``: SGLang's attention backend interface over fp8mla (see fp8mla.sglang).

Per forward batch SGLang calls ``init_forward_metadata`` (eager) or
``init_forward_metadata_out_graph`` (CUDA-graph capture and replay) once, then ``forward_decode``
or ``forward_extend`` once per layer. This backend:

  * builds the batch's page table on the batch's device (fp8mla.sglang.page_table,
    fp8mla::fill_page_table: one launch on CUDA), into a buffer that an fp8mla graph-mode wrapper
    borrows (Problem::borrowed_kv_indices): no host round trip, and a captured run reads the
    table written for the step it replays;
  * plans with host copies of the lengths SGLang keeps (seq_lens_cpu): the plan is
    stream-ordered on the current stream (no synchronisation, no allocation);
  * reads the layer's pool as it is stored (FP8 e4m3 read natively with unit scales, as SGLang's
    MLA pool is written unscaled; or bf16), in pages of SGLang's page size (1 or 64 ...);
  * decode: one query token a request; target verify: draft_token_num tokens, causal; extend with
    a prefix: the new tokens causal over prefix + themselves, on the FP8 pool, or for long chunks
    of an FP8 pool on the gathered cast (GATHER_MIN_NEW_TOKENS); extend without a prefix: the
    non-absorbed ragged prefill (FlashInfer's ragged prefill, or torch's SDPA without FlashInfer).
"""

import math

import torch

from .. import BatchMLAPagedAttentionWrapper, MLAPlanMetadata, api
from .page_table import PageTable
from .routing import register_model_routing

# Extend-with-prefix batches of an FP8 pool whose longest chunk has at least this many new tokens
# run on the gathered cast: each layer casts only the batch's listed pages to bf16, then fp8mla's
# bf16 kernel runs on them. Such chunks are compute-bound, where bf16 products beat fp8 codes
# converted on the way: 11-54% less time on an H100 (two leases) for chunks of 512-8192 new
# tokens over 4K-32K cached ones (bench/sglang_step.py's gather way,
# bench/results/h100_sglang_step.txt). Shorter chunks (not measured to gain) and batches whose
# gathered pages would take more than GATHER_MAX_BYTES of bf16 read the FP8 pool. Both are
# attributes of the backend, too.
GATHER_MIN_NEW_TOKENS = 512
GATHER_MAX_BYTES = 1 << 30

try:  # SGLang's base class when SGLang is installed (always, when SGLang loads this plugin)
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
except ImportError:  # pragma: no cover - SGLang is what imports this module
    AttentionBackend = object


def _parallel_attn_tp_size():
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().attn_tp_size


def _dcp_enabled():
    from sglang.srt.runtime_context import get_parallel

    try:
        return bool(get_parallel().dcp_enabled)
    except RuntimeError:
        return False


def refuse_unserved_runner(model_runner, who):
    """What both fp8mla backends (this one and the DSA one, `who` naming it in each error) refuse
    before they are built: decode context parallelism, MLA dimensions other than 512 + 64, a KV
    pool of another dtype than bfloat16 or float8_e4m3fn, and pools read through translated ids."""
    if _dcp_enabled():
        raise NotImplementedError(f"{who}: decode context parallelism (DCP) is not supported")
    cfg = model_runner.model_config
    dims = (cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    if dims != (api.DIM_CKV, api.DIM_KPE):
        raise NotImplementedError(
            f"{who}: kv_lora_rank {dims[0]} and qk_rope_head_dim {dims[1]}; fp8mla computes MLA "
            f"with {api.DIM_CKV} + {api.DIM_KPE}")
    if model_runner.kv_cache_dtype not in (torch.bfloat16, torch.float8_e4m3fn):
        raise NotImplementedError(
            f"{who}: the KV pool dtype {model_runner.kv_cache_dtype} is not read by fp8mla "
            "(bfloat16 or float8_e4m3fn: --kv-cache-dtype fp8_e4m3)")
    translator = getattr(model_runner, "kv_index_translator", None)
    if translator is not None and getattr(translator, "needs_read_translate", False):
        raise NotImplementedError(f"{who}: pools read through translated (virtual) ids are not "
                                  "supported")


def first_layer(pool):
    """The first layer id of SGLang's KV pool (pools of a pipeline stage start past 0)."""
    return int(getattr(pool, "start_layer", 0) or 0)


class RaggedPrefill:
    """Extend without a prefix in the non-absorbed form (q, k [T, H, 192], v [T, H, 128]),
    causal within each request: FlashInfer's ragged prefill on CUDA (what SGLang's flashinfer MLA
    backend runs), else torch's scaled_dot_product_attention per request."""

    def __init__(self, workspace, device):
        self.qo_indptr_cpu = None
        self._flashinfer = None
        if torch.device(device).type == "cuda":
            try:
                from flashinfer import BatchPrefillWithRaggedKVCacheWrapper

                self._flashinfer = BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
            except ImportError:
                self._flashinfer = None
        self._planned = None

    def plan(self, qo_indptr_cpu, heads, head_dim_qk, head_dim_vo, dtype, device):
        self.qo_indptr_cpu = qo_indptr_cpu
        if self._flashinfer is not None:
            indptr = qo_indptr_cpu.to(device, non_blocking=True)
            self._flashinfer.begin_forward(
                qo_indptr=indptr, kv_indptr=indptr, num_qo_heads=heads, num_kv_heads=heads,
                head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, q_data_type=dtype,
                causal=True)

    def run(self, q, k, v, sm_scale, logit_cap):
        if self._flashinfer is not None:
            return self._flashinfer.forward(q, k, v, causal=True, sm_scale=sm_scale,
                                            logits_soft_cap=logit_cap)
        if logit_cap:
            raise NotImplementedError("logit_cap: the torch fallback of the ragged prefill does "
                                      "not apply logit soft-capping (install FlashInfer)")
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        bounds = self.qo_indptr_cpu.tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b == a:
                continue
            o = torch.nn.functional.scaled_dot_product_attention(
                q[a:b].transpose(0, 1).float(), k[a:b].transpose(0, 1).float(),
                v[a:b].transpose(0, 1).float(), is_causal=True, scale=sm_scale)
            out[a:b] = o.transpose(0, 1).to(out.dtype)
        return out


class _Metadata:
    """What forward_* reads for the current batch."""

    def __init__(self, wrapper=None, ragged=False, gather_pages=None):
        self.wrapper = wrapper
        self.ragged = ragged
        self.gather_pages = gather_pages  # int64 page ids to cast to bf16 each layer, in order


class Fp8MlaAttnBackend(AttentionBackend):
    """SGLang attention backend over fp8mla for MLA models (absorbed decode / verify / extend
    with a prefix on fp8mla; the ragged prefill as SGLang's flashinfer backend runs it)."""

    supports_ragged_verify_graph = False

    def __init__(self, model_runner):
        super().__init__()
        refuse_unserved_runner(model_runner, "fp8mla backend")
        cfg = model_runner.model_config
        self.device = torch.device(model_runner.device)
        self.num_heads = cfg.num_attention_heads // _parallel_attn_tp_size()
        self.kv_lora_rank = cfg.kv_lora_rank
        self.rope_dim = cfg.qk_rope_head_dim
        self.qk_nope_dim = getattr(cfg, "qk_nope_head_dim", 128)
        self.v_head_dim = getattr(cfg, "v_head_dim", 128)
        self.scaling = cfg.scaling
        self.data_type = model_runner.dtype
        self.kv_cache_dtype = model_runner.kv_cache_dtype
        self.page_size = model_runner.page_size
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.kv_index_translator = getattr(model_runner, "kv_index_translator", None)
        self.max_context_len = cfg.context_len
        self.max_bs = int(getattr(model_runner, "max_batch_size", 0) or
                          self.req_to_token_pool.size)
        self.workspace = torch.empty(1, dtype=torch.uint8, device=self.device)
        self.pool_pages = self._pool_tokens() // self.page_size
        self.kv_scales = ({"ckv_scale": 1.0, "kpe_scale": 1.0}
                          if self.kv_cache_dtype == torch.float8_e4m3fn else {})
        self.forward_metadata = None
        self._eager = {}  # forward mode -> (wrapper, page table)
        self._graph = {}  # (forward mode, bs) -> (wrapper, page table)
        self._extend = BatchMLAPagedAttentionWrapper(self.workspace, num_pages=self.pool_pages)
        self._gathered = BatchMLAPagedAttentionWrapper(self.workspace)
        self.gather_min_new_tokens = GATHER_MIN_NEW_TOKENS
        self.gather_max_bytes = GATHER_MAX_BYTES
        self._ragged = RaggedPrefill(self.workspace, self.device)
        register_model_routing()

    # ---- sizes ----

    def _pool_tokens(self):
        return int(self.token_to_kv_pool.get_key_buffer(first_layer(self.token_to_kv_pool))
                   .shape[0])

    def _table_capacity(self, bs):
        return bs * math.ceil(self.max_context_len / self.page_size) + bs

    # ---- wrappers ----

    def _new_graph_wrapper(self, bs, qo_len):
        table = PageTable(self._table_capacity(bs), self.page_size, self.device)
        w = BatchMLAPagedAttentionWrapper(
            self.workspace, use_cuda_graph=True, kv_indices=table.table,
            num_pages=self.pool_pages, max_batch=bs, max_total_q=bs * qo_len, max_qo_len=qo_len)
        return w, table

    def _plan(self, wrapper, table, req_pool_indices, kv_len_cpu, qo_len, causal):
        bs = len(kv_len_cpu)
        kv_indptr, kv_len = table.fill(self.req_to_token_pool.req_to_token, req_pool_indices,
                                       kv_len_cpu)
        qo_indptr = torch.arange(0, (bs + 1) * qo_len, qo_len, dtype=torch.int32)
        if wrapper.plan_info is not None:
            # Each step after the first: only the lengths change (the wrapper, its mode and its
            # page-table buffer are fixed), so skip plan()'s FlashInfer argument parsing.
            wrapper.replan_step(qo_indptr, kv_indptr, kv_len)
            return
        wrapper.plan(
            metadata=MLAPlanMetadata.csr(qo_indptr, kv_indptr, table.table, kv_len),
            num_heads=self.num_heads, head_dim_ckv=self.kv_lora_rank,
            head_dim_kpe=self.rope_dim, page_size=self.page_size, causal=causal,
            sm_scale=self.scaling, q_data_type=self.data_type,
            kv_data_type=self.kv_cache_dtype, query_layout="split", kv_cache_layout="split")

    @staticmethod
    def _mode_key(forward_batch):
        mode = forward_batch.forward_mode
        if mode.is_decode_or_idle():
            return "decode"
        if mode.is_target_verify():
            return "verify"
        return "extend"

    def _qo_len(self, forward_batch, key):
        if key == "decode":
            return 1
        spec = forward_batch.spec_info
        return int(spec.draft_token_num)

    def _kv_len_cpu(self, forward_batch, key, bs):
        seq = forward_batch.seq_lens_cpu
        if seq is None:
            seq = forward_batch.seq_lens.cpu()  # a sync: SGLang provides seq_lens_cpu
        seq = seq[:bs].to(torch.int32)
        return seq + self._qo_len(forward_batch, key) if key == "verify" else seq

    # ---- SGLang's metadata entry points ----

    def init_forward_metadata(self, forward_batch):
        key = self._mode_key(forward_batch)
        bs = int(forward_batch.batch_size)
        if forward_batch.forward_mode.is_idle() or bs == 0:
            self.forward_metadata = _Metadata()
            return
        if key == "extend":
            self._init_extend(forward_batch)
            return
        qo_len = self._qo_len(forward_batch, key)
        if key not in self._eager:
            self._eager[key] = self._new_graph_wrapper(self.max_bs, qo_len)
        wrapper, table = self._eager[key]
        self._plan(wrapper, table, forward_batch.req_pool_indices[:bs],
                   self._kv_len_cpu(forward_batch, key, bs), qo_len, key == "verify")
        self.forward_metadata = _Metadata(wrapper)

    def init_cuda_graph_state(self, max_bs, max_num_tokens, kv_indices_buf=None):
        self._graph = {}  # wrappers are made at capture, one per (mode, batch size)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        key = self._mode_key(forward_batch)
        if key == "extend":
            raise NotImplementedError("fp8mla backend: extend batches are not captured in CUDA "
                                      "graphs (SGLang captures decode and target verify)")
        bs = int(forward_batch.batch_size)
        qo_len = self._qo_len(forward_batch, key)
        slot = (key, bs, qo_len)
        if in_capture or slot not in self._graph:
            self._graph[slot] = self._new_graph_wrapper(bs, qo_len)
        wrapper, table = self._graph[slot]
        self._plan(wrapper, table, forward_batch.req_pool_indices[:bs],
                   self._kv_len_cpu(forward_batch, key, bs), qo_len, key == "verify")
        self.forward_metadata = _Metadata(wrapper)

    def init_forward_metadata_in_graph(self, forward_batch):
        return None

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def _init_extend(self, forward_batch):
        bs = int(forward_batch.batch_size)
        prefix = forward_batch.extend_prefix_lens_cpu
        extend = forward_batch.extend_seq_lens_cpu
        if extend is None:
            raise ValueError("forward_batch.extend_seq_lens_cpu: required for extend batches")
        extend = torch.as_tensor(list(extend)[:bs], dtype=torch.int32)
        qo_indptr = torch.zeros(bs + 1, dtype=torch.int32)
        torch.cumsum(extend, 0, out=qo_indptr[1:])
        if prefix is None or not any(int(p) for p in list(prefix)[:bs]):
            self._ragged.plan(qo_indptr, self.num_heads, self.qk_nope_dim + self.rope_dim,
                              self.v_head_dim, self.data_type, self.device)
            self.forward_metadata = _Metadata(ragged=True)
            return
        # Absorbed MLA over prefix + new tokens, causal: copied page table (plan() checks it).
        kv_len_cpu = self._kv_len_cpu(forward_batch, "extend", bs)
        table = PageTable(int(((kv_len_cpu + self.page_size - 1) // self.page_size).sum()),
                          self.page_size, self.device)
        kv_indptr, kv_len = table.fill(self.req_to_token_pool.req_to_token,
                                       forward_batch.req_pool_indices[:bs], kv_len_cpu)
        n_pages = int(kv_indptr[-1])
        if (self.kv_cache_dtype == torch.float8_e4m3fn
                and int(extend.max()) >= self.gather_min_new_tokens
                and n_pages * self.page_size * (self.kv_lora_rank + self.rope_dim) * 2
                <= self.gather_max_bytes):
            # The gathered pages in table order: page i of the bf16 copy is table.table[i].
            local = torch.arange(n_pages, dtype=torch.int32, device=self.device)
            self._gathered.plan(
                metadata=MLAPlanMetadata.csr(qo_indptr, kv_indptr, local, kv_len),
                num_heads=self.num_heads, head_dim_ckv=self.kv_lora_rank,
                head_dim_kpe=self.rope_dim, page_size=self.page_size, causal=True,
                sm_scale=self.scaling, q_data_type=self.data_type, kv_data_type=torch.bfloat16,
                query_layout="split", kv_cache_layout="split", num_pages=n_pages)
            self.forward_metadata = _Metadata(self._gathered,
                                              gather_pages=table.table[:n_pages].to(torch.int64))
            return
        self._extend.plan(
            metadata=MLAPlanMetadata.csr(qo_indptr, kv_indptr, table.table, kv_len),
            num_heads=self.num_heads, head_dim_ckv=self.kv_lora_rank,
            head_dim_kpe=self.rope_dim, page_size=self.page_size, causal=True,
            sm_scale=self.scaling, q_data_type=self.data_type,
            kv_data_type=self.kv_cache_dtype, query_layout="split", kv_cache_layout="split")
        self.forward_metadata = _Metadata(self._extend)

    # ---- forward ----

    def _save(self, layer, forward_batch, k, v, k_rope, save_kv_cache):
        if k is None or not save_kv_cache:
            return
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc

        loc = KVWriteLoc.for_batch(forward_batch)
        if k_rope is not None:
            self.token_to_kv_pool.set_mla_kv_buffer(layer, loc, k, k_rope)
        else:
            self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)

    def _cache(self, layer, gather_pages=None):
        """(ckv, kpe) views [pages, page_size, 512 | 64] of the layer's pool, as stored; or of a
        bf16 copy of its pages gather_pages, in that order (the gathered cast)."""
        buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        buf = buf.view(-1, self.page_size, buf.shape[-1])
        if gather_pages is not None:
            buf = buf.index_select(0, gather_pages).to(torch.bfloat16)
        return buf[..., : self.kv_lora_rank], buf[..., self.kv_lora_rank:]

    def _absorbed(self, q, q_rope, layer, wrapper, gather_pages=None):
        heads = layer.tp_q_head_num
        if q_rope is not None:
            q_nope = q.view(-1, heads, layer.v_head_dim)
            q_rope = q_rope.view(-1, heads, layer.head_dim - layer.v_head_dim)
        else:
            qall = q.view(-1, heads, layer.head_dim)
            q_nope, q_rope = qall[..., : layer.v_head_dim], qall[..., layer.v_head_dim:]
        out = q_nope.new_empty(q_nope.shape[0], heads, self.kv_lora_rank)
        ckv, kpe = self._cache(layer, gather_pages)
        scales = self.kv_scales if gather_pages is None else {}  # the copy is bf16
        wrapper.run(query=(q_nope, q_rope), kv_cache=(ckv, kpe), out=out, **scales)
        return out.view(-1, heads * self.kv_lora_rank)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None,
                       k_rope=None, **kwargs):
        self._reject(kwargs)
        self._save(layer, forward_batch, k, v, k_rope, save_kv_cache)
        return self._absorbed(q, q_rope, layer, self.forward_metadata.wrapper)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None,
                       k_rope=None, **kwargs):
        self._reject(kwargs)
        md = self.forward_metadata
        if md.ragged:
            if q_rope is not None or k_rope is not None:
                raise ValueError("fp8mla backend: the ragged prefill takes the non-absorbed q, k, "
                                 "v (the model routed an absorbed call to it)")
            if save_kv_cache and k is not None:
                self._save(layer, forward_batch, k, v, None, True)
            o = self._ragged.run(q.view(-1, layer.tp_q_head_num, layer.head_dim),
                                 k.view(-1, layer.tp_k_head_num, layer.head_dim),
                                 v.view(-1, layer.tp_v_head_num, layer.v_head_dim),
                                 layer.scaling, layer.logit_cap)
            return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)
        self._save(layer, forward_batch, k, v, k_rope, save_kv_cache)  # before any gather
        return self._absorbed(q, q_rope, layer, md.wrapper, md.gather_pages)

    @staticmethod
    def _reject(kwargs):
        """Keyword arguments other backends take (sinks, top-k indices, fused rope ...)."""
        given = [k for k, v in kwargs.items() if v is not None]
        if given:
            raise NotImplementedError(f"fp8mla backend: {', '.join(sorted(given))} not supported")
