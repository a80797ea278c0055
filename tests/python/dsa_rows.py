"""The token rows SGLang's DSA KV pool (DSATokenToKVPool) stores, encoded and decoded with torch:
shared by test_sglang_dsa.py (which checks encode_rows against SGLang's own writer, bit for bit)
and test_sparse_plans.py (which needs no SGLang); and interpret_sglang_triton, which runs SGLang's
Triton kernels on CPU tensors for test_sglang_dsa.py.

  fp8_e4m3_block  656 bytes: 512 e4m3 codes, 4 float32 scales (one per 128 codes), 64 bf16 rope
                  values; SGLang's quantizer (quantize_k_cache_separate) picks scale = amax / 448
                  and stores e4m3(x * (1 / scale)), no power of two
  fp8_e4m3        576 e4m3 codes, the latent cast unscaled (SGLang's raw FP8 layout)
  bf16            576 bf16 values

The codecs are the package's (fp8mla.sglang.sparse.encode_rows / decode_rows): decode_rows is
re-exported here, encode_rows wrapped to give host rows.
"""

import torch

from fp8mla.sglang import sparse
from fp8mla.sglang.sparse import decode_rows  # noqa: F401 (re-exported for the tests)


def encode_rows(k, fmt):
    """The rows for latent tokens k (bf16 [n, 576]) on the host: fp8mla.sglang.sparse.encode_rows
    of k's host copy (uint8 [n, 656 | 576] or bf16 [n, 576])."""
    return sparse.encode_rows(k.cpu(), fmt)


def sparse_reference(q, kv, slots, sm_scale):
    """float64 [T, H, 512]: query token t (q [T, H, 576]) over the rows kv[slots[t]] (-1
    skipped), on kv's device; a row that sees nothing is 0."""
    q = q.to(kv.device, torch.float64)
    slots = slots.to(kv.device)
    out = torch.zeros(q.shape[0], q.shape[1], 512, dtype=torch.float64, device=kv.device)
    for t in range(q.shape[0]):
        idx = slots[t][slots[t] >= 0].long()
        if len(idx):
            keys = kv[idx]
            p = torch.softmax(torch.einsum("hd,nd->hn", q[t], keys) * sm_scale, -1)
            out[t] = p @ keys[:, :512]
    return out


# SGLang modules whose Triton kernels the tests run (in Triton's interpreter on the CPU).
TRITON_MODULES = ("sglang.kernels.ops.quantization.dsa_quant_k_cache",
                  "sglang.kernels.ops.kvcache.mla_buffer",
                  "sglang.kernels.ops.attention.dsa.transform_index",
                  "sglang.kernels.ops.attention.pad")


def interpret_sglang_triton(mp):
    """SGLang's Triton kernels in TRITON_MODULES, run by Triton's interpreter (the kernels' code,
    on CPU tensors); the jit helpers they call (tl.max ...) run as Python inside it. The
    interpreter's float32 -> e4m3 conversion drops the carry of a rounded-up mantissa into the
    exponent (124.6 becomes 64, not 128); it gets torch's round-to-nearest-even conversion, what
    the GPU's cvt.rn.satfinite gives for the clamped values SGLang's quantizer converts."""
    import importlib

    import numpy as np
    import triton
    import triton.language as tl
    from triton.runtime import interpreter
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    convert = interpreter._convert_float

    def convert_float(data, src, dst, rounding_mode):
        if src == tl.float32 and dst == tl.float8e4nv:
            x = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
            return x.to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(data.shape)
        return convert(data, src, dst, rounding_mode)

    mp.setattr(interpreter, "_convert_float", convert_float)
    mp.setattr(JITFunction, "__call__", lambda self, *a, **k: self.fn(*a, **k))
    for name in TRITON_MODULES:
        mod = importlib.import_module(name)
        for attr, value in list(vars(mod).items()):
            if isinstance(value, JITFunction):
                mp.setattr(mod, attr, InterpretedFunction(value.fn))
    # seqlens_expand_triton (the verify metadata) asserts CUDA tensors before launching its
    # kernel: the same launch without the asserts.
    import sglang.kernels.ops.attention.pad as pad
    import sglang.srt.layers.attention.dsa_backend as dsa_backend

    def seqlens_expand(extend_seq_lens, seq_lens, total_len, max_q_len):
        n = extend_seq_lens.numel()
        offsets = torch.zeros(n + 1, dtype=torch.int32)
        offsets[1:] = torch.cumsum(extend_seq_lens, dim=0)
        output = torch.empty(total_len, dtype=torch.int32)
        pad.seqlens_expand_kernel[(n,)](extend_seq_lens, seq_lens, offsets, output, n,
                                        BLOCK=triton.next_power_of_2(max_q_len))
        return output

    mp.setattr(dsa_backend, "seqlens_expand_triton", seqlens_expand)
