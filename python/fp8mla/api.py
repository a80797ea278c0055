"""fp8mla's low-level Python API: plan, replan, run and merge_states (the paged cache is in
cache.py, context parallelism in context_parallel.py, the codecs in format.py).

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
