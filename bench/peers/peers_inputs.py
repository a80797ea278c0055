"""The peer benchmark's tensors (torch, any device): the FP8 latent pools, and for one case the
bf16 queries, the output, the index data of every timed call, and the float64 reference of the
checked requests. Every peer reads these same tensors.

The pool is one uint8 buffer [tokens, 576] of e4m3 codes: a token's first 512 bytes are its
latent (ckv), the last 64 its rotary part (kpe), as SGLang and vLLM store it. Values are drawn
like real latents after their norm (standard normal, both halves), stored as code = value /
scale with a per-tensor scale a half (ckv_scale, kpe_scale; their ratio a power of two, as
calibrated FP8 caches have), clamped to e4m3's +-448.

The block pool (made only when a peer reads it) is one uint8 buffer [tokens, 656] in DeepSeek
V3.2's FP8 sparse layout (FlashMLA's; fp8mla's fp8_e4m3_block): 512 e4m3 codes, 4 float32
scales (one per 128 latent values), the 64 rope values in bf16. Its values are drawn the same
way (its own draws), each 128-value block stored with the power-of-two scale FlashMLA's
quantizer picks, 2^ceil(log2(max(amax / 448, 1e-4))). It has as many tokens as the pool, so the
same page tables and top-k rows index both.
"""

import numpy as np

import peers_cases as pc
import peers_reference as ref

SM_SCALE = 192 ** -0.5  # DeepSeek's 1 / sqrt(qk_nope 128 + qk_rope 64)
CKV_SCALE = 0.0125  # ~ 5.6 (the largest |value| of ~1e10 normal draws) / 448
KPE_SCALE = 0.025


def make_pool(torch, device, tokens, seed, ckv_scale=CKV_SCALE, kpe_scale=KPE_SCALE,
              chunk=1 << 18):
    """uint8 [tokens, 576] FP8 codes of standard-normal latents (see the module docstring),
    filled `chunk` tokens at a time so the float staging stays small."""
    pool = torch.empty((tokens, pc.TOKEN_BYTES), dtype=torch.uint8, device=device)
    codes = pool.view(torch.float8_e4m3fn)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    inv = torch.ones(pc.TOKEN_BYTES, dtype=torch.float32, device=device)
    inv[:512] = 1.0 / ckv_scale
    inv[512:] = 1.0 / kpe_scale
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        x = torch.randn((n, pc.TOKEN_BYTES), generator=gen, dtype=torch.float32, device=device)
        x.mul_(inv).clamp_(-448.0, 448.0)
        codes[start:start + n] = x.to(torch.float8_e4m3fn)
    return pool


def block_scales(torch, latent):
    """float32 [..., 512] -> the power-of-two scale of each 128-value block, float32 [..., 4]:
    2^ceil(log2(max(amax / 448, 1e-4))), so amax / scale <= 448 and dividing by it is exact."""
    amax = latent.unflatten(-1, (4, 128)).abs().amax(dim=-1)
    return torch.exp2(torch.ceil(torch.log2((amax / 448.0).clamp_min(1e-4))))


def fill_block_tokens(torch, dst, x):
    """Writes float32 values x [n, 576] into dst, uint8 [n, 656] rows (a slice of a block pool):
    codes RNE(x / scale) of each 128-value block, the scales, the rope part RNE to bf16."""
    n = x.shape[0]
    latent = x[:, :512]
    scale = block_scales(torch, latent)  # [n, 4]
    q = (latent.unflatten(-1, (4, 128)) / scale.unsqueeze(-1)).clamp_(-448.0, 448.0)
    dst[:, :512].view(torch.float8_e4m3fn).copy_(q.reshape(n, 512).to(torch.float8_e4m3fn))
    dst[:, 512:528].view(torch.float32).copy_(scale)
    dst[:, 528:].view(torch.bfloat16).copy_(x[:, 512:].to(torch.bfloat16))


def encode_block_tokens(torch, x):
    """float32 [n, 576] -> uint8 [n, 656] block-scaled tokens (see fill_block_tokens)."""
    out = torch.empty((x.shape[0], pc.BLOCK_TOKEN_BYTES), dtype=torch.uint8, device=x.device)
    fill_block_tokens(torch, out, x)
    return out


def make_block_pool(torch, device, tokens, seed, chunk=1 << 18):
    """uint8 [tokens, 656] block-scaled tokens of standard-normal values (see the module
    docstring), filled `chunk` tokens at a time so the float staging stays small."""
    pool = torch.empty((tokens, pc.BLOCK_TOKEN_BYTES), dtype=torch.uint8, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        x = torch.randn((n, pc.TOKEN_BYTES), generator=gen, dtype=torch.float32, device=device)
        fill_block_tokens(torch, pool[start:start + n], x)
    return pool


class CaseInputs:
    """One case's tensors over the shared pools.

    pool       uint8 [tokens, 576] (tokens a multiple of the page size)
    ckv, kpe   float8_e4m3fn views [pages, page, 512] / [pages, page, 64] of the pool
    block_pool uint8 [tokens, 656] block-scaled tokens, or None (no peer reads it)
    block      uint8 [pages, page, 656] view of block_pool (None without it)
    q          bf16 [bs, heads, 576]; q_nope / q_pe its [..., :512] / [..., 512:] views
    out        bf16 [bs, heads, 512] (each peer writes it; poisoned before each check)
    bytes_per_call / block_bytes_per_call: the cache bytes a call lists, 576 / 656 a token
    dense:  kv_indptr, kv_len (numpy int32), tables (numpy int32 page tables, one a call) and
            tables_dev (the same on the device)
    sparse: rows (numpy int32 [bs, topk] global slots with -1 entries, one a call), rows_dev
    """

    def __init__(self, torch, case, pool, calls, seed, invalid_frac=0.05,
                 ckv_scale=CKV_SCALE, kpe_scale=KPE_SCALE, block_pool=None):
        self.torch = torch
        self.case = case
        self.device = pool.device
        self.pool = pool
        self.ckv_scale, self.kpe_scale, self.sm_scale = ckv_scale, kpe_scale, SM_SCALE
        tokens = pool.shape[0]
        if tokens % case.page:
            raise ValueError(f"pool of {tokens} tokens is not a whole number of "
                             f"{case.page}-token pages")
        self.pool_pages = tokens // case.page
        paged = pool.view(torch.float8_e4m3fn).view(self.pool_pages, case.page, pc.TOKEN_BYTES)
        self.ckv = paged[:, :, :512]
        self.kpe = paged[:, :, 512:]
        self.block_pool = block_pool
        self.block = None
        if block_pool is not None:
            if tuple(block_pool.shape) != (tokens, pc.BLOCK_TOKEN_BYTES):
                raise ValueError(f"block pool of shape {tuple(block_pool.shape)}, expected "
                                 f"({tokens}, {pc.BLOCK_TOKEN_BYTES}): as many tokens as the "
                                 f"pool")
            self.block = block_pool.view(self.pool_pages, case.page, pc.BLOCK_TOKEN_BYTES)
        rng = np.random.default_rng(seed)
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        self.q = torch.randn((case.bs, case.heads, pc.TOKEN_BYTES), generator=gen,
                             dtype=torch.float32, device=self.device).to(torch.bfloat16)
        self.q_nope = self.q[:, :, :512]
        self.q_pe = self.q[:, :, 512:]
        self.out = torch.empty((case.bs, case.heads, 512), dtype=torch.bfloat16,
                               device=self.device)
        if case.kind == "dense":
            self.kv_indptr, self.kv_len, self.tables = pc.dense_page_tables(
                rng, case.bs, case.ctx, case.page, self.pool_pages, calls)
            self.tables_dev = [torch.from_numpy(t).to(self.device) for t in self.tables]
            self.calls = len(self.tables)
            valid = None
        else:
            self.rows = [pc.sparse_rows(rng, case.bs, case.ctx, tokens, invalid_frac)
                         for _ in range(calls)]
            self.rows_dev = [torch.from_numpy(r).to(self.device) for r in self.rows]
            self.calls = len(self.rows)
            valid = [int(pc.valid_counts(r).sum()) for r in self.rows]
        self.bytes_per_call = pc.bytes_read(case, valid)
        self.block_bytes_per_call = pc.bytes_read(case, valid, pc.BLOCK_TOKEN_BYTES)

    def require_block_pool(self):
        """The block pool, or ValueError when these inputs were made without one."""
        if self.block_pool is None:
            raise ValueError("no block pool in these inputs (CaseInputs(block_pool=...), "
                             "make_block_pool's pool)")
        return self.block_pool

    def bytes_for(self, pool="fp8"):
        """Cache bytes a call lists in the pool a peer reads ("fp8" or "block")."""
        return self.block_bytes_per_call if pool == "block" else self.bytes_per_call

    def poison_out(self):
        self.out.fill_(float("nan"))

    def request_tokens(self, r):
        """Global token ids that request (dense) or query token (sparse) r of call 0 reads."""
        if self.case.kind == "dense":
            return pc.dense_request_tokens(self.tables[0], self.kv_indptr, self.kv_len,
                                           self.case.page, r)
        row = self.rows[0][r]
        return row[row >= 0].astype(np.int64)

    def reference(self, requests, pool="fp8"):
        """float64 (o [len(requests), heads, 512], lse [len(requests), heads]) of call 0 over the
        pool a peer reads: "fp8" (the 576-byte pool) or "block" (the block pool)."""
        torch = self.torch
        if pool not in ("fp8", "block"):
            raise ValueError(f"pool: expected 'fp8' or 'block', got {pool!r}")
        if pool == "block":
            self.require_block_pool()
        outs, lses = [], []
        for r in requests:
            tok = torch.from_numpy(self.request_tokens(r)).to(self.device)
            if pool == "block":
                keys = ref.decode_block_tokens(self.block_pool.index_select(0, tok).cpu().numpy())
            else:
                codes = self.pool.index_select(0, tok).cpu().numpy()
                keys = ref.decode_tokens(codes, self.ckv_scale, self.kpe_scale)
            q = ref.bf16_to_f64(self.q[r].view(torch.int16).cpu().numpy())
            o, lse = ref.attention(q, keys, self.sm_scale)
            outs.append(o)
            lses.append(lse)
        return np.stack(outs), np.stack(lses)

    def output_rows(self, requests):
        """The peer's output rows (float64) and whether every output element is finite (a row
        a kernel forgot keeps its NaN poison)."""
        torch = self.torch
        idx = torch.tensor(list(requests), dtype=torch.long, device=self.device)
        got = self.out.index_select(0, idx).float().cpu().numpy().astype(np.float64)
        return got, bool(torch.isfinite(self.out).all().item())
