"""FlashInfer-compatible MLA wrapper over fp8mla: ``BatchMLAPagedAttentionWrapper``.

It takes every call form of flashinfer.mla.BatchMLAPagedAttentionWrapper in flashinfer-python
0.6.18 and 0.7.4 with FlashInfer's semantics: plan() once per batch, run() once per layer, the LSE
in base 2 unless asked for base e, the FP8 cache's ckv_scale / kpe_scale required, graph mode
reading the index buffers given to the constructor. What fp8mla does not implement is refused
with an error naming the argument (NotImplementedError for a valid FlashInfer request fp8mla
cannot serve, ValueError for an invalid one); docs/python.md lists every difference.
"""

import math

from . import _fp8mla as _ext
from . import _registry, _replan_step
from ._flashinfer_args import (
    FLASHINFER_BACKENDS,
    OWN_BACKENDS,
    array_dtype,
    csr_from_dense,
    csr_from_flat,
    deprecated,
    dtype_name,
    metadata_form,
    plan_contract,
    refuse_other_backends,
    renamed,
    run_inputs,
    run_scales,
    unsupported,
    warn_positional,
)
from ._tensors import (
    copy_into,
    device_of,
    empty,
    for_ext,
    host_i32,
    is_capturing,
    is_torch,
    length,
    max_value,
    page_table,
    raw_stream,
    squeeze_head_dim,
    to_log2_inplace,
    torch_module,
)
from .api import DIM_CKV, KvFormat, _plan_options, _problem_args, pow2_scale_ratio


class BatchMLAPagedAttentionWrapper:
    """MLA attention over a paged latent cache with FlashInfer's plan/run interface.

    ``BatchMLAPagedAttentionWrapper(float_workspace_buffer, use_cuda_graph=False,
    qo_indptr=None, kv_indptr=None, kv_indices=None, kv_len_arr=None, backend="auto")``

    float_workspace_buffer: any tensor or array; its device picks the backend (fp8mla plans own
        their split-KV workspace, so its size does not matter). None means the CPU.
    use_cuda_graph: graph mode. As in FlashInfer, plan() copies its index arrays into the int32
        buffers given here and the kernels read ``kv_indices`` from that buffer when they run
        (a CUDA graph replay included), so a caller may rewrite it in place between plan and
        replay; the first plan() sizes the device buffers (capacities: ``max_batch`` = the
        buffers' batch, ``max_kv_indices`` = len(kv_indices), ``max_total_q`` = the first plan's
        total_q, at least max_batch; keywords below override them), and later plan() calls are
        stream-ordered on torch's current stream: no host synchronisation, no allocation. Without
        buffers (a fp8mla extension) plan() copies the page table and re-plans synchronously.
    backend: "auto", "fa2", "fa3" (fp8mla's kernels, by the workspace's device), "cpu",
        "cpu_reference" (float64 reference), "cuda". FlashInfer's other backends ("cutlass",
        "trtllm-gen", ...) raise NotImplementedError; an unknown name raises ValueError.
    Keyword-only fp8mla extras: ``num_pages`` (pool size; default: learned from the cache passed
        to the first run()), ``num_threads`` (CPU threads, 0 = all cores), ``exact_scores`` (CUDA
        FP8 caches: keep the scores off the fp8 tensor cores; README "Numerics"),
        ``any_scale_ratio`` (CUDA fp8_e4m3: plan kernels that take any kpe_scale / ckv_scale;
        without it, an eager wrapper re-plans with it at the first run() whose ratio is not a
        power of two, as FlashInfer takes any ratio, and a graph-mode one raises ValueError
        naming kpe_scale, since its captured kernels are fixed at plan()),
        ``max_tile_rows`` (0..64, fp8mla::PlanOptions::max_tile_rows), ``max_batch``,
        ``max_total_q``, ``max_kv_indices``, ``max_qo_len`` (graph capacities).

    Attributes engines read: ``device``, ``_backend``, ``_use_cuda_graph``,
    ``_float_workspace_buffer``, ``_qo_indptr_buf``, ``_kv_indptr_buf``, ``_kv_indices_buf``,
    ``_kv_len_arr_buf`` and, after plan(), ``_sm_scale``, ``_causal``, ``_page_size``,
    ``_head_dim_ckv``, ``_q_data_type``, ``_kv_data_type``, ``_use_profiler``, ``_plan_info``.
    """

    def __init__(
        self,
        float_workspace_buffer=None,
        use_cuda_graph=False,
        qo_indptr=None,
        kv_indptr=None,
        kv_indices=None,
        kv_len_arr=None,
        backend="auto",
        *,
        num_pages=None,
        max_batch=None,
        max_total_q=None,
        max_kv_indices=None,
        max_qo_len=None,
        num_threads=0,
        exact_scores=False,
        max_tile_rows=0,
        any_scale_ratio=False,
    ):
        if backend not in OWN_BACKENDS:
            if backend in FLASHINFER_BACKENDS:
                raise unsupported(
                    "backend", f"{backend!r} names a FlashInfer kernel family fp8mla does not "
                    f"have; use 'auto' (or 'fa2' / 'fa3', which select fp8mla's kernels)")
            raise ValueError(f"backend: expected one of {', '.join(map(repr, OWN_BACKENDS))}, "
                             f"got {backend!r}")
        self._float_workspace_buffer = float_workspace_buffer
        kind, index = device_of(float_workspace_buffer)
        if backend in ("cpu", "cpu_reference"):
            kind, index = "cpu", 0
        elif backend == "cuda" and kind != "cuda":
            kind, index = "cuda", 0
        self._device = (kind, index)
        # FlashInfer exposes the workspace's torch.device; keep that (a string without torch).
        if is_torch(float_workspace_buffer) and kind == device_of(float_workspace_buffer)[0]:
            self.device = float_workspace_buffer.device
        else:
            self.device = "cpu" if kind == "cpu" else f"cuda:{index}"
        self._backend = backend
        self._cpu_reference = backend == "cpu_reference"
        self._num_threads = int(num_threads)
        self._exact_scores = bool(exact_scores)
        self._any_scale_ratio = bool(any_scale_ratio)
        self._pow2_scales = None  # (ckv, kpe, sm_scale) of the last run() with a power-of-two ratio
        self._max_tile_rows = int(max_tile_rows)
        self._use_cuda_graph = bool(use_cuda_graph)
        self._qo_indptr_buf = qo_indptr
        self._kv_indptr_buf = kv_indptr
        self._kv_indices_buf = kv_indices
        self._kv_len_arr_buf = kv_len_arr
        if self._use_cuda_graph and kv_indices is not None:
            if length(getattr(kv_indices, "shape", ())) != 1 or array_dtype(kv_indices) != "int32":
                raise ValueError("kv_indices: the CUDA graph buffer must be a rank-1 int32 array")
            if device_of(kv_indices) != self._device:
                raise ValueError(f"kv_indices: the CUDA graph buffer must be on the workspace's "
                                 f"device {self.device}")
        self._num_pages = int(num_pages) if num_pages is not None else None
        if max_batch is None and self._use_cuda_graph:
            if kv_len_arr is not None:
                max_batch = length(kv_len_arr)
            elif qo_indptr is not None:
                max_batch = length(qo_indptr) - 1
        if max_kv_indices is None and self._use_cuda_graph and kv_indices is not None:
            max_kv_indices = length(kv_indices)
        self._max_batch = max_batch
        self._max_total_q = max_total_q
        self._max_kv_indices = max_kv_indices
        self._max_qo_len = max_qo_len
        self._plan = None  # the native Plan
        self._args = None  # the Problem tuple (api._problem_args) of the last build
        self._step = None  # _ext.StepProblem of the last build's fixed fields (replan_step)
        self._problem = None  # host copies + parameters of the last plan()
        self._planned_pages = None
        self._plan_info = None
        self._warned_positional = False
        self._warned_legacy_tensors = False
        self._warned_dynamic_lse = False
        self._key = _registry.register(self)  # how the torch custom op finds this wrapper

    # ---- plan ----

    @warn_positional
    def plan(
        self,
        qo_indptr=None,
        kv_indptr=None,
        kv_indices=None,
        kv_len_arr=None,
        num_heads=None,
        head_dim_ckv=None,
        head_dim_kpe=None,
        page_size=None,
        causal=None,
        sm_scale=None,
        q_data_type=None,
        kv_data_type=None,
        use_profiler=False,
        *,
        metadata=None,
        cum_seq_lens_q=None,
        block_tables=None,
        seq_lens=None,
        max_q_len=None,
        query_layout=None,
        kv_cache_layout=None,
        lse_mode="none",
        output_dtype=None,
        output_scale="none",
        scale_mode="default",
        skip_softmax=False,
        enable_pdl=None,
        use_sinks=False,
        kv_format=None,
        num_pages=None,
    ):
        """Plans attention for one batch (FlashInfer 0.6.18 and 0.7.4 forms).

        Metadata, one of: ``metadata=MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices,
        kv_len_arr)`` (0.7; checked strictly as FlashInfer does: the arrays' batches agree and
        kv_indptr lists exactly ceil(kv_len / page_size) pages a request), ``.dense(
        cum_seq_lens_q, block_tables, seq_lens, max_q_len)`` or ``.dual(...)``; the flat CSR
        arrays (positional or keyword; deprecated in 0.7): batch = len(kv_len_arr), and the first
        batch + 1 entries of qo_indptr and kv_indptr are read (engines pass over-allocated
        buffers); or the flat dense arrays. Positional arguments warn (DeprecationWarning) as in
        FlashInfer 0.7.

        qo_indptr int32 [batch + 1]; kv_indptr int32 [batch + 1] page offsets; kv_indices int32
        [>= kv_indptr[batch]] page ids; kv_len_arr int32 [batch] tokens (<= pages * page_size).
        num_heads 1..128; head_dim_ckv 512 and head_dim_kpe 64 (other widths and NoPE:
        NotImplementedError); page_size a power of two in 1..128; causal: query token i of a
        request with qo_len tokens sees cache tokens [0, kv_len - qo_len + i]; sm_scale > 0.
        q_data_type torch.bfloat16, or torch.float16 on the CPU backend; kv_data_type
        torch.bfloat16 or torch.float8_e4m3fn (uint8 taken as FP8 bytes); kv_format=
        "fp8_e4m3_block" (fp8mla extra) selects the 656-byte block-scaled tokens.
        0.7 contract keywords: query_layout / kv_cache_layout "packed" | "split" (default packed
        for metadata=, split for the flat forms), lse_mode "none" | "base2" | "basee" (what run()
        must ask for; flat CSR plans keep 0.6's run-time choice, with a DeprecationWarning),
        output_dtype (= q_data_type), output_scale "none", scale_mode "default" (FP8 caches:
        "kv-per-tensor", the default there), skip_softmax False, enable_pdl None / True (fp8mla's
        CUDA kernels always launch with PDL; False raises NotImplementedError), use_sinks False,
        use_profiler False. num_pages (fp8mla extra): the pool's size.

        Index arrays may be on the host or the plan's device; those on a GPU are copied to the
        host (a sync, as FlashInfer's plan), except kv_indices. Bad input raises ValueError
        naming the argument, the index and the bound.
        """
        legacy_flat = metadata_form(
            metadata, (qo_indptr, kv_indptr, kv_indices, kv_len_arr),
            (cum_seq_lens_q, block_tables, seq_lens, max_q_len),
            dict(num_heads=num_heads, head_dim_ckv=head_dim_ckv, head_dim_kpe=head_dim_kpe,
                 page_size=page_size, causal=causal, sm_scale=sm_scale,
                 q_data_type=q_data_type, kv_data_type=kv_data_type))
        flat_csr = any(v is not None for v in (qo_indptr, kv_indptr, kv_indices, kv_len_arr))
        # The run contract (FlashInfer 0.7) and the options fp8mla cannot honour.
        c = plan_contract(
            self._device[0], legacy_flat, head_dim_ckv=head_dim_ckv, head_dim_kpe=head_dim_kpe,
            page_size=page_size, q_data_type=q_data_type, kv_data_type=kv_data_type,
            kv_format=kv_format, output_dtype=output_dtype, query_layout=query_layout,
            kv_cache_layout=kv_cache_layout, lse_mode=lse_mode, output_scale=output_scale,
            scale_mode=scale_mode, skip_softmax=skip_softmax, enable_pdl=enable_pdl,
            use_sinks=use_sinks, use_profiler=use_profiler)
        query_layout, kv_cache_layout = c.query_layout, c.kv_cache_layout
        q_dtype, fmt, out_name, scale_mode = c.q_dtype, c.fmt, c.out_name, c.scale_mode

        # Index arrays.
        try:
            if metadata is not None:
                if metadata.qo_indptr is not None:
                    csr = csr_from_flat(metadata.qo_indptr, metadata.kv_indptr,
                                        metadata.kv_indices, metadata.kv_len_arr, page_size,
                                        strict=True)
                else:
                    csr = csr_from_dense(metadata.cum_seq_lens_q, metadata.block_tables,
                                         metadata.seq_lens, metadata.max_q_len, page_size)
            elif flat_csr:
                csr = csr_from_flat(qo_indptr, kv_indptr, kv_indices, kv_len_arr, page_size,
                                    strict=False)
            else:
                csr = csr_from_dense(cum_seq_lens_q, block_tables, seq_lens, max_q_len, page_size)
        except ValueError as e:
            raise renamed(e) from None

        n_pages = int(csr.kv_indptr[csr.batch]) if csr.batch >= 0 else 0
        borrowed = None
        if self._use_cuda_graph and self._kv_indices_buf is not None:
            # FlashInfer's graph mode: the kernels read the constructor's buffer.
            copy_into(self._kv_indices_buf, csr.kv_indices[:n_pages], "kv_indices")
            borrowed = self._kv_indices_buf
            kvi = None
        else:
            kvi = page_table(csr.kv_indices[:n_pages], self._device)  # on the GPU: stays there
        if self._use_cuda_graph:
            self._fill_graph_buffers(csr.qo_indptr, csr.kv_indptr, csr.kv_len)
        else:
            self._qo_indptr_buf, self._kv_indptr_buf = csr.qo_indptr, csr.kv_indptr
            self._kv_indices_buf, self._kv_len_arr_buf = csr.kv_indices, csr.kv_len

        batch = csr.batch
        total_q = int(csr.qo_indptr[batch]) if batch >= 0 else 0
        problem = dict(
            qo=csr.qo_indptr, kvp=csr.kv_indptr, kvi=kvi, kvl=csr.kv_len, borrowed=borrowed,
            n_pages=n_pages, num_heads=int(num_heads), page_size=int(page_size), fmt=fmt,
            causal=bool(causal), sm_scale=float(sm_scale), batch=batch, total_q=total_q,
            q_dtype=q_dtype, out_dtype=q_dtype,
        )
        if num_pages is not None:
            self._num_pages = int(num_pages)
        # The pool size is not a FlashInfer plan() argument: use the one given or learned from
        # an earlier run(); otherwise plan for the smallest pool the host indices fit (every
        # check but the pool bound runs now) and re-plan when run() sees the cache.
        pages = self._num_pages
        if pages is None:
            if kvi is not None and length(kvi):
                pages = max(max_value(kvi) + 1, 1)
            elif borrowed is not None and n_pages and not is_torch(borrowed):
                pages = max(int(borrowed[:n_pages].max()) + 1, 1)
            else:
                pages = 1
        self._args = None  # replan_step() reuses only a build of this plan()'s arguments
        try:
            self._build(pages, problem)
        except ValueError as e:
            raise renamed(e) from None
        # Only once it planned: a failed plan() leaves the last one.
        self._problem = problem
        self._contract = dict(
            lse_mode=lse_mode, dynamic_lse=legacy_flat and flat_csr and lse_mode == "none",
            query_layout=query_layout, kv_cache_layout=kv_cache_layout,
            output_dtype=out_name, scale_mode=scale_mode,
        )
        self._sm_scale = float(sm_scale)
        self._causal = bool(causal)
        self._page_size = int(page_size)
        self._head_dim_ckv = int(head_dim_ckv)
        self._q_data_type = q_data_type
        self._kv_data_type = kv_data_type
        self._use_profiler = bool(use_profiler)
        self._plan_info = self._plan

    def replan_step(self, qo_indptr, kv_indptr, kv_len_arr):
        """An engine's per-step re-plan (an fp8mla extension; fp8mla's SGLang backend calls it):
        the last plan()'s arguments with new qo_indptr / kv_indptr [batch + 1] and kv_len_arr
        [batch] (host int32: CPU torch tensors, numpy, sequences), the page ids read from the
        constructor's kv_indices buffer. It skips plan()'s FlashInfer argument parsing, which
        costs more host time than the re-plan itself; the library still checks every value
        (ValueError naming the argument, index and bound). Contiguous CPU int32 torch tensors
        (what the SGLang backend passes) are copied by the native module from their addresses,
        without a Python copy or a DLPack import. Needs a graph-mode wrapper with that buffer and
        a plan() made first; on CUDA it is stream-ordered, as plan() is there."""
        _replan_step.replan_step(self, qo_indptr, kv_indptr, kv_len_arr)

    def _fill_graph_buffers(self, qo, kvp, kvl):
        """Graph mode: the plan's index arrays into the constructor's buffers that hold them,
        as FlashInfer's plan fills them."""
        for buf, src, name in ((self._qo_indptr_buf, qo, "qo_indptr"),
                               (self._kv_indptr_buf, kvp, "kv_indptr"),
                               (self._kv_len_arr_buf, kvl, "kv_len_arr")):
            if buf is not None and length(buf) >= length(src):
                copy_into(buf, src, name)

    def _build(self, num_pages, p):
        """(Re-)plans problem ``p`` for a pool of ``num_pages`` pages."""
        if p["batch"] <= 0:
            self._step = None
            # An empty batch (SGLang's idle step): nothing to plan or compute, and no Problem
            # tuple for the next replan_step() to reuse.
            self._planned_pages = num_pages
            self._args = None
            return
        if p["qo"] is None:  # planned by _replan_step_host: its arrays are the step's copies
            qo, kvp, kvl = (host_i32(x, n) for x, n in zip(
                self._step.arrays(), ("qo_indptr", "kv_indptr", "kv_len_arr")))
            p.update(qo=qo, kvp=kvp, kvl=kvl)
        self._step = None  # parsed from the last build's fields, which this one may change
        kind, index = self._device
        args = _problem_args(p["qo"], p["kvp"], p["kvi"], p["kvl"], p["num_heads"],
                             p["page_size"], num_pages, p["sm_scale"], p["fmt"], p["causal"],
                             0, None, (kind, index), q_dtype=p["q_dtype"],
                             out_dtype=p["out_dtype"], borrowed_kv_indices=p["borrowed"])
        if self._use_cuda_graph and self._plan is not None:
            stream = self._plan_stream(p)
            if stream is None:
                _ext.replan(self._plan, args)
            else:
                _ext.replan_on_stream(self._plan, args, stream)
        else:
            graph = self._use_cuda_graph
            max_batch = self._max_batch or p["batch"]
            max_total_q = self._max_total_q or max(p["total_q"], max_batch)
            max_kv = self._max_kv_indices or max(p["n_pages"], 1)
            # PlanOptions' own defaults (the device's SM count, the kernel's residency, 64-token
            # chunks): the split the C++ planner is tuned and benchmarked with.
            self._plan = _ext.plan(args, _plan_options(
                num_threads=self._num_threads, cpu_reference=self._cpu_reference,
                cuda_graph=graph,
                max_batch=max_batch if graph else 0,
                max_total_q=max_total_q if graph else 0,
                max_kv_indices=max_kv if graph else 0,
                max_qo_len=(self._max_qo_len or 0) if graph else 0,
                exact_scores=self._exact_scores, max_tile_rows=self._max_tile_rows,
                any_scale_ratio=self._any_scale_ratio))
        self._planned_pages = num_pages
        self._args = args

    def _plan_stream(self, p):
        """The stream a graph-mode re-plan is ordered on (torch's current stream of the plan's
        GPU), or None for the synchronous form: CPU plans, and a copied page table on the GPU
        (the library checks that one with a host round trip)."""
        kind, index = self._device
        if kind != "cuda" or (p["borrowed"] is None and is_torch(p["kvi"]) and p["kvi"].is_cuda):
            return None
        if torch_module() is None:
            return None
        return raw_stream(index)

    # ---- run ----

    @warn_positional
    def run(
        self,
        q_nope=None,
        q_pe=None,
        ckv_cache=None,
        kpe_cache=None,
        out=None,
        lse=None,
        return_lse=False,
        profiler_buffer=None,
        kv_len=None,
        page_table=None,
        return_lse_base_on_e=False,
        o_scale=None,
        *,
        query=None,
        kv_cache=None,
        ckv_scale=None,
        ckv_scale_arr=None,
        kpe_scale=None,
        sinks=None,
        skip_softmax_threshold_scale_factor=None,
        bmm1_scale=None,
        bmm2_scale=None,
        k_scale=None,
    ):
        """Runs attention for the planned batch (FlashInfer 0.6.18 and 0.7.4 forms).

        Inputs: ``query=`` / ``kv_cache=`` (0.7: a packed [.., 576] tensor or a (nope, rope)
        pair) or the 0.6 arguments q_nope [total_q, H, 512], q_pe [total_q, H, 64], ckv_cache
        [pages, page_size, 512], kpe_cache [pages, page_size, 64] (deprecated in 0.7; accepted
        with a DeprecationWarning). Views of one buffer (SGLang's pool) or two buffers; a head
        dim of 1, [pages, page_size, 1, D], is squeezed. The block format's cache is uint8
        [pages, page_size, 656] (kpe_cache None).
        out: [total_q, H, 512] of the output dtype (allocated when None); lse float32
        [total_q, H], written when given (base 2, or base e with return_lse_base_on_e) and
        returned with return_lse. FP8 caches need ckv_scale and kpe_scale (real = code x scale;
        Python floats keep run() capture-safe); fp8mla's k_scale sets both. ckv_scale_arr:
        NotImplementedError. kv_len / page_table (FlashInfer's cutlass inputs), o_scale, sinks,
        skip_softmax_threshold_scale_factor, bmm1_scale / bmm2_scale, profiler_buffer: ValueError
        naming them, as FlashInfer's fa2 / fa3 backends do.

        With torch tensors it runs on torch's current CUDA stream through the custom op
        fp8mla::mla_decode (CUDA-graph capturable, torch.compile traceable).
        """
        if self._problem is None:
            raise RuntimeError("BatchMLAPagedAttentionWrapper.run() called before plan()")
        refuse_other_backends(
            kv_len=kv_len, page_table=page_table, o_scale=o_scale, sinks=sinks,
            skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
            bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale, profiler_buffer=profiler_buffer)
        p = self._problem
        fmt = p["fmt"]
        contract = self._contract

        # Inputs: the 0.7 structural forms or the 0.6 tensors.
        q_nope, q_pe, ckv_cache, kpe_cache, legacy = run_inputs(
            query, kv_cache, q_nope, q_pe, ckv_cache, kpe_cache, contract["query_layout"],
            contract["kv_cache_layout"], block_format=fmt == KvFormat.fp8_e4m3_block)
        if legacy and not self._warned_legacy_tensors:
            self._warned_legacy_tensors = True
            deprecated("q_nope / q_pe and ckv_cache / kpe_cache are deprecated in FlashInfer 0.7; "
                        "pass query= and kv_cache= (fp8mla accepts both).")

        # The LSE contract (0.7): what run() asks for must be what plan() declared, except for
        # flat CSR plans, which keep 0.6's run-time choice.
        asked = "none"
        if return_lse or lse is not None or return_lse_base_on_e:
            asked = "basee" if return_lse_base_on_e else "base2"
        if asked != contract["lse_mode"]:
            if not contract["dynamic_lse"]:
                raise ValueError(f"lse_mode: the plan declared {contract['lse_mode']!r} but run() "
                                 f"asks for {asked!r}; re-plan with lse_mode={asked!r}")
            if not self._warned_dynamic_lse:
                self._warned_dynamic_lse = True
                deprecated("FlashInfer 0.7 flat CSR plans allow a run-time LSE only "
                            "temporarily; pass lse_mode= to plan().")

        # Scales: FP8 caches need both (as FlashInfer requires), other formats none.
        cs, ks = run_scales(fmt, ckv_scale, ckv_scale_arr, kpe_scale, k_scale)
        if fmt == KvFormat.fp8_e4m3:
            self._take_scale_ratio(cs, ks, q_nope)

        self._check_inputs(q_nope, q_pe, ckv_cache, kpe_cache, out, lse)
        ckv_cache = squeeze_head_dim(ckv_cache)
        kpe_cache = squeeze_head_dim(kpe_cache) if fmt != KvFormat.fp8_e4m3_block else None
        rows = (q_nope.shape[0], q_nope.shape[1])
        if out is None:
            out = empty(q_nope, rows + (DIM_CKV,), p["out_dtype"])
        want_lse = asked != "none"
        if want_lse and lse is None:
            lse = empty(q_nope, rows, "f32")
        if not want_lse:
            lse = None

        if is_torch(q_nope):
            from . import torch_ops

            torch_ops.mla_decode(self._key, q_nope, q_pe, ckv_cache, kpe_cache, out, lse, cs, ks)
        else:
            self._run_native(q_nope, q_pe, ckv_cache, kpe_cache, out, lse, cs, ks, 0)

        if want_lse and not return_lse_base_on_e:
            to_log2_inplace(lse)
        return (out, lse) if return_lse else out

    def _take_scale_ratio(self, cs, ks, q):
        """FlashInfer takes any kpe_scale / ckv_scale; fp8mla's fastest CUDA kernels fold a power of
        two into q_pe (PlanOptions::any_scale_ratio). An eager plan is re-made once with
        any_scale_ratio (kept for later plans); a graph-mode plan cannot change its kernels."""
        if self._device[0] != "cuda" or self._any_scale_ratio:
            return
        key = (cs, ks, self._problem["sm_scale"])
        if key == self._pow2_scales:
            return  # the last run()'s scales, already checked (run() is a hot path)
        if pow2_scale_ratio(key[2], cs, ks):
            self._pow2_scales = key
            return
        if self._use_cuda_graph or is_capturing(q):
            raise ValueError(
                f"kpe_scale: kpe_scale / ckv_scale = {ks:g} / {cs:g} is not a power of two, "
                f"which this graph-mode wrapper's kernels assume; construct it with "
                f"any_scale_ratio=True to take any ratio")
        self._any_scale_ratio = True
        self._planned_pages = None  # _run_native re-plans for the cache it is given

    def _check_inputs(self, q_nope, q_pe, ckv_cache, kpe_cache, out, lse):
        """dtype checks naming the Python arguments and the planned FlashInfer dtypes."""
        p = self._problem
        q_want = ("bfloat16", "uint16") if p["q_dtype"] == "bf16" else ("float16",)
        for name, t in (("q_nope", q_nope), ("q_pe", q_pe)):
            if not hasattr(t, "shape"):
                raise TypeError(f"{name}: expected an array or tensor with DLPack support "
                                f"(numpy, torch, cupy), got {type(t).__name__}")
            if len(t.shape) != 3:
                raise ValueError(f"{name}.ndim: expected 3 dimensions, got shape "
                                 f"{tuple(t.shape)}")
            if array_dtype(t) not in q_want:
                raise ValueError(f"{name}.dtype={array_dtype(t)} does not match the planned "
                                 f"q_data_type={dtype_name(self._q_data_type)}")
        fmt = p["fmt"]
        kv_want = {KvFormat.bf16: ("bfloat16", "uint16"),
                   KvFormat.fp8_e4m3: ("float8_e4m3fn", "uint8"),
                   KvFormat.fp8_e4m3_block: ("uint8", "float8_e4m3fn")}[fmt]
        for name, t in (("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
            if t is None:
                continue
            if not hasattr(t, "shape"):
                raise TypeError(f"{name}: expected an array or tensor with DLPack support, got "
                                f"{type(t).__name__}")
            if array_dtype(t) not in kv_want:
                raise ValueError(f"{name}.dtype={array_dtype(t)} does not match the planned "
                                 f"kv_data_type={dtype_name(self._kv_data_type)}")
        if out is not None:
            want = self._contract["output_dtype"]
            got = array_dtype(out)
            if not (got == want or (want == "bfloat16" and got == "uint16")):
                raise ValueError(f"out.dtype={got} does not match the planned output dtype "
                                 f"{want}")
        if lse is not None and array_dtype(lse) != "float32":
            raise ValueError(f"lse.dtype={array_dtype(lse)}: expected float32")

    def _run_native(self, q_nope, q_pe, ckv_cache, kpe_cache, out, lse, ckv_scale, kpe_scale,
                    stream):
        """Calls the library (used directly for numpy, through the torch op for torch)."""
        p = self._problem
        if p["batch"] <= 0 or p["total_q"] == 0:
            return  # nothing to compute; out has no rows (or no planned rows)
        pages = int(ckv_cache.shape[0]) if getattr(ckv_cache, "ndim", 0) >= 1 else None
        if pages == 0 and p["n_pages"] == 0:
            # A pool of no pages and a batch that lists none: every row sees no token.
            if is_capturing(q_nope):
                raise RuntimeError("ckv_cache: a pool of no pages cannot be captured in a CUDA "
                                   "graph (nothing would be launched for later replays)")
            out[...] = 0
            if lse is not None:
                lse[...] = -math.inf
            return
        if pages is not None and pages != self._planned_pages:
            if is_capturing(q_nope):
                raise RuntimeError(
                    f"ckv_cache has {pages} pages but the plan was made for "
                    f"{self._planned_pages}; re-planning is not possible during CUDA graph "
                    "capture: pass num_pages= to plan() or run once before capturing"
                )
            # Remembered only once the batch planned for it: a cache too small for the batch (an
            # error) must not become the pool size the next plan() assumes.
            try:
                self._build(pages, p)
            except ValueError as e:
                raise renamed(e) from None
            self._num_pages = pages
        elif pages is not None:
            self._num_pages = pages  # later plan() calls check the pool bound at once
        try:
            _ext.run(self._plan, for_ext(q_nope), for_ext(q_pe), for_ext(ckv_cache),
                     for_ext(kpe_cache), for_ext(out), for_ext(lse), float(ckv_scale),
                     float(kpe_scale), None, int(stream))
        except ValueError as e:
            raise renamed(e) from None

    # FlashInfer's older names.
    begin_forward = plan
    forward = run

    @property
    def plan_info(self):
        """The native fp8mla.Plan of the last plan() (None before, or for an empty batch)."""
        return self._plan
