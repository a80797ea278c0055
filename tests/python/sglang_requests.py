"""Requests as SGLang's scheduler keeps them, for the SGLang plugin's tests (test_sglang_plugin.py,
test_sglang_dsa.py): req_to_token rows of token slots, allocated a page at a time (a page's tokens
together) from pages in a shuffled order; page 0 is SGLang's padding page. forward_batch() builds
SGLang's ForwardBatch of such requests, as both files' batch() helpers start theirs."""

import torch


class Scheduler:
    """The requests of runner `r` (its req_to_token_pool, token_to_kv_pool and page_size)."""

    def __init__(self, r, gen):
        self.r = r
        self.gen = gen
        pages = r.token_to_kv_pool.get_key_buffer(0).shape[0] // r.page_size
        self.free = (torch.randperm(pages - 1, generator=gen) + 1).tolist()  # page 0: padding
        self.rows = {}

    def grow(self, req, new_len):
        """Extends request `req` to new_len tokens; returns the slots of the new tokens."""
        ps = self.r.page_size
        row = self.r.req_to_token_pool.req_to_token[req]
        old = self.rows.get(req, 0)
        for j in range(old, new_len):
            page = self.free.pop() if j % ps == 0 else int(row[j - 1]) // ps
            row[j] = page * ps + j % ps
        self.rows[req] = new_len
        return row[old:new_len].clone()

    def slots(self, req, positions):
        """The global slots of request `req`'s token positions."""
        return self.r.req_to_token_pool.req_to_token[req].cpu()[positions.long()]


def forward_batch(mode, bs, req, seqs, slots, device):
    """SGLang's ForwardBatch of `bs` requests (rows `req`, `seqs` tokens each, the new tokens at
    `slots`) in forward mode `mode`, with the host lengths SGLang keeps (seq_lens_cpu)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    seq = torch.tensor(seqs, dtype=torch.int64)
    fb = ForwardBatch(forward_mode=mode, batch_size=bs,
                      input_ids=torch.zeros(len(slots), dtype=torch.int64, device=device),
                      req_pool_indices=torch.tensor(req, dtype=torch.int64, device=device),
                      seq_lens=seq.to(device), out_cache_loc=slots.to(device),
                      seq_lens_sum=int(seq.sum()))
    fb.seq_lens_cpu = seq.clone()
    return fb
