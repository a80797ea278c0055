"""Empty arrays are valid input (numpy 2 and nanobind hand them over with stride 0), and one plan
may be run from several Python threads at once (run() releases the GIL; CPU runs keep their
own split-KV workspace)."""

import threading

import numpy as np
import pytest

import fp8mla
import mla_ref as ref

PAGE, HEADS = 4, 2


def test_all_empty_batch_gives_zero_and_minus_inf():
    # Every kv_len 0 and kv_indices = []: before, the empty page table was "expected a
    # contiguous array". (A context-parallel shard past every request's end looks like this.)
    p = fp8mla.plan([0, 1, 3], [0, 0, 0], np.array([], np.int32), [0, 0], num_heads=HEADS,
                    page_size=PAGE, num_pages=4, sm_scale=0.1)
    q = np.full((3, HEADS, 576), 0x3F80, np.uint16)
    pool = np.zeros((4, PAGE, 576), np.uint8)
    out = ref.poison_bf16((3, HEADS, 512))
    lse = ref.poison_f32((3, HEADS))
    fp8mla.run(p, q[:, :, :512], q[:, :, 512:], pool[:, :, :512], pool[:, :, 512:], out=out,
               lse=lse)
    assert np.all(out == 0) and np.all(np.isneginf(lse))


def test_batch_of_no_requests():
    p = fp8mla.plan([0], [0], [], [], num_heads=HEADS, page_size=PAGE, num_pages=4, sm_scale=0.1)
    assert p.batch == 0 and p.total_q == 0
    q = np.zeros((0, HEADS, 576), np.uint16)
    pool = np.zeros((4, PAGE, 576), np.uint8)
    out, lse = fp8mla.run(p, q[:, :, :512], q[:, :, 512:], pool[:, :, :512], pool[:, :, 512:],
                          return_lse=True)
    assert out.shape == (0, HEADS, 512) and lse.shape == (0, HEADS)


def test_cache_calls_with_nothing_to_do():
    cache = fp8mla.PagedLatentCache(2, PAGE)
    cache.append(np.zeros(0, np.int32), np.zeros((0, 512), np.float32),
                 np.zeros((0, 64), np.float32))
    cache.release([])
    cache.release(np.zeros(0, np.int32))
    assert len(cache.allocate(0)) == 0
    assert cache.free_pages == 2
    assert not cache.storage().any()


def test_merge_states_of_no_rows_and_no_states():
    vo, so = fp8mla.merge_states(np.zeros((0, 3, 16), np.float32), np.zeros((0, 3), np.float32))
    assert vo.shape == (0, 16) and so.shape == (0,)
    vo, so = fp8mla.merge_states(np.zeros((2, 0, 16), np.float32), np.zeros((2, 0), np.float32))
    assert np.all(vo == 0) and np.all(np.isneginf(so))


@pytest.mark.parametrize("fmt", ref.FORMATS)
def test_codecs_of_empty_arrays(fmt):
    tb = fp8mla.token_bytes(fmt)
    assert fp8mla.encode_tokens(np.zeros((0, 576), np.float32), fmt).shape == (0, tb)
    assert fp8mla.decode_tokens(np.zeros((0, tb), np.uint8), fmt).shape == (0, 576)
    assert fp8mla.fp8_e4m3_encode(np.zeros((3, 0), np.float32)).shape == (3, 0)
    assert fp8mla.fp8_e4m3_decode(np.zeros(0, np.uint8)).shape == (0,)
    assert fp8mla.bf16_encode(np.zeros(0, np.float32)).shape == (0,)
    assert fp8mla.bf16_decode(np.zeros((0, 2), np.uint16)).shape == (0, 2)


def test_one_plan_from_many_threads(rng):
    # Requests split across kv chunks: before, concurrent runs of one plan shared its split-KV
    # workspace and 79 of 100 runs differed from the single-threaded result, with no error.
    page, heads = 16, 8
    b = ref.Batch(rng, [300, 260, 280], [1, 2, 1], page)
    data, _ = ref.make_pool(rng, "fp8_e4m3", b.num_pages, page)
    p = fp8mla.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len, num_heads=heads,
                    page_size=page, num_pages=b.num_pages, sm_scale=0.1, sm_count=512,
                    min_chunk_tokens=1, num_threads=2)
    assert p.partial_rows > 0
    layers = [ref.random_q(rng, b.total_q, heads)[0] for _ in range(4)]

    def run(q):
        return fp8mla.run(p, q[:, :, :512], q[:, :, 512:], data[:, :, :512], data[:, :, 512:],
                          return_lse=True)

    want = [run(q) for q in layers]
    mismatches = []
    barrier = threading.Barrier(len(layers))

    def worker(i):
        barrier.wait()
        for _ in range(5):
            out, lse = run(layers[i])
            if not (np.array_equal(out, want[i][0]) and
                    np.array_equal(lse.view(np.uint32), want[i][1].view(np.uint32))):
                mismatches.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(layers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert mismatches == []
