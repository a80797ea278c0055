"""fp8mla.merge_states and fp8mla.PagedLatentCache (allocate / append / read / release)."""

import numpy as np
import pytest

import fp8mla
import mla_ref as ref


def merge_reference(v, s):
    """float64 merge of partial states from the definition; all-empty rows -> (0, -inf)."""
    rows, n, d = v.shape
    vo = np.zeros((rows, d))
    so = np.full(rows, -np.inf)
    for r in range(rows):
        live = np.isfinite(s[r])
        if not live.any():
            continue
        m = s[r][live].max()
        w = np.where(live, np.exp(np.where(live, s[r], 0.0) - m), 0.0)
        vo[r] = (w[:, None] * v[r]).sum(0) / w.sum()
        so[r] = m + np.log(w.sum())
    return vo, so


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_merge_states(rng, dtype):
    rows, n, d = 37, 5, 512
    vf = rng.standard_normal((rows, n, d)).astype(np.float32)
    s = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
    s[rng.random((rows, n)) < 0.3] = -np.inf  # empty partial states
    s[4] = -np.inf  # a row with no state at all
    if dtype == "bf16":
        v = ref.f32_to_bf16(vf)
        v64 = ref.bf16_to_f64(v)
        v_out = ref.poison_bf16((rows, d))
    else:
        v, v64 = vf, vf.astype(np.float64)
        v_out = np.full((rows, d), np.nan, np.float32)
    s_out = ref.poison_f32(rows)
    got_v, got_s = fp8mla.merge_states(v, s, v_out, s_out)
    assert got_v is v_out and got_s is s_out
    rv, rs = merge_reference(v64, s.astype(np.float64))
    got = ref.bf16_to_f64(got_v) if dtype == "bf16" else got_v
    ref.assert_close(got, rv, 8e-3 if dtype == "bf16" else 1e-5, 1e-5, "merged v")
    ref.assert_close(got_s, rs, 1e-6, 1e-5, "merged lse")
    assert np.all(got[4] == 0.0) and np.isneginf(got_s[4])


def test_merge_states_allocates_and_takes_permuted_views(rng):
    rows, n, d = 6, 3, 64
    states_major = rng.standard_normal((n, rows, d)).astype(np.float32)
    lse_major = rng.standard_normal((n, rows)).astype(np.float32)
    v = states_major.transpose(1, 0, 2)  # [rows, n, d] view
    s = lse_major.T
    vo, so = fp8mla.merge_states(v, s)
    assert vo.shape == (rows, d) and so.shape == (rows,)
    rv, rs = merge_reference(v.astype(np.float64), s.astype(np.float64))
    ref.assert_close(vo, rv, 1e-5, 1e-5, "v")
    ref.assert_close(so, rs, 1e-6, 1e-5, "s")
    with pytest.raises(ValueError, match="s"):
        fp8mla.merge_states(v, s[:, :2])


def test_split_then_merge_equals_whole(rng):
    """Attention over two halves of a context, merged, equals attention over all of it."""
    page, heads, L = 8, 4, 96
    b = ref.Batch(rng, [L], [1], page, spare_pages=0)
    data, pool = ref.make_pool(rng, "fp8_e4m3", b.num_pages, page)
    q_bits, q = ref.random_q(rng, 1, heads)
    parts = []
    for lo, hi in ((0, 6), (6, 12)):  # pages of each half
        idx = b.kv_indices[lo:hi]
        p = fp8mla.plan([0, 1], [0, hi - lo], idx, [(hi - lo) * page], num_heads=heads,
                        page_size=page, num_pages=b.num_pages, sm_scale=0.1, causal=False)
        parts.append(fp8mla.run(p, q_bits[:, :, :512], q_bits[:, :, 512:], data[:, :, :512],
                                data[:, :, 512:], return_lse=True))
    v = np.stack([ref.bf16_to_f64(o[0]) for o, _ in parts], axis=1).astype(np.float32)
    s = np.stack([lse[0] for _, lse in parts], axis=1)
    vo, so = fp8mla.merge_states(v, s)
    ro, rl = ref.attention(q, pool, b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len, page,
                           False, np.float32(0.1))
    # The partial outputs were rounded to bf16: allow half an ulp of the largest of them.
    ref.assert_close(vo, ro[0], 1e-2, 2.0**-8 * float(np.abs(v).max()), "merged halves")
    ref.assert_close(so, rl[0], 1e-5, 1e-4, "merged lse")


@pytest.mark.parametrize("fmt", ref.FORMATS)
def test_cache_append_read_and_attend(rng, fmt):
    page, pages, heads = 4, 12, 8
    scale = 0.5 if fmt == "fp8_e4m3" else 1.0
    cache = fp8mla.PagedLatentCache(pages, page, fmt, scale=scale)
    assert cache.free_pages == pages and cache.capacity_tokens == pages * page
    assert cache.token_bytes == ref.TOKEN_BYTES[fmt]
    storage = cache.storage()
    assert storage.shape == (pages, page, ref.TOKEN_BYTES[fmt]) and storage.dtype == np.uint8
    assert not storage.any()  # zero-filled

    a = cache.allocate(3)
    b_pages = cache.allocate(2)
    assert list(a) == [0, 1, 2] and list(b_pages) == [3, 4] and cache.free_pages == pages - 5
    assert cache.is_allocated(4) and not cache.is_allocated(5)
    lens = [10, 6]
    slots = np.concatenate([a[np.arange(10) // page] * page + np.arange(10) % page,
                            b_pages[np.arange(6) // page] * page + np.arange(6) % page])
    slots = slots.astype(np.int32)
    vals = ref.random_tokens(rng, (16,), fmt, scale)
    # Append with float32 rows given as strided views of one [n, 576] array.
    cache.append(slots, vals[:, :512], vals[:, 512:])
    expect = fp8mla.encode_tokens(vals, fmt, scale)
    flat = storage.reshape(-1, ref.TOKEN_BYTES[fmt])
    assert np.array_equal(flat[slots], expect)  # the storage array is a live view
    for i in (0, 7, 15):
        got = cache.read_token(int(slots[i]))
        ref.assert_close(got, ref.decode_tokens(expect[i], fmt, scale), 0.0, 0.0, "read_token")

    # Attention straight over the cache's own views.
    ckv, kpe = cache.view()
    kv_indptr = np.array([0, 3, 5], np.int32)
    kv_indices = np.concatenate([a, b_pages]).astype(np.int32)
    q_bits, q = ref.random_q(rng, 2, heads)
    p = fp8mla.plan([0, 1, 2], kv_indptr, kv_indices, lens, num_heads=heads, page_size=page,
                    num_pages=pages, sm_scale=0.08, kv_format=fmt, causal=False)
    o, lse = fp8mla.run(p, q_bits[:, :, :512], q_bits[:, :, 512:], ckv, kpe, return_lse=True,
                        ckv_scale=cache.scale, kpe_scale=cache.scale)
    pool = ref.decode_tokens(storage, fmt, scale)
    ro, rl = ref.attention(q, pool, [0, 1, 2], kv_indptr, kv_indices, lens, page, False,
                           np.float32(0.08))
    ref.check_attention(o, lse, ro, rl, f"cache {fmt}")

    # Release: all or nothing; double release and foreign ids are errors.
    cache.release(a)
    assert cache.free_pages == pages - 2 and not cache.is_allocated(0)
    with pytest.raises(ValueError, match="pages"):
        cache.release(a)
    with pytest.raises(ValueError, match="pages"):
        cache.release([3, pages])
    assert cache.is_allocated(3)  # nothing released by the failed call
    with pytest.raises(ValueError, match="slots"):  # a slot on a released page
        cache.append(np.array([0], np.int32), vals[:1, :512], vals[:1, 512:])


def test_cache_exhaustion_loses_nothing(rng):
    cache = fp8mla.PagedLatentCache(3, 2, "fp8_e4m3")
    got = cache.allocate(2)
    vals = ref.random_tokens(rng, (4,), "fp8_e4m3")
    slots = np.array([0, 1, 2, 3], np.int32)
    cache.append(slots, vals[:, :512], vals[:, 512:])
    before = cache.storage().copy()
    with pytest.raises(RuntimeError):
        cache.allocate(2)
    assert cache.free_pages == 1 and list(got) == [0, 1]
    assert np.array_equal(cache.storage(), before)
    assert len(cache.allocate(1)) == 1


def test_cache_append_nan_policy_and_bf16_input(rng):
    cache = fp8mla.PagedLatentCache(2, 4, "fp8_e4m3")
    cache.allocate(2)
    vals = ref.random_tokens(rng, (3,), "fp8_e4m3")
    vals[2, 5] = np.nan
    with pytest.raises(ValueError):
        cache.append(np.array([0, 1, 2], np.int32), vals[:, :512], vals[:, 512:], nan="error")
    assert not cache.storage().any()  # nothing written
    fp8mla.append_kv(cache, np.array([0, 1, 2], np.int32), vals[:, :512], vals[:, 512:])
    assert cache.storage()[0, 2, 5] & 0x7F == 0x7F
    # bf16 input rows (bits): same codes as encoding their float values.
    bits = ref.f32_to_bf16(vals[:2])
    cache.append(np.array([4, 5], np.int32), bits[:, :512], bits[:, 512:])
    expect = fp8mla.encode_tokens(ref.bf16_to_f64(bits).astype(np.float32), "fp8_e4m3")
    assert np.array_equal(cache.storage()[1, :2], expect)
