"""FlashInfer as a peer: BatchMLAPagedAttentionWrapper on its fa3 backend with bf16 queries and
an FP8 e4m3 cache (kv_data_type=torch.float8_e4m3fn: the SM90 kernel dequantizes the cache in
shared memory; per-tensor ckv_scale / kpe_scale at run()).

Dense: the case's page tables as CSR metadata, one wrapper a timed call (a wrapper owns one
plan and one page table). Sparse: vLLM's FLASHINFER_MLA_SPARSE_SM90 use of the same wrapper,
pages of one token whose ids are the top-k slots, each query token a request of one query token
with kv_len = its valid slots (peers_cases.sparse_to_page_table), causal=False.

prepare(inputs) returns one callable a timed call, launching on torch's current stream into
inputs.out (FlashInfer's tvm-ffi binding takes torch's current stream).
"""

import warnings

import peers_cases as pc

WORKSPACE_BYTES = 128 << 20  # FlashInfer's usual float workspace


def load():
    """(module, description); raises ImportError or AttributeError (with the reason) when
    FlashInfer or its MLA wrapper is missing."""
    import flashinfer
    import flashinfer.mla

    for name in ("BatchMLAPagedAttentionWrapper", "MLAPlanMetadata"):
        getattr(flashinfer.mla, name)  # AttributeError names what this FlashInfer lacks
    return flashinfer, f"flashinfer {flashinfer.__version__} ({flashinfer.__file__})"


class FlashinferPeer:
    name = "flashinfer"

    def __init__(self, module):
        from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

        self.flashinfer = module
        self.Wrapper = BatchMLAPagedAttentionWrapper
        self.Metadata = MLAPlanMetadata
        self._workspace = None

    def workspace(self, torch, device):
        # One float workspace for every wrapper: the timed calls run one after another on one
        # stream, and a run only uses it between its own kernels.
        if self._workspace is None or self._workspace.device != device:
            self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspace

    def prepare(self, inputs):
        torch = inputs.torch
        c = inputs.case
        if c.kind == "dense":
            qo_indptr = torch.arange(c.bs + 1, dtype=torch.int32)
            calls = [(qo_indptr, torch.from_numpy(inputs.kv_indptr), table,
                      torch.from_numpy(inputs.kv_len)) for table in inputs.tables_dev]
            page = c.page
        else:
            calls = []
            for rows in inputs.rows:
                qo, kvp, kvi, kvl = pc.sparse_to_page_table(rows)
                calls.append((torch.from_numpy(qo), torch.from_numpy(kvp),
                              torch.from_numpy(kvi).to(inputs.device), torch.from_numpy(kvl)))
            page = 1
            # pages of one token: the pool's [tokens, 1, 512] / [tokens, 1, 64] views
        ckv, kpe = (inputs.ckv, inputs.kpe) if page == c.page else _token_views(inputs)
        ws = self.workspace(torch, inputs.device)
        runs = []
        for qo, kvp, kvi, kvl in calls:
            w = self.Wrapper(ws, backend="fa3")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                w.plan(metadata=self.Metadata.csr(qo, kvp, kvi, kvl), num_heads=c.heads,
                       head_dim_ckv=512, head_dim_kpe=64, page_size=page, causal=False,
                       sm_scale=inputs.sm_scale, q_data_type=torch.bfloat16,
                       kv_data_type=torch.float8_e4m3fn, query_layout="split",
                       kv_cache_layout="split")

            def run(w=w, kvi=kvi):  # kvi: keep the page table alive with the plan
                w.run(query=(inputs.q_nope, inputs.q_pe), kv_cache=(ckv, kpe), out=inputs.out,
                      ckv_scale=inputs.ckv_scale, kpe_scale=inputs.kpe_scale)

            runs.append(run)
        return runs


def _token_views(inputs):
    """The pool as pages of one token: ([tokens, 1, 512], [tokens, 1, 64]) float8 views."""
    torch = inputs.torch
    flat = inputs.pool.view(torch.float8_e4m3fn).view(-1, 1, pc.TOKEN_BYTES)
    return flat[:, :, :512], flat[:, :, 512:]
