"""FlashInfer-compatible MLA wrapper over fp8mla: ``BatchMLAPagedAttentionWrapper``.

A drop-in for ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` as SGLang's flashinfer_mla
backend uses it: ``plan()`` once per batch, ``run()`` once per layer. Differences from
FlashInfer are listed in docs/python.md; the main ones: FP8 caches are read natively (no cast),
the workspace buffer is not used (plans own their buffers), and plan() also copies kv_indices
to the host (fp8mla validates every page id).
"""

from . import _fp8mla as _ext
from . import _registry
from ._tensors import (
    as_float,
    device_of,
    empty,
    for_ext,
    host_i32,
    is_capturing,
    is_torch,
    length,
    max_value,
    page_table,
    require_array,
    squeeze_head_dim,
    to_log2_inplace,
)
from .api import DIM_CKV, DIM_KPE, KvFormat, _plan_options, as_format

_BACKENDS = ("auto", "fa2", "fa3", "cpu", "cpu_reference", "cuda")


def _dtype_name(dt, name):
    """'bfloat16', 'float8_e4m3fn', 'uint8', ... from a torch/numpy dtype or a string."""
    if dt is None:
        raise ValueError(f"{name}: a dtype is required")
    if isinstance(dt, str):
        text = dt
    else:
        text = str(dt)
        if text.startswith("torch."):
            text = text[len("torch."):]
        elif hasattr(dt, "name"):
            text = dt.name
        else:
            try:
                import numpy as np

                text = np.dtype(dt).name
            except (ImportError, TypeError):
                pass
    text = text.lower()
    aliases = {"bf16": "bfloat16", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
               "e4m3": "float8_e4m3fn", "e4m3fn": "float8_e4m3fn"}
    return aliases.get(text, text)


def _resolve_kv_format(kv_data_type, kv_format):
    """KvFormat from FlashInfer's kv_data_type and fp8mla's optional kv_format."""
    kv = _dtype_name(kv_data_type, "kv_data_type")
    bf16_types = ("bfloat16", "uint16")
    fp8_types = ("float8_e4m3fn", "uint8")
    if kv not in bf16_types + fp8_types:
        raise ValueError(
            f"kv_data_type: expected torch.bfloat16 or torch.float8_e4m3fn (uint8 accepted as FP8 "
            f"bytes), got {kv_data_type}"
        )
    if kv_format is None:
        return KvFormat.bf16 if kv in bf16_types else KvFormat.fp8_e4m3
    fmt = as_format(kv_format)
    ok = (fmt == KvFormat.bf16) == (kv in bf16_types)
    if not ok:
        raise ValueError(
            f"kv_format: {_ext.format_name(fmt)} does not match kv_data_type {kv_data_type}"
        )
    return fmt


def _check_q_dtype(q_data_type, fmt):
    q = _dtype_name(q_data_type, "q_data_type")
    if q in ("bfloat16", "uint16"):
        return
    # SGLang's flashinfer_mla decode path passes the KV cache dtype for both q and kv; the
    # query is still bf16 there, so an FP8 q_data_type with an FP8 cache means "bf16 q".
    if q == "float8_e4m3fn" and fmt != KvFormat.bf16:
        return
    raise ValueError(
        f"q_data_type: fp8mla computes with bf16 queries (q_nope, q_pe, out), got {q_data_type}"
    )


class BatchMLAPagedAttentionWrapper:
    """MLA attention over a paged latent cache with FlashInfer's plan/run interface.

    ``BatchMLAPagedAttentionWrapper(float_workspace_buffer, use_cuda_graph=False,
    qo_indptr=None, kv_indptr=None, kv_indices=None, kv_len_arr=None, backend="auto")``

    float_workspace_buffer: any tensor or array; only its device is used (fp8mla plans own
        their split-KV workspace). None means the CPU.
    use_cuda_graph: graph mode. The first plan() allocates fixed-capacity device buffers; later
        plan() calls rewrite them in place (call plan outside capture), so a graph that captured
        run() replays on the new batch. Capacities: ``max_batch`` (default: len(qo_indptr) - 1
        or len(kv_len_arr) of the buffers given here, else the first plan's batch),
        ``max_total_q`` (default: the first plan's total_q, at least max_batch),
        ``max_kv_indices`` (default: len(kv_indices) given here, else the first plan's),
        ``max_qo_len`` (default 0 = max_total_q). The index buffers themselves are not used.
    backend: "auto" (by the workspace's device), "fa2" / "fa3" (accepted for compatibility,
        same as "auto"), "cpu", "cpu_reference" (float64 reference path), "cuda".
    Keyword-only fp8mla extras: ``num_pages`` (pool size; default: learned from the cache
        passed to the first run()), ``num_threads`` (CPU backend threads, 0 = all cores),
        ``exact_scores`` (CUDA fp8_e4m3: keep the scores off the fp8 tensor cores, whose
        accumulator keeps 13 mantissa bits; 21-29% slower; README "Numerics"),
        ``max_tile_rows`` (0..64: rows, heads x query tokens, a tile packs at most; 0 = the
        planner's choice, fp8mla::PlanOptions::max_tile_rows).

    Raises ValueError for an unknown backend.
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
    ):
        if backend not in _BACKENDS:
            raise ValueError(f"backend: expected one of {', '.join(_BACKENDS)}, got {backend!r}")
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
        self._max_tile_rows = int(max_tile_rows)
        self._use_cuda_graph = bool(use_cuda_graph)
        self._num_pages = int(num_pages) if num_pages is not None else None
        if max_batch is None and self._use_cuda_graph:
            if qo_indptr is not None:
                max_batch = len(qo_indptr) - 1
            elif kv_len_arr is not None:
                max_batch = len(kv_len_arr)
        if max_kv_indices is None and self._use_cuda_graph and kv_indices is not None:
            max_kv_indices = len(kv_indices)
        self._max_batch = max_batch
        self._max_total_q = max_total_q
        self._max_kv_indices = max_kv_indices
        self._max_qo_len = max_qo_len
        self._plan = None  # the native Plan
        self._problem = None  # host copies + parameters of the last plan()
        self._planned_pages = None
        self._key = _registry.register(self)  # how the torch custom op finds this wrapper

    # ---- plan ----

    def plan(
        self,
        qo_indptr,
        kv_indptr,
        kv_indices,
        kv_len_arr,
        num_heads,
        head_dim_ckv,
        head_dim_kpe,
        page_size,
        causal,
        sm_scale,
        q_data_type,
        kv_data_type,
        use_profiler=False,
        *,
        kv_format=None,
        num_pages=None,
    ):
        """Plans attention for one batch (host side; a sync when the arrays live on the GPU).

        qo_indptr   int [batch + 1]   query-token offsets (decode: 0, 1, ..., batch)
        kv_indptr   int [batch + 1]   page offsets into kv_indices
        kv_indices  int [>= kv_indptr[-1]] page ids (entries past kv_indptr[-1] are ignored)
        kv_len_arr  int [batch]       cached tokens per request (<= its pages * page_size)
        num_heads 1..128; head_dim_ckv must be 512 and head_dim_kpe 64 (ValueError otherwise);
        page_size a power of two in 1..128; causal: query token i of a request with qo_len
        tokens sees cache tokens [0, kv_len - qo_len + i]; sm_scale > 0 (the caller folds YaRN
        in); q_data_type bfloat16 (an FP8 q_data_type is taken as bf16 when the cache is FP8,
        as SGLang passes it); kv_data_type bfloat16 -> bf16 cache, float8_e4m3fn or uint8 ->
        fp8_e4m3 (per-tensor scale). kv_format="fp8_e4m3_block" selects the 656-byte
        block-scaled token format (kv_data_type uint8 or float8_e4m3fn). num_pages: the pool
        size (optional; see the class docstring). use_profiler=True raises ValueError.

        Every index array is checked: ValueError names the argument, index and bound (e.g.
        "kv_indices[17] = 4096 is outside the pool [0, 4096)"). qo_indptr, kv_indptr and
        kv_len_arr are copied to the host; kv_indices too, unless it is a torch tensor on the
        plan's GPU: then it is checked and copied there (device_kv_indices[i] in errors).
        """
        if int(head_dim_ckv) != DIM_CKV:
            raise ValueError(
                f"head_dim_ckv: expected {DIM_CKV} (the MLA latent width, kv_lora_rank), "
                f"got {head_dim_ckv}"
            )
        if int(head_dim_kpe) != DIM_KPE:
            raise ValueError(
                f"head_dim_kpe: expected {DIM_KPE} (the MLA rotary width, qk_rope_head_dim), "
                f"got {head_dim_kpe}"
            )
        if use_profiler:
            raise ValueError("use_profiler: FlashInfer's intra-kernel profiler is not supported")
        fmt = _resolve_kv_format(kv_data_type, kv_format)
        _check_q_dtype(q_data_type, fmt)

        qo = host_i32(qo_indptr, "qo_indptr")
        kvp = host_i32(kv_indptr, "kv_indptr")
        kvl = host_i32(kv_len_arr, "kv_len_arr")
        n_indices = int(kvp[length(kvp) - 1]) if length(kvp) else 0
        if n_indices < 0:
            raise ValueError(f"kv_indptr[-1]: {n_indices} must be >= 0")
        if len(kv_indices) < n_indices:
            raise ValueError(
                f"kv_indices: expected at least kv_indptr[-1] = {n_indices} entries, "
                f"got {len(kv_indices)}"
            )
        kvi = page_table(kv_indices[:n_indices], self._device)  # on the GPU: stays there

        batch = length(qo) - 1
        total_q = int(qo[batch]) if batch >= 0 else 0
        problem = dict(
            qo=qo, kvp=kvp, kvi=kvi, kvl=kvl, num_heads=int(num_heads),
            page_size=int(page_size), fmt=fmt, causal=bool(causal), sm_scale=float(sm_scale),
            batch=batch, total_q=total_q,
        )
        if num_pages is not None:
            self._num_pages = int(num_pages)
        # The pool size is not a FlashInfer plan() argument: use the one given or learned from
        # an earlier run(); otherwise plan for the smallest pool the indices fit (every check
        # but the pool bound runs now) and re-plan when run() sees the cache.
        pages = self._num_pages
        if pages is None:
            pages = max(max_value(kvi) + 1, 1) if length(kvi) else 1
        self._build(pages, problem)
        self._problem = problem  # only once it planned: a failed plan() leaves the last one

    def _build(self, num_pages, p):
        """(Re-)plans problem ``p`` for a pool of ``num_pages`` pages."""
        if p["batch"] <= 0 and length(p["qo"]) == 1:
            # An empty batch (SGLang's idle step): nothing to plan or compute.
            self._planned_pages = num_pages
            return
        kind, index = self._device
        # api._problem_args' tuple, from the arrays plan() already converted.
        args = (
            p["qo"], p["kvp"], p["kvi"], p["kvl"], p["num_heads"], p["page_size"],
            int(num_pages), p["fmt"], p["causal"], p["sm_scale"], 0, None, None, kind, index,
        )
        if self._use_cuda_graph and self._plan is not None:
            _ext.replan(self._plan, args)
        else:
            graph = self._use_cuda_graph
            max_batch = self._max_batch or p["batch"]
            max_total_q = self._max_total_q or max(p["total_q"], max_batch)
            max_kv = self._max_kv_indices or max(length(p["kvi"]), 1)
            # PlanOptions' own defaults (the device's SM count, the kernel's residency, 64-token
            # chunks): the split the C++ planner is tuned and benchmarked with (bench/NOTES.md
            # v22; the fixed 2 CTAs per SM and 256-token chunks used here before cost e.g.
            # 1/8/4096 12.7 instead of 9.0 us on the H200).
            self._plan = _ext.plan(args, _plan_options(
                num_threads=self._num_threads, cpu_reference=self._cpu_reference,
                cuda_graph=graph,
                max_batch=max_batch if graph else 0,
                max_total_q=max_total_q if graph else 0,
                max_kv_indices=max_kv if graph else 0,
                max_qo_len=(self._max_qo_len or 0) if graph else 0,
                exact_scores=self._exact_scores, max_tile_rows=self._max_tile_rows))
        self._planned_pages = num_pages

    # ---- run ----

    def run(
        self,
        q_nope,
        q_pe,
        ckv_cache,
        kpe_cache=None,
        out=None,
        lse=None,
        return_lse=False,
        profiler_buffer=None,
        kv_len=None,
        page_table=None,
        return_lse_base_on_e=False,
        *,
        k_scale=None,
        ckv_scale=None,
        kpe_scale=None,
        ckv_scale_arr=None,
    ):
        """Runs attention for the planned batch.

        q_nope  bf16 [total_q, H, 512]; q_pe bf16 [total_q, H, 64] (innermost stride 1; slices
                of one [total_q, H, 576] tensor are fine)
        ckv_cache, kpe_cache: the paged cache, strides read from the tensors (two views of one
                [pages, page_size, 576] buffer, as SGLang passes them, or two buffers; a head dim
                of 1, [pages, page_size, 1, D], is squeezed):
                bf16 cache:     bf16 [pages, page_size, 512] and [pages, page_size, 64]
                fp8_e4m3:       float8_e4m3fn or uint8, same shapes
                fp8_e4m3_block: uint8 [pages, page_size, 656]; kpe_cache is ignored
        out     bf16 [total_q, H, 512] (allocated like q_nope when None)
        lse     float32 [total_q, H] (allocated when None and return_lse)
        return_lse: return (out, lse) instead of out. The LSE is base 2 (FlashInfer's) unless
                return_lse_base_on_e=True.
        k_scale / ckv_scale / kpe_scale: FP8 dequantisation scales (real = code * scale) for
                the fp8_e4m3 cache; k_scale sets both, ckv_scale / kpe_scale override it;
                default 1.0 (SGLang's unscaled pool). Python floats keep run() capture-safe (a
                tensor is read with a host sync).
        profiler_buffer / ckv_scale_arr: not supported (ValueError when given). kv_len and
                page_table are ignored, as FlashInfer ignores them outside its cutlass backend.

        With torch tensors it runs on torch's current CUDA stream through the custom op
        fp8mla::mla_decode (CUDA-graph capturable, torch.compile traceable). Raises ValueError
        for tensors that do not match the plan (dtype, shape, innermost stride, device; the
        message names the tensor), RuntimeError when plan() was not called.
        """
        if self._problem is None:
            raise RuntimeError("run() called before plan()")
        if profiler_buffer is not None:
            raise ValueError("profiler_buffer: FlashInfer's profiler is not supported")
        if ckv_scale_arr is not None:
            raise ValueError(
                "ckv_scale_arr: per-token FP8 scales are not supported; use "
                "kv_format='fp8_e4m3_block' (per-token, per-128-value scales) instead"
            )
        require_array(q_nope, "q_nope", 3)
        fmt = self._problem["fmt"]
        ckv_cache = squeeze_head_dim(ckv_cache)
        if fmt == KvFormat.fp8_e4m3_block:
            kpe_cache = None
        else:
            if kpe_cache is None:
                raise ValueError(f"kpe_cache: required for the {_ext.format_name(fmt)} cache")
            kpe_cache = squeeze_head_dim(kpe_cache)
        cs = as_float(ckv_scale if ckv_scale is not None else k_scale, "ckv_scale") or 1.0
        ks = as_float(kpe_scale if kpe_scale is not None else k_scale, "kpe_scale") or 1.0
        if fmt != KvFormat.fp8_e4m3 and (cs != 1.0 or ks != 1.0):
            raise ValueError(
                f"k_scale: scales apply to the fp8_e4m3 cache only, not {_ext.format_name(fmt)}"
            )

        if out is None:
            out = empty(q_nope, (q_nope.shape[0], q_nope.shape[1], DIM_CKV), "bf16")
        want_lse = return_lse or lse is not None
        if want_lse and lse is None:
            lse = empty(q_nope, (q_nope.shape[0], q_nope.shape[1]), "f32")
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

    def _run_native(self, q_nope, q_pe, ckv_cache, kpe_cache, out, lse, ckv_scale, kpe_scale,
                    stream):
        """Calls the library (used directly for numpy, through the torch op for torch)."""
        pages = int(ckv_cache.shape[0]) if getattr(ckv_cache, "ndim", 0) >= 1 else None
        if self._problem["batch"] <= 0 and length(self._problem["qo"]) == 1:
            return  # empty batch: out has 0 rows
        if pages is not None and pages != self._planned_pages:
            if is_capturing(q_nope):
                raise RuntimeError(
                    f"ckv_cache has {pages} pages but the plan was made for "
                    f"{self._planned_pages}; re-planning is not possible during CUDA graph "
                    "capture: pass num_pages= to plan() or run once before capturing"
                )
            self._num_pages = pages
            self._build(pages, self._problem)
        elif pages is not None:
            self._num_pages = pages  # later plan() calls check the pool bound at once
        _ext.run(
            self._plan,
            for_ext(q_nope),
            for_ext(q_pe),
            for_ext(ckv_cache),
            for_ext(kpe_cache),
            for_ext(out),
            for_ext(lse),
            float(ckv_scale),
            float(kpe_scale),
            None,
            int(stream),
        )

    # FlashInfer's older names.
    begin_forward = plan
    forward = run

    @property
    def plan_info(self):
        """The native fp8mla.Plan of the last plan() (None before, or for an empty batch)."""
        return self._plan
