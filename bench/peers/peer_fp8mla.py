"""fp8mla as a peer, in two cache formats: "fp8mla" reads the 576-byte e4m3 pool (per-tensor
scales), "fp8mla_block" the 656-byte block-scaled pool (kv_format "fp8_e4m3_block", FlashMLA's
layout). Dense cases: its FlashInfer-style wrapper (one wrapper a timed call, as each call has
its own page table). Sparse cases: its sparse mode (fp8mla.plan(..., topk, sparse_indices), -1
entries in place; one plan, the call's indices passed to run()).

prepare(inputs) returns one callable a timed call; each launches that call's attention on
torch's current stream into inputs.out. Works on any device fp8mla serves (the CPU backend with
CPU tensors: the CPU smoke test runs it there).
"""


def load():
    """(module, description); raises ImportError (with the reason) when fp8mla is missing."""
    import fp8mla

    where = getattr(fp8mla, "__file__", "?")
    return fp8mla, f"fp8mla {fp8mla.version()} ({where}; cuda_available {fp8mla.cuda_available()})"


class Fp8mlaPeer:
    name = "fp8mla"
    pool = "fp8"  # the pool it reads: CaseInputs.reference(pool=...) and bytes_for(...)
    kv_format = "fp8_e4m3"

    def __init__(self, module):
        self.fp8mla = module
        self.kernel_name = None  # the kernel family the last prepare()'s plans launch

    def _note_kernel(self, plan):
        self.kernel_name = getattr(plan, "kernel_name", None)

    def prepare(self, inputs):
        if inputs.case.kind == "dense":
            return self._dense(inputs)
        return self._sparse(inputs)

    def _dense(self, inp):
        torch = inp.torch
        c = inp.case
        qo_indptr = torch.arange(c.bs + 1, dtype=torch.int32)
        kv_indptr = torch.from_numpy(inp.kv_indptr)
        kv_len = torch.from_numpy(inp.kv_len)
        workspace = torch.empty(1, dtype=torch.uint8, device=inp.device)  # its device only
        runs = []
        for table in inp.tables_dev:
            w = self.fp8mla.BatchMLAPagedAttentionWrapper(workspace, num_pages=inp.pool_pages)
            w.plan(qo_indptr, kv_indptr, table, kv_len, c.heads, 512, 64, c.page, False,
                   inp.sm_scale, torch.bfloat16, torch.float8_e4m3fn,
                   **self._wrapper_format())
            self._note_kernel(w.plan_info)

            def run(w=w):
                w.run(inp.q_nope, inp.q_pe, *self._caches(inp), out=inp.out,
                      **self._scales(inp))

            runs.append(run)
        return runs

    # The format's plan keyword, cache tensors and run() scales.
    def _wrapper_format(self):
        return {}

    def _caches(self, inp):
        return inp.ckv, inp.kpe

    def _scales(self, inp):
        return {"ckv_scale": inp.ckv_scale, "kpe_scale": inp.kpe_scale}

    def _sparse(self, inp):
        import numpy as np

        c = inp.case
        plan = self.fp8mla.plan(
            np.arange(c.bs + 1, dtype=np.int32), None, None, None, num_heads=c.heads,
            page_size=c.page, num_pages=inp.pool_pages, sm_scale=inp.sm_scale,
            kv_format=self.kv_format, causal=False, topk=c.ctx, sparse_indices=inp.rows[0],
            device=str(inp.device))
        self._note_kernel(plan)
        runs = []
        for rows in inp.rows_dev:

            def run(rows=rows):
                self.fp8mla.run(plan, inp.q_nope, inp.q_pe, *self._caches(inp), out=inp.out,
                                sparse_indices=rows, **self._scales(inp))

            runs.append(run)
        return runs


class Fp8mlaBlockPeer(Fp8mlaPeer):
    """fp8mla on the 656-byte block-scaled pool: the cache is inputs.block, uint8 [pages, page,
    656] whole tokens (kpe_cache None), whose scales travel in each token (no run() scales)."""

    name = "fp8mla_block"
    pool = "block"
    kv_format = "fp8_e4m3_block"

    def prepare(self, inputs):
        inputs.require_block_pool()
        return super().prepare(inputs)

    def _wrapper_format(self):
        return {"kv_format": self.kv_format}

    def _caches(self, inp):
        return inp.block, None

    def _scales(self, inp):
        return {}
