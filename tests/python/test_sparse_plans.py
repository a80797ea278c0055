"""fp8mla.sglang.sparse.SparsePlans, the sparse runner of the SGLang plugin's DSA backend, on the
rows SGLang's DSA pool stores (dsa_rows.py: FlashMLA's 656-byte rows with SGLang's amax / 448
scales, raw e4m3, bf16), read as pages of one token: on the CPU backend and, where torch sees a
CUDA device and fp8mla has its CUDA backend, on CUDA, including a CUDA-graph capture whose top-k
and query buffers are rewritten in place before each replay. Every output against the float64
reference (dsa_rows.sparse_reference), outputs poisoned (NaN) before each call. No SGLang needed.
"""

import math

import pytest

torch = pytest.importorskip("torch")

import fp8mla  # noqa: E402
from dsa_rows import decode_rows, encode_rows, sparse_reference  # noqa: E402
from fp8mla.sglang.sparse import SparsePlans  # noqa: E402

CUDA = torch.cuda.is_available() and fp8mla.cuda_available()
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
SCALE = 1.0 / math.sqrt(256)
FORMATS = ["fp8_e4m3_block", "fp8_e4m3", "bf16"]
POOL = 4160  # SGLang's pool: size + one page of 64


@pytest.fixture
def gen(rng):
    return torch.Generator().manual_seed(int(rng.integers(2**62)))


def pool_of(fmt, gen, device):
    """(rows [POOL, 1, bytes or values] on device, values float64 [POOL, 576] on device)."""
    k = (torch.randn(POOL, 576, generator=gen) * 0.5).to(torch.bfloat16)
    rows = encode_rows(k, fmt)
    return rows[:, None].to(device), decode_rows(rows, fmt).to(device)


def views(rows, fmt):
    if fmt == "fp8_e4m3_block":
        return rows, None
    if fmt == "fp8_e4m3":
        rows = rows.view(torch.float8_e4m3fn)
    return rows[..., :512], rows[..., 512:]


def slots_of(gen, rows, topk, pool=POOL):
    """[rows, topk] int32: distinct pool slots at random places, -1 elsewhere; row 0 sees 3
    slots, row 1 none, the others min(topk, 900)."""
    out = torch.full((rows, topk), -1, dtype=torch.int32)
    for t in range(rows):
        n = 3 if t == 0 else 0 if t == 1 else min(topk, 900)
        where = torch.randperm(topk, generator=gen)[:n]
        out[t, where] = torch.randperm(pool, generator=gen)[:n].to(torch.int32)
    return out


def scales(fmt):
    return {"ckv_scale": 1.0, "kpe_scale": 1.0} if fmt == "fp8_e4m3" else {}


def check(out, want, what):
    out = out.double()
    assert not torch.isnan(out).any(), f"{what}: unwritten (NaN) output"
    assert torch.equal(out[1], torch.zeros_like(out[1])), f"{what}: a row of -1 must give 0"
    err = torch.linalg.norm(out - want) / torch.linalg.norm(want)
    assert err < 1e-2, f"{what}: relative L2 error {float(err):.2e}"


@pytest.mark.parametrize("heads", [8, 16, 64, 128])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("device", DEVICES)
def test_sglang_rows_in_chunks(device, fmt, heads, gen):
    """37 query tokens in plans of at most 16 (16 + 16 + 5), top-k 2048 on CUDA (512 on the CPU),
    each token over its own slots; the plans are re-used by a second batch of the same size."""
    rows, topk = 37, 2048 if device == "cuda" else 512
    if device == "cpu" and heads > 16:
        rows = 5
    pool, kv = pool_of(fmt, gen, device)
    ckv, kpe = views(pool, fmt)
    plans = SparsePlans(device, POOL, fmt, torch.bfloat16, max_rows=16)
    for batch in range(2):
        q = (torch.randn(rows, heads, 576, generator=gen)).to(torch.bfloat16).to(device)
        slots = slots_of(gen, rows, topk).to(device)
        out = torch.full((rows, heads, 512), float("nan"), dtype=torch.bfloat16, device=device)
        plans.run(q[..., :512], q[..., 512:], ckv, kpe, out, slots, SCALE, **scales(fmt))
        check(out, sparse_reference(q, kv, slots, SCALE), f"{device} {fmt} h{heads} #{batch}")
    assert len(plans._recent) == len({min(16, rows), rows % 16 or 16})


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device and fp8mla's CUDA backend")
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_graph_replays_rewritten_indices(fmt, gen):
    """A CUDA graph captures SparsePlans.run (its plan made before capture, pinned); before each
    replay the top-k and query buffers are rewritten in place, as SGLang's replayed indexer and
    layers write them: each replay computes on the new indices."""
    heads, rows, topk = 8, 4, 2048
    pool, kv = pool_of(fmt, gen, "cuda")
    ckv, kpe = views(pool, fmt)
    plans = SparsePlans("cuda", POOL, fmt, torch.bfloat16)
    plans.prepare(rows, heads, topk, SCALE, pin=True)
    q = torch.zeros(rows, heads, 576, dtype=torch.bfloat16, device="cuda")
    slots = torch.full((rows, topk), -1, dtype=torch.int32, device="cuda")
    out = torch.zeros(rows, heads, 512, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture, as torch recommends
        plans.run(q[..., :512], q[..., 512:], ckv, kpe, out, slots, SCALE, **scales(fmt))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plans.run(q[..., :512], q[..., 512:], ckv, kpe, out, slots, SCALE, **scales(fmt))
    for replay in range(3):
        q.copy_(torch.randn(rows, heads, 576, generator=gen).to(torch.bfloat16))
        slots.copy_(slots_of(gen, rows, topk))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out, sparse_reference(q, kv, slots, SCALE), f"{fmt} replay {replay}")
    assert not plans._recent  # no plan was made after the capture


def test_the_row_codecs_name_an_unknown_format():
    with pytest.raises(ValueError, match="^kv_format: .*got 'fp8'"):
        decode_rows(torch.zeros(1, 576, dtype=torch.uint8), "fp8")
    with pytest.raises(ValueError, match="^kv_format: .*got 'fp8'"):
        encode_rows(torch.zeros(1, 576), "fp8")
