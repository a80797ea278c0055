"""The SGLang backend's per-batch page table: a CSR list of the batch's pages, written on the
batch's device into a buffer a graph-mode wrapper borrows (Problem::borrowed_kv_indices).

Request r lists pages [0, ceil(kv_len[r] / page_size)) of its req_to_token row: the page of token
j is req_to_token[row, j] // page_size (SGLang's allocator places a page's tokens together), at
kv_indptr[r] + j / page_size. Host lengths give kv_indptr (the running sum of the pages, which the
same native call writes) and kv_len for the plan.

fp8mla::fill_page_table writes it (include/fp8mla/page_table.h; on CUDA one launch on torch's
current stream, the requests' starts passed in its parameters; on the host a plain loop). The
fill runs every decode step: on an H100 host it takes 11.9-13.2 us of host time at any batch up
to 128, against 31.5-50.9 when four torch ops summed kv_indptr and 151-161 when a dozen tensor ops
wrote it all (bench/results/h100_replan_host.txt; a Triton kernel took 129-132). The token
table and the buffer are imported once (_ext.PageFill); a step hands the native call the row ids
and lengths by address.
"""

import torch

from .. import _fp8mla as _ext
from .._tensors import host_i32_address, raw_stream


class PageTable:
    """A batch's CSR page table in a buffer of `capacity` entries; the wrapper borrows
    ``table``."""

    def __init__(self, capacity, page_size, device):
        self.page_size = page_size
        self.table = torch.zeros(capacity, dtype=torch.int32, device=device)
        self._device_index = self.table.get_device()  # -1 on the host
        self._tokens = None
        self._fill = None

    def fill(self, req_to_token, req_pool_indices, kv_len_cpu):
        """Writes the table for requests req_pool_indices (rows of req_to_token, int32) with
        kv_len_cpu tokens (host tensor); returns host (kv_indptr [bs + 1], kv_len [bs]) int32
        tensors. ValueError (naming the argument) when the pages exceed the capacity or an argument
        is out of range; nothing is written then."""
        kv_len = kv_len_cpu.to(torch.int32)
        lens = host_i32_address(kv_len)
        if lens is None:
            if kv_len.ndim != 1:
                raise ValueError(f"kv_len_cpu: expected one length per request, got shape "
                                 f"{tuple(kv_len.shape)}")
            kv_len = kv_len.cpu().contiguous()
            lens = host_i32_address(kv_len)
        kv_indptr = torch.empty(len(kv_len) + 1, dtype=torch.int32)
        if req_to_token is not self._tokens:  # SGLang's is fixed: imported once
            self._fill = _ext.PageFill(req_to_token, self.table, self.page_size)
            self._tokens = req_to_token
        rows = self._rows(req_pool_indices, len(kv_len))
        stream = raw_stream(self._device_index) if self._device_index >= 0 else 0
        self._fill.fill(rows.data_ptr(), rows.dtype is torch.int64, lens[0], len(kv_len), stream,
                        kv_indptr.data_ptr())
        return kv_indptr, kv_len

    def _rows(self, rows, batch):
        """The row ids as the native fill reads them: int32 or int64, contiguous, [batch], on the
        table's device (converted when they are not)."""
        if not (type(rows) is torch.Tensor and rows.dtype in (torch.int64, torch.int32)
                and rows.get_device() == self._device_index and rows.ndim == 1
                and rows.is_contiguous()):
            rows = torch.as_tensor(rows).to(self.table.device, torch.int64).contiguous()
        if rows.numel() != batch:
            raise ValueError(f"req_pool_indices: {rows.numel()} rows for {batch} requests")
        return rows
