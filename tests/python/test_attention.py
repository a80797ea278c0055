"""fp8mla.plan / fp8mla.run on the CPU backend against the float64 reference (mla_ref).

Fresh random data per test, outputs poisoned with NaN before the run, inf/NaN positions
compared as well as values.
"""

import numpy as np
import pytest

import fp8mla
import mla_ref as ref

# (format, page_size, heads, kv_lens, qo_lens, causal)
DENSE_GRID = [
    ("fp8_e4m3", 1, 8, [37, 5, 300], [1, 1, 1], False),
    ("fp8_e4m3", 16, 16, [1, 64, 129, 700], [1, 1, 1, 1], False),
    ("fp8_e4m3", 64, 1, [1000, 3], [1, 1], True),
    ("bf16", 1, 4, [9, 33], [1, 1], False),
    ("bf16", 32, 128, [100, 257], [1, 1], True),
    ("fp8_e4m3_block", 64, 8, [65, 130, 1], [1, 1, 1], False),
    ("fp8_e4m3_block", 128, 16, [300], [1], True),
    # multi-token (MTP / verify / chunked prefill), causal
    ("fp8_e4m3", 4, 8, [20, 7, 16], [4, 2, 16], True),
    ("bf16", 2, 2, [5, 40], [5, 3], True),
    ("fp8_e4m3_block", 8, 4, [33, 9], [8, 1], True),
    ("fp8_e4m3", 8, 2, [12, 30], [3, 4], False),
]


def run_case(rng, fmt, page_size, heads, kv_lens, qo_lens, causal, scale=1.0, **plan_opts):
    b = ref.Batch(rng, kv_lens, qo_lens, page_size)
    data, pool = ref.make_pool(rng, fmt, b.num_pages, page_size, scale)
    ckv, kpe = ref.cache_views(data, fmt)
    q_bits, q = ref.random_q(rng, b.total_q, heads)
    sm_scale = float(rng.uniform(0.04, 0.1))
    p = fp8mla.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len, num_heads=heads,
                    page_size=page_size, num_pages=b.num_pages, sm_scale=sm_scale,
                    kv_format=fmt, causal=causal, **plan_opts)
    assert p.batch == b.batch and p.total_q == b.total_q and p.num_heads == heads
    out = ref.poison_bf16((b.total_q, heads, 512))
    lse = ref.poison_f32((b.total_q, heads))
    got_out, got_lse = fp8mla.run(p, q_bits[:, :, :512], q_bits[:, :, 512:], ckv, kpe, out=out,
                                  lse=lse, return_lse=True, ckv_scale=scale, kpe_scale=scale)
    assert got_out is out and got_lse is lse
    ro, rl = ref.attention(q, pool, b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len, page_size,
                           causal, np.float32(sm_scale))
    ref.check_attention(out, lse, ro, rl, f"{fmt} ps={page_size} h={heads}")
    return p


@pytest.mark.parametrize("fmt,page_size,heads,kv_lens,qo_lens,causal", DENSE_GRID)
def test_dense_matches_reference(rng, fmt, page_size, heads, kv_lens, qo_lens, causal):
    run_case(rng, fmt, page_size, heads, kv_lens, qo_lens, causal)


@pytest.mark.parametrize("fmt", ref.FORMATS)
def test_float64_reference_backend(rng, fmt):
    run_case(rng, fmt, 16, 4, [50, 17], [2, 1], True, cpu_reference=True)


def test_split_kv_partition_is_exercised(rng):
    # Long contexts on few "SMs" force split requests: the merge path must agree too.
    p = run_case(rng, "fp8_e4m3", 16, 8, [4000, 2500, 10], [1, 1, 1], False, sm_count=4,
                 min_chunk_tokens=256)
    assert max(p.num_splits) > 1 and p.partial_rows > 0
    assert all(len(t) == 8 for t in p.tiles)


def test_max_tile_rows_cuts_query_blocks(rng):
    # 16 heads x 3 query tokens make one 48-row tile by default; max_tile_rows=16 gives a tile a
    # token (tiles are (request, q_begin, q_count, head_begin, head_count, kv_begin, kv_end,
    # split)), with the same answer.
    p = run_case(rng, "fp8_e4m3", 16, 16, [300, 40], [3, 2], True, max_tile_rows=16)
    assert all(t[2] == 1 for t in p.tiles)
    assert {(t[0], t[1]) for t in p.tiles} == {(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)}
    p = run_case(rng, "fp8_e4m3", 16, 16, [300, 40], [3, 2], True)
    assert {(t[0], t[1], t[2]) for t in p.tiles} == {(0, 0, 3), (1, 0, 2)}
    with pytest.raises(ValueError, match="options.max_tile_rows"):
        run_case(rng, "fp8_e4m3", 16, 16, [300], [3], True, max_tile_rows=65)


def test_causal_len_shards_merge_to_the_full_result(rng):
    """Two page-aligned shards of each context, planned with causal_len (the context's length
    minus the shard's first token), merge (merge_states) to the unsharded result: multi-token
    rows see the tokens the whole context shows them, and rows that see none of a shard give
    empty states (request 0's second shard holds only its last token)."""
    fmt, page_size, heads, sm_scale = "fp8_e4m3", 4, 8, 0.07
    b = ref.Batch(rng, [13, 40], [4, 3], page_size)
    data, pool = ref.make_pool(rng, fmt, b.num_pages, page_size)
    ckv, kpe = ref.cache_views(data, fmt)
    q_bits, q = ref.random_q(rng, b.total_q, heads)
    cut = [3, 5]  # pages of each request in the first shard
    outs, lses = [], []
    for shard in (0, 1):
        kvp, kvi, kvl, causal_len = [0], [], [], []
        for r in range(b.batch):
            pages = b.kv_indices[b.kv_indptr[r]:b.kv_indptr[r + 1]]
            length, start = int(b.kv_len[r]), shard * cut[r] * page_size
            kvi.extend(pages[:cut[r]] if shard == 0 else pages[cut[r]:])
            kvp.append(len(kvi))
            kvl.append(min(length, cut[r] * page_size) if shard == 0 else length - start)
            causal_len.append(length - start)
        p = fp8mla.plan(b.qo_indptr, kvp, kvi, kvl, num_heads=heads, page_size=page_size,
                        num_pages=b.num_pages, sm_scale=sm_scale, kv_format=fmt, causal=True,
                        causal_len=causal_len)
        o, lse = fp8mla.run(p, q_bits[:, :, :512], q_bits[:, :, 512:], ckv, kpe,
                            return_lse=True)
        outs.append(ref.bf16_to_f64(o).reshape(-1, 512))
        lses.append(lse.reshape(-1))
    assert np.all(np.isneginf(lses[1][: 3 * heads])), "query tokens 0-2 see none of shard 1"
    v = np.stack(outs, axis=1).astype(np.float32)
    s = np.stack(lses, axis=1)
    vo, so = fp8mla.merge_states(v, s)
    ro, rl = ref.attention(q, pool, b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len, page_size,
                           True, np.float32(sm_scale))
    # The partial outputs are bf16 (as run() writes them): each element carries up to 2^-9 of
    # its shard's |o| <= max |V|, which the merge's weights carry into the result.
    vmax = float(np.abs(pool[..., :512]).max())
    ref.assert_close(vo.reshape(ro.shape), ro, ref.OUT_RTOL, ref.OUT_ATOL + 2.0**-8 * vmax,
                     "merged out")
    ref.assert_close(so.reshape(rl.shape), rl, ref.LSE_RTOL, ref.LSE_ATOL, "merged lse")


def test_fp8_per_tensor_scale(rng):
    run_case(rng, "fp8_e4m3", 8, 4, [70, 9], [1, 1], False, scale=0.03125)


def test_empty_requests_give_zero_and_minus_inf(rng):
    # kv_len = 0 (with or without a listed page), causal and not: o = 0, lse = -inf.
    for causal in (False, True):
        run_case(rng, "fp8_e4m3", 4, 2, [0, 11, 0], [1, 1, 2], causal)


def test_sparse_topk(rng):
    page_size, num_pages, heads, total_q, topk = 16, 40, 8, 5, 48
    for fmt in ref.FORMATS:
        data, pool = ref.make_pool(rng, fmt, num_pages, page_size)
        ckv, kpe = ref.cache_views(data, fmt)
        slots = rng.integers(0, num_pages * page_size, (total_q, topk)).astype(np.int32)
        slots[rng.random((total_q, topk)) < 0.2] = -1
        slots[3] = -1  # a row that sees nothing
        q_bits, q = ref.random_q(rng, total_q, heads)
        qo = np.arange(total_q + 1, dtype=np.int32)
        p = fp8mla.plan(qo, None, None, None, num_heads=heads, page_size=page_size,
                        num_pages=num_pages, sm_scale=0.0625, kv_format=fmt, causal=False,
                        topk=topk, sparse_indices=slots)
        assert p.topk == topk
        out = ref.poison_bf16((total_q, heads, 512))
        lse = ref.poison_f32((total_q, heads))
        fp8mla.run(p, q_bits[:, :, :512], q_bits[:, :, 512:], ckv, kpe, out=out, lse=lse)
        ro, rl = ref.attention(q, pool, None, None, None, None, page_size, False,
                               np.float32(0.0625), sparse_indices=slots)
        ref.check_attention(out, lse, ro, rl, f"sparse {fmt}")
        # Per-layer indices replace the planned ones at run time.
        slots2 = rng.integers(-1, num_pages * page_size, (total_q, topk)).astype(np.int32)
        fp8mla.run(p, q_bits[:, :, :512], q_bits[:, :, 512:], ckv, kpe, out=out, lse=lse,
                   sparse_indices=slots2)
        ro, rl = ref.attention(q, pool, None, None, None, None, page_size, False,
                               np.float32(0.0625), sparse_indices=slots2)
        ref.check_attention(out, lse, ro, rl, f"sparse {fmt} run-time indices")


def test_run_allocates_outputs_and_q_from_one_buffer(rng):
    b = ref.Batch(rng, [40, 3], [1, 1], 8)
    data, pool = ref.make_pool(rng, "fp8_e4m3", b.num_pages, 8)
    q_bits, q = ref.random_q(rng, b.total_q, 4)
    p = fp8mla.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len, num_heads=4, page_size=8,
                    num_pages=b.num_pages, sm_scale=0.1)
    out = fp8mla.run(p, q_bits[:, :, :512], q_bits[:, :, 512:], data[:, :, :512],
                     data[:, :, 512:])
    assert out.shape == (b.total_q, 4, 512) and out.dtype == np.uint16
    ro, _ = ref.attention(q, pool, b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len, 8, True,
                          np.float32(0.1))
    ref.check_attention(out, None, ro, None, "allocated out")


def test_index_arrays_of_any_integer_type(rng):
    b = ref.Batch(rng, [10, 20], [1, 1], 4)
    p = fp8mla.plan(b.qo_indptr.tolist(), b.kv_indptr.astype(np.int64),
                    tuple(int(i) for i in b.kv_indices), b.kv_len.astype(np.uint16),
                    num_heads=2, page_size=4, num_pages=b.num_pages, sm_scale=0.1)
    assert p.batch == 2


def test_plan_records_its_kernel_family(rng):
    # A CPU plan runs cpu_fast, or the float64 reference when asked for by either option; a
    # family that cannot serve the plan, or an unknown name, is refused by name.
    assert run_case(rng, "fp8_e4m3", 16, 4, [50], [1], False).kernel_name == "cpu_fast"
    p = run_case(rng, "bf16", 16, 4, [50], [1], False, cpu_reference=True)
    assert p.kernel_name == "cpu_reference" and "kernel=cpu_reference" in repr(p)
    p = run_case(rng, "bf16", 16, 4, [50], [1], False, kernel_family="cpu_reference")
    assert p.kernel_name == "cpu_reference"
    with pytest.raises(ValueError, match="options.kernel_family.*fp8_tma"):
        run_case(rng, "fp8_e4m3", 16, 4, [50], [1], False, kernel_family="fp8_tma")
    with pytest.raises(ValueError, match="fp8_exact"):
        run_case(rng, "fp8_e4m3", 16, 4, [50], [1], False, kernel_family="fp8frag")
