"""fp8mla.sglang.page_table: the SGLang backend's per-batch page table. The Triton kernel (what
CUDA runs) against the tensor-op path and a plain loop, in Triton's interpreter on CPU tensors,
and on the GPU when there is one."""

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

from fp8mla.sglang import page_table  # noqa: E402

CASES = [  # (page size, request lengths): zero lengths, partial last pages, pages > one BLOCK
    (1, [5, 0, 17, 1]),
    (1, [1300, 7, 600]),
    (16, [33, 16, 0, 1, 250, 47, 9]),
    (64, [4096, 65, 63, 1]),
    (64, [64 * 600 + 5]),
]


def expected(req_to_token, rows, lens, ps):
    """The CSR page ids, by a plain loop."""
    ids = []
    for row, n in zip(rows.tolist(), lens):
        ids += [int(req_to_token[row, k * ps]) // ps for k in range(-(-n // ps))]
    return torch.tensor(ids, dtype=torch.int32)


def make_case(gen, ps, lens, device, rows_dtype):
    bs, width = len(lens), max(max(lens), 1) + ps
    pool_rows = bs + 3
    # Token slots as SGLang's allocator hands them out: a page's tokens together, pages shuffled.
    pages = torch.randperm(pool_rows * (-(-width // ps)), generator=gen)
    slots = (pages[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1)
    req_to_token = slots[: pool_rows * width].reshape(pool_rows, width).to(torch.int32)
    rows = torch.randperm(pool_rows, generator=gen)[:bs].to(rows_dtype)
    return req_to_token.to(device), rows.to(device)


def run_fill(device, ps, lens, rows_dtype, kernel, gen):
    req_to_token, rows = make_case(gen, ps, lens, device, rows_dtype)
    total = sum(-(-n // ps) for n in lens)
    pt = page_table.PageTable(total + 5, ps, device)
    pt.kernel = kernel
    pt.storage.fill_(-7)  # poison: every listed entry must be written
    kv_indptr, kv_len = pt.fill(req_to_token, rows, torch.tensor(lens, dtype=torch.int32))
    want = expected(req_to_token.cpu(), rows.cpu(), lens, ps)
    assert kv_indptr.tolist() == [0] + torch.cumsum(
        torch.tensor([-(-n // ps) for n in lens]), 0).tolist()
    assert kv_len.tolist() == lens
    assert torch.equal(pt.table[:total].cpu(), want)
    return pt


@pytest.fixture
def interpreted(monkeypatch):
    """The kernel in Triton's interpreter (its code, run on CPU tensors)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    monkeypatch.setattr(page_table, "fill_pages_kernel",
                        InterpretedFunction(page_table.fill_pages_kernel.fn))
    # The language's own jit helpers (tl.sum ...) run as Python inside the interpreter.
    monkeypatch.setattr(JITFunction, "__call__", lambda self, *a, **k: self.fn(*a, **k))


@pytest.mark.parametrize("ps,lens", CASES)
@pytest.mark.parametrize("rows_dtype", [torch.int64, torch.int32])
def test_kernel_writes_the_listed_pages(interpreted, ps, lens, rows_dtype):
    pt = run_fill("cpu", ps, lens, rows_dtype, True, torch.Generator().manual_seed(ps + len(lens)))
    total = sum(-(-n // ps) for n in lens)
    assert (pt.storage[total:] == -7).all()  # nothing past the batch's pages


@pytest.mark.parametrize("ps,lens", CASES)
def test_tensor_ops_write_the_listed_pages(ps, lens):
    run_fill("cpu", ps, lens, torch.int64, False, torch.Generator().manual_seed(ps))


def test_capacity_is_checked_before_anything_is_written():
    pt = page_table.PageTable(3, 16, "cpu")
    pt.storage.fill_(-7)
    with pytest.raises(ValueError, match="page table: 5 pages exceed the capacity 3"):
        pt.fill(torch.zeros(2, 64, dtype=torch.int32), torch.tensor([0, 1]),
                torch.tensor([33, 17], dtype=torch.int32))
    assert (pt.storage == -7).all()


def test_the_kernel_fills_cuda_tables():
    """CUDA tables take the kernel (use_kernel), and it writes what the plain loop lists."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    assert page_table.use_kernel("cuda") and not page_table.use_kernel("cpu")
    gen = torch.Generator().manual_seed(3)
    for ps, lens in CASES + [(1, list(range(1, 300, 7))), (64, [32768] * 128)]:
        pt = run_fill("cuda", ps, lens, torch.int64, True, gen)
        assert pt.kernel
