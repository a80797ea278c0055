"""``fp8mla.mla`` mirrors ``flashinfer.mla`` for code that imports from the module:

    from fp8mla.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

takes the place of ``from flashinfer.mla import ...`` (flashinfer-python 0.6.18 and 0.7.4 call
forms; docs/python.md lists the differences). flashinfer.mla's other entry points (the
trtllm-gen, XQA, CuTe DSL and sparse SM120 kernels, ...) are FlashInfer's own kernels: asking this
module for one raises AttributeError naming it.
"""

from ._flashinfer_args import MLAPlanMetadata
from .wrapper import BatchMLAPagedAttentionWrapper

__all__ = ["BatchMLAPagedAttentionWrapper", "MLAPlanMetadata"]


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(
        f"module 'fp8mla.mla' has no attribute {name!r}: fp8mla provides flashinfer.mla's "
        f"BatchMLAPagedAttentionWrapper and MLAPlanMetadata only ({name} is a FlashInfer kernel)")
