#!/usr/bin/env python3
"""Writes the seed corpus of the fuzz targets: fuzz/corpus/<target>/<name>.

Each seed is one input in fuzz/fuzz_input.h's format, made field by field in the order the
target reads it: valid calls (so fuzzing starts from inputs that reach the planner and the
kernels) and the reproducers of issue 35 (bad index arrays in shard_context, ndim 1 << 24,
2^31 - 1 query tokens, sm_count 1e6, num_threads 100000, sm_scale 3.4e38, 2^32 merge states,
an extent of -1, a plan of no query tokens run with q of 5 tokens, ...). ctest replays them all
(fuzz.replay.<target>); scripts/sanitize.sh fuzzes from them. Run from anywhere:
    python3 fuzz/seeds.py
"""

import os
import struct

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
INT_MIN, INT_MAX = -(2**31), 2**31 - 1


class W:
    """Little-endian fields, as fp8mla::fuzz::Input reads them."""

    def __init__(self):
        self.b = bytearray()

    def u8(self, v):
        self.b += struct.pack("<B", v & 0xFF)
        return self

    def u16(self, v):
        self.b += struct.pack("<H", v)
        return self

    def i32(self, v):
        self.b += struct.pack("<i", v)
        return self

    def i64(self, v):
        self.b += struct.pack("<q", v)
        return self

    def f32(self, v):
        self.b += struct.pack("<f", v)
        return self

    def int_in(self, v):
        """An Input::int_in field taken raw (mode 0)."""
        return self.u8(0).i32(v)

    def int64_in(self, v):
        return self.u8(0).i64(v)

    def array(self, values):
        """An Input::array of raw values (mode 0)."""
        self.u8(0).u16(len(values))
        for v in values:
            self.i32(v)
        return self


# ---- fuzz_plan ----

CAUSAL, SPARSE, GRAPH, RUN, SHARD, REFERENCE, CAUSAL_LEN = 1, 2, 4, 8, 16, 32, 64
FORMATS = {"bf16": 0, "fp8_e4m3": 1, "fp8_e4m3_block": 2}


def plan_input(flags=0, fmt="fp8_e4m3", heads=8, page=4, pages=16, sm_scale=0.0625, topk=0,
               sm_count=4, ctas=0, min_chunk=64, threads=1, max_tile_rows=0, max_batch=0,
               max_total_q=0, max_kv_indices=0, max_qo_len=0, rank=0, world=2,
               qo=(0, 1), kvp=(0, 2), kvi=(0, 1), kv_len=(5,), causal_len=(), sparse=(),
               family=0):
    w = W().u8(flags).u8(FORMATS.get(fmt, fmt) if isinstance(fmt, str) else fmt)
    w.int_in(heads).int_in(page).int64_in(pages).f32(sm_scale).u8(0)
    if flags & SPARSE:
        w.int_in(topk)
    for v in (sm_count, ctas, min_chunk, threads, max_tile_rows, max_batch, max_total_q):
        w.int_in(v)
    w.int64_in(max_kv_indices).int_in(max_qo_len).int_in(rank).int_in(world).u8(family)
    for a in (qo, kvp, kvi, kv_len, causal_len, sparse):
        w.array(list(a))
    w.b += bytes(range(64))  # run_small's data
    return w.b


def plan_seeds():
    s = {}
    # Valid calls, planned and run, of every format; sparse; multi-token causal; a shard.
    for fmt in FORMATS:
        s[f"valid_{fmt}"] = plan_input(RUN, fmt, qo=(0, 1, 3), kvp=(0, 2, 5), kvi=(0, 1, 2, 3, 4),
                                       kv_len=(5, 9))
    s["valid_causal_mtp"] = plan_input(RUN | CAUSAL, qo=(0, 3, 5), kvp=(0, 2, 5),
                                       kvi=(4, 1, 2, 3, 0), kv_len=(7, 12))
    s["valid_split"] = plan_input(RUN, sm_count=64, min_chunk=1, page=16, pages=16,
                                  qo=(0, 1, 2), kvp=(0, 8, 16), kvi=tuple(range(16)),
                                  kv_len=(120, 128))
    s["valid_sparse"] = plan_input(RUN | SPARSE, topk=4, qo=(0, 1, 3), kvp=(), kvi=(), kv_len=(),
                                   sparse=(0, 1, -1, 5, 6, 7, 8, 63, -1, -1, -1, 2))
    s["valid_shard"] = plan_input(RUN | SHARD | CAUSAL, rank=1, world=2, qo=(0, 2), kvp=(0, 3),
                                  kvi=(3, 1, 2), kv_len=(10,))
    s["valid_graph"] = plan_input(RUN | GRAPH, max_batch=2, max_total_q=3, max_kv_indices=5,
                                  qo=(0, 1, 3), kvp=(0, 2, 5), kvi=(0, 1, 2, 3, 4), kv_len=(5, 9))
    s["valid_reference"] = plan_input(RUN | REFERENCE, qo=(0, 1), kvp=(0, 2), kvi=(0, 1),
                                      kv_len=(5,))
    s["empty_batch"] = plan_input(RUN, qo=(0,), kvp=(0,), kvi=(), kv_len=())
    s["no_query_tokens"] = plan_input(RUN, qo=(0, 0, 0), kvp=(0, 1, 2), kvi=(0, 1), kv_len=(3, 4))
    s["all_empty_context"] = plan_input(RUN | CAUSAL, qo=(0, 1, 3), kvp=(0, 0, 0), kvi=(),
                                        kv_len=(0, 0))
    # Issue 35: shard_context read past kv_indices or overflowed.
    for name, kvp in (("int_min", (INT_MIN, 0)), ("past_end", (1000, 1001)),
                      ("negative", (-100000, -99999))):
        s[f"issue35_shard_kv_indptr_{name}"] = plan_input(SHARD | RUN, qo=(0, 1), kvp=kvp,
                                                          kvi=(0,), kv_len=(1,))
    s["issue35_shard_qo_indptr"] = plan_input(SHARD, qo=(0, INT_MIN), kvp=(0, 1), kvi=(0,),
                                              kv_len=(1,))
    # Issue 35: unbounded work and memory from small inputs.
    s["issue35_total_q_int_max"] = plan_input(0, heads=128, qo=(0, INT_MAX), kvp=(0, 0), kvi=(),
                                              kv_len=(0,))
    s["issue35_graph_sm_count_1e6"] = plan_input(GRAPH | RUN, sm_count=10**6, max_batch=2,
                                                 max_total_q=3, max_kv_indices=5,
                                                 qo=(0, 1, 3), kvp=(0, 2, 5),
                                                 kvi=(0, 1, 2, 3, 4), kv_len=(5, 9))
    s["issue35_sm_count_int_max"] = plan_input(GRAPH, sm_count=INT_MAX, max_batch=1,
                                               max_total_q=1, max_kv_indices=2)
    s["issue35_num_threads_1e5"] = plan_input(RUN, threads=100000)
    s["issue35_sm_scale_3e38"] = plan_input(RUN, sm_scale=3.4e38)
    s["graph_max_kv_indices_2e40"] = plan_input(GRAPH, max_batch=1, max_total_q=1,
                                                max_kv_indices=2**40)
    s["sparse_topk_int_max"] = plan_input(SPARSE, topk=INT_MAX, qo=(0, 3), kvp=(), kvi=(),
                                          kv_len=())
    s["kv_indptr_mismatch"] = plan_input(RUN, qo=(0, 1), kvp=(0, 5), kvi=(0,), kv_len=(1,))
    s["family_cpu_reference"] = plan_input(RUN, family=128 + 2)
    s["family_cuda_on_cpu"] = plan_input(RUN, family=128 + 5)
    s["family_unknown"] = plan_input(RUN, family=128 + 15)
    return s


# ---- fuzz_run ----


def dense(w):
    """fuzz_tensor.h's mode 0 (the expected shape, dense) and its fill byte."""
    return w.u8(0).u8(7)


def hostile(w, ndim, dtype, shape, stride, device=1):
    """Mode 2: every field raw. dtype: 0 u8 1 i32 2 f32 3 bf16 4 f16 5 fp8 6 i64; device 0 =
    cuda."""
    w.u8(2).int_in(ndim).u8(dtype).u8(device)
    for d in range(4):
        w.int64_in(shape[d] if d < len(shape) else 0)
        w.int64_in(stride[d] if d < len(stride) else 0)
    return w.u8(7)


def run_input(tensors, fmt=1, qo_steps=(1, 2), pages=((0, 1), (2, 3, 4)), lens=(5, 9)):
    """fuzz_run's run branch: 8 heads, pages of 4, the given requests, then 6 tensors (q_nope,
    q_pe, out, lse, ckv, kpe) written by the callables in `tensors` (default dense)."""
    w = W().u8(0).u8(fmt).int_in(8).u8(2).u8(len(qo_steps) - 1)
    for step, pg, ln in zip(qo_steps, pages, lens):
        w.u8(step).u8(len(pg))
        for p in pg:
            w.u8(p)
        if pg:
            w.u8(ln - 1)
    w.u8(3).u8(0).u8(0)  # sm_count 4, 1 thread, the fast path
    for i in range(6):
        (tensors.get(i) or dense)(w)
    return w.u8(0).u8(0).b


def merge_input(rows, states, dim, tensors):
    w = W().u8(1).int64_in(rows).int64_in(states).int64_in(dim).u8(0).u8(0)
    for i in range(4):
        (tensors.get(i) or dense)(w)
    return w.b


def run_seeds():
    s = {}
    for fmt in (0, 1, 2):
        s[f"valid_run_format{fmt}"] = run_input({}, fmt)
    s["valid_merge"] = merge_input(5, 3, 16, {})
    s["merge_no_states"] = merge_input(3, 0, 16, {})
    s["merge_no_rows"] = merge_input(0, 3, 16, {})
    # Issue 35: ndim 1 << 24 and 5 read past the 4-entry shape arrays in describe().
    s["issue35_q_nope_ndim_2pow24"] = run_input({0: lambda w: hostile(w, 1 << 24, 3, [], [])})
    s["issue35_lse_ndim_5"] = run_input({3: lambda w: hostile(w, 5, 2, [3, 8, 1, 1], [8, 1, 1, 1])})
    # Issue 35: a plan of no query tokens run with q of 5 tokens checked nothing.
    s["issue35_no_query_tokens_q_of_5"] = run_input(
        {0: lambda w: hostile(w, 3, 3, [5, 8, 512], [4096, 512, 1]),
         1: lambda w: hostile(w, 3, 3, [5, 8, 64], [512, 64, 1])},
        qo_steps=(0, 0))
    s["out_heads_overlap"] = run_input({2: lambda w: hostile(w, 3, 3, [3, 8, 512], [512, 0, 1])})
    s["q_stride_beyond_int64"] = run_input(
        {0: lambda w: hostile(w, 3, 3, [3, 8, 512], [2**62, 512, 1])})
    # Issue 35: 2^32 and 2^31 states (stride-0 views) were truncated to int; 2^62 rows overflowed.
    for name, rows, states in (("states_2pow32", 1, 2**32), ("states_2pow31", 1, 2**31),
                               ("rows_2pow62", 2**62, 2)):
        s[f"issue35_merge_{name}"] = merge_input(1, 1, 1, {
            0: lambda w, r=rows, n=states: hostile(w, 3, 2, [r, n, 1], [0, 0, 1]),
            1: lambda w, r=rows, n=states: hostile(w, 2, 2, [r, n], [0, 0]),
            2: lambda w, r=rows: hostile(w, 2, 2, [r, 1], [1, 1]),
            3: lambda w, r=rows: hostile(w, 1, 2, [r], [1]),
        })
    s["merge_values_bound"] = merge_input(1, 1, 1, {
        0: lambda w: hostile(w, 3, 2, [1 << 22, 4096, 4096], [0, 0, 1]),
        1: lambda w: hostile(w, 2, 2, [1 << 22, 4096], [0, 0]),
    })
    return s


# ---- fuzz_cache ----


def cache_input(ops, pages=4, page=4, fmt=1):
    w = W().u8(0).int64_in(pages).int_in(page).u8(fmt).u8(0)
    for op in ops:
        op(w)
    return w.b


def allocate(n):
    return lambda w: w.u8(0).int64_in(n)


def release(pages):
    return lambda w: w.u8(1).array(pages)


def append(n, dtype, slots, ckv=dense, kpe=dense, values=(), nan_error=False):
    """Op 2: n tokens of dtype (2 f32 3 bf16 4 f16); `slots` writes the slots view, `values`
    the slot ids fuzz_cache writes into it (raw int_in fields, one a token)."""
    def op(w):
        w.u8(2).int64_in(n).u8(dtype)
        slots(w)
        ckv(w)
        kpe(w)
        for v in values:
            w.int_in(v)
        w.u8(1 if nan_error else 0)
    return op


def read_token(slot, size=576):
    return lambda w: w.u8(3).int_in(size).int64_in(slot)


def codec_input(fmt, values, token_size, raw, out_size, name=b"fp8"):
    w = W().u8(1).u8(fmt).u8(0).int_in(len(values))
    for v in values:
        w.u8(1).f32(v)
    w.int_in(token_size).u8(0).int_in(len(raw))
    for b in raw:
        w.u8(b)
    w.int_in(out_size).u8(len(name))
    for c in name:
        w.u8(c)
    return w.b


def cache_seeds():
    s = {}
    s["valid_allocate_append_read_release"] = cache_input(
        [allocate(2), append(1, 2, dense, values=[3]), read_token(3), release([0, 1]),
         allocate(1)])
    s["valid_bf16_pool"] = cache_input([allocate(4), append(2, 3, dense, values=[5, 9]),
                                        read_token(5)], fmt=0)
    s["valid_block_pool"] = cache_input([allocate(1), append(1, 4, dense, values=[1])], fmt=2)
    s["append_unallocated_slot"] = cache_input([allocate(1), append(2, 2, dense, values=[1, 6])])
    s["release_nothing_append_nothing"] = cache_input([release([]), append(0, 2, dense)])
    s["double_release"] = cache_input([allocate(1), release([0, 0]), release([0]), release([0])])
    s["allocate_beyond_free"] = cache_input([allocate(3), allocate(2), allocate(-1)])
    s["read_outside"] = cache_input([read_token(-1), read_token(16), read_token(0, 575)])
    # Issue 35: append with an extent of -1 asked for 2^64 floats (std::length_error).
    s["issue35_append_extent_minus_1"] = cache_input([allocate(4), append(-1, 2, dense)])
    # More tokens than the pool has slots, rows of stride 0.
    s["append_beyond_pool"] = cache_input([
        allocate(4),
        append(17, 2, dense, values=[0] * 17,
               ckv=lambda w: w.u8(1).int64_in(0).int64_in(1).u8(7),
               kpe=lambda w: w.u8(1).int64_in(0).int64_in(1).u8(7))])
    s["append_slots_ndim_2pow24"] = cache_input(
        [allocate(1), append(1, 2, lambda w: hostile(w, 1 << 24, 1, [1], [1]))])
    s["config_too_many_slots"] = cache_input([], pages=2**40, page=128)
    s["config_bad_page"] = cache_input([], page=3)
    s["codec_fp8"] = codec_input(1, [0.5 * i for i in range(576)], 576, bytes(range(256)) * 3, 576)
    s["codec_bf16"] = codec_input(0, [-1.0] * 576, 1152, bytes(1152), 576, b"bf16")
    s["codec_block"] = codec_input(2, [1e3] * 576, 656, bytes(656), 576, b"block656")
    s["codec_wrong_sizes"] = codec_input(1, [1.0] * 10, 5, bytes(3), 7, b"\x00\xff")
    return s


# ---- fuzz_page_table ----


def page_table_input(n_rows, width, ps, lens, rows, capacity, indptr_size, wide=True, tensors={}):
    """fuzz_page_table: the token table's size, the page size, the lengths, then the views
    (tokens, rows, table: default dense), kv_indptr's size and the row ids."""
    w = W().int64_in(n_rows).int64_in(width).int_in(ps).u8(1 if wide else 0).array(lens)
    (tensors.get(0) or dense)(w)
    (tensors.get(1) or dense)(w)
    w.int64_in(capacity)
    (tensors.get(2) or dense)(w)
    w.u8(0).i32(indptr_size)
    for r in rows:
        w.int_in(r)
    return w.b


def page_table_seeds():
    s = {}
    for ps in (1, 16, 64):
        s[f"valid_page{ps}"] = page_table_input(5, 200, ps, [200, 0, 17, 1], [3, 0, 4, 1], 300, 5)
    s["valid_i32_rows"] = page_table_input(4, 40, 16, [40, 20], [2, 1], 8, 3, wide=False)
    s["valid_no_indptr"] = page_table_input(4, 40, 16, [40, 20], [2, 1], 8, 0)
    s["empty_batch"] = page_table_input(2, 8, 1, [], [], 4, 1)
    s["table_too_short"] = page_table_input(4, 40, 16, [40, 20], [2, 1], 4, 3)
    s["kv_len_past_row"] = page_table_input(4, 40, 16, [49, 1], [2, 1], 8, 3)
    s["row_outside"] = page_table_input(4, 40, 16, [40, 20], [0, 4], 8, 3)
    s["indptr_wrong_size"] = page_table_input(4, 40, 16, [40, 20], [2, 1], 8, 2)
    s["page_size_24"] = page_table_input(4, 40, 24, [40, 20], [2, 1], 8, 3)
    s["tokens_inner_stride_2"] = page_table_input(
        4, 40, 16, [40, 20], [2, 1], 8, 3, tensors={0: lambda w: hostile(w, 2, 1, [4, 40], [80, 2])})
    s["table_strided"] = page_table_input(
        4, 40, 16, [40, 20], [2, 1], 8, 3, tensors={2: lambda w: hostile(w, 1, 1, [8], [2])})
    s["rows_on_cuda"] = page_table_input(
        4, 40, 16, [40, 20], [2, 1], 8, 3, tensors={1: lambda w: hostile(w, 1, 6, [2], [1], 0)})
    return s


def main():
    for target, seeds in (("plan", plan_seeds()), ("run", run_seeds()), ("cache", cache_seeds()),
                          ("page_table", page_table_seeds())):
        folder = os.path.join(ROOT, target)
        os.makedirs(folder, exist_ok=True)
        for name, data in seeds.items():
            with open(os.path.join(folder, name), "wb") as f:
                f.write(bytes(data))
        print(f"{folder}: {len(seeds)} seeds")


if __name__ == "__main__":
    main()
