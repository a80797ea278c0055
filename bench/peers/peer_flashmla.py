"""FlashMLA's sparse FP8 decode kernel (DeepSeek V3.2's DSA decode) as a peer: the prebuilt
FlashMLA that vLLM ships (its stable-ABI _flashmla_C extension and FlashMLA's Python interface,
carried as the package flashmla_vllm by scripts/device/carry_flashmla.sh), called as vLLM's
FLASHMLA_SPARSE backend calls it on a decode batch.

It reads the 656-byte block-scaled pool (inputs.block_pool: 512 e4m3 codes, 4 float32 scales,
64 bf16 rope values a token) as k_cache uint8 [pool / 64, 64, 1, 656] (pages of 64 tokens, the
only page size its kernel takes; a slot is the same global token id either way), each query
token a request of one query token: q bf16 [bs, 1, heads, 576], indices int32 [bs, 1, topk] (the
case's rows, -1 entries in place), out bf16 [bs, 1, heads, 512].

Its kernel takes 64 or 128 query heads; fewer are padded to 64 (vLLM's and SGLang's rule): zero
query rows for the padding heads, the kernel writing its own [bs, 1, 64, 512] output, whose
real heads publish() copies into inputs.out after the check's call. Engines pad and slice in
every call; here the padded query is built once in prepare() and the copy is outside the timed
calls, so the time is the kernel's alone (the row notes the padding).

Dense cases are not run: this FlashMLA's dense decode takes a cache of the query's dtype (bf16);
its FP8 656-byte cache is read by the sparse kernel only.

Each timed call has its own FlashMLASchedMeta (FlashMLA fills it on its first call and checks
every later call has the same shapes); the check's call and peers_timing's warm-up fill them
all before the CUDA-graph capture.
"""

import os

import peers_cases as pc

PAGE = 64  # FlashMLA's sparse FP8 decode: "Currently page_block_size must be 64"


def load():
    """(module, description); raises ImportError (flashmla_vllm not on PYTHONPATH, or its
    extension failing to load) or RuntimeError (no CUDA device) with the reason."""
    import flashmla_vllm
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is visible (FlashMLA's kernels are CUDA only)")
    for name in ("get_mla_metadata", "flash_mla_with_kvcache"):
        getattr(flashmla_vllm, name)  # AttributeError names what the carried package lacks
    where = os.path.dirname(os.path.abspath(flashmla_vllm.__file__))
    origin = ""
    try:
        with open(os.path.join(os.path.dirname(where), "CARRY.txt")) as f:
            origin = f.readline().strip()
    except OSError:
        pass
    return flashmla_vllm, f"FlashMLA sparse FP8 decode ({where}{'; ' + origin if origin else ''})"


def padded_heads(heads):
    """The query heads FlashMLA's sparse FP8 decode runs: 64 up to 64 heads, else 128."""
    if heads > 128:
        raise ValueError(f"num_heads {heads}: FlashMLA's sparse FP8 decode takes at most 128")
    return 64 if heads <= 64 else 128


class FlashmlaPeer:
    name = "flashmla"
    pool = "block"  # the pool it reads: CaseInputs.reference(pool=...) and bytes_for(...)

    def __init__(self, module):
        self.flashmla = module
        self.note = None  # "padded to N heads" when the last prepare() padded
        self._padded_out = None

    def prepare(self, inputs):
        c = inputs.case
        if c.kind != "sparse":
            raise NotImplementedError(
                "dense cases: this FlashMLA's dense decode takes a bf16 cache (the query's "
                "dtype); its FP8 656-byte cache is read by the sparse kernel only")
        block_pool = inputs.require_block_pool()
        torch = inputs.torch
        tokens = block_pool.shape[0]
        if tokens % PAGE:
            raise ValueError(f"block pool of {tokens} tokens is not a whole number of "
                             f"{PAGE}-token pages")
        k_cache = block_pool.view(tokens // PAGE, PAGE, 1, pc.BLOCK_TOKEN_BYTES)
        bs, heads = c.bs, c.heads
        hp = padded_heads(heads)
        if hp == heads:
            q = inputs.q.view(bs, 1, heads, 576)
            out = inputs.out.view(bs, 1, heads, 512)
            self._padded_out, self.note = None, None
        else:
            q = torch.zeros((bs, 1, hp, 576), dtype=torch.bfloat16, device=inputs.device)
            q[:, 0, :heads] = inputs.q
            # NaN until the kernel writes it, so the check sees rows it forgot.
            out = torch.full((bs, 1, hp, 512), float("nan"), dtype=torch.bfloat16,
                             device=inputs.device)
            self._padded_out, self.note = out, f"padded to {hp} heads"
        metas = [self.flashmla.get_mla_metadata()[0] for _ in inputs.rows_dev]

        def call(cache, meta, indices):  # vLLM's FLASHMLA_SPARSE decode call
            self.flashmla.flash_mla_with_kvcache(
                q, cache, None, None, 512, meta, None, softmax_scale=inputs.sm_scale,
                is_fp8_kvcache=True, indices=indices, out=out)

        k_cache = self._cache_dtype(call, k_cache, metas[0],
                                    inputs.rows_dev[0].view(bs, 1, c.ctx))
        runs = []
        for rows, meta in zip(inputs.rows_dev, metas):

            def run(meta=meta, indices=rows.view(bs, 1, c.ctx)):
                call(k_cache, meta, indices)

            runs.append(run)
        return runs

    @staticmethod
    def _cache_dtype(call, k_cache, meta, indices):
        """The cache as the kernel takes it: FlashMLA's quantizer stores the 656-byte tokens as
        uint8, some callers view them as float8_e4m3fn; one trial call(cache, meta, indices)
        (which also fills the first call's metadata) picks the one this build accepts."""
        import torch

        try:
            call(k_cache, meta, indices)
            return k_cache
        except (RuntimeError, AssertionError) as first:
            view = k_cache.view(torch.float8_e4m3fn)
            try:
                call(view, meta, indices)
            except (RuntimeError, AssertionError):
                raise first from None
            return view

    def publish(self, inputs):
        """Copies the real heads of the padded output into inputs.out (after the check's call;
        not part of the timed calls). Nothing to do when the kernel wrote inputs.out itself."""
        if self._padded_out is not None:
            inputs.out.copy_(self._padded_out[:, 0, :inputs.case.heads])
