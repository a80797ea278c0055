"""fp8mla.sglang.page_table: the SGLang backend's per-batch page table, written by
fp8mla::fill_page_table (by address from torch tensors), against a plain loop, on the CPU and on
the GPU when there is one."""

import pytest

torch = pytest.importorskip("torch")

import fp8mla  # noqa: E402
from fp8mla.sglang import page_table  # noqa: E402

CASES = [  # (page size, request lengths): zero lengths, partial last pages, long requests
    (1, [5, 0, 17, 1]),
    (1, [1300, 7, 600]),
    (16, [33, 16, 0, 1, 250, 47, 9]),
    (64, [4096, 65, 63, 1]),
    (64, [64 * 600 + 5]),
    (16, [0, 0]),
]


def devices():
    yield "cpu"
    if torch.cuda.is_available() and fp8mla.cuda_available():
        yield "cuda"


def expected(req_to_token, rows, lens, ps):
    """The CSR page ids, by a plain loop."""
    ids = []
    for row, n in zip(rows.tolist(), lens):
        ids += [int(req_to_token[row, k * ps]) // ps for k in range(-(-n // ps))]
    return torch.tensor(ids, dtype=torch.int32)


def make_case(gen, ps, lens, device, rows_dtype):
    """SGLang's req_to_token: each row a request's token slots, a page's tokens together, pages
    shuffled (one column past the longest request, as rows are wider than what they hold)."""
    bs, width = len(lens), max(max(lens), 1) + 1
    pool_rows = bs + 3
    pages = torch.randperm(pool_rows * (-(-width // ps)), generator=gen)
    slots = (pages[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1)
    req_to_token = slots[: pool_rows * width].reshape(pool_rows, width).to(torch.int32)
    rows = torch.randperm(pool_rows, generator=gen)[:bs].to(rows_dtype)
    return req_to_token.to(device), rows.to(device)


@pytest.mark.parametrize("device", list(devices()))
@pytest.mark.parametrize("ps,lens", CASES)
@pytest.mark.parametrize("rows_dtype", [torch.int64, torch.int32])
def test_fill_writes_the_listed_pages(device, ps, lens, rows_dtype):
    gen = torch.Generator().manual_seed(ps * 31 + len(lens))
    req_to_token, rows = make_case(gen, ps, lens, device, rows_dtype)
    total = sum(-(-n // ps) for n in lens)
    pt = page_table.PageTable(total + 5, ps, device)
    pt.table.fill_(-7)  # poison: every listed entry must be written, nothing past them
    kv_len_cpu = torch.tensor(lens, dtype=torch.int32)
    for step in range(2):  # the second step reuses the imported token table
        kv_indptr, kv_len = pt.fill(req_to_token, rows, kv_len_cpu)
        assert kv_indptr.tolist() == [0] + torch.cumsum(
            torch.tensor([-(-n // ps) for n in lens]), 0).tolist()
        assert kv_len.tolist() == lens
        assert torch.equal(pt.table[:total].cpu(), expected(req_to_token.cpu(), rows.cpu(), lens,
                                                            ps)), f"step {step}"
        assert (pt.table[total:] == -7).all()
        rows = rows.flip(0).contiguous()
        lens = lens[::-1]
        kv_len_cpu = torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("device", list(devices()))
def test_rows_in_other_forms_are_converted(device):
    """Row ids on the host for a device table, as a strided view, or as a list."""
    gen = torch.Generator().manual_seed(5)
    req_to_token, rows = make_case(gen, 16, [40, 3, 70], device, torch.int64)
    want = expected(req_to_token.cpu(), rows.cpu(), [40, 3, 70], 16)
    pt = page_table.PageTable(len(want), 16, device)
    for form in (rows.cpu(), torch.stack([rows, rows], 1)[:, 0], rows.tolist()):
        pt.table.fill_(-7)
        pt.fill(req_to_token, form, torch.tensor([40, 3, 70]))
        assert torch.equal(pt.table.cpu(), want)


def test_bad_batches_are_refused_by_name_before_anything_is_written():
    gen = torch.Generator().manual_seed(9)
    req_to_token, rows = make_case(gen, 16, [40, 20], "cpu", torch.int64)
    pt = page_table.PageTable(8, 16, "cpu")
    pt.table.fill_(-7)
    small = page_table.PageTable(4, 16, "cpu")
    small.table.fill_(-7)
    with pytest.raises(ValueError, match=r"table.shape\[0\]: 4 entries hold fewer than the "
                       r"batch's 5 pages"):
        small.fill(req_to_token, rows, torch.tensor([40, 20], dtype=torch.int32))
    assert (small.table == -7).all()
    with pytest.raises(ValueError, match=r"^kv_len_cpu: expected one length per request"):
        pt.fill(req_to_token, rows, torch.tensor([[40, 20]], dtype=torch.int32))
    with pytest.raises(ValueError, match="^req_pool_indices: 1 rows for 2 requests"):
        pt.fill(req_to_token, rows[:1], torch.tensor([40, 20], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"kv_len\[0\]: 60 must be in \[0, 48\]"):
        pt.fill(req_to_token, rows, torch.tensor([60, 20], dtype=torch.int32))
    far = torch.tensor([0, len(req_to_token)])
    with pytest.raises(ValueError, match=r"rows\[1\]: 5 is outside the token table's 5 rows"):
        pt.fill(req_to_token, far, torch.tensor([40, 20], dtype=torch.int32))
    assert (pt.table == -7).all()
