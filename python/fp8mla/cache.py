"""The paged latent KV cache fp8mla owns (include/fp8mla/cache.h): pages handed out and released,
quantizing appends, and views of its bytes as run() and the wrapper take them."""

from . import _fp8mla as _ext
from ._tensors import (
    as_int,
    as_real,
    as_str,
    for_ext,
    host_i32,
    is_torch,
    numpy_module,
    parse_device,
    torch_module,
)
from .api import _NAN_POLICIES, DIM_CKV, KvFormat, _stream, as_format


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
        is_t = is_torch(st)
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
