"""fp8mla sparse plans for an engine's DSA layers (fp8mla.sglang.dsa runs them): each query token
of a batch reads the global slots of its row of top-k indices (-1 skipped), given at run time.

Torch-only (no SGLang import), so the GPU tests run it on its own.
"""

import collections

import torch

from .. import api
from .._registry import register as _register_owner
from .._tensors import is_capturing

# Query tokens one sparse plan covers: a plan holds its placeholder index list (rows x topk int32)
# on the host and the device, so a longer batch (a long prefill chunk) runs in chunks of this many
# tokens, each enough to fill a GPU (1024 tokens x 2048 slots x H heads).
MAX_PLAN_ROWS = 1024
# Plans kept for batches run outside a CUDA graph (the least recently used go first); plans a
# captured graph runs are kept for the backend's life.
RECENT_PLANS = 8


class _SparsePlan:
    """One native sparse plan, registered so the torch op fp8mla::mla_sparse can find it."""

    def __init__(self, plan):
        self.plan = plan
        self.key = _register_owner(self)

    def _run_sparse(self, q_nope, q_pe, ckv, kpe, out, sparse_indices, ckv_scale, kpe_scale,
                    stream):
        api.run(self.plan, q_nope, q_pe, ckv, kpe, out=out, ckv_scale=ckv_scale,
                kpe_scale=kpe_scale, sparse_indices=sparse_indices, stream=stream)

    def run(self, q_nope, q_pe, ckv, kpe, out, slots, ckv_scale=1.0, kpe_scale=1.0):
        from .. import torch_ops

        torch_ops.mla_sparse(self.key, q_nope, q_pe, ckv, kpe, out, slots, float(ckv_scale),
                             float(kpe_scale))


class SparsePlans:
    """fp8mla sparse plans over one pool: query token t of a batch is a request of one query
    whose cache tokens are the slots of row t of the indices passed to run() (read when the
    kernels run). A plan depends on (tokens, heads, topk, sm_scale) only, so it is made once and
    re-used; plans made for a CUDA graph (pin=True) are never dropped."""

    def __init__(self, device, pool_tokens, kv_format, q_dtype, max_rows=MAX_PLAN_ROWS,
                 recent=RECENT_PLANS):
        self.device = torch.device(device)
        self.pool_tokens = int(pool_tokens)
        self.kv_format = kv_format
        self.q_dtype = q_dtype
        self.max_rows = int(max_rows)
        self.recent = int(recent)
        self._pinned = {}
        self._recent = collections.OrderedDict()

    def _chunks(self, rows):
        return [(a, min(rows, a + self.max_rows)) for a in range(0, rows, self.max_rows)]

    def get(self, rows, heads, topk, sm_scale, pin=False, like=None):
        """The plan for `rows` query tokens (<= max_rows), made when missing (never during a
        CUDA graph capture: RuntimeError)."""
        key = (int(rows), int(heads), int(topk), float(sm_scale))
        plan = self._pinned.get(key)
        if plan is not None:
            return plan
        plan = self._recent.pop(key, None)
        if plan is None:
            if like is not None and is_capturing(like):
                raise RuntimeError(
                    f"fp8mla DSA backend: no sparse plan for {rows} query tokens (heads {heads}, "
                    f"topk {topk}) was made before this CUDA graph capture; "
                    "init_forward_metadata_out_graph(in_capture=True) makes it")
            plan = _SparsePlan(api.plan(
                torch.arange(rows + 1, dtype=torch.int32), None, None, None,
                num_heads=heads, page_size=1, num_pages=self.pool_tokens, sm_scale=sm_scale,
                kv_format=self.kv_format, causal=False, topk=topk,
                sparse_indices=torch.full((rows, topk), -1, dtype=torch.int32),
                device=self.device, q_dtype=self.q_dtype, out_dtype=self.q_dtype))
        if pin:
            self._pinned[key] = plan
        else:
            self._recent[key] = plan
            while len(self._recent) > self.recent:
                self._recent.popitem(last=False)
        return plan

    def prepare(self, rows, heads, topk, sm_scale, pin=False):
        """Makes the plans a batch of `rows` query tokens runs (one per chunk)."""
        for a, b in self._chunks(int(rows)):
            self.get(b - a, heads, topk, sm_scale, pin=pin)

    def pinned(self, rows, heads, topk, sm_scale):
        return (int(rows), int(heads), int(topk), float(sm_scale)) in self._pinned

    def run(self, q_nope, q_pe, ckv, kpe, out, slots, sm_scale, **scales):
        rows, heads = int(q_nope.shape[0]), int(q_nope.shape[1])
        topk = int(slots.shape[1])
        for a, b in self._chunks(rows):
            plan = self.get(b - a, heads, topk, sm_scale, like=q_nope)
            plan.run(q_nope[a:b], q_pe[a:b], ckv, kpe, out[a:b], slots[a:b], **scales)


def encode_rows(k, kv_format):
    """Pool rows for latent tokens k [n, 576] as SGLang's DSA writer stores them, on k's device:
    fp8_e4m3_block uint8 [n, 656] (each 128-value group's codes e4m3(x * (1 / scale)) with scale
    = amax / 448, the four float32 scales, the bf16 rope), fp8_e4m3 uint8 [n, 576] (the latent
    cast unscaled), bf16 [n, 576]. decode_rows' inverse, for checks and benchmarks."""
    if kv_format == "bf16":
        return k.to(torch.bfloat16)
    if kv_format == "fp8_e4m3":
        return k.to(torch.float8_e4m3fn).view(torch.uint8)
    if kv_format != "fp8_e4m3_block":
        raise ValueError(f"kv_format: expected fp8_e4m3_block, fp8_e4m3 or bf16, got {kv_format!r}")
    nope = k[:, :512].float().reshape(-1, 4, 128)
    scale = nope.abs().amax(-1) / 448.0
    codes = (nope * (1.0 / scale)[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return torch.cat([codes.view(torch.uint8).reshape(-1, 512), scale.view(torch.uint8),
                      k[:, 512:].to(torch.bfloat16).contiguous().view(torch.uint8)], 1)


def decode_rows(rows, kv_format):
    """float64 [n, 576]: the values that pool rows [n, row bytes] of `kv_format` hold, as the
    sparse plans read them (fp8_e4m3_block: each 128-code group times its float32 scale, exact in
    float64; fp8_e4m3: the codes, unit scale; bf16). A plain reference for checks (tests, the
    DSA step bench), on the host; encode_rows' inverse."""
    rows = rows.cpu()
    if kv_format == "bf16":
        return rows.view(torch.bfloat16).double()
    if kv_format == "fp8_e4m3":
        return rows.view(torch.float8_e4m3fn).double()
    if kv_format != "fp8_e4m3_block":
        raise ValueError(f"kv_format: expected fp8_e4m3_block, fp8_e4m3 or bf16, got {kv_format!r}")
    rows = rows.view(torch.uint8)
    codes = rows[:, :512].contiguous().view(torch.float8_e4m3fn).double().view(-1, 4, 128)
    scale = rows[:, 512:528].contiguous().view(torch.float32).double()
    rope = rows[:, 528:].contiguous().view(torch.bfloat16).double()
    return torch.cat([(codes * scale[..., None]).reshape(-1, 512), rope], 1)
