"""torch test cases shared by test_torch_cpu.py (torch CPU tensors, CPU backend) and
test_gpu.py (CUDA tensors, CUDA backend). Each takes the torch device to run on."""

import numpy as np
import pytest
import torch

import fp8mla
import mla_ref as ref


def bf16(bits, device):
    """numpy bf16 bits -> torch.bfloat16 tensor on ``device``."""
    t = torch.from_numpy(np.ascontiguousarray(bits).view(np.int16))
    return t.view(torch.bfloat16).to(device)


def bits(t):
    """torch.bfloat16 tensor -> numpy bf16 bits."""
    return t.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


def u8(data, device):
    return torch.from_numpy(np.ascontiguousarray(data)).to(device)


def torch_cache(data, fmt, device):
    """(ckv, kpe) torch views of a pool's bytes, typed as a framework would type them:
    bf16 -> torch.bfloat16, fp8_e4m3 -> torch.float8_e4m3fn, block -> uint8 (kpe None)."""
    t = u8(data, device)
    if fmt == "fp8_e4m3_block":
        return t, None
    t = t.view(torch.bfloat16) if fmt == "bf16" else t.view(torch.float8_e4m3fn)
    return t[:, :, :512], t[:, :, 512:]


def kv_dtype(fmt):
    return torch.bfloat16 if fmt == "bf16" else torch.float8_e4m3fn


def scales(fmt, scale=1.0):
    """run()'s scale arguments: an fp8_e4m3 cache needs both (as FlashInfer requires)."""
    return dict(ckv_scale=scale, kpe_scale=scale) if fmt == "fp8_e4m3" else {}


def nan_bf16(shape, device):
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device=device)


def make_wrapper(device, **kw):
    workspace = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    return fp8mla.BatchMLAPagedAttentionWrapper(workspace, **kw)


def plan_batch(w, b, heads, causal, sm_scale, fmt, device, **kw):
    ti = lambda a: torch.from_numpy(np.asarray(a, np.int32)).to(device)  # noqa: E731
    extra = {"kv_format": fmt} if fmt == "fp8_e4m3_block" else {}
    w.plan(ti(b.qo_indptr), ti(b.kv_indptr), ti(b.kv_indices), ti(b.kv_len), heads, 512, 64,
           b.page_size, causal, sm_scale, torch.bfloat16, kv_dtype(fmt), **extra, **kw)


def case_wrapper_formats(rng, device, fmt, page_size, heads, kv_lens, qo_lens, causal):
    """Wrapper run with poisoned out/lse against the float64 reference."""
    b = ref.Batch(rng, kv_lens, qo_lens, page_size)
    data, pool = ref.make_pool(rng, fmt, b.num_pages, page_size)
    ckv, kpe = torch_cache(data, fmt, device)
    q_bits, q = ref.random_q(rng, b.total_q, heads)
    qt = bf16(q_bits, device)
    w = make_wrapper(device)
    plan_batch(w, b, heads, causal, 0.0625, fmt, device)
    out = nan_bf16((b.total_q, heads, 512), device)
    lse = torch.full((b.total_q, heads), float("nan"), device=device)
    o, l2 = w.run(qt[:, :, :512], qt[:, :, 512:], ckv, kpe, out=out, lse=lse, return_lse=True,
                  **scales(fmt))
    assert o is out and l2 is lse and o.device == qt.device
    ro, rl = ref.attention(q, pool, b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len, page_size,
                           causal, np.float32(0.0625))
    fp8_scores = (q, 0.0625) if fmt == "fp8_e4m3" else None
    ref.check_attention(bits(o), l2.cpu().numpy(), ro, rl * ref.LOG2E, f"torch {fmt}", device,
                        pool, fp8_scores=fp8_scores)
    # Allocated outputs, base-e LSE.
    o2, le = w.run(qt[:, :, :512], qt[:, :, 512:], ckv, kpe, return_lse=True,
                   return_lse_base_on_e=True, **scales(fmt))
    assert o2.dtype == torch.bfloat16 and o2.shape == (b.total_q, heads, 512)
    ref.check_attention(bits(o2), le.cpu().numpy(), ro, rl, f"torch {fmt} base e", device,
                        pool, fp8_scores=fp8_scores)


def case_sglang_sequence(rng, device, layers=3):
    """SGLang flashinfer_mla decode: per-layer MLATokenToKVPool buffers (stored as uint8,
    read as float8_e4m3fn [size, 1, 576]), index tensors on the device, plan per batch (q
    bfloat16, kv float8_e4m3fn), run per layer on q / k_buffer slices with unit scales."""
    heads, pool_tokens, sm_scale = 16, 2000, 0.13523
    w = make_wrapper(device)
    buffers = []
    for _ in range(layers):
        vals = ref.random_tokens(rng, (pool_tokens,), "fp8_e4m3")
        store = u8(fp8mla.encode_tokens(vals, "fp8_e4m3"), device).view(pool_tokens, 1, 576)
        buffers.append((store.view(torch.float8_e4m3fn), ref.decode_tokens(
            store.cpu().numpy(), "fp8_e4m3")))
    for step in range(2):
        seq_lens = rng.integers(1, 300, size=int(rng.integers(1, 8)))
        bs = len(seq_lens)
        kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=device)
        kv_indptr[1:] = torch.cumsum(torch.from_numpy(seq_lens).to(device), dim=0)
        kv_indices = torch.from_numpy(rng.permutation(pool_tokens)[: int(seq_lens.sum())]
                                      .astype(np.int32)).to(device)
        q_indptr = torch.arange(0, bs + 1, dtype=torch.int32, device=device)
        kv_lens = torch.from_numpy(seq_lens).to(device).to(torch.int32)
        w.plan(q_indptr, kv_indptr, kv_indices, kv_lens, heads, 512, 64, 1, False, sm_scale,
               torch.bfloat16, torch.float8_e4m3fn)
        for layer, (k_buffer, pool) in enumerate(buffers):
            q_bits, q = ref.random_q(rng, bs, heads)
            reshaped_q = bf16(q_bits, device).view(-1, heads, 576)
            o = w.run(reshaped_q[:, :, :512], reshaped_q[:, :, 512:], k_buffer[:, :, :512],
                      k_buffer[:, :, 512:], ckv_scale=1.0, kpe_scale=1.0)
            o = o.view(-1, heads * 512)  # what SGLang does with the result
            ro, _ = ref.attention(q, pool, q_indptr.cpu().numpy(), kv_indptr.cpu().numpy(),
                                  kv_indices.cpu().numpy(), seq_lens, 1, False,
                                  np.float32(sm_scale))
            ref.check_attention(bits(o).reshape(bs, heads, 512), None, ro, None,
                                f"sglang step {step} layer {layer}", device, pool)


def case_opcheck(rng, device):
    """torch.library.opcheck on fp8mla::mla_decode (schema, fake tensor, functionalization)."""
    import fp8mla.torch_ops as ops

    b = ref.Batch(rng, [40, 9], [1, 1], 8)
    data, _ = ref.make_pool(rng, "fp8_e4m3", b.num_pages, 8)
    # uint8 bytes (the op takes them for FP8): opcheck's schema check compares inputs with
    # arithmetic that float8 tensors lack on the CPU.
    pool = u8(data, device)
    ckv, kpe = pool[:, :, :512], pool[:, :, 512:]
    q_bits, _ = ref.random_q(rng, b.total_q, 4)
    qt = bf16(q_bits, device)
    w = make_wrapper(device, num_pages=b.num_pages)
    plan_batch(w, b, 4, False, 0.1, "fp8_e4m3", device)
    w.run(qt[:, :, :512], qt[:, :, 512:], ckv, kpe, **scales("fp8_e4m3"))  # registers the key
    out = torch.empty(b.total_q, 4, 512, dtype=torch.bfloat16, device=device)
    lse = torch.empty(b.total_q, 4, dtype=torch.float32, device=device)
    args = (w._key, qt[:, :, :512], qt[:, :, 512:], ckv, kpe, out, lse, 1.0, 1.0)
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(ops.mla_decode, args, test_utils=utils)
    torch.library.opcheck(ops.mla_decode, args[:6] + (None, 1.0, 1.0),
                          test_utils=("test_schema", "test_faketensor"))


def case_compile(rng, device, backend):
    """torch.compile(fullgraph=True) through wrapper.run: no graph break, same result."""
    b = ref.Batch(rng, [64, 20, 5], [1, 1, 1], 16)
    data, pool = ref.make_pool(rng, "fp8_e4m3", b.num_pages, 16)
    ckv, kpe = torch_cache(data, "fp8_e4m3", device)
    q_bits, q = ref.random_q(rng, b.total_q, 8)
    qt = bf16(q_bits, device)
    w = make_wrapper(device, num_pages=b.num_pages)
    plan_batch(w, b, 8, False, 0.1, "fp8_e4m3", device)

    def layer(x, ckv, kpe):
        y = x * 1.0  # some work around the op
        o, lse = w.run(y[:, :, :512], y[:, :, 512:], ckv, kpe, return_lse=True,
                       **scales("fp8_e4m3"))
        return o.float() * 2.0, lse

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    o_c, lse_c = compiled(qt, ckv, kpe)
    o_e, lse_e = layer(qt, ckv, kpe)
    assert torch.equal(o_c, o_e) and torch.equal(lse_c, lse_e)
    ro, rl = ref.attention(q, pool, b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len, 16, False,
                           np.float32(0.1))
    # 8 heads, pages of 16: the fp8 score path on the GPU; a 5-token row
    out_rtol, out_atol, lse_rtol, lse_atol = ref.tolerances(device, pool, fp8_scores=(q, 0.1))
    ref.assert_close(o_c.cpu().numpy() / 2.0, ro, out_rtol, out_atol, "compiled out")
    ref.assert_close(lse_c.cpu().numpy(), rl * ref.LOG2E, lse_rtol, lse_atol, "compiled lse")
    # A new plan (new lengths) is picked up by the compiled function without recompiling.
    b2 = ref.Batch(rng, [3, 60, 33], [1, 1, 1], 16, num_pages=b.num_pages)
    plan_batch(w, b2, 8, False, 0.1, "fp8_e4m3", device)
    o_c2, _ = compiled(qt, ckv, kpe)
    ro2, _ = ref.attention(q, pool, b2.qo_indptr, b2.kv_indptr, b2.kv_indices, b2.kv_len, 16,
                           False, np.float32(0.1))
    ref.assert_close(o_c2.cpu().numpy() / 2.0, ro2, out_rtol, out_atol, "replanned")


def case_low_level(rng, device):
    """fp8mla.plan / run / merge_states with torch tensors."""
    dev = torch.device(device)
    b = ref.Batch(rng, [90, 13], [2, 1], 8)
    data, pool = ref.make_pool(rng, "fp8_e4m3_block", b.num_pages, 8)
    q_bits, q = ref.random_q(rng, b.total_q, 4)
    qt = bf16(q_bits, device)
    p = fp8mla.plan(torch.from_numpy(b.qo_indptr), b.kv_indptr, b.kv_indices, b.kv_len,
                    num_heads=4, page_size=8, num_pages=b.num_pages, sm_scale=0.09,
                    kv_format="fp8_e4m3_block", causal=True, device=dev)
    o, lse = fp8mla.run(p, qt[:, :, :512], qt[:, :, 512:], u8(data, device), None,
                        return_lse=True)
    ro, rl = ref.attention(q, pool, b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len, 8, True,
                           np.float32(0.09))
    ref.check_attention(bits(o), lse.cpu().numpy(), ro, rl, "low-level torch", device, pool)
    v = torch.randn(5, 3, 512, device=device)
    s = torch.randn(5, 3, device=device)
    s[2] = float("-inf")
    vo, so = fp8mla.merge_states(v, s)
    w = torch.softmax(s.double().nan_to_num(neginf=-1e300), dim=1)
    expect = (w[:, :, None] * v.double()).sum(1)
    expect[2] = 0
    assert torch.allclose(vo.double(), expect, atol=1e-5) and torch.isneginf(so[2])


def case_cache(rng, device):
    """PagedLatentCache on ``device``: append torch rows, attend over its views."""
    cache = fp8mla.PagedLatentCache(16, 4, "fp8_e4m3", scale=0.5, device=device)
    pages = cache.allocate(4)
    vals = ref.random_tokens(rng, (13,), "fp8_e4m3", 0.5)
    slots = (np.asarray(pages)[np.arange(13) // 4] * 4 + np.arange(13) % 4).astype(np.int32)
    vt = torch.from_numpy(vals).to(device)
    cache.append(torch.from_numpy(slots).to(device), vt[:, :512].to(torch.bfloat16),
                 vt[:, 512:].to(torch.bfloat16))
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    st = cache.storage(framework="torch")
    assert tuple(st.shape) == (16, 4, 576)
    expect = fp8mla.encode_tokens(
        vt.to(torch.bfloat16).float().cpu().numpy(), "fp8_e4m3", 0.5)
    assert np.array_equal(torch.as_tensor(st).cpu().numpy().reshape(-1, 576)[slots], expect)
    ckv, kpe = cache.view(framework="torch")
    q_bits, q = ref.random_q(rng, 1, 8)
    qt = bf16(q_bits, device)
    w = make_wrapper(device)
    w.plan(torch.tensor([0, 1]), torch.tensor([0, 4]), torch.from_numpy(np.asarray(pages)),
           torch.tensor([13]), 8, 512, 64, 4, False, 0.1, torch.bfloat16, torch.float8_e4m3fn)
    o = w.run(qt[:, :, :512], qt[:, :, 512:], ckv, kpe, k_scale=cache.scale)
    pool = ref.decode_tokens(torch.as_tensor(st).cpu().numpy(), "fp8_e4m3", 0.5)
    ro, _ = ref.attention(q, pool, [0, 1], [0, 4], np.asarray(pages), [13], 4, False,
                          np.float32(0.1))
    ref.check_attention(bits(o), None, ro, None, "cache", device, pool)


def case_replan_step_host_tensors(rng, device):
    """replan_step() with host int32 torch tensors (the SGLang backend's case, which the native
    module reads by address): each step matches the reference of its batch even though the
    caller overwrites its tensors right after the call; a run over a larger pool re-plans from
    the plan's own copies, not from those overwritten tensors; a refused step keeps the last
    plan and its arrays; other tensors (int64, strided) take the general path to the same
    result."""
    heads, ps, small, large = 8, 16, 30, 60
    data, pool = ref.make_pool(rng, "fp8_e4m3", large, ps)
    ckv, kpe = torch_cache(data, "fp8_e4m3", device)
    table = torch.zeros(64, dtype=torch.int32, device=device)
    w = make_wrapper(device, use_cuda_graph=True, kv_indices=table, num_pages=small,
                     max_batch=4)
    host = lambda a: torch.tensor(np.asarray(a), dtype=torch.int32)  # noqa: E731  (a copy)

    def run_and_check(b, what, view=small):
        q_bits, q = ref.random_q(rng, b.total_q, heads)
        qt = bf16(q_bits, device)
        o = w.run(qt[:, :, :512], qt[:, :, 512:], ckv[:view], kpe[:view], ckv_scale=1.0,
                  kpe_scale=1.0)
        ro, _ = ref.attention(q, pool, b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len, ps,
                              False, np.float32(0.0625))
        ref.check_attention(bits(o), None, ro, None, what, device, pool)

    def batch(lens, pages=small):
        b = ref.Batch(rng, lens, [1] * len(lens), ps, num_pages=pages)
        table[: len(b.kv_indices)] = torch.from_numpy(b.kv_indices).to(device)
        return b

    b = batch([100, 7, 230])
    plan_batch(w, b, heads, False, 0.0625, "fp8_e4m3", device)
    run_and_check(b, "plan()")
    for step, lens in enumerate([[33, 190, 5, 64], [1, 300], [250, 2, 17]]):
        b = batch(lens)
        qo, kvp, kvl = host(b.qo_indptr), host(b.kv_indptr), host(b.kv_len)
        w.replan_step(qo, kvp, kvl)
        for t in (qo, kvp, kvl):
            t.fill_(-7)  # the engine reuses its buffers for the next batch
        run_and_check(b, f"replan_step {step}, the caller's tensors overwritten")
    # A run over the larger pool re-plans for it from the last step's arrays.
    run_and_check(b, "re-planned for the larger pool after replan_step", view=large)
    # A refused step (more tokens than the listed pages hold) leaves the last plan and arrays.
    bad = batch([40, 40, 40])
    too_long = host(bad.kv_len)
    too_long[1] = ps * int(bad.kv_indptr[2] - bad.kv_indptr[1]) + 1
    with pytest.raises(ValueError, match="kv_len"):
        w.replan_step(host(bad.qo_indptr), host(bad.kv_indptr), too_long)
    with pytest.raises(ValueError, match="^kv_indptr"):
        w.replan_step(host(bad.qo_indptr), host(bad.kv_indptr)[:-1], host(bad.kv_len))
    table[: len(b.kv_indices)] = torch.from_numpy(b.kv_indices).to(device)
    run_and_check(b, "the step before the refused ones", view=small)
    run_and_check(b, "the step before the refused ones, larger pool", view=large)
    # int64 and strided host tensors: the general path, the same answers.
    for form in ("int64", "strided"):
        b = batch([70, 3, 129], pages=large)
        if form == "int64":
            args = [torch.from_numpy(np.asarray(a, np.int64)) for a in
                    (b.qo_indptr, b.kv_indptr, b.kv_len)]
        else:
            args = [host(np.repeat(a, 2))[::2] for a in (b.qo_indptr, b.kv_indptr, b.kv_len)]
            assert not args[0].is_contiguous()
        w.replan_step(*args)
        run_and_check(b, f"replan_step with {form} host tensors", view=large)
