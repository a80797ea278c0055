"""The SGLang backend's per-batch page table: a CSR list of the batch's pages, written on the
batch's device into a buffer a graph-mode wrapper borrows (Problem::borrowed_kv_indices).

Request r lists pages [0, ceil(kv_len[r] / page_size)) of its req_to_token row: the page of token
j is req_to_token[row, j] // page_size (SGLang's allocator places a page's tokens together), at
kv_indptr[r] + j / page_size. Host lengths give kv_indptr and kv_len for the plan.

On CUDA one Triton kernel writes it (a program a request: its start is the sum of the pages of
the requests before it, from the lengths uploaded with the launch): the fill runs every decode
step, and the dozen tensor ops the general path launches cost 220-350 us of host time a step on
an H100 host (bench/replan_host.py), ten times the re-plan's. Elsewhere (the CPU backend, or no
Triton) tensor ops write it, columns past a request's pages sent to a trash entry past the table
so that every shape depends on the batch only through host integers.
"""

import torch

try:  # SGLang needs Triton on CUDA; the CPU backend's tests run without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None

# Columns of a request a program writes per loop step.
FILL_BLOCK = 512


if triton is not None:

    @triton.jit
    def fill_pages_kernel(req_to_token, token_stride, rows, kv_len, table, page_size,
                          BATCH: tl.constexpr, BLOCK: tl.constexpr):
        """Program r: table[start + k] = req_to_token[rows[r], k * page_size] // page_size for
        k < ceil(kv_len[r] / page_size), start = the pages of requests 0..r-1 (BATCH >= the
        batch, a power of two)."""
        r = tl.program_id(0)
        before = tl.arange(0, BATCH)
        lens = tl.load(kv_len + before, mask=before < r, other=0)
        start = tl.sum((lens + page_size - 1) // page_size)
        pages = (tl.load(kv_len + r) + page_size - 1) // page_size
        row = req_to_token + tl.load(rows + r).to(tl.int64) * token_stride
        for k0 in range(0, pages, BLOCK):
            k = k0 + tl.arange(0, BLOCK)
            live = k < pages
            token = tl.load(row + k.to(tl.int64) * page_size, mask=live)
            tl.store(table + start + k, (token // page_size).to(tl.int32), mask=live)


def use_kernel(device):
    """Whether the Triton kernel fills tables on `device` (CUDA with Triton installed)."""
    return triton is not None and torch.device(device).type == "cuda"


class PageTable:
    """A batch's CSR page table in a buffer of `capacity` entries (plus a trash entry the
    tensor-op path writes unused columns to); the wrapper borrows ``table``."""

    def __init__(self, capacity, page_size, device):
        self.page_size = page_size
        self.capacity = capacity
        self.storage = torch.zeros(capacity + 1, dtype=torch.int32, device=device)
        self.table = self.storage[:capacity]
        self.kernel = use_kernel(device)

    def fill(self, req_to_token, req_pool_indices, kv_len_cpu):
        """Writes the table for requests req_pool_indices (on the table's device) with
        kv_len_cpu tokens (host tensor); returns host (kv_indptr [bs + 1], kv_len [bs]) int32
        tensors. ValueError when the pages exceed the capacity."""
        ps = self.page_size
        kv_len = kv_len_cpu.to(torch.int32)
        pages = (kv_len + ps - 1) // ps
        kv_indptr = torch.zeros(len(kv_len) + 1, dtype=torch.int32)
        torch.cumsum(pages, 0, out=kv_indptr[1:])
        total = int(kv_indptr[-1])
        if total > self.capacity:
            raise ValueError(f"page table: {total} pages exceed the capacity {self.capacity}")
        if total == 0:
            return kv_indptr, kv_len
        if self.kernel:
            self._fill_kernel(req_to_token, req_pool_indices, kv_len)
        else:
            self._fill_ops(req_to_token, req_pool_indices, pages, kv_indptr)
        return kv_indptr, kv_len

    def _fill_kernel(self, req_to_token, req_pool_indices, kv_len):
        bs = len(kv_len)
        # A pageable host tensor: the copy is staged before this returns, so the caller may
        # reuse kv_len_cpu at once, and it is ordered before the kernel on the stream.
        lens = kv_len.to(self.storage.device, non_blocking=True)
        fill_pages_kernel[(bs,)](
            req_to_token, req_to_token.stride(0), req_pool_indices, lens, self.table,
            self.page_size, BATCH=triton.next_power_of_2(bs), BLOCK=FILL_BLOCK)

    def _fill_ops(self, req_to_token, req_pool_indices, pages, kv_indptr):
        ps = self.page_size
        width = int(pages.max())
        device = self.storage.device
        rows = req_to_token.index_select(0, req_pool_indices.to(torch.int64))
        ids = rows[:, ::ps][:, :width].to(torch.int32) // ps  # [bs, <= width]
        if ids.shape[1] < width:  # a row narrower than the longest request: never read
            ids = torch.nn.functional.pad(ids, (0, width - ids.shape[1]))
        col = torch.arange(width, device=device, dtype=torch.int32)
        pages_d = pages.to(device, non_blocking=True)
        start = kv_indptr[:-1].to(device, non_blocking=True)
        dest = torch.where(col[None, :] < pages_d[:, None], start[:, None] + col[None, :],
                           torch.full_like(col[None, :], self.capacity))
        self.storage.scatter_(0, dest.reshape(-1).to(torch.int64), ids.reshape(-1))
