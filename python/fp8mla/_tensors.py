"""Framework helpers shared by the fp8mla Python layer.

fp8mla takes numpy arrays (CPU backend), torch tensors (CPU or CUDA) and anything else that
speaks DLPack. Neither numpy nor torch is imported here unless the caller already did: a torch
tensor can only exist once torch is imported, so ``sys.modules`` tells which framework an
argument belongs to.
"""

import array
import operator
import sys

LOG2E = 1.4426950408889634  # log2(e): FlashInfer's LSE is base 2 (lse2 = lse_e * LOG2E)


def torch_module():
    """The torch module if it is already imported, else None (never imports it)."""
    return sys.modules.get("torch")


def numpy_module():
    """The numpy module, imported on demand; None when numpy is not installed."""
    np = sys.modules.get("numpy")
    if np is None:
        try:
            import numpy as np
        except ImportError:
            return None
    return np


def is_torch(x):
    """True when ``x`` is a torch.Tensor."""
    torch = torch_module()
    return torch is not None and isinstance(x, torch.Tensor)


def is_numpy(x):
    """True when ``x`` is a numpy.ndarray."""
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, np.ndarray)


def for_ext(x):
    """Returns ``x`` in a form the native module imports without copying.

    torch tensors become a DLPack capsule made without stream synchronisation (so the call is
    safe inside CUDA-graph capture on any stream); float8_e4m3fn tensors are viewed as uint8.
    numpy arrays of ml_dtypes' bfloat16 / float8_e4m3fn are viewed as uint16 / uint8 bits.
    Anything else (numpy, cupy, None, ...) is passed as it is.
    """
    if x is None:
        return None
    torch = torch_module()
    if torch is not None and isinstance(x, torch.Tensor):
        if x.dtype == torch.float8_e4m3fn:
            x = x.view(torch.uint8)
        return torch.utils.dlpack.to_dlpack(x.detach())
    if is_numpy(x):
        name = x.dtype.name
        if name == "bfloat16":
            return x.view("uint16")
        if name == "float8_e4m3fn":
            return x.view("uint8")
    return x


def device_of(x):
    """(kind, index) of an array: ("cpu", 0) or ("cuda", i). None counts as the CPU."""
    if x is None or is_numpy(x):
        return ("cpu", 0)
    if is_torch(x):
        if x.device.type == "cuda":
            return ("cuda", x.device.index if x.device.index is not None else 0)
        if x.device.type == "cpu":
            return ("cpu", 0)
        raise ValueError(f"tensor on device {x.device} is not supported (CPU or CUDA only)")
    dev = getattr(x, "__dlpack_device__", None)
    if dev is not None:
        kind, index = dev()
        if int(kind) in (1, 3):  # kDLCPU, kDLCUDAHost
            return ("cpu", 0)
        if int(kind) in (2, 13):  # kDLCUDA, kDLCUDAManaged
            return ("cuda", int(index))
        raise ValueError(f"DLPack device type {int(kind)} is not supported (CPU or CUDA only)")
    return ("cpu", 0)


def parse_device(device):
    """Normalises "cpu", "cuda", "cuda:1", a torch.device or an int (CUDA index)."""
    if device is None:
        return ("cpu", 0)
    if isinstance(device, tuple):
        return (str(device[0]), as_int(device[1], "device index", 0))
    if isinstance(device, int) and not isinstance(device, bool):
        return ("cuda", device)
    torch = torch_module()
    if torch is not None and isinstance(device, torch.device):
        return (device.type, device.index if device.index is not None else 0)
    text = str(device)
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
        raise ValueError(f'device: expected "cpu", "cuda" or "cuda:N", got {device!r}')
    return (kind, int(index) if index else 0)


_raw_stream_getter = None


def raw_stream(index):
    """torch's current cudaStream_t (as int) on CUDA device ``index``.

    torch._C._cuda_getCurrentRawStream (the call torch's own generated code makes) costs 0.7-0.9
    us where torch.cuda.current_stream(index).cuda_stream, which builds a Stream object, costs
    2.2-3.7 us (bench/replan_host.py on H100 hosts): once a re-plan or an eager run. The public
    form is the fallback.
    """
    global _raw_stream_getter
    torch = torch_module()
    if _raw_stream_getter is None:
        get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _raw_stream_getter = get if callable(get) else (
            lambda i: torch.cuda.current_stream(i).cuda_stream)
    return int(_raw_stream_getter(index))


def current_stream(x):
    """The cudaStream_t (as int) torch would launch on for tensor ``x``; 0 elsewhere."""
    if is_torch(x) and x.is_cuda:
        return raw_stream(x.get_device())
    return 0


def is_capturing(x):
    """True while torch is capturing a CUDA graph on the current stream of ``x``'s device."""
    if is_torch(x) and x.is_cuda:
        return bool(torch_module().cuda.is_current_stream_capturing())
    return False


def _int_range_check(lo, hi, name):
    if lo < -(2**31) or hi >= 2**31:
        raise ValueError(f"{name}: values [{lo}, {hi}] do not fit in int32")


def _torch_i32(x, name, ndim, device):
    """A fresh, contiguous int32 copy on ``device`` of integer tensor ``x`` of ``ndim``
    dimensions (ValueError names ``name``: dtype, shape, values beyond int32)."""
    torch = torch_module()
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise ValueError(f"{name}: expected an integer tensor, got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimension(s), got shape {tuple(x.shape)}")
    t = x.detach().to(device=device)
    if t.dtype != torch.int32 and t.numel():
        _int_range_check(int(t.min()), int(t.max()), name)
    return t.to(dtype=torch.int32, copy=True).contiguous()


def host_i32_address(x):
    """(address, entries) of a contiguous 1-D int32 CPU torch tensor (an engine's host index
    array), else None: what replan_step() hands the native module to copy from, without a
    Python copy or a DLPack import. Reads only the cheapest attributes."""
    torch = sys.modules.get("torch")
    if (torch is None or type(x) is not torch.Tensor or x.dtype is not torch.int32
            or not x.is_cpu or x.ndim != 1 or x.layout is not torch.strided
            or not x.is_contiguous()):
        return None
    return x.data_ptr(), x.numel()


def host_i32(x, name, ndim=1):
    """A fresh, contiguous host int32 copy of an index array (ValueError names ``name``).

    Accepts numpy arrays, torch tensors (copied from the GPU when needed: a sync, as in
    FlashInfer's plan()), other DLPack arrays on the host, and Python sequences. Returns a numpy
    array when numpy is installed; otherwise a CPU torch tensor or an ``array.array('i')``.
    The copy keeps plan() independent of later writes to the caller's buffers.
    """
    if x is None:
        return None
    np = sys.modules.get("numpy")
    if np is not None and type(x) is np.ndarray and x.dtype == np.int32 and x.ndim == ndim:
        return x.copy()  # the plan path's common case: already a host int32 array
    torch = sys.modules.get("torch")
    # Engines' host index tensors (replan_step's every call): one copy, no range check needed,
    # and only the cheapest attribute reads (each torch property costs a few hundred ns).
    if (torch is not None and type(x) is torch.Tensor and x.dtype is torch.int32 and x.is_cpu
            and x.ndim == ndim):
        return x.numpy().copy() if (np or numpy_module()) is not None else x.clone()
    if torch is not None and isinstance(x, torch.Tensor):
        t = _torch_i32(x, name, ndim, "cpu")
        np = numpy_module()
        return t.numpy() if np is not None else t
    if isinstance(x, (str, bytes, dict, set)) or not (
            hasattr(x, "__len__") or hasattr(x, "__array__") or hasattr(x, "__dlpack__")):
        raise TypeError(f"{name}: expected an index array (numpy, torch, a sequence of ints), "
                        f"got {type(x).__name__}")
    np = numpy_module()
    if np is None:
        if ndim != 1:
            raise ValueError(f"{name}: a {ndim}-D index array needs numpy or torch")
        try:
            return array.array("i", [int(v) for v in x])
        except (OverflowError, TypeError) as e:
            raise ValueError(f"{name}: {e}") from None
    if not is_numpy(x) and hasattr(x, "get") and type(x).__module__.startswith("cupy"):
        x = x.get()  # cupy -> numpy (device to host copy)
    a = np.asarray(x)
    if a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimension(s), got shape {a.shape}")
    if a.size == 0:
        return np.zeros(a.shape, dtype=np.int32)
    if a.dtype.kind not in "iu":
        raise ValueError(f"{name}: expected an integer array, got dtype {a.dtype}")
    if a.dtype != np.int32:
        _int_range_check(int(a.min()), int(a.max()), name)
    return np.array(a, dtype=np.int32, order="C", copy=True)


def page_table(x, device):
    """kv_indices for a plan on ``device`` ((kind, index)): a torch tensor already on that CUDA
    device stays there as a contiguous int32 copy (fp8mla::Problem::device_kv_indices: the plan
    checks and copies it on the GPU, saving the host round trip of the largest index array);
    anything else becomes a host int32 copy (host_i32).

    torch's current stream is synchronised first: plan() reads the table on the legacy default
    stream, which a kernel still writing it on another stream would race.
    """
    torch = torch_module()
    kind, index = device
    if (torch is None or not isinstance(x, torch.Tensor) or not x.is_cuda or kind != "cuda"
            or x.device.index != index):
        return host_i32(x, "kv_indices")
    # A copy, as host_i32 makes: the wrapper keeps it for a later re-plan, and the caller may
    # rewrite its buffer meanwhile.
    t = _torch_i32(x, "kv_indices", 1, x.device)
    torch.cuda.current_stream(x.device).synchronize()
    return t


def length(a):
    """Number of entries of a 1-D host index array (numpy, torch or array.array)."""
    return len(a)


def max_value(a):
    """Largest entry of a non-empty index array (host, or a CUDA tensor: a sync)."""
    if is_torch(a):
        return int(a.max())
    if is_numpy(a):
        return int(a.max())
    return max(a)


def empty(like, shape, dtype):
    """An uninitialised array of ``shape`` in the framework and on the device of ``like``.

    ``dtype``: "bf16" (torch.bfloat16; numpy: ``like``'s dtype when it is a 2-byte bf16 carrier,
    else uint16 bits), "f16" (torch.float16 / numpy.float16) or "f32".
    """
    shape = tuple(int(s) for s in shape)
    torch = torch_module()
    if torch is not None and isinstance(like, torch.Tensor):
        tdt = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[dtype]
        return torch.empty(shape, dtype=tdt, device=like.device)
    np = numpy_module()
    if np is None:
        raise RuntimeError("allocating an output needs numpy (or pass torch tensors)")
    if dtype == "bf16":
        carrier = is_numpy(like) and like.dtype.name in ("uint16", "bfloat16")
        return np.empty(shape, dtype=like.dtype if carrier else np.uint16)
    return np.empty(shape, dtype=np.float16 if dtype == "f16" else np.float32)


def to_log2_inplace(lse):
    """lse (natural log) -> base 2, in place; -inf stays -inf."""
    if is_torch(lse):
        lse.mul_(LOG2E)
    else:
        np = numpy_module()
        np.multiply(lse, np.float32(LOG2E), out=lse)
    return lse


INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def _is_bool(x):
    """True for Python's and numpy's booleans (numpy.bool_ is no int subclass)."""
    np = sys.modules.get("numpy")
    return isinstance(x, bool) or (np is not None and isinstance(x, np.bool_))


def as_int(x, name, lo=INT32_MIN, hi=INT32_MAX):
    """``x`` as a Python int in [lo, hi] (default: int32): TypeError naming ``name`` unless it is
    an integer (int, numpy integer, anything with __index__; not bool, float or str: 2.9 is not
    truncated to 2), ValueError when it is outside [lo, hi] (no silent wrap to 32 bits)."""
    if _is_bool(x):
        raise TypeError(f"{name}: expected an integer, got {type(x).__name__} {x!r}")
    try:
        v = operator.index(x)
    except TypeError:
        raise TypeError(f"{name}: expected an integer, got {type(x).__name__} {x!r}") from None
    if v < lo or v > hi:
        raise ValueError(f"{name}: {v} is outside [{lo}, {hi}]")
    return v


def as_real(x, name):
    """``x`` as a Python float: TypeError naming ``name`` unless it is a real number (int, float,
    numpy scalar, a one-element tensor; not bool or str). Range checks are the library's."""
    if isinstance(x, (str, bytes)) or x is None or _is_bool(x):
        raise TypeError(f"{name}: expected a number, got {type(x).__name__} {x!r}")
    try:
        return float(x)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a number, got {type(x).__name__} {x!r}") from None


def as_flag(x, name):
    """``x`` as a bool: True / False (Python or numpy) or the integers 0 and 1; TypeError naming
    ``name`` otherwise (the string "False" must not read as True)."""
    if _is_bool(x):
        return bool(x)
    try:
        v = operator.index(x)
    except TypeError:
        raise TypeError(f"{name}: expected a bool, got {type(x).__name__} {x!r}") from None
    if v not in (0, 1):
        raise ValueError(f"{name}: expected a bool (or 0 / 1), got {v}")
    return bool(v)


def as_str(x, name, choices):
    """``x`` when it is one of the strings ``choices``: TypeError for a non-string, ValueError
    for another string (both naming ``name``)."""
    if not isinstance(x, str):
        raise TypeError(f"{name}: expected a string, got {type(x).__name__} {x!r}")
    if x not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(repr(c) for c in choices)}, got {x!r}")
    return x


def squeeze_head_dim(x):
    """[pages, page_size, 1, D] (SGLang's pool with its head dim of 1) -> [pages, page_size, D]."""
    if x is not None and getattr(x, "ndim", 0) == 4 and x.shape[2] == 1:
        return x[:, :, 0]
    return x


def require_array(x, name, ndim=None):
    """TypeError naming ``name`` unless ``x`` is an array (has .shape and, given ``ndim``,
    that many dimensions: a ValueError otherwise)."""
    if not hasattr(x, "shape"):
        raise TypeError(f"{name}: expected an array or tensor with DLPack support (numpy, torch, "
                        f"cupy), got {type(x).__name__}")
    if ndim is not None and len(x.shape) != ndim:
        raise ValueError(f"{name}.ndim: expected {ndim} dimensions, got shape {tuple(x.shape)}")
    return x


def same_buffer(a, b):
    """True when a and b are the same elements of one buffer (a copy between them is a no-op)."""
    if a is b:
        return True
    if is_torch(a) and is_torch(b):
        return (a.data_ptr() == b.data_ptr() and a.numel() == b.numel() and a.dtype == b.dtype
                and (a.numel() <= 1 or a.stride() == b.stride()))
    if is_numpy(a) and is_numpy(b):
        return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
                and a.shape == b.shape and a.strides == b.strides)
    return False


def copy_into(dst, src, name):
    """dst[:len(src)] = src, stream-ordered for torch (non_blocking), as FlashInfer's graph plan
    fills the constructor's buffers."""
    n = length(src)
    if length(dst) < n:
        raise ValueError(f"{name}: the CUDA graph buffer given to the constructor holds "
                         f"{length(dst)} entries, fewer than the {n} planned")
    # The plan path's common case (every graph-mode plan() fills three buffers): a host int32
    # numpy array (host_i32's copy) into a torch buffer, by torch.from_numpy (no conversion)
    # and without the generic checks below, which cost more than the copy.
    np, torch = sys.modules.get("numpy"), sys.modules.get("torch")
    if (np is not None and torch is not None and type(src) is np.ndarray
            and type(dst) is torch.Tensor and src.flags.writeable):  # from_numpy warns else
        source, target = torch.from_numpy(src), dst[:n]
        if target.data_ptr() != source.data_ptr():
            target.copy_(source, non_blocking=True)
        return
    target = dst[:n]
    if same_buffer(target, src):
        return
    if is_torch(dst):
        torch = torch_module()
        source = src if is_torch(src) else torch.as_tensor(src)
        target.copy_(source, non_blocking=True)
    else:
        target[...] = src
