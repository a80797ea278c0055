"""Which attention form SGLang's DeepSeek-family models (deepseek_v2 and its users: DeepSeek-V3 /
R1, Kimi K2, GLM-5) run under ``--attention-backend fp8mla``.

SGLang asks a per-backend handler (models/deepseek_common/attention_backend_handler.py) for the
forward method of each batch; an unregistered name falls back to triton's. fp8mla registers its
own: the absorbed form (MLA: fp8mla's kernels over the latent pool) for decode, target verify,
extend with a prefix and captured prefill, and the non-absorbed form (MHA: the ragged prefill
over the new tokens) for extend batches without a prefix, as SGLang's flashinfer backend routes
them. DSA layers (DeepSeek-V3.2, GLM-5) follow SGLang's own DSA dispatch: dense MHA where the
DSA backend chose it for the batch, else the absorbed sparse MLA. The handler is registered when
the backend is made (the model code is imported by then).
"""

from . import BACKEND_NAME


def handle_attention_fp8mla(attn, forward_batch):
    """The forward method for one batch (SGLang's handler signature)."""
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import (
        is_in_breakable_cuda_graph,
    )
    from sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph import (
        is_in_tc_piecewise_cuda_graph,
    )
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        _dispatch_mla_subtype,
    )
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    if getattr(attn, "use_dsa", False):
        # DSA layers: SGLang's DSA dispatch (dense MHA where its backend chose use_mha, else the
        # absorbed sparse MLA fp8mla serves).
        from sglang.srt.models.deepseek_common.attention_backend_handler import (
            handle_attention_dsa,
        )

        return handle_attention_dsa(attn, forward_batch)
    if is_in_tc_piecewise_cuda_graph() or is_in_breakable_cuda_graph():
        return AttnForwardMethod.MLA
    prefix = forward_batch.extend_prefix_lens_cpu
    if forward_batch.forward_mode.is_extend_without_speculative() and (
            prefix is None or sum(prefix) == 0):
        return AttnForwardMethod.MHA
    return _dispatch_mla_subtype(attn, forward_batch)


def register_model_routing():
    """Registers the handler with SGLang's DeepSeek attention dispatch (idempotent)."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
    )

    AttentionBackendRegistry.register(BACKEND_NAME, handle_attention_fp8mla)
