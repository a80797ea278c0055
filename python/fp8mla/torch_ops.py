"""torch integration: fp8mla's attention as the torch custom op ``fp8mla::mla_decode``.

Importing this module imports torch and registers the op (fp8mla imports it lazily, the first
time a wrapper is run with torch tensors). The op

    torch.ops.fp8mla.mla_decode(plan_key, q_nope, q_pe, ckv_cache, kpe_cache, out, lse,
                                ckv_scale, kpe_scale) -> None

writes ``out`` (bf16 [total_q, H, 512]) and, when given, ``lse`` (float32 [total_q, H], natural
log) for the plan registered under ``plan_key`` (an int, see fp8mla._registry). It launches on
torch's current CUDA stream, allocates nothing and never synchronises, so it may be captured in
a CUDA graph; its fake (meta) implementation lets torch.compile trace through it without a
graph break (the op is opaque to the compiler and mutates only ``out`` and ``lse``).

``torch.ops.fp8mla.mla_sparse(plan_key, q_nope, q_pe, ckv_cache, kpe_cache, out, sparse_indices,
ckv_scale, kpe_scale)`` is its sparse (DSA top-k) form, with the same properties: each query token
reads the global slots of its row of ``sparse_indices`` (int32 [total_q, topk], -1 skipped) when
the op runs (the SGLang plugin's DSA backend, fp8mla.sglang.dsa, runs it).
"""

from typing import Optional

import torch

from ._registry import lookup, register  # noqa: F401  (register: for other owners)
from ._tensors import current_stream


@torch.library.custom_op("fp8mla::mla_decode", mutates_args=("out", "lse"))
def mla_decode(
    plan_key: int,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: Optional[torch.Tensor],
    out: torch.Tensor,
    lse: Optional[torch.Tensor],
    ckv_scale: float,
    kpe_scale: float,
) -> None:
    """MLA attention of the registered plan ``plan_key`` (see the module docstring).

    q_nope bf16 [total_q, H, 512], q_pe bf16 [total_q, H, 64]; ckv_cache / kpe_cache as the
    plan's format stores them (bf16 [P, S, 512] / [P, S, 64]; float8_e4m3fn or uint8 for
    fp8_e4m3; uint8 [P, S, 656] and kpe None for fp8_e4m3_block); out bf16 [total_q, H, 512];
    lse float32 [total_q, H] or None. Raises ValueError for tensors that do not match the plan.
    """
    lookup(plan_key)._run_native(
        q_nope, q_pe, ckv_cache, kpe_cache, out, lse, ckv_scale, kpe_scale, current_stream(q_nope)
    )


@mla_decode.register_fake
def _mla_decode_fake(
    plan_key, q_nope, q_pe, ckv_cache, kpe_cache, out, lse, ckv_scale, kpe_scale
):
    return None


@torch.library.custom_op("fp8mla::mla_sparse", mutates_args=("out",))
def mla_sparse(
    plan_key: int,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: Optional[torch.Tensor],
    out: torch.Tensor,
    sparse_indices: torch.Tensor,
    ckv_scale: float,
    kpe_scale: float,
) -> None:
    """Sparse (DSA top-k) attention of the registered sparse plan ``plan_key``: query token t
    attends to the global slots sparse_indices[t] (int32 [total_q, topk], -1 skipped), read when
    the op runs (so a CUDA graph replays on the indices rewritten in place). Tensors as for
    mla_decode; out bf16 [total_q, H, 512]. Raises ValueError for tensors that do not match the
    plan."""
    lookup(plan_key)._run_sparse(
        q_nope, q_pe, ckv_cache, kpe_cache, out, sparse_indices, ckv_scale, kpe_scale,
        current_stream(q_nope)
    )


@mla_sparse.register_fake
def _mla_sparse_fake(
    plan_key, q_nope, q_pe, ckv_cache, kpe_cache, out, sparse_indices, ckv_scale, kpe_scale
):
    return None
