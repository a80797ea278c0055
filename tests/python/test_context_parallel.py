"""Context parallelism over NCCL from Python (fp8mla.NcclComm, plan/replan/run_context_parallel).

On the CPU: the NCCL id and the arguments NcclComm checks before it joins a group. On a GPU
(torch, a CUDA device, a CUDA build): world 1, whose merged result must equal fp8mla.run's bit
for bit (one state merges to itself), also captured in a CUDA graph and re-planned. Worlds of
several GPUs are tested in C++ (tests/cuda/test_cuda_context_parallel.cpp, one thread a GPU).
"""

import numpy as np
import pytest

import fp8mla
import mla_ref as ref


def nccl_id_or_skip():
    try:
        return fp8mla.nccl_unique_id()
    except RuntimeError as e:  # no NCCL on this machine
        pytest.skip(str(e))


def test_nccl_ids_are_fresh_128_bytes():
    a, b = nccl_id_or_skip(), nccl_id_or_skip()
    assert isinstance(a, bytes) and len(a) == 128 and a != b


@pytest.mark.parametrize("args,name", [((b"short", 0, 1, 0), "id"),
                                       ((bytes(128), 0, 0, 0), "world"),
                                       ((bytes(128), 2, 2, 0), "rank")])
def test_nccl_comm_checks_its_arguments_first(args, name):
    with pytest.raises(ValueError, match=name):
        fp8mla.NcclComm(*args)


def gpu_or_skip():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or not fp8mla.cuda_available():
        pytest.skip("needs torch with a CUDA device and fp8mla's CUDA backend")
    return torch


@pytest.mark.parametrize("graph", [False, True])
def test_world_one_equals_run(rng, graph):
    torch = gpu_or_skip()
    import torch_cases as cases

    comm = fp8mla.NcclComm(nccl_id_or_skip(), 0, 1, 0)
    b = ref.Batch(rng, [3000, 17, 0, 900], [1, 1, 1, 1], 16, spare_pages=300)
    data, _ = ref.make_pool(rng, "fp8_e4m3", b.num_pages, 16)
    ckv, kpe = cases.torch_cache(data, "fp8_e4m3", "cuda")
    q_bits, _ = ref.random_q(rng, b.total_q, 16)
    qt = cases.bf16(q_bits, "cuda")
    kw = dict(num_heads=16, page_size=16, num_pages=b.num_pages, sm_scale=0.08, causal=True)
    graph_kw = dict(cuda_graph=True, max_batch=b.batch, max_total_q=b.total_q,
                    max_kv_indices=b.num_pages, max_qo_len=1) if graph else {}
    cp = fp8mla.plan_context_parallel(comm, b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len,
                                      **kw, **graph_kw)
    assert (cp.rank, cp.world, cp.kv_len) == (0, 1, list(b.kv_len))
    out = cases.nan_bf16((b.total_q, 16, 512), "cuda")
    lse = torch.full((b.total_q, 16), float("nan"), device="cuda")

    def run():
        fp8mla.run_context_parallel(cp, qt[:, :, :512], qt[:, :, 512:], ckv, kpe, out=out,
                                    lse=lse)

    batches = [b]
    if graph:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            run()  # NCCL's and the kernels' first-use set-up, outside capture
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            run()
        b2 = ref.Batch(rng, [5000, 1, 64, 2], [1, 1, 1, 1], 16, num_pages=b.num_pages)
        batches.append(b2)
    for i, bb in enumerate(batches):
        if i == 1:
            fp8mla.replan_context_parallel(cp, bb.qo_indptr, bb.kv_indptr, bb.kv_indices,
                                           bb.kv_len, **kw)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        g.replay() if graph else run()
        torch.cuda.synchronize()
        # The same options, so the same partition and kernels: equal bits.
        p = fp8mla.plan(bb.qo_indptr, bb.kv_indptr, bb.kv_indices, bb.kv_len, **kw, **graph_kw,
                        device="cuda")
        want, want_lse = fp8mla.run(p, qt[:, :, :512], qt[:, :, 512:], ckv, kpe, return_lse=True)
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), want.view(torch.int16)), f"batch {i}"
        assert torch.equal(lse.nan_to_num(), want_lse.nan_to_num()), f"batch {i}"
