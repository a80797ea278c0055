"""fp8mla's low-level Python API: plan, run, merge_states, the paged cache and the codecs.

These mirror include/fp8mla/*.h one to one. Arrays: numpy on the CPU backend; torch (or cupy)
tensors on either backend. bf16 data travels as torch.bfloat16, as ml_dtypes.bfloat16, or as
uint16 arrays holding the bf16 bits (numpy has no bfloat16); FP8 data as torch.float8_e4m3fn,
ml_dtypes.float8_e4m3fn or uint8 bytes. Errors: TypeError for an argument of the wrong type
(checked before use: an integer argument takes no float, nothing is truncated), ValueError for
bad input (the message names the argument, the index and the bound, exactly as the C++ library
words it; integers beyond int32 included), MemoryError when memory runs out (OutOfMemoryError,
also a RuntimeError), RuntimeError for everything else (no CUDA in this build, a CUDA error).

The LSE returned here is the library's: natural log. The FlashInfer-compatible wrapper
(fp8mla.BatchMLAPagedAttentionWrapper) converts it to FlashInfer's base 2.
"""

import math
import struct

from . import _fp8mla as _ext
from ._tensors import (
    as_flag,
    as_int,
    as_real,
    as_str,
    current_stream,
    empty,
    for_ext,
    host_i32,
    numpy_module,
    page_table,
    parse_device,
    require_array,
    torch_module,
)

KvFormat = _ext.KvFormat
Plan = _ext.Plan

DIM_CKV = _ext.DIM_CKV  # 512: latent width, also the V / output width
DIM_KPE = _ext.DIM_KPE  # 64: rotary width
DIM_QK = DIM_CKV + DIM_KPE  # 576
MAX_HEADS = _ext.MAX_HEADS  # 128
MAX_PAGE_SIZE = _ext.MAX_PAGE_SIZE  # 128
OutOfMemoryError = _ext.OutOfMemoryError  # a MemoryError and a RuntimeError (out_of_memory)

_NAN_POLICIES = ("propagate", "error")


def as_format(kv_format):
    """KvFormat from a KvFormat or a name ("bf16", "fp8_e4m3" / "fp8", "fp8_e4m3_block" /
    "fp8_block" / "block656"). Raises ValueError for any other name."""
    if isinstance(kv_format, KvFormat):
        return kv_format
    if isinstance(kv_format, str):
        return _ext.parse_format(kv_format)
    raise TypeError(f"kv_format: expected a KvFormat or its name, got {kv_format!r}")


def token_bytes(kv_format):
    """Bytes one token occupies in ``kv_format``: 1152 (bf16), 576 (fp8_e4m3), 656 (block)."""
    return _ext.token_bytes(as_format(kv_format))


def cuda_available():
    """True when this build has the CUDA backend and a CUDA device is visible."""
    return _ext.cuda_available()


def version():
    """The library version string, e.g. "0.1.0"."""
    return _ext.version()


def _stream(stream, like):
    if stream is None:
        return current_stream(like)
    if hasattr(stream, "cuda_stream"):  # a torch.cuda.Stream
        return int(stream.cuda_stream)
    return as_int(stream, "stream", 0, 2**64 - 1)  # a cudaStream_t


def _problem_args(qo_indptr, kv_indptr, kv_indices, kv_len, num_heads, page_size, num_pages,
                  sm_scale, kv_format, causal, topk, sparse_indices, device, host_pages=False,
                  causal_len=None, q_dtype="bf16", out_dtype="bf16", borrowed_kv_indices=None):
    """The Problem argument of _ext.plan / replan / plan_context_parallel /
    replan_context_parallel, one tuple converted once for all (_ext_args.h fill_problem's order).
    kv_indices stays on the plan's GPU when it is there (page_table), unless host_pages (context
    parallelism shards it on the host). borrowed_kv_indices (then kv_indices is None) is passed
    as it is: the plan reads that array at every run (fp8mla::Problem::borrowed_kv_indices)."""
    kind, index = parse_device(device)
    return (
        host_i32(qo_indptr, "qo_indptr"),
        host_i32(kv_indptr, "kv_indptr"),
        host_i32(kv_indices, "kv_indices") if host_pages else page_table(kv_indices, (kind, index)),
        host_i32(kv_len, "kv_len"),
        as_int(num_heads, "num_heads"),
        as_int(page_size, "page_size"),
        as_int(num_pages, "num_pages", 0, 2**63 - 1),
        as_format(kv_format),
        as_flag(causal, "causal"),
        as_real(sm_scale, "sm_scale"),
        as_int(topk, "topk"),
        host_i32(sparse_indices, "sparse_indices", ndim=2) if sparse_indices is not None else None,
        host_i32(causal_len, "causal_len") if causal_len is not None else None,
        kind,
        index,
        _q_dtype_name(q_dtype, "q_dtype"),
        _q_dtype_name(out_dtype, "out_dtype"),
        for_ext(borrowed_kv_indices),
    )


def _q_dtype_name(dtype, name):
    """"bf16" or "f16" from those names, "bfloat16" / "float16" or a torch / numpy dtype."""
    text = str(dtype)
    text = text[len("torch."):] if text.startswith("torch.") else text
    aliases = {"bf16": "bf16", "bfloat16": "bf16", "f16": "f16", "float16": "f16", "half": "f16"}
    if text not in aliases:
        raise ValueError(f"{name}: expected bf16 or f16 (bfloat16 / float16), got {dtype!r}")
    return aliases[text]


def plan(
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_len,
    *,
    num_heads,
    page_size,
    num_pages,
    sm_scale,
    kv_format="fp8_e4m3",
    causal=True,
    topk=0,
    sparse_indices=None,
    causal_len=None,
    device="cpu",
    q_dtype="bf16",
    out_dtype="bf16",
    borrowed_kv_indices=None,
    sm_count=0,
    ctas_per_sm=0,
    min_chunk_tokens=64,
    num_threads=0,
    cpu_reference=False,
    cuda_graph=False,
    max_batch=0,
    max_total_q=0,
    max_kv_indices=0,
    max_qo_len=0,
    exact_scores=False,
    max_tile_rows=0,
    any_scale_ratio=False,
    kernel_family="auto",
):
    """Validates a batch, chooses its kernel family and partitions its work (fp8mla::plan).

    Index arrays (any integer dtype, host or device; they are copied to the host as int32):
      qo_indptr   [batch + 1]   query-token offsets per request, starting at 0
      kv_indptr   [batch + 1]   offsets into kv_indices (pages)
      kv_indices  [kv_indptr[-1]] page ids in [0, num_pages)
      kv_len      [batch]       cached tokens per request, <= pages listed * page_size
      sparse_indices [total_q, topk] global slots (page * page_size + offset) or -1 (sparse
                  mode, topk > 0; kv_* may then be None)
      causal_len  [batch] (optional, causal dense) the length each request's causal mask
                  counts from, >= kv_len, when the listed tokens start a longer context (a
                  context-parallel shard: the context's length minus the shard's first token)
    num_heads 1..128, page_size a power of two in 1..128, num_pages >= 1 (the pool the cache
    view will have), sm_scale in (0, 65536], kv_format a KvFormat or its name, device "cpu",
    "cuda", "cuda:N" or a torch.device. q_dtype / out_dtype: "bf16" (default) or "f16" (CPU
    backend only; the CUDA kernels take bf16). borrowed_kv_indices: instead of kv_indices (pass
    None there), an int32 contiguous array of >= kv_indptr[-1] entries on the plan's device that
    the plan borrows: every run() reads the page ids from it then, so the caller may rewrite it
    in place between plan and run (or before a CUDA graph replay); keep it alive as long as the
    plan (fp8mla::Problem::borrowed_kv_indices). The remaining options are fp8mla::PlanOptions (graph
    mode: cuda_graph=True with max_batch, max_total_q, max_kv_indices > 0; exact_scores=True
    keeps fp8_e4m3 scores off the fp8 tensor cores, README "Numerics"; max_tile_rows in 0..64
    caps the rows, heads x query tokens, a tile packs: 16 puts multi-token rows of <= 16 heads
    on the <= 16-row CUDA kernels; 0 lets the planner choose; any_scale_ratio=True lets run()
    pass fp8_e4m3 scales whose kpe_scale / ckv_scale is not a power of two; kernel_family
    "auto" or a family's name forces it, e.g. "fp8_exact").

    Returns a Plan (Plan.kernel_name: the kernel family every run launches). Raises TypeError
    for an argument of the wrong type, ValueError naming the argument, index and bound for bad
    input (including the bounds of fp8mla/limits.h: at most 2^22 rows total_q x num_heads,
    sm_count <= 4096, ctas_per_sm <= 32, num_threads <= 1024; README "Errors"), MemoryError when
    memory runs out, RuntimeError when the device cannot be served (e.g. "cuda" in a build
    without CUDA).
    """
    return _ext.plan(
        _problem_args(qo_indptr, kv_indptr, kv_indices, kv_len, num_heads, page_size, num_pages,
                      sm_scale, kv_format, causal, topk, sparse_indices, device,
                      causal_len=causal_len, q_dtype=q_dtype, out_dtype=out_dtype,
                      borrowed_kv_indices=borrowed_kv_indices),
        _plan_options(sm_count, ctas_per_sm, min_chunk_tokens, num_threads, cpu_reference,
                      cuda_graph, max_batch, max_total_q, max_kv_indices, max_qo_len,
                      exact_scores, max_tile_rows, any_scale_ratio, kernel_family),
    )


LOG2E = 1.4426950408889634


def pow2_scale_ratio(sm_scale, ckv_scale, kpe_scale):
    """Whether kpe_scale / ckv_scale, as the CUDA kernels see it (both times sm_scale * log2(e) in
    float32), is a power of two: src/core/dispatch.cpp's pow2_scale_ratio, which run() checks on
    plans made without any_scale_ratio."""
    def f32(x):  # a double rounded to float32 (a product of two float32 values is exact first)
        try:
            return struct.unpack("f", struct.pack("f", x))[0]
        except OverflowError:
            return math.inf

    s = f32(f32(sm_scale) * f32(LOG2E))
    nope, pe = f32(s * f32(ckv_scale)), f32(s * f32(kpe_scale))
    tiny = 2.0 ** -126  # float32's smallest normal
    if not (tiny <= nope < math.inf and tiny <= pe < math.inf):
        return False
    return math.frexp(f32(pe / nope))[0] == 0.5


def _plan_options(sm_count=0, ctas_per_sm=0, min_chunk_tokens=64, num_threads=0,
                  cpu_reference=False, cuda_graph=False, max_batch=0, max_total_q=0,
                  max_kv_indices=0, max_qo_len=0, exact_scores=False, max_tile_rows=0,
                  any_scale_ratio=False, kernel_family="auto"):
    """fp8mla::PlanOptions as the dict _ext takes (every key, converted; TypeError for a value
    of the wrong type, ValueError for an integer beyond int32 / int64, each naming the option)."""
    if not isinstance(kernel_family, str):
        raise TypeError(f"kernel_family: expected a string, got {type(kernel_family).__name__}")
    return dict(sm_count=as_int(sm_count, "sm_count"),
                ctas_per_sm=as_int(ctas_per_sm, "ctas_per_sm"),
                min_chunk_tokens=as_int(min_chunk_tokens, "min_chunk_tokens"),
                num_threads=as_int(num_threads, "num_threads"),
                cpu_reference=as_flag(cpu_reference, "cpu_reference"),
                cuda_graph=as_flag(cuda_graph, "cuda_graph"),
                max_batch=as_int(max_batch, "max_batch"),
                max_total_q=as_int(max_total_q, "max_total_q"),
                max_kv_indices=as_int(max_kv_indices, "max_kv_indices", -(2**63), 2**63 - 1),
                max_qo_len=as_int(max_qo_len, "max_qo_len"),
                exact_scores=as_flag(exact_scores, "exact_scores"),
                max_tile_rows=as_int(max_tile_rows, "max_tile_rows"),
                any_scale_ratio=as_flag(any_scale_ratio, "any_scale_ratio"),
                kernel_family=kernel_family)


def replan(
    plan,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_len,
    *,
    num_heads,
    page_size,
    num_pages,
    sm_scale,
    kv_format="fp8_e4m3",
    causal=True,
    topk=0,
    sparse_indices=None,
    causal_len=None,
    device="cpu",
    q_dtype="bf16",
    out_dtype="bf16",
    borrowed_kv_indices=None,
    stream=None,
):
    """Re-plans a graph-mode Plan (made with cuda_graph=True) in place for a new batch, keeping
    its device buffers so a captured run() replays on the new batch (fp8mla::replan).

    Arguments as for plan(). Raises ValueError as plan() does, and when ``plan`` is not a
    graph-mode plan or num_heads, format, page size, topk, device, q_dtype, out_dtype or the
    borrowed page table's buffer differ from it, or the new batch exceeds its max_* capacities.
    Call it outside capture. stream=None: synchronous; on CUDA it first waits until the device
    is idle (a run of the plan still queued on any stream reads the buffers it rewrites).
    stream given (a cudaStream_t as int or a torch.cuda.Stream): stream-ordered, no host wait;
    the copies go on that stream from the plan's pinned staging, and every run of the plan
    must be on that stream or ordered after it (fp8mla::replan(plan, problem, stream)); a page
    table on the GPU must then be the borrowed one (a device kv_indices is refused).
    """
    args = _problem_args(qo_indptr, kv_indptr, kv_indices, kv_len, num_heads, page_size,
                         num_pages, sm_scale, kv_format, causal, topk, sparse_indices, device,
                         causal_len=causal_len, q_dtype=q_dtype, out_dtype=out_dtype,
                         borrowed_kv_indices=borrowed_kv_indices)
    if stream is None:
        _ext.replan(plan, args)
    else:
        _ext.replan_on_stream(plan, args, _stream(stream, None))


def run(
    plan,
    q_nope,
    q_pe,
    ckv_cache,
    kpe_cache=None,
    *,
    out=None,
    lse=None,
    return_lse=False,
    ckv_scale=1.0,
    kpe_scale=1.0,
    sparse_indices=None,
    stream=None,
):
    """Attention for a planned batch (fp8mla::run).

    q_nope  bf16 [total_q, H, 512], q_pe bf16 [total_q, H, 64] (innermost stride 1; other
            strides free, so slices of one [total_q, H, 576] tensor work)
    ckv_cache / kpe_cache, by the plan's format (strides free, innermost stride 1):
            bf16:           bf16 [num_pages, page_size, 512] and [num_pages, page_size, 64]
            fp8_e4m3:       float8_e4m3fn or uint8, same shapes; real = code * ckv_scale
                            (kpe_scale for kpe); SGLang's pool is unscaled: 1.0
            fp8_e4m3_block: uint8 [num_pages, page_size, 656] (whole tokens); kpe_cache None
    out     bf16 [total_q, H, 512], allocated (like q_nope) when None; written completely
    lse     float32 [total_q, H], natural log; allocated when None and return_lse
    sparse_indices  int32 [total_q, topk] on the plan's device: replaces the planned indices
            (sparse plans only; entries outside the pool are treated like -1)
    stream  cudaStream_t as int (or a torch.cuda.Stream); None = torch's current stream for
            torch CUDA tensors, 0 otherwise

    Returns out, or (out, lse) when return_lse. Raises ValueError for a tensor whose dtype,
    shape, innermost stride or device does not match the plan (the message names it and gives
    both values). Releases the GIL while computing. Not a torch custom op (torch.compile graph
    breaks here): BatchMLAPagedAttentionWrapper.run and fp8mla.torch_ops are.
    """
    out, lse = _outputs(q_nope, out, lse, return_lse)
    _ext.run(plan, for_ext(q_nope), for_ext(q_pe), for_ext(ckv_cache), for_ext(kpe_cache),
             for_ext(out), for_ext(lse), as_real(ckv_scale, "ckv_scale"),
             as_real(kpe_scale, "kpe_scale"), for_ext(sparse_indices), _stream(stream, q_nope))
    return (out, lse) if return_lse else out


def _outputs(q_nope, out, lse, return_lse):
    """run()'s out (allocated like q_nope when None) and lse (allocated when asked for)."""
    require_array(q_nope, "q_nope", 3)
    if out is None:
        out = empty(q_nope, (q_nope.shape[0], q_nope.shape[1], DIM_CKV), "bf16")
    if lse is None and return_lse:
        lse = empty(q_nope, (q_nope.shape[0], q_nope.shape[1]), "f32")
    return out, lse


# ---- context parallelism (include/fp8mla/context_parallel.h) ----

NcclComm = _ext.NcclComm
ContextParallelPlan = _ext.ContextParallelPlan


def nccl_unique_id():
    """A fresh NCCL unique id (128 bytes) for NcclComm(id, rank, world, device_id): one rank
    makes it and sends it to the others (e.g. with torch.distributed.broadcast_object_list). The
    process that makes it serves the group's bootstrap until every rank has joined.

    NCCL is loaded at run time: FP8MLA_NCCL_LIBRARY when set, else the process's own
    libnccl.so.2 (PyTorch's, once torch has loaded it), else the loader's. RuntimeError when
    none loads.
    NcclComm(id, rank, world, device_id) joins the group (blocking until every rank has);
    NcclComm.borrow(nccl_comm, device_id) wraps an ncclComm_t the caller owns (an int).
    """
    return _ext.nccl_unique_id()


def plan_context_parallel(comm, qo_indptr, kv_indptr, kv_indices, kv_len, *, num_heads,
                          page_size, num_pages, sm_scale, kv_format="fp8_e4m3", causal=True,
                          device=None, **options):
    """This rank's plan of a batch whose contexts are spread over comm's ranks
    (fp8mla::plan_context_parallel): rank k of world n takes pages [k m, (k + 1) m) of each
    request (m = ceil(pages / n)); the page table lists the full contexts, with page ids of
    this rank's pool for its own pages. Arguments as plan()'s (dense only; causal
    multi-token rows are masked as over the whole context); device defaults to comm's
    ("cuda:<device_id>"); options are plan()'s (cuda_graph=True with max_* for
    replan_context_parallel). Keeps comm alive.
    """
    if device is None:
        device = f"cuda:{comm.device_id}"
    args = _problem_args(qo_indptr, kv_indptr, kv_indices, kv_len, num_heads, page_size,
                         num_pages, sm_scale, kv_format, causal, 0, None, device, host_pages=True)
    return _ext.plan_context_parallel(comm, args, _plan_options(**options))


def replan_context_parallel(plan, qo_indptr, kv_indptr, kv_indices, kv_len, *, num_heads,
                            page_size, num_pages, sm_scale, kv_format="fp8_e4m3", causal=True,
                            device=None):
    """Re-plans a graph-mode ContextParallelPlan in place for new lengths and page tables
    (fp8mla::replan_context_parallel); qo_indptr must equal the planned one."""
    if device is None:
        device = f"cuda:{plan.device_id}"
    args = _problem_args(qo_indptr, kv_indptr, kv_indices, kv_len, num_heads, page_size,
                         num_pages, sm_scale, kv_format, causal, 0, None, device, host_pages=True)
    _ext.replan_context_parallel(plan, args)


def run_context_parallel(plan, q_nope, q_pe, ckv_cache, kpe_cache=None, *, out=None, lse=None,
                         return_lse=False, ckv_scale=1.0, kpe_scale=1.0, stream=None):
    """Decode of the whole contexts on every rank (fp8mla::run_context_parallel): this rank's
    share into its slot of the exchange buffers, an NCCL all-gather of (out, lse) on `stream`,
    and the merge into out / lse. Arguments as run()'s for the full batch (out and lse dense
    over their rows); ckv_cache / kpe_cache are this rank's pool. Every rank calls it, in the
    same order as its other collectives. No allocation inside (out / lse are allocated here
    when None) and no host sync: capturable in a CUDA graph.
    """
    out, lse = _outputs(q_nope, out, lse, return_lse)
    _ext.run_context_parallel(plan, for_ext(q_nope), for_ext(q_pe), for_ext(ckv_cache),
                              for_ext(kpe_cache), for_ext(out), for_ext(lse),
                              as_real(ckv_scale, "ckv_scale"), as_real(kpe_scale, "kpe_scale"),
                              _stream(stream, q_nope))
    return (out, lse) if return_lse else out


def merge_states(v, s, v_out=None, s_out=None, *, stream=None):
    """Combines partial attention states of the same rows (fp8mla::merge_states).

    v      float32 or bf16 [rows, num_states, D]: partial outputs, each normalised by its sum
    s      float32 [rows, num_states]: their LSE, natural log; -inf marks an empty state
    v_out  [rows, D], v's dtype (allocated when None); s_out float32 [rows] (allocated when None)
    Per row: w_i = exp(s_i - max s); v_out = sum w_i v_i / sum w_i; s_out = max s + log sum w_i.
    All-empty rows give v_out = 0 and s_out = -inf (never NaN). Strides are free (pass a
    states-major buffer as a permuted view). Returns (v_out, s_out). Raises ValueError for bad
    shapes/dtypes/devices, TypeError for an argument that is not an array.
    """
    require_array(v, "v", 3)
    require_array(s, "s", 2)
    for t, name in ((v_out, "v_out"), (s_out, "s_out")):
        if t is not None:
            require_array(t, name)
    rows, dim = v.shape[0], v.shape[2]
    if v_out is None:
        np = numpy_module()
        torch = torch_module()
        if torch is not None and isinstance(v, torch.Tensor):
            v_out = torch.empty((rows, dim), dtype=v.dtype, device=v.device)
        else:
            v_out = np.empty((rows, dim), dtype=v.dtype)
    if s_out is None:
        s_out = empty(v, (rows,), "f32")
    _ext.merge_states(for_ext(v), for_ext(s), for_ext(v_out), for_ext(s_out), _stream(stream, v))
    return v_out, s_out


class PagedLatentCache:
    """A paged latent KV cache owned by fp8mla (fp8mla::PagedLatentCache).

    Storage: uint8 [num_pages, page_size, token_bytes(format)] on ``device`` (zero-filled).
    ``PagedLatentCache(num_pages, page_size, format="fp8_e4m3", scale=1.0, device="cpu")``.
    Raises ValueError for a bad configuration, RuntimeError for a CUDA cache in a build without
    CUDA or when memory runs out.
    """

    def __init__(self, num_pages, page_size, format="fp8_e4m3", scale=1.0, device="cpu"):
        kind, index = parse_device(device)
        self._c = _ext.PagedLatentCache(
            as_int(num_pages, "num_pages", 0, 2**63 - 1), as_int(page_size, "page_size"),
            as_format(format), as_real(scale, "scale"), kind, index
        )

    num_pages = property(lambda self: self._c.num_pages, doc="pages in the pool")
    page_size = property(lambda self: self._c.page_size, doc="tokens per page")
    format = property(lambda self: self._c.format, doc="the KvFormat")
    scale = property(lambda self: self._c.scale, doc="fp8_e4m3 scale (real = code * scale)")
    free_pages = property(lambda self: self._c.free_pages, doc="pages on the free list")
    capacity_tokens = property(lambda self: self._c.capacity_tokens, doc="num_pages * page_size")

    @property
    def device(self):
        """"cpu" or "cuda:N"."""
        return "cpu" if self._c.device == "cpu" else f"cuda:{self._c.device_id}"

    @property
    def token_bytes(self):
        """Bytes per token of this cache's format."""
        return _ext.token_bytes(self._c.format)

    def allocate(self, n):
        """Takes ``n`` pages off the free list (lowest ids first) and returns their ids (int32
        numpy array, or a list without numpy). MemoryError (OutOfMemoryError, also a
        RuntimeError) when fewer than n are free, and then nothing is taken; ValueError for
        n < 0."""
        pages = self._c.allocate(as_int(n, "n", -(2**63), 2**63 - 1))
        np = numpy_module()
        return np.asarray(pages, dtype=np.int32) if np is not None else pages

    def release(self, pages):
        """Returns pages to the free list, all or nothing: an id outside the pool, not allocated
        (double release) or repeated raises ValueError and releases none."""
        self._c.release(host_i32(pages, "pages"))

    def is_allocated(self, page):
        """True when ``page`` is currently handed out."""
        return self._c.is_allocated(as_int(page, "page"))

    def append(self, slots, ckv, kpe, *, nan="propagate", stream=None):
        """Quantizing write of token i (ckv[i], kpe[i]) at global slot slots[i].

        slots int32 [n]; ckv bf16/float16/float32 [n, 512]; kpe the same dtype [n, 64]; rows may
        be strided; all on the cache's device (a CUDA cache runs on ``stream``, default torch's
        current stream). nan: "propagate" (store NaN) or "error" (ValueError naming the value's
        index, nothing written; checked on the host only). A host cache checks every slot
        (inside the pool, on an allocated page) before writing anything.
        """
        self._c.append(
            for_ext(slots), for_ext(ckv), for_ext(kpe), as_str(nan, "nan", _NAN_POLICIES),
            _stream(stream, ckv)
        )

    def storage(self, framework=None):
        """The cache bytes, uint8 [num_pages, page_size, token_bytes], no copy; the array keeps
        the cache alive. framework: "numpy" or "torch"; None = numpy for a host cache (torch
        when numpy is missing), torch for a CUDA cache. ValueError for another framework or
        numpy with a CUDA cache."""
        raw = self._c.storage()
        if framework is None:
            framework = "torch" if self._c.device == "cuda" or numpy_module() is None else "numpy"
        if framework == "torch":
            import torch

            return torch.from_dlpack(raw)
        if framework == "numpy" and self._c.device == "cpu":
            return numpy_module().from_dlpack(raw)
        raise ValueError(
            f'framework: expected "numpy" (host caches) or "torch", got {framework!r}'
        )

    def view(self, framework=None):
        """(ckv_cache, kpe_cache) as run() and the wrapper take them, views into storage()
        (``framework`` as there): bf16: [P, S, 512] / [P, S, 64] bf16 (uint16 bits in numpy,
        torch.bfloat16 in torch); fp8_e4m3: the same shapes, uint8 (numpy) / float8_e4m3fn
        (torch); fp8_e4m3_block: (uint8 [P, S, 656], None)."""
        st = self.storage(framework)
        fmt = self._c.format
        is_t = is_torch_tensor(st)
        if fmt == KvFormat.fp8_e4m3_block:
            return st, None
        if fmt == KvFormat.bf16:
            st = st.view(torch_module().bfloat16) if is_t else st.view("uint16")
        elif is_t:
            st = st.view(torch_module().float8_e4m3fn)
        return st[:, :, :DIM_CKV], st[:, :, DIM_CKV:]

    def read_token(self, slot):
        """Token at ``slot`` decoded to 576 floats (numpy float32, or a list without numpy).
        ValueError for a slot outside the pool."""
        vals = self._c.read_token(as_int(slot, "slot", -(2**63), 2**63 - 1))
        np = numpy_module()
        return np.asarray(vals, dtype=np.float32) if np is not None else vals

    def __repr__(self):
        return (
            f"fp8mla.PagedLatentCache(num_pages={self.num_pages}, page_size={self.page_size}, "
            f"format={_ext.format_name(self.format)}, scale={self.scale}, device={self.device}, "
            f"free_pages={self.free_pages})"
        )


def append_kv(cache, slots, ckv, kpe, *, nan="propagate", stream=None):
    """Quantizing write into a PagedLatentCache: same as ``cache.append(slots, ckv, kpe)``.

    slots int32 [n] global slots (page * page_size + offset) on allocated pages; ckv
    bf16/float16/float32 [n, 512]; kpe [n, 64]. Raises ValueError for bad slots, shapes or
    (nan="error") NaN input.
    """
    cache.append(slots, ckv, kpe, nan=nan, stream=stream)


# ---- codecs (host, numpy): the library's exact scalar and token codecs, for tests and tools ----


def _np_in(x, dtype):
    """(numpy, contiguous host array of ``dtype``). Float inputs convert to float32; code and
    bit inputs must already be integers of the right width (no silent float -> int casts)."""
    np = numpy_module()
    if np is None:
        raise RuntimeError("the fp8mla codec helpers need numpy")
    if x is None or isinstance(x, (str, bytes)):
        raise TypeError(f"expected an array or a number, got {type(x).__name__}")
    if is_torch_tensor(x):
        x = x.detach().cpu()
        torch = torch_module()
        if x.dtype == torch.bfloat16:
            x = x.view(torch.int16)
        elif x.dtype == torch.float8_e4m3fn:
            x = x.view(torch.uint8)
        x = x.numpy()
    a = np.asarray(x)
    if a.dtype.name in ("bfloat16", "int16"):
        a = a.view(np.uint16)
    elif a.dtype.name == "float8_e4m3fn":
        a = a.view(np.uint8)
    if dtype != "float32" and a.size and a.dtype != np.dtype(dtype):
        raise ValueError(f"expected {dtype} data, got dtype {a.dtype}")
    # asarray keeps a 0-d input 0-d (ascontiguousarray makes it shape (1,)).
    return np, np.asarray(a, dtype=dtype, order="C")


def is_torch_tensor(x):
    torch = torch_module()
    return torch is not None and isinstance(x, torch.Tensor)


def fp8_e4m3_encode(x):
    """float32 values (any shape) -> e4m3fn codes, uint8, same shape. Round to nearest even;
    magnitudes beyond 448 (and +-inf) saturate to +-448; NaN -> 0x7f | sign; -0.0 -> 0x80."""
    np, a = _np_in(x, "float32")
    out = np.empty(a.shape, dtype=np.uint8)
    _ext.fp8_e4m3_encode(a, out)
    return out


def fp8_e4m3_decode(codes):
    """e4m3fn codes (uint8 or float8_e4m3fn, any shape) -> exact float32 values (NaN for 0x7f
    and 0xff)."""
    np, a = _np_in(codes, "uint8")
    out = np.empty(a.shape, dtype=np.float32)
    _ext.fp8_e4m3_decode(a, out)
    return out


def bf16_encode(x):
    """float32 values -> bf16 bits (uint16, same shape); RNE, NaN stays a quiet NaN."""
    np, a = _np_in(x, "float32")
    out = np.empty(a.shape, dtype=np.uint16)
    _ext.bf16_encode(a, out)
    return out


def bf16_decode(bits):
    """bf16 bits (uint16, ml_dtypes.bfloat16 or torch.bfloat16) -> float32 (exact)."""
    np, a = _np_in(bits, "uint16")
    out = np.empty(a.shape, dtype=np.float32)
    _ext.bf16_decode(a, out)
    return out


def encode_tokens(values, kv_format, scale=1.0, *, nan="propagate"):
    """Tokens [..., 576] float32 (ckv 512 then kpe 64) -> their bytes, uint8 [..., token_bytes].

    The layout of include/fp8mla/format.h (bf16: 576 bf16, little endian; fp8_e4m3: 576 codes
    of x / scale; fp8_e4m3_block: 512 codes, 4 float32 power-of-two scales, 64 bf16). ``scale``
    (fp8_e4m3 only) must be finite and > 0. nan="error" raises ValueError naming the token
    and writes nothing.
    """
    fmt = as_format(kv_format)
    np, a = _np_in(values, "float32")
    if a.ndim < 1 or a.shape[-1] != DIM_QK:
        raise ValueError(f"values: expected shape [..., {DIM_QK}], got {a.shape}")
    out = np.empty(a.shape[:-1] + (_ext.token_bytes(fmt),), dtype=np.uint8)
    _ext.encode_tokens(fmt, as_real(scale, "scale"), a, out, as_str(nan, "nan", _NAN_POLICIES))
    return out


def decode_tokens(data, kv_format, scale=1.0):
    """Token bytes uint8 [..., token_bytes] -> float32 [..., 576] (exact decode; the fp8_e4m3
    scale multiplies in float32)."""
    fmt = as_format(kv_format)
    np, a = _np_in(data, "uint8")
    tb = _ext.token_bytes(fmt)
    if a.ndim < 1 or a.shape[-1] != tb:
        raise ValueError(
            f"data: expected shape [..., {tb}] for {_ext.format_name(fmt)}, got {a.shape}"
        )
    out = np.empty(a.shape[:-1] + (DIM_QK,), dtype=np.float32)
    _ext.decode_tokens(fmt, as_real(scale, "scale"), a, out)
    return out


def encode_token(values, kv_format, scale=1.0, *, nan="propagate"):
    """One token: 576 floats -> uint8 [token_bytes] (see encode_tokens)."""
    return encode_tokens(values, kv_format, scale, nan=nan)


def decode_token(data, kv_format, scale=1.0):
    """One token: uint8 [token_bytes] -> float32 [576] (see decode_tokens)."""
    return decode_tokens(data, kv_format, scale)
