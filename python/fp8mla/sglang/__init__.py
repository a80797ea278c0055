"""SGLang plugin: the ``fp8mla`` attention backend for MLA models (DeepSeek-V3/R1, Kimi K2, GLM-5).

``pip install fp8mla`` registers :func:`register` in SGLang's general plugin group
(``sglang.srt.plugins``, entry point ``fp8mla``); SGLang calls it in every process before it
parses the server arguments. It admits ``--attention-backend fp8mla`` (SGLang's own
``add_attention_backend_choices`` hook, so argument parsing accepts the name) and registers the
backend's factory in SGLang's attention registry. Nothing is imported from SGLang until SGLang
loads the plugin; without SGLang this package imports nothing.

    python -m sglang.launch_server --model-path deepseek-ai/DeepSeek-V3 \\
        --kv-cache-dtype fp8_e4m3 --attention-backend fp8mla

What runs where (docs/integrations/sglang.md): decode, target-verify and extend-with-prefix read
the FP8 (or bf16) pool natively through fp8mla's kernels, under CUDA-graph capture and replay;
extend without a prefix (the non-absorbed ragged prefill) runs FlashInfer's ragged prefill, as
SGLang's flashinfer MLA backend does (torch's SDPA where FlashInfer is not installed). DSA models
(DeepSeek-V3.2, GLM-5) get fp8mla.sglang.dsa.Fp8MlaDsaBackend: SGLang's DSA backend with its
sparse core attention (decode, verify, sparse extend over the indexer's top-k) on fp8mla.
"""

BACKEND_NAME = "fp8mla"


def register():
    """SGLang's plugin entry point: admits and registers the ``fp8mla`` attention backend."""
    from sglang.srt.arg_groups.choices import (
        ATTENTION_BACKEND_CHOICES,
        add_attention_backend_choices,
    )
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    if BACKEND_NAME not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND_NAME)(create_backend)


def create_backend(model_runner):
    """The factory SGLang's attention registry calls (model_runner: SGLang's ModelRunner)."""
    if not getattr(model_runner, "use_mla_backend", False):
        raise ValueError("--attention-backend fp8mla serves MLA models only (DeepSeek-V2/V3/R1, "
                         "Kimi K2, GLM-5 ...); this model is not one")
    if is_dsa_model(model_runner):
        from .dsa import Fp8MlaDsaBackend

        return Fp8MlaDsaBackend(model_runner)
    from .backend import Fp8MlaAttnBackend

    return Fp8MlaAttnBackend(model_runner)


def is_dsa_model(model_runner):
    """Whether the model attends with DSA (DeepSeek sparse attention: its indexer's top-k)."""
    hf_config = getattr(model_runner.model_config, "hf_config", None)
    if hf_config is None:
        return False
    from sglang.srt.configs.model_config import is_deepseek_dsa

    return bool(is_deepseek_dsa(hf_config))
