"""The peer benchmark's cases and their index data (numpy only, no GPU): the dense grid, the
sparse top-k grid, the page tables of each timed call, sparse top-k rows with -1 entries, and
FlashInfer's sparse-as-page-table form of those rows.

Dense case: `bs` requests of one query token and `ctx` cached tokens each, on pages of `page`
tokens. Sparse case: `bs` query tokens (one a request), each attending the `topk` global slots of
its row (slot = page * page_size + offset = a token of the pool), some of them -1 (no token).
"""

import fnmatch
from dataclasses import dataclass

import numpy as np

TOKEN_BYTES = 576  # fp8_e4m3: 512 latent (ckv) + 64 rotary (kpe) bytes
BLOCK_TOKEN_BYTES = 656  # fp8_e4m3_block: 512 e4m3 + 4 float32 scales + 64 bf16 (rope)

# `fp8mla bench`'s dense shapes (bs, heads, ctx), each at pages of 64 and 1 tokens.
DENSE_SHAPES = (
    (1, 8, 4096), (1, 8, 131072), (16, 16, 4096), (64, 8, 4096), (64, 16, 4096),
    (128, 16, 8192), (128, 8, 8192), (64, 128, 4096), (1, 128, 4096),
)
DENSE_PAGES = (64, 1)
QUICK_DENSE_SHAPES = ((1, 8, 4096), (1, 8, 131072), (64, 16, 4096), (128, 16, 8192),
                      (64, 128, 4096))

# Sparse top-k (DeepSeek sparse attention): k, heads, batch (query tokens).
SPARSE_TOPK = (2048, 512)
SPARSE_HEADS = (8, 16, 64, 128)
SPARSE_BATCH = (1, 16, 64, 128)
QUICK_SPARSE = ((2048, 8, 128), (2048, 64, 128), (2048, 128, 128), (2048, 16, 1),
                (512, 16, 64))


@dataclass(frozen=True)
class Case:
    kind: str  # "dense" or "sparse"
    bs: int  # requests (dense) or query tokens (sparse, one a request)
    heads: int
    ctx: int  # dense: tokens a request; sparse: top-k
    page: int  # page size the peers see the pool with

    @property
    def name(self):
        if self.kind == "dense":
            return f"dense/{self.bs}/{self.heads}/{self.ctx}/p{self.page}"
        return f"sparse/{self.bs}/{self.heads}/k{self.ctx}/p{self.page}"


def dense_cases(quick=False):
    shapes = QUICK_DENSE_SHAPES if quick else DENSE_SHAPES
    return [Case("dense", bs, h, ctx, p) for p in DENSE_PAGES for bs, h, ctx in shapes]


def sparse_cases(quick=False, pages=(1,)):
    if quick:
        triples = QUICK_SPARSE
    else:
        triples = [(k, h, b) for k in SPARSE_TOPK for h in SPARSE_HEADS for b in SPARSE_BATCH]
    return [Case("sparse", b, h, k, p) for p in pages for k, h, b in triples]


def all_cases(quick=False, sparse_pages=(1,)):
    return dense_cases(quick) + sparse_cases(quick, sparse_pages)


def select_cases(cases, patterns):
    """The cases whose name matches one of the comma-separated fnmatch patterns (a bare "dense"
    or "sparse" means that kind), in their order. An empty pattern list selects all. A pattern
    that matches nothing raises ValueError naming it (a typo must not run an empty bench)."""
    pats = [p.strip() for p in (patterns or "").split(",") if p.strip()]
    if not pats:
        return list(cases)
    chosen, unmatched = [], []
    for pat in pats:
        glob = pat + "/*" if pat in ("dense", "sparse") else pat
        hits = [c for c in cases if fnmatch.fnmatchcase(c.name, glob)]
        if not hits:
            unmatched.append(pat)
        chosen.extend(c for c in hits if c not in chosen)
    if unmatched:
        names = ", ".join(c.name for c in cases[:3])
        raise ValueError(f"--cases: {', '.join(unmatched)} matches no case (names look like "
                         f"{names}, ...)")
    return [c for c in cases if c in chosen]


def dense_page_tables(rng, bs, ctx, page, pool_pages, calls):
    """Page tables of `calls` timed calls of a dense case, each over its own region of the pool
    (call v: pages [v n, (v + 1) n), n = bs x pages a request, in a random order), so no call
    reads what another read. Returns (kv_indptr int32 [bs + 1], kv_len int32 [bs], tables: a
    list of int32 [n]). Raises ValueError when one call does not fit the pool."""
    per_req = -(-ctx // page)
    n = bs * per_req
    if n > pool_pages:
        raise ValueError(f"one call needs {n} pages, the pool has {pool_pages}")
    calls = max(1, min(calls, pool_pages // n))
    kv_indptr = (np.arange(bs + 1, dtype=np.int64) * per_req).astype(np.int32)
    kv_len = np.full(bs, ctx, dtype=np.int32)
    tables = [(v * n + rng.permutation(n)).astype(np.int32) for v in range(calls)]
    return kv_indptr, kv_len, tables


def sparse_rows(rng, rows, topk, pool_tokens, invalid_frac):
    """Top-k rows [rows, topk] int32 of global slots drawn uniformly over the pool (with
    replacement, as an indexer's choices over a long context may repeat none or few), with
    about `invalid_frac` of the entries -1, scattered. Every row keeps at least one valid entry
    (its first), so no query sees nothing."""
    if pool_tokens > np.iinfo(np.int32).max:
        raise ValueError(f"pool of {pool_tokens} tokens does not fit int32 slots")
    idx = rng.integers(0, pool_tokens, size=(rows, topk), dtype=np.int64).astype(np.int32)
    drop = rng.random((rows, topk)) < invalid_frac
    drop[:, 0] = False
    idx[drop] = -1
    return idx


def valid_counts(idx):
    """Valid (non -1) entries a row: int64 [rows]."""
    return (np.asarray(idx) >= 0).sum(axis=1)


def sparse_to_page_table(idx):
    """FlashInfer's sparse-as-page-table form of top-k rows (vLLM's FLASHINFER_MLA_SPARSE_SM90):
    with pages of one token the slots are page ids, each query token is a request of one query
    token whose pages are its row's valid slots, and its kv_len is their count. vLLM's converter
    hands the kernel rows whose valid entries form a prefix (-1 only past it) and plans kv_len
    = that count; here the -1 entries are dropped wherever they are, keeping the valid ones in
    order, which is the same attention (a set of keys; order does not matter).

    Returns (qo_indptr [rows + 1], kv_indptr [rows + 1], kv_indices [total valid],
    kv_len [rows]), all int32."""
    idx = np.asarray(idx)
    rows = idx.shape[0]
    valid = idx >= 0
    kv_len = valid.sum(axis=1).astype(np.int32)
    kv_indptr = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(kv_len, out=kv_indptr[1:])
    kv_indices = idx[valid].astype(np.int32)  # row-major: each row's valid slots, in order
    qo_indptr = np.arange(rows + 1, dtype=np.int32)
    return qo_indptr, kv_indptr.astype(np.int32), kv_indices, kv_len


def check_requests(bs, count=3):
    """The requests (or query tokens) checked against the reference: first, middle, last."""
    return sorted({0, bs // 2, bs - 1})[:count]


def dense_request_tokens(table, kv_indptr, kv_len, page, r):
    """Global token ids (page * page + offset) of dense request r in call `table`, in order."""
    pages = np.asarray(table[kv_indptr[r]:kv_indptr[r + 1]], dtype=np.int64)
    tokens = (pages[:, None] * page + np.arange(page)[None, :]).reshape(-1)
    return tokens[: int(kv_len[r])]


def bytes_read(case, valid_per_call=None, token_bytes=TOKEN_BYTES):
    """Cache bytes a call reads at least: every listed token once (dense: bs x ctx; sparse: the
    valid top-k entries, averaged over the calls when given), token_bytes a token (576 for the
    e4m3 pool, 656 for the block-scaled one)."""
    if case.kind == "dense" or valid_per_call is None:
        return case.bs * case.ctx * token_bytes
    return float(np.mean(valid_per_call)) * token_bytes
