"""CPU checks of bench/peers/ (the fp8mla vs FlashInfer / FlashMLA MLA benchmark): its case grid
and selection, page tables and sparse top-k rows, the -1 handling and FlashInfer's
sparse-as-page-table form, the float64 reference (both token formats), the report; with torch,
the fp8mla peer end to end on the CPU backend; with torch and the carried FlashInfer
(.device_carry/flashinfer on PYTHONPATH), the FlashInfer peer's plan/run calls as far as Python
goes, the native module stubbed. The 656-byte pool's peers (fp8mla_block, FlashMLA) are in
test_mla_peers_block.py. No GPU needed; the torch and FlashInfer parts skip where those are
missing."""

import json
import math
import os
import struct
import sys

import numpy as np
import pytest

from peers_testing import ROOT, torch_and  # bench/peers on sys.path first

import mla_peers  # noqa: E402
import peers_cases as pc  # noqa: E402
import peers_reference as ref  # noqa: E402
import peers_report as report  # noqa: E402

# ---- cases ----


def test_grid_matches_the_issue():
    dense = pc.dense_cases()
    assert len(dense) == 18 and {c.page for c in dense} == {64, 1}
    assert {(c.bs, c.heads, c.ctx) for c in dense} == set(pc.DENSE_SHAPES)
    sparse = pc.sparse_cases()
    assert len(sparse) == 32
    assert {c.ctx for c in sparse} == {2048, 512}
    assert {c.heads for c in sparse} == {8, 16, 64, 128}
    assert {c.bs for c in sparse} == {1, 16, 64, 128}
    names = [c.name for c in pc.all_cases()]
    assert len(set(names)) == len(names)
    assert set(pc.all_cases(quick=True)) <= set(pc.all_cases())


def test_select_cases():
    cases = pc.all_cases()
    assert pc.select_cases(cases, "") == cases
    assert all(c.kind == "sparse" for c in pc.select_cases(cases, "sparse"))
    one = pc.select_cases(cases, "dense/128/16/8192/p64")
    assert [c.name for c in one] == ["dense/128/16/8192/p64"]
    # dense/1/* must not take bs 16, 64 or 128
    assert {c.bs for c in pc.select_cases(cases, "dense/1/*")} == {1}
    both = pc.select_cases(cases, "sparse/*/k512/*,dense/64/*")
    assert both == [c for c in cases if c in both]  # grid order, no duplicates
    with pytest.raises(ValueError, match="nonesuch"):
        pc.select_cases(cases, "dense,nonesuch")


def test_parse_args_rejects_unknown_peers_and_cases():
    with pytest.raises(SystemExit):
        mla_peers.parse_args(["--peers", "fp8mla,nonesuch"])
    assert mla_peers.parse_args([]).peer_list == ["fp8mla", "fp8mla_block", "flashmla",
                                                  "flashinfer"]
    with pytest.raises(SystemExit):
        mla_peers.parse_args(["--cases", "dense/3/*"])
    a = mla_peers.parse_args(["--quick", "--peers", "flashinfer", "--cases", "sparse"])
    assert a.peer_list == ["flashinfer"] and a.reps == 7
    assert a.selected and all(c.kind == "sparse" for c in a.selected)


def test_dense_page_tables_are_disjoint_regions(rng):
    indptr, kv_len, tables = pc.dense_page_tables(rng, 3, 700, 64, 200, 8)
    per_req = 11  # ceil(700 / 64)
    assert indptr.tolist() == [0, 11, 22, 33] and kv_len.tolist() == [700] * 3
    assert len(tables) == 6  # 200 pages hold 6 calls of 33 pages
    for v, t in enumerate(tables):
        assert t.dtype == np.int32 and sorted(t.tolist()) == list(range(33 * v, 33 * v + 33))
    assert per_req * 3 == len(tables[0])
    with pytest.raises(ValueError, match="pool has"):
        pc.dense_page_tables(rng, 4, 4096, 64, 200, 1)


def test_dense_request_tokens(rng):
    indptr, kv_len, tables = pc.dense_page_tables(rng, 2, 100, 64, 10, 1)
    tok = pc.dense_request_tokens(tables[0], indptr, kv_len, 64, 1)
    pages = tables[0][2:4]
    assert tok.tolist() == [int(pages[0]) * 64 + i for i in range(64)] + \
        [int(pages[1]) * 64 + i for i in range(36)]


def test_sparse_rows_have_scattered_minus_one(rng):
    idx = pc.sparse_rows(rng, 64, 2048, 1 << 20, 0.05)
    assert idx.shape == (64, 2048) and idx.dtype == np.int32
    valid = idx >= 0
    assert valid[:, 0].all()
    assert idx[valid].max() < (1 << 20) and (idx[~valid] == -1).all()
    frac = 1.0 - valid.mean()
    assert 0.03 < frac < 0.07
    # scattered, not a tail: some row has a -1 before a valid entry
    assert any((~valid[r, :-1] & valid[r, 1:]).any() for r in range(64))
    with pytest.raises(ValueError, match="int32"):
        pc.sparse_rows(rng, 1, 4, 1 << 32, 0.0)


def test_sparse_to_page_table_drops_minus_one(rng):
    idx = np.array([[5, -1, 7, 9], [-1, -1, 3, -1], [1, 2, 3, 4]], dtype=np.int32)
    qo, kvp, kvi, kvl = pc.sparse_to_page_table(idx)
    assert qo.tolist() == [0, 1, 2, 3]
    assert kvl.tolist() == [3, 1, 4]
    assert kvp.tolist() == [0, 3, 4, 8]
    assert kvi.tolist() == [5, 7, 9, 3, 1, 2, 3, 4]
    assert all(a.dtype == np.int32 for a in (qo, kvp, kvi, kvl))
    big = pc.sparse_rows(rng, 16, 512, 100000, 0.1)
    qo, kvp, kvi, kvl = pc.sparse_to_page_table(big)
    for r in range(16):
        row = big[r]
        assert kvi[kvp[r]:kvp[r + 1]].tolist() == row[row >= 0].tolist()
    assert kvl.tolist() == pc.valid_counts(big).tolist()


def test_bytes_and_check_requests():
    d = pc.Case("dense", 128, 16, 8192, 64)
    assert pc.bytes_read(d) == 128 * 8192 * 576
    s = pc.Case("sparse", 128, 8, 2048, 1)
    assert pc.bytes_read(s, [1000, 1100]) == 1050 * 576
    assert pc.bytes_read(s, [1000, 1100], pc.BLOCK_TOKEN_BYTES) == 1050 * 656
    assert pc.bytes_read(d, None, 656) == 128 * 8192 * 656
    assert pc.check_requests(1) == [0] and pc.check_requests(128) == [0, 64, 127]


# ---- reference ----


def test_e4m3_values_and_scales():
    codes = np.array([[0x38, 0x7E, 0x01, 0x80, 0xB8] + [0x38] * 571], dtype=np.uint8)
    v = ref.decode_tokens(codes, 0.5, 4.0)
    assert v[0, :5].tolist() == [0.5, 224.0, 2.0**-10, -0.0, -0.5]
    assert v[0, 511] == 0.5 and v[0, 512] == 4.0 and v[0, 575] == 4.0
    assert math.isnan(ref.E4M3[0x7F]) and math.isnan(ref.E4M3[0xFF])
    assert ref.E4M3[:0x7F].max() == 448.0


def test_bf16_to_f64():
    bits = np.array([0x3F80, 0xC000, 0x0000], dtype=np.uint16)
    assert ref.bf16_to_f64(bits).tolist() == [1.0, -2.0, 0.0]
    assert ref.bf16_to_f64(bits.view(np.int16)).tolist() == [1.0, -2.0, 0.0]


def _e4m3_value(code):
    """An e4m3fn code's value from its bit fields (sign, 4-bit exponent of bias 7, 3-bit
    mantissa; exponent 0 subnormal), written out apart from peers_reference's table."""
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 0:
        return sign * man * 2.0**-9
    return sign * (8 + man) * 2.0 ** (exp - 10)


def _bf16_bytes(value):
    """The little-endian bf16 bytes of a value bf16 holds exactly: float32's upper half."""
    b = struct.pack("<f", value)
    assert b[:2] == b"\0\0", value
    return b[2:]


def test_decode_block_tokens_by_hand(rng):
    """656-byte tokens built from their documented layout (512 codes, 4 little-endian float32
    scales, 64 little-endian bf16) decode to code x its block's scale and the rope values."""
    tokens, want = [], []
    for t in range(3):
        codes = rng.integers(0, 256, 512)
        codes[(codes & 0x7F) == 0x7F] = 0x38  # no NaN codes
        codes[:4] = [0x38, 0x7E, 0x01, 0xB8]  # 1, 448, 2^-9, -1
        scales = [2.0**-7, 0.5, 3.0, 1024.0] if t == 0 else [float(2.0**k) for k in
                                                             rng.integers(-12, 4, 4)]
        rope = [(-1) ** i * (1 + i / 64) * 2.0 ** (i % 5 - 2 - t) for i in range(64)]
        data = (bytes(codes.astype(np.uint8).tolist()) + struct.pack("<4f", *scales)
                + b"".join(_bf16_bytes(v) for v in rope))
        assert len(data) == 656
        tokens.append(np.frombuffer(data, dtype=np.uint8))
        want.append([_e4m3_value(int(c)) * scales[i // 128] for i, c in enumerate(codes)] + rope)
    got = ref.decode_block_tokens(np.stack(tokens)[None])  # leading dims kept
    assert got.shape == (1, 3, 576) and got.dtype == np.float64
    np.testing.assert_array_equal(got[0], np.array(want))
    assert got[0, 0, :4].tolist() == [2.0**-7, 448 * 2.0**-7, 2.0**-16, -(2.0**-7)]
    try:
        import fp8mla.format as fmt  # the library's own codec of the same layout
    except ImportError:
        fmt = None
    if fmt is not None:
        np.testing.assert_array_equal(got[0], fmt.decode_tokens(np.stack(tokens),
                                                                "fp8_e4m3_block"))
    with pytest.raises(ValueError, match="656"):
        ref.decode_block_tokens(np.zeros((2, 576), dtype=np.uint8))


def test_attention_against_the_definition(rng):
    heads, n = 3, 20
    q = rng.standard_normal((heads, 576))
    keys = rng.standard_normal((n, 576))
    o, lse = ref.attention(q, keys, 0.1)
    for h in range(heads):
        s = [0.1 * sum(q[h, d] * keys[j, d] for d in range(576)) for j in range(n)]
        m = max(s)
        w = [math.exp(x - m) for x in s]
        z = sum(w)
        assert lse[h] == pytest.approx(m + math.log(z), rel=1e-12)
        want = [sum(w[j] * keys[j, d] for j in range(n)) / z for d in range(0, 512, 37)]
        np.testing.assert_allclose(o[h, 0:512:37], want, rtol=1e-10, atol=1e-12)
    o1, lse1 = ref.attention(q, keys[:1], 0.1)  # one key: o = its latent
    np.testing.assert_allclose(o1, np.broadcast_to(keys[0, :512], (heads, 512)))
    o0, lse0 = ref.attention(q, keys[:0], 0.1)
    assert (o0 == 0).all() and np.isneginf(lse0).all()


def test_rel_l2():
    a = np.array([3.0, 4.0])
    assert ref.rel_l2(a, a) == 0.0
    assert ref.rel_l2(a * 1.01, a) == pytest.approx(0.01)
    assert ref.rel_l2(np.zeros(2), np.zeros(2)) == 0.0
    assert ref.rel_l2(a, np.zeros(2)) == math.inf
    assert math.isnan(ref.rel_l2(np.array([np.nan, 4.0]), a))
    assert not ref.rel_l2(np.array([np.nan, 4.0]), a) <= report.CHECK_REL_L2


# ---- report ----


def test_report_rows_table_and_json():
    c = pc.Case("sparse", 128, 8, 2048, 1)
    ok = report.row(c, "fp8mla", "ok", 8, 50.0, 1.2e8, 4000.0, 3e-3)
    assert ok["gbs"] == pytest.approx(2400.0) and ok["read_pct"] == pytest.approx(60.0)
    assert ok["topk"] == 2048 and "context" not in ok
    bad = report.row(c, "flashinfer", "not importable: ImportError: no module", rel_l2=math.nan)
    text = report.table([ok, bad])
    assert "not importable: ImportError" in text and "2400" in text
    doc = json.loads(report.document({"device": "x"}, {"read_ceiling_gbs": 4000.0},
                                     {"flashinfer": bad["status"]}, [ok, bad]))
    assert doc["cases"][1]["check_rel_l2"] is None and doc["cases"][0]["us"] == 50.0
    assert mla_peers.speedups([ok, dict(ok, peer="flashinfer", us=100.0)])[0].endswith("2.00")


# ---- the fp8mla peer end to end on the CPU backend (torch CPU tensors) ----


@pytest.mark.parametrize("case", [pc.Case("dense", 3, 8, 700, 64),
                                  pc.Case("sparse", 4, 16, 256, 1)], ids=lambda c: c.name)
def test_fp8mla_peer_on_cpu(case):
    torch = torch_and("fp8mla")
    import peer_fp8mla
    import peers_inputs

    pool = peers_inputs.make_pool(torch, torch.device("cpu"), 64 * 70, 11, chunk=1000)
    inp = peers_inputs.CaseInputs(torch, case, pool, 2, 5)  # 70 pages: two dense calls
    requests = pc.check_requests(case.bs)
    ref_o, _ = inp.reference(requests)
    runs = peer_fp8mla.Fp8mlaPeer(peer_fp8mla.load()[0]).prepare(inp)
    assert len(runs) == inp.calls == 2
    inp.poison_out()
    runs[0]()
    got, finite = inp.output_rows(requests)
    assert finite and ref.rel_l2(got, ref_o) <= 5e-3
    runs[1]()  # call 1 reads other tokens: another answer
    assert ref.rel_l2(inp.output_rows(requests)[0], ref_o) > 0.1
    # The check catches a wrong scale.
    inp.ckv_scale *= 2.0
    peer_fp8mla.Fp8mlaPeer(peer_fp8mla.load()[0]).prepare(inp)[0]()
    assert ref.rel_l2(inp.output_rows(requests)[0], ref_o) > report.CHECK_REL_L2


def test_run_case_reports_every_peer(monkeypatch):
    """mla_peers.run_case on the CPU: fp8mla checked and timed (a wall-clock timer stands in for
    the CUDA graph), a peer writing wrong values not timed, a failing and a missing peer
    reported, none dropped."""
    torch = torch_and("fp8mla")
    import peer_fp8mla
    import peers_inputs

    good = peer_fp8mla.Fp8mlaPeer(peer_fp8mla.load()[0])

    class Wrong:
        def prepare(self, inputs):
            runs = good.prepare(inputs)
            return [lambda: (runs[0](), inputs.out.mul_(1.1))]

    class Unwritten:
        def prepare(self, inputs):
            return [lambda: inputs.out[:-1].zero_()]

    class Failing:
        def prepare(self, inputs):
            raise ValueError("num_heads: 128 is not supported\nmore")

    peers = {"fp8mla": (good, "fp8mla"), "wrong": (Wrong(), ""), "unwritten": (Unwritten(), ""),
             "failing": (Failing(), ""), "missing": (None, "not importable: ImportError: x")}
    args = mla_peers.parse_args(["--calls", "2"])
    args.peer_list = list(peers)
    pool = peers_inputs.make_pool(torch, torch.device("cpu"), 64 * 70, 11, chunk=1000)
    timed = []

    def timer(runs):
        timed.append(len(runs))
        return 123.0

    case = pc.Case("sparse", 4, 16, 256, 1)
    rows = mla_peers.run_case(torch, case, pool, peers, args, {"read_ceiling_gbs": 1000.0},
                              timer, lambda: None)
    by = {r["peer"]: r for r in rows}
    assert list(by) == list(peers) and timed == [2]
    assert by["fp8mla"]["status"] == "ok" and by["fp8mla"]["us"] == 123.0
    assert by["fp8mla"]["check_rel_l2"] < 5e-3 and by["fp8mla"]["gbs"] > 0
    if hasattr(peer_fp8mla.load()[0].Plan, "kernel_name"):
        assert by["fp8mla"]["note"].startswith("kernel ")  # the family fp8mla's plan chose
    assert by["wrong"]["status"].startswith("wrong: rel_l2") and by["wrong"]["us"] is None
    assert by["unwritten"]["status"].startswith("wrong: unwritten")
    assert by["failing"]["status"] == "error: ValueError: num_heads: 128 is not supported"
    assert by["missing"]["status"] == "not importable: ImportError: x"
    # A case whose inputs cannot be made (one call needs more pages than the pool has) is
    # reported for every peer.
    big = pc.Case("dense", 8, 8, 4096, 64)
    rows = mla_peers.run_case(torch, big, pool, peers, args, {"read_ceiling_gbs": 1.0}, timer,
                              lambda: None)
    assert [r["peer"] for r in rows] == list(peers)
    assert all(r["status"].startswith("error: inputs: ValueError: one call needs") for r in rows)


def test_pool_codes_are_finite_and_scaled():
    torch = pytest.importorskip("torch")
    import peers_inputs

    pool = peers_inputs.make_pool(torch, torch.device("cpu"), 4096, 3, chunk=1000)
    codes = pool.numpy()
    assert not ((codes & 0x7F) == 0x7F).any()  # no NaN codes
    v = ref.decode_tokens(codes, peers_inputs.CKV_SCALE, peers_inputs.KPE_SCALE)
    assert 0.9 < v[:, :512].std() < 1.1 and 0.9 < v[:, 512:].std() < 1.1


# ---- the FlashInfer peer's Python path (carried FlashInfer, native module stubbed) ----


def test_flashinfer_peer_calls(monkeypatch):
    torch = torch_and("flashinfer.mla")
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    sys.path.insert(0, os.path.join(ROOT, "scripts", "device"))
    import check_flashinfer_carry
    import peer_flashinfer
    import peers_inputs

    module = peer_flashinfer.load()[0]
    check_flashinfer_carry.fake_hopper(torch, monkeypatch.setattr)
    import flashinfer.mla._batch_mla._backends._fa_common as fa_common
    import flashinfer.mla._batch_mla._backends.fa3_backend as fa3

    launched = []

    class Native:  # the generated module: its plan and run are CUDA code
        def plan_with_staged_workspace_bytes(self, *args):
            return [0] * 32, 0

        def run(self, *args):
            launched.append(args)

    for m in (fa_common, fa3):
        monkeypatch.setattr(m, "get_batch_mla_module", lambda *a: Native())
    pool = peers_inputs.make_pool(torch, torch.device("cpu"), 64 * 70, 11, chunk=1000)
    names = ("fws iws plan q_nope q_pe ckv kpe kv_indices out lse mask heads page sm_scale "
             "base_e ckv_scale kpe_scale ckv_scale_arr").split()
    for case in (pc.Case("dense", 3, 8, 700, 64), pc.Case("sparse", 4, 16, 256, 64)):
        inp = peers_inputs.CaseInputs(torch, case, pool, 2, 5)
        runs = peer_flashinfer.FlashinferPeer(module).prepare(inp)
        launched.clear()
        runs[1]()
        a = dict(zip(names, launched[0]))
        assert a["q_nope"] is inp.q_nope and a["out"] is inp.out and a["lse"] is None
        assert a["heads"] == case.heads and a["mask"] == 0  # non-causal
        assert a["ckv_scale"] == inp.ckv_scale and a["kpe_scale"] == inp.kpe_scale
        assert a["sm_scale"] == pytest.approx(inp.sm_scale)
        if case.kind == "dense":
            assert a["page"] == 64 and a["ckv"] is inp.ckv
            assert a["kv_indices"].tolist() == inp.tables[1].tolist()
        else:  # pages of one token over the same bytes, the valid slots of call 1's rows
            assert a["page"] == 1 and tuple(a["ckv"].shape) == (64 * 70, 1, 512)
            assert a["ckv"].data_ptr() == inp.pool.data_ptr()
            assert a["kpe"].data_ptr() == inp.pool.data_ptr() + 512
            rows = inp.rows[1]
            assert a["kv_indices"].tolist() == rows[rows >= 0].tolist()
