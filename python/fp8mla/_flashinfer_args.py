"""FlashInfer's MLA argument forms, normalised for fp8mla's wrapper (fp8mla.wrapper).

FlashInfer 0.6.18 and 0.7.4 call BatchMLAPagedAttentionWrapper in several forms: plan() with flat
CSR arrays (positional or keyword), with ``metadata=MLAPlanMetadata.csr(...)`` / ``.dense(...)`` /
``.dual(...)``, or with flat dense arrays; run() with ``q_nope, q_pe, ckv_cache, kpe_cache`` or
with structural ``query=`` / ``kv_cache=`` values (a packed tensor or a (nope, rope) pair). This
module turns each form into the arrays and views the library takes, and reads the index arrays
as FlashInfer reads them, and resolves FlashInfer's data types, choices, deprecated forms and
argument names in messages. It imports no framework: torch and numpy arrays are told apart by
fp8mla._tensors.
"""

import functools
import math
import re
import warnings
from dataclasses import dataclass
from typing import Optional

from . import _fp8mla as _ext
from ._tensors import host_i32, is_numpy, is_torch, length, numpy_module, torch_module
from .api import DIM_CKV, DIM_KPE, KvFormat, as_format

# FlashInfer's backend names (0.6.18 and 0.7.4). "auto", "fa2" and "fa3" select fp8mla's own
# kernels; the others name FlashInfer kernels fp8mla does not have.
FLASHINFER_BACKENDS = (
    "auto", "fa2", "fa3", "cutlass", "cutile", "trtllm-gen", "xqa", "autotune", "cute-dsl",
    "cute-dsl-monolithic", "cute-dsl-modular", "cute-dsl-rubin-mtp",
)
OWN_BACKENDS = ("auto", "fa2", "fa3", "cpu", "cpu_reference", "cuda")

LSE_MODES = ("none", "base2", "basee")
LAYOUTS = ("packed", "split")
SCALE_MODES = ("default", "kv-per-tensor", "bmm-scalar", "bmm-tensor")
OUTPUT_SCALES = ("none", "per-tensor")


@dataclass(frozen=True)
class MLAPlanMetadata:
    """FlashInfer 0.7's plan metadata: CSR (qo_indptr, kv_indptr, kv_indices, kv_len_arr), dense
    (cum_seq_lens_q, block_tables, seq_lens, max_q_len) or both ("dual"). Same fields and
    constructors as flashinfer.mla.MLAPlanMetadata."""

    qo_indptr: Optional[object] = None
    kv_indptr: Optional[object] = None
    kv_indices: Optional[object] = None
    kv_len_arr: Optional[object] = None
    cum_seq_lens_q: Optional[object] = None
    block_tables: Optional[object] = None
    seq_lens: Optional[object] = None
    max_q_len: Optional[int] = None

    @classmethod
    def csr(cls, qo_indptr, kv_indptr, kv_indices, kv_len_arr):
        return cls(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                   kv_len_arr=kv_len_arr)

    @classmethod
    def dense(cls, cum_seq_lens_q, block_tables, seq_lens, max_q_len=None):
        return cls(cum_seq_lens_q=cum_seq_lens_q, block_tables=block_tables, seq_lens=seq_lens,
                   max_q_len=max_q_len)

    @classmethod
    def dual(cls, qo_indptr, kv_indptr, kv_indices, kv_len_arr, *, cum_seq_lens_q, block_tables,
             seq_lens, max_q_len=None):
        return cls(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                   kv_len_arr=kv_len_arr, cum_seq_lens_q=cum_seq_lens_q,
                   block_tables=block_tables, seq_lens=seq_lens, max_q_len=max_q_len)


def dtype_name(dt):
    """'bfloat16', 'float16', 'float8_e4m3fn', 'uint8', ... from a torch/numpy dtype or a string
    (None stays None)."""
    if dt is None:
        return None
    if isinstance(dt, str):
        text = dt
    else:
        text = str(dt)
        if text.startswith("torch."):
            text = text[len("torch."):]
        elif hasattr(dt, "name"):
            text = dt.name
        else:
            np = numpy_module()
            if np is not None:
                try:
                    text = np.dtype(dt).name
                except TypeError:
                    pass
    text = text.lower()
    aliases = {"bf16": "bfloat16", "half": "float16", "f16": "float16", "fp16": "float16",
               "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "e4m3": "float8_e4m3fn",
               "e4m3fn": "float8_e4m3fn", "float": "float32", "f32": "float32"}
    return aliases.get(text, text)


def array_dtype(a):
    """dtype_name of an array's element type; numpy's uint16 carries bf16 bits."""
    return dtype_name(a.dtype)


# ---- plan metadata ----

@dataclass
class Csr:
    """The CSR arrays as the plan reads them: host int32 qo_indptr / kv_indptr [batch + 1] and
    kv_len [batch]; kv_indices as given (host or device, >= kv_indptr[batch] entries) or None
    when the dense form gave the pages (then `pages` holds them on the host)."""

    qo_indptr: object
    kv_indptr: object
    kv_len: object
    kv_indices: object
    batch: int
    strict: bool


def _rank1_int32(name, a, *, strict_dtype):
    if a is None:
        raise TypeError(f"{name}: required")
    if not hasattr(a, "shape") and not isinstance(a, (list, tuple)):
        raise ValueError(f"{name}: expected an int32 array or tensor, got {type(a).__name__}")
    if hasattr(a, "shape") and len(a.shape) != 1:
        raise ValueError(f"{name}: expected rank 1, got shape {tuple(a.shape)}")
    if strict_dtype and hasattr(a, "dtype") and dtype_name(a.dtype) != "int32":
        raise ValueError(f"{name}: expected dtype int32, got {dtype_name(a.dtype)}")


def csr_from_flat(qo_indptr, kv_indptr, kv_indices, kv_len_arr, page_size, *, strict):
    """Reads flat CSR metadata as FlashInfer does. batch = len(kv_len_arr); qo_indptr and
    kv_indptr give (at least) batch + 1 entries, of which the first batch + 1 are read, as engines
    pass over-allocated graph buffers (strict, the metadata= form: exactly batch + 1, and
    kv_indptr's page counts equal ceil(kv_len_arr / page_size), as FlashInfer 0.7 checks)."""
    for name, a in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr),
                    ("kv_indices", kv_indices), ("kv_len_arr", kv_len_arr)):
        _rank1_int32(name, a, strict_dtype=strict)
    kvl = host_i32(kv_len_arr, "kv_len_arr")
    batch = length(kvl)
    qo = host_i32(qo_indptr, "qo_indptr")
    kvp = host_i32(kv_indptr, "kv_indptr")
    for name, a in (("qo_indptr", qo), ("kv_indptr", kvp)):
        n = length(a)
        if strict and n != batch + 1:
            raise ValueError(
                f"{name}: CSR metadata batch dimensions must agree: kv_len_arr has {batch} "
                f"entries, so {name} needs {batch + 1}, got {n}")
        if n < batch + 1:
            raise ValueError(f"{name}: expected at least len(kv_len_arr) + 1 = {batch + 1} "
                             f"entries, got {n}")
    qo, kvp = qo[: batch + 1], kvp[: batch + 1]
    n_pages = int(kvp[batch]) if batch >= 0 else 0
    if length(kv_indices) < n_pages:
        raise ValueError(f"kv_indices: expected at least kv_indptr[{batch}] = {n_pages} entries, "
                         f"got {length(kv_indices)}")
    if strict and batch > 0:
        np = numpy_module()
        lens = np.maximum(np.asarray(kvl, dtype=np.int64), 0)
        got = np.diff(np.asarray(kvp, dtype=np.int64))
        bad = np.flatnonzero(got != (lens + page_size - 1) // page_size)
        if bad.size:
            r = int(bad[0])
            raise ValueError(
                f"kv_indptr: CSR metadata page counts must equal ceil(kv_len_arr / page_size): "
                f"request {r} lists {int(got[r])} pages for kv_len_arr[{r}] = {int(kvl[r])} at "
                f"page_size {page_size}")
    return Csr(qo, kvp, kvl, kv_indices, batch, strict)


def csr_from_dense(cum_seq_lens_q, block_tables, seq_lens, max_q_len, page_size):
    """FlashInfer's dense metadata (block_tables [batch, width] of page ids, seq_lens [batch])
    as CSR on the host: request r lists its first ceil(seq_lens[r] / page_size) pages."""
    for name, a in (("cum_seq_lens_q", cum_seq_lens_q), ("seq_lens", seq_lens)):
        _rank1_int32(name, a, strict_dtype=True)
    if block_tables is None or not hasattr(block_tables, "shape") or len(block_tables.shape) != 2:
        raise ValueError("block_tables: expected a rank-2 int32 array [batch, pages]")
    if dtype_name(block_tables.dtype) != "int32":
        raise ValueError(f"block_tables: expected dtype int32, got {dtype_name(block_tables.dtype)}")
    qo = host_i32(cum_seq_lens_q, "cum_seq_lens_q")
    kvl = host_i32(seq_lens, "seq_lens")
    table = host_i32(block_tables, "block_tables", ndim=2)
    batch = length(qo) - 1
    if batch < 0 or table.shape[0] != batch or length(kvl) != batch:
        raise ValueError(
            f"dense metadata batch dimensions must agree: cum_seq_lens_q describes {batch}, "
            f"block_tables has {table.shape[0]} rows and seq_lens {length(kvl)} entries")
    if max_q_len is not None:
        longest = max((int(qo[r + 1]) - int(qo[r]) for r in range(batch)), default=0)
        if not isinstance(max_q_len, int) or isinstance(max_q_len, bool) or max_q_len < longest:
            raise ValueError(f"max_q_len: must be an int >= the longest query ({longest}), "
                             f"got {max_q_len!r}")
    np = numpy_module()
    counts = [(max(int(kvl[r]), 0) + page_size - 1) // page_size for r in range(batch)]
    for r, c in enumerate(counts):
        if c > table.shape[1]:
            raise ValueError(f"block_tables: row {r} has {table.shape[1]} pages, fewer than the "
                             f"{c} seq_lens[{r}] = {int(kvl[r])} needs at page_size {page_size}")
    kvp = np.zeros(batch + 1, dtype=np.int32)
    kvp[1:] = np.cumsum(counts)
    kvi = np.concatenate([table[r, :c] for r, c in enumerate(counts)] or
                         [np.zeros(0, dtype=np.int32)]).astype(np.int32)
    return Csr(qo, kvp, kvl, kvi, batch, True)


# ---- run() inputs ----

def is_array(x):
    return is_torch(x) or is_numpy(x) or hasattr(x, "__dlpack__")


def parse_structural(value, name):
    """(packed, (nope, rope)) of a structural query / kv_cache value: a tensor (packed), a
    (nope, rope) pair, or FlashInfer's dual nesting of both; either part may be None."""
    if is_array(value):
        return value, None
    if type(value) is not tuple or len(value) != 2:
        raise TypeError(f"{name}: expected a tensor or a (nope, rope) 2-tuple, got "
                        f"{type(value).__name__}")
    left, right = value
    if isinstance(left, tuple) and isinstance(right, tuple):
        raise ValueError(f"{name}: malformed nesting (two tuples)")
    if isinstance(left, tuple):
        return right, tuple(left)
    if isinstance(right, tuple):
        return left, tuple(right)
    return None, (left, right)


def adjacent_views(left, right):
    """True when right starts where left's last dimension ends in the same buffer, with the same
    strides (a split of one packed tensor, as SGLang passes q and its pool)."""
    try:
        if tuple(left.shape[:-1]) != tuple(right.shape[:-1]):
            return False
        if is_torch(left) and is_torch(right):
            if left.stride()[:-1] != right.stride()[:-1] or left.dtype != right.dtype:
                return False
            return right.data_ptr() == left.data_ptr() + left.shape[-1] * left.stride(-1) * \
                left.element_size()
        if is_numpy(left) and is_numpy(right):
            if left.strides[:-1] != right.strides[:-1] or left.dtype != right.dtype:
                return False
            return (right.__array_interface__["data"][0] ==
                    left.__array_interface__["data"][0] + left.shape[-1] * left.strides[-1])
    except (AttributeError, TypeError):
        return False
    return False


def split_last(packed, widths, name):
    """(nope, rope) views of a packed [..., nope + rope] array."""
    if len(packed.shape) != 3:
        raise ValueError(f"{name}: a packed value must have rank 3, got shape "
                         f"{tuple(packed.shape)}")
    if packed.shape[-1] != sum(widths):
        raise ValueError(f"{name}: the packed last dimension must be {widths[0]} + {widths[1]} = "
                         f"{sum(widths)}, got {packed.shape[-1]}")
    return packed[..., : widths[0]], packed[..., widths[0]:]


# ---- data types, choices, messages and deprecations ----

# FlashInfer's C++ names in library messages -> the Python argument the caller passed.
RENAMES = (
    (re.compile(r"\bkv\.ckv_scale\b"), "ckv_scale"),
    (re.compile(r"\bkv\.kpe_scale\b"), "kpe_scale"),
    (re.compile(r"\bkv\.ckv\b"), "ckv_cache"),
    (re.compile(r"\bkv\.kpe\b"), "kpe_cache"),
    (re.compile(r"\bkv\.format\b"), "kv_data_type"),
    (re.compile(r"\bkv_len(?=[\[:. ])"), "kv_len_arr"),
    (re.compile(r"\bborrowed_kv_indices\b"), "kv_indices"),
    (re.compile(r"\bdevice_kv_indices\b"), "kv_indices"),
)


def renamed(err):
    """A library ValueError re-raised with FlashInfer's Python argument names."""
    text = str(err)
    for pattern, name in RENAMES:
        text = pattern.sub(name, text)
    return type(err)(text)


def unsupported(name, what):
    return NotImplementedError(f"{name}: {what}")


def q_dtype_of(q_data_type):
    """"bf16" or "f16" for a FlashInfer q_data_type (f16 on both backends; the CUDA kernels round
    fp16 queries to bf16 as they load them)."""
    q = dtype_name(q_data_type)
    if q in ("bfloat16", "uint16"):
        return "bf16"
    if q == "float16":
        return "f16"
    if q == "float8_e4m3fn":
        raise unsupported("q_data_type", "FP8 queries are not supported; fp8mla reads the FP8 "
                           "cache with bfloat16 or float16 queries")
    raise ValueError(f"q_data_type: expected torch.bfloat16 or torch.float16, got {q_data_type}")


def kv_format_of(kv_data_type, kv_format):
    """KvFormat from FlashInfer's kv_data_type and fp8mla's optional kv_format."""
    kv = dtype_name(kv_data_type)
    bf16_types = ("bfloat16", "uint16")
    fp8_types = ("float8_e4m3fn", "uint8")
    if kv == "float16":
        raise unsupported("kv_data_type", "float16 caches are not supported: fp8mla stores "
                           "bfloat16, float8_e4m3fn (per-tensor scales) or the 656-byte block "
                           "format")
    if kv not in bf16_types + fp8_types:
        raise ValueError(f"kv_data_type: expected torch.bfloat16 or torch.float8_e4m3fn (uint8 "
                         f"taken as FP8 bytes), got {kv_data_type}")
    if kv_format is None:
        return KvFormat.bf16 if kv in bf16_types else KvFormat.fp8_e4m3
    fmt = as_format(kv_format)
    if (fmt == KvFormat.bf16) != (kv in bf16_types):
        raise ValueError(
            f"kv_format: {_ext.format_name(fmt)} does not match kv_data_type {kv_data_type}")
    return fmt


def check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, "
                         f"got {value!r}")


_legacy_plan_warned = False


def metadata_form(metadata, flat_csr_arrays, flat_dense_arrays, required):
    """Which metadata form plan() was given: False for metadata= (FlashInfer 0.7), True for the
    flat CSR or dense arrays (deprecated in 0.7: a DeprecationWarning, once a process). Raises
    TypeError / ValueError for a mix of forms, none, or a required argument (``required``: name
    -> value) left out."""
    global _legacy_plan_warned
    flat_csr = any(v is not None for v in flat_csr_arrays)
    flat_dense = any(v is not None for v in flat_dense_arrays)
    if metadata is not None:
        if not isinstance(metadata, MLAPlanMetadata) and type(metadata).__name__ != \
                "MLAPlanMetadata":
            raise TypeError("metadata: expected an MLAPlanMetadata instance")
        if flat_csr or flat_dense:
            raise ValueError("metadata: given with flat metadata arguments; only one "
                             "representation may be supplied")
        legacy_flat = False
    else:
        if flat_csr and flat_dense:
            raise ValueError("qo_indptr / cum_seq_lens_q: flat CSR and dense metadata forms "
                             "cannot be mixed")
        if not flat_csr and not flat_dense:
            raise TypeError("plan() requires metadata= or flat metadata arguments")
        legacy_flat = True
        if not _legacy_plan_warned:
            _legacy_plan_warned = True
            deprecated(
                "Passing flat BatchMLAPagedAttentionWrapper.plan metadata arrays is "
                "deprecated in FlashInfer 0.7; pass metadata=fp8mla.mla.MLAPlanMetadata."
                "csr(...) (fp8mla accepts both).")
    missing = [name for name, value in required.items() if value is None]
    if missing:
        raise TypeError("plan() missing required arguments: " + ", ".join(missing))
    return legacy_flat


@dataclass
class PlanContract:
    """What plan()'s arguments other than the index arrays decide (plan_contract)."""

    query_layout: str
    kv_cache_layout: str
    q_dtype: str
    fmt: object
    out_name: str
    scale_mode: str


def plan_contract(device_kind, legacy_flat, *, head_dim_ckv, head_dim_kpe, page_size,
                  q_data_type, kv_data_type, kv_format, output_dtype, query_layout,
                  kv_cache_layout, lse_mode, output_scale, scale_mode, skip_softmax, enable_pdl,
                  use_sinks, use_profiler):
    """plan()'s checks of its arguments other than the metadata: FlashInfer 0.7's run contract
    (layouts, LSE mode, output dtype and scale, scale mode), the options fp8mla cannot honour
    (NotImplementedError naming them), the MLA shape and the data types. Raises as plan()
    documents; returns the PlanContract they decide."""
    if query_layout is None:
        query_layout = "split" if legacy_flat else "packed"
    if kv_cache_layout is None:
        kv_cache_layout = "split" if legacy_flat else "packed"
    check_choice("query_layout", query_layout, LAYOUTS)
    check_choice("kv_cache_layout", kv_cache_layout, LAYOUTS)
    check_choice("lse_mode", lse_mode, LSE_MODES)
    check_choice("output_scale", output_scale, OUTPUT_SCALES)
    check_choice("scale_mode", scale_mode, SCALE_MODES)
    if use_profiler:
        raise unsupported("use_profiler", "FlashInfer's intra-kernel profiler is not "
                           "supported")
    if output_scale != "none":
        raise unsupported("output_scale", "FP8 outputs (o_scale) are not supported")
    if scale_mode in ("bmm-scalar", "bmm-tensor"):
        raise unsupported("scale_mode", f"{scale_mode!r} (FlashInfer's trtllm-gen BMM "
                           "scales) is not supported; FP8 caches take kv-per-tensor scales")
    if skip_softmax:
        raise unsupported("skip_softmax", "skip-softmax thresholds are not supported")
    if use_sinks:
        raise unsupported("use_sinks", "attention sinks are not supported")
    if enable_pdl is False:
        raise unsupported("enable_pdl", "fp8mla's CUDA kernels always launch with "
                           "programmatic dependent launch (stream order is kept); False "
                           "cannot be honoured")

    for name, value, low in (("head_dim_ckv", head_dim_ckv, 1), ("head_dim_kpe",
                                                                 head_dim_kpe, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name}: must be an integer >= {low}, got {value!r}")
    if head_dim_ckv != DIM_CKV:
        raise unsupported("head_dim_ckv", f"fp8mla computes MLA with a {DIM_CKV}-wide "
                           f"latent (kv_lora_rank), got {head_dim_ckv}")
    if head_dim_kpe != DIM_KPE:
        raise unsupported("head_dim_kpe", f"fp8mla computes MLA with a {DIM_KPE}-wide rope "
                           f"part (NoPE, 0, is not supported), got {head_dim_kpe}")
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
        raise ValueError(f"page_size: must be a positive int, got {page_size!r}")
    q_dtype = q_dtype_of(q_data_type)
    fmt = kv_format_of(kv_data_type, kv_format)
    out_name = dtype_name(output_dtype) if output_dtype is not None else dtype_name(
        q_data_type)
    if out_name != dtype_name(q_data_type):
        raise ValueError(f"output_dtype: must match q_data_type ({q_data_type}), got "
                         f"{output_dtype}")
    fp8 = fmt == KvFormat.fp8_e4m3
    if fp8 and scale_mode == "default":
        scale_mode = "kv-per-tensor"  # FP8 callers always give ckv / kpe scales at run time
    if not fp8 and scale_mode != "default":
        raise ValueError(f"scale_mode: {scale_mode!r} needs an FP8 (float8_e4m3fn) cache "
                         f"with per-tensor scales; this plan's cache is "
                         f"{_ext.format_name(fmt)}")
    return PlanContract(query_layout, kv_cache_layout, q_dtype, fmt, out_name, scale_mode)


# ---- run() arguments ----

def refuse_other_backends(**values):
    """run()'s parameters only FlashInfer's other backends take: ValueError naming the first one
    given, as its fa2 / fa3 backends refuse them."""
    why = {
        "kv_len": "is only supported with FlashInfer's cutlass backend; fp8mla reads the lengths "
                  "planned by plan()",
        "page_table": "is only supported with FlashInfer's cutlass backend; fp8mla reads the "
                      "pages planned by plan()",
        "o_scale": "(FP8 outputs) is only supported with FlashInfer's cutlass backend",
        "sinks": "attention sinks are not supported",
        "skip_softmax_threshold_scale_factor": "skip-softmax is not supported",
        "bmm1_scale": "BMM scales are not supported",
        "bmm2_scale": "BMM scales are not supported",
        "profiler_buffer": "FlashInfer's profiler is not supported",
    }
    for name, value in values.items():
        if value is not None:
            raise ValueError(f"{name}: {why[name]}")


def structural(value, name, widths, declared):
    """(nope, rope) of a query= / kv_cache= value under the planned layout: a packed value is
    split; a split pair declared "packed" must be two adjacent views (FlashInfer takes it
    zero-copy then, and refuses independent buffers)."""
    packed, pair = parse_structural(value, name)
    if packed is not None:
        return split_last(packed, widths, name)
    left, right = pair
    if declared == "packed" and not adjacent_views(left, right):
        layout = "query_layout" if name == "query" else "kv_cache_layout"
        raise ValueError(f"{name}: the plan declared {layout}='packed' but run() got two "
                         f"independent tensors; re-plan with {layout}='split'")
    return left, right


def run_inputs(query, kv_cache, q_nope, q_pe, ckv_cache, kpe_cache, query_layout,
               kv_cache_layout, *, block_format):
    """run()'s tensors from the 0.7 structural forms (query= / kv_cache=) or the 0.6 ones:
    (q_nope, q_pe, ckv_cache, kpe_cache, legacy), legacy when a 0.6 form was used. The block
    format's kv_cache is its whole 656-byte token (kpe_cache None)."""
    if query is None:
        if (q_nope is None) != (q_pe is None):
            raise ValueError("q_nope / q_pe: both must be provided")
        if q_nope is None:
            raise TypeError("run() requires query= or q_nope and q_pe")
        legacy = True
    else:
        if q_nope is not None or q_pe is not None:
            raise TypeError("query: pass either query= or q_nope / q_pe, not both")
        q_nope, q_pe = structural(query, "query", (DIM_CKV, DIM_KPE), query_layout)
        legacy = False
    if kv_cache is None:
        if ckv_cache is None:
            raise TypeError("run() requires kv_cache= or ckv_cache and kpe_cache")
        if kpe_cache is None and not block_format:
            raise ValueError("kpe_cache: ckv_cache and kpe_cache must both be provided")
        legacy = True
    else:
        if ckv_cache is not None or kpe_cache is not None:
            raise TypeError("kv_cache: pass either kv_cache= or ckv_cache / kpe_cache, not both")
        if block_format:
            ckv_cache, kpe_cache = kv_cache, None
        else:
            ckv_cache, kpe_cache = structural(kv_cache, "kv_cache", (DIM_CKV, DIM_KPE),
                                              kv_cache_layout)
    return q_nope, q_pe, ckv_cache, kpe_cache, legacy


def scale_value(x, name):
    """A finite positive scale from a number or a one-element tensor (ValueError naming it)."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a number or a one-element tensor, got "
                         f"{x!r}") from None
    if not math.isfinite(v) or v <= 0.0:
        raise ValueError(f"{name}: must be a finite positive value, got {x}")
    return v


def run_scales(fmt, ckv_scale, ckv_scale_arr, kpe_scale, k_scale):
    """run()'s (ckv_scale, kpe_scale) as floats: an FP8 cache needs both (as FlashInfer
    requires; fp8mla's k_scale sets both), other formats take none (1.0)."""
    if k_scale is not None:
        ckv_scale = k_scale if ckv_scale is None else ckv_scale
        kpe_scale = k_scale if kpe_scale is None else kpe_scale
    if fmt == KvFormat.fp8_e4m3:
        if (ckv_scale is None) == (ckv_scale_arr is None):
            raise ValueError("ckv_scale: Exactly one of ckv_scale or ckv_scale_arr is "
                             "required when kv_data_type is FP8 (SGLang's unscaled pool: "
                             "ckv_scale=1.0, kpe_scale=1.0)")
        if ckv_scale_arr is not None:
            raise unsupported("ckv_scale_arr", "per-token, per-128-channel scales in a "
                              "separate array are not supported; the fp8_e4m3_block cache "
                              "format (kv_format='fp8_e4m3_block') keeps such scales in "
                              "each token")
        if kpe_scale is None:
            raise ValueError("kpe_scale: required when kv_data_type is FP8")
        return scale_value(ckv_scale, "ckv_scale"), scale_value(kpe_scale, "kpe_scale")
    for name, value in (("ckv_scale", ckv_scale), ("ckv_scale_arr", ckv_scale_arr),
                        ("kpe_scale", kpe_scale)):
        if value is not None:
            raise ValueError(f"{name}: ckv_scale / ckv_scale_arr / kpe_scale are only "
                             f"valid when kv_data_type is FP8 (float8_e4m3fn); this "
                             f"plan's cache is {_ext.format_name(fmt)}")
    return 1.0, 1.0


def deprecated(message):
    """A DeprecationWarning as FlashInfer 0.7 gives for its deprecated forms; not while
    torch.compile traces (Dynamo cannot trace warnings.warn)."""
    torch = torch_module()
    if torch is not None and torch.compiler.is_compiling():
        return
    warnings.warn(message, DeprecationWarning, stacklevel=4)


def warn_positional(method):
    """FlashInfer 0.7 deprecates positional plan() / run() arguments: warn once per wrapper."""

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        if args and not self._warned_positional:
            self._warned_positional = True
            deprecated("Positional MLA arguments are deprecated in FlashInfer 0.7; pass plan() "
                        "and run() arguments by keyword (fp8mla accepts both).")
        return method(self, *args, **kwargs)

    return wrapped
