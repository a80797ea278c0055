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
