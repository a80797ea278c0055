"""fp8mla: MLA (Multi-head Latent Attention) decode over a paged FP8 latent KV cache.

High level (FlashInfer-compatible, flashinfer-python 0.6.18 and 0.7.4 call forms):
    BatchMLAPagedAttentionWrapper   plan() once per batch, run() per layer (LSE base 2)
    MLAPlanMetadata                 0.7's plan(metadata=...) form
    fp8mla.mla                      mirrors flashinfer.mla (from fp8mla.mla import ...)

Low level (one to one with the C++ API, LSE natural log):
    plan, replan, run, merge_states, PagedLatentCache, append_kv
    context parallelism over NCCL: nccl_unique_id, NcclComm, plan_context_parallel,
    replan_context_parallel, run_context_parallel
    KvFormat, token_bytes, cuda_available, version
    codecs: fp8_e4m3_encode/decode, bf16_encode/decode, encode_token(s)/decode_token(s)

Arrays: numpy (CPU backend) or torch/cupy tensors (CPU or CUDA) through DLPack. bf16 data may
be torch.bfloat16, ml_dtypes.bfloat16 or uint16 bits; FP8 data torch.float8_e4m3fn or uint8.
Bad input raises ValueError naming the argument; other failures raise RuntimeError. torch is
optional and imported only when torch tensors are passed (fp8mla.torch_ops registers the
custom op fp8mla::mla_decode).
"""

from .api import (
    DIM_CKV,
    DIM_KPE,
    DIM_QK,
    MAX_HEADS,
    MAX_PAGE_SIZE,
    KvFormat,
    Plan,
    as_format,
    cuda_available,
    merge_states,
    plan,
    replan,
    run,
    token_bytes,
    version,
)
from .cache import PagedLatentCache, append_kv
from .context_parallel import (
    ContextParallelPlan,
    NcclComm,
    nccl_unique_id,
    plan_context_parallel,
    replan_context_parallel,
    run_context_parallel,
)
from .format import (
    bf16_decode,
    bf16_encode,
    decode_token,
    decode_tokens,
    encode_token,
    encode_tokens,
    fp8_e4m3_decode,
    fp8_e4m3_encode,
)
from . import mla
from ._flashinfer_args import MLAPlanMetadata
from .wrapper import BatchMLAPagedAttentionWrapper

__version__ = version()

__all__ = [
    "BatchMLAPagedAttentionWrapper",
    "ContextParallelPlan",
    "DIM_CKV",
    "DIM_KPE",
    "DIM_QK",
    "KvFormat",
    "MAX_HEADS",
    "MLAPlanMetadata",
    "MAX_PAGE_SIZE",
    "NcclComm",
    "PagedLatentCache",
    "Plan",
    "append_kv",
    "as_format",
    "bf16_decode",
    "bf16_encode",
    "cuda_available",
    "decode_token",
    "decode_tokens",
    "encode_token",
    "encode_tokens",
    "fp8_e4m3_decode",
    "fp8_e4m3_encode",
    "merge_states",
    "nccl_unique_id",
    "plan",
    "plan_context_parallel",
    "replan",
    "replan_context_parallel",
    "run",
    "run_context_parallel",
    "token_bytes",
    "version",
]
