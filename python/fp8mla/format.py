"""The library's exact scalar and token codecs on host arrays (include/fp8mla/format.h), for tests
and tools: e4m3fn and bf16 values, and whole tokens in each KvFormat's layout."""

from . import _fp8mla as _ext
from ._tensors import as_real, as_str, is_torch, numpy_module, torch_module
from .api import _NAN_POLICIES, DIM_QK, as_format


def _np_in(x, dtype):
    """(numpy, contiguous host array of ``dtype``). Float inputs convert to float32; code and
    bit inputs must already be integers of the right width (no silent float -> int casts)."""
    np = numpy_module()
    if np is None:
        raise RuntimeError("the fp8mla codec helpers need numpy")
    if x is None or isinstance(x, (str, bytes)):
        raise TypeError(f"expected an array or a number, got {type(x).__name__}")
    if is_torch(x):
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
