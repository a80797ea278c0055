"""CPU checks of bench/peers/ on the 656-byte block-scaled pool (FlashMLA's sparse FP8 layout):
the pool's encoding, the fp8mla_block peer end to end on the CPU backend, and the FlashMLA peer's
calls with FlashMLA stubbed by a torch reference of its sparse FP8 decode (its padding to 64
heads, publish() and error rows), beside the 576-byte fp8mla peer. No GPU needed; the torch
parts skip where torch or fp8mla is missing."""

import os
import subprocess
import sys

import numpy as np
import pytest

from peers_testing import ROOT, torch_and  # bench/peers on sys.path first

import mla_peers  # noqa: E402
import peers_cases as pc  # noqa: E402
import peers_reference as ref  # noqa: E402
import peers_report as report  # noqa: E402


# ---- the block-scaled pool (torch) ----


def _assert_within_block_precision(values, data):
    """values float64 [n, 576] against their block tokens data [n, 656]: latent values within
    half an e4m3 step (2^-4 relative; 2^-10 x scale among subnormals), rope within bf16's."""
    v = ref.decode_block_tokens(data)
    scale = np.repeat(data[:, 512:528].copy().view("<f4").astype(np.float64), 128, axis=1)
    err = np.abs(v[:, :512] - values[:, :512])
    assert (err <= np.maximum(2.0**-4 * np.abs(values[:, :512]), 2.0**-10 * scale)).all()
    assert (np.abs(v[:, 512:] - values[:, 512:]) <= 2.0**-8 * np.abs(values[:, 512:])).all()


def test_block_encoding():
    torch = pytest.importorskip("torch")
    import peers_inputs

    gen = torch.Generator().manual_seed(7)
    x = torch.randn((300, 576), generator=gen) * torch.logspace(-4, 3, 300).unsqueeze(1)
    x[0] = 0.0
    data = peers_inputs.encode_block_tokens(torch, x).numpy()
    assert data.shape == (300, 656) and data.dtype == np.uint8
    xs = x.numpy().astype(np.float64)
    scales = data[:, 512:528].copy().view("<f4").astype(np.float64)
    assert (np.frexp(scales)[0] == 0.5).all()  # powers of two
    amax = np.abs(xs[:, :512]).reshape(-1, 4, 128).max(axis=-1)
    big = amax / 448 > 1e-4  # elsewhere the scale is the floor 2^ceil(log2(1e-4)) = 2^-13
    assert big.any() and (~big).any()
    ratio = amax[big] / scales[big]
    assert (ratio <= 448).all() and (ratio > 224).all()  # the smallest power of two that fits
    assert (scales[~big] == 2.0**-13).all()
    _assert_within_block_precision(xs, data)
    assert not data[0, :512].any()  # zeros stay zero codes
    try:
        import fp8mla.format as fmt
    except ImportError:
        fmt = None
    if fmt is not None:  # the library's writer makes the same bytes
        np.testing.assert_array_equal(fmt.encode_tokens(x.numpy(), "fp8_e4m3_block"), data)


def test_make_block_pool():
    torch = pytest.importorskip("torch")
    import peers_inputs

    cpu = torch.device("cpu")
    pool = peers_inputs.make_block_pool(torch, cpu, 3000, 5, chunk=1000)
    assert pool.dtype == torch.uint8 and tuple(pool.shape) == (3000, 656)
    data = pool.numpy()
    assert not ((data[:, :512] & 0x7F) == 0x7F).any()  # no NaN codes
    assert (np.frexp(data[:, 512:528].copy().view("<f4"))[0] == 0.5).all()
    v = ref.decode_block_tokens(data)
    assert 0.9 < v[:, :512].std() < 1.1 and 0.9 < v[:, 512:].std() < 1.1
    assert not np.array_equal(data[:1000], data[1000:2000])  # each chunk its own draws
    # Its values are the seed's standard-normal draws (one chunk here) within e4m3 precision.
    one = peers_inputs.make_block_pool(torch, cpu, 500, 5, chunk=1000).numpy()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn((500, 576), generator=gen, dtype=torch.float32).numpy().astype(np.float64)
    _assert_within_block_precision(x, one)
    # The decoded values round-trip: encoding them again gives the same values.
    again = peers_inputs.encode_block_tokens(torch, torch.from_numpy(v.astype(np.float32)))
    np.testing.assert_array_equal(ref.decode_block_tokens(again.numpy()), v)


def test_case_inputs_block_pool():
    torch = pytest.importorskip("torch")
    import peers_inputs

    cpu = torch.device("cpu")
    pool = peers_inputs.make_pool(torch, cpu, 64 * 8, 1, chunk=1000)
    block = peers_inputs.make_block_pool(torch, cpu, 64 * 8, 2, chunk=1000)
    case = pc.Case("sparse", 3, 8, 64, 1)
    inp = peers_inputs.CaseInputs(torch, case, pool, 2, 5, block_pool=block)
    assert tuple(inp.block.shape) == (64 * 8, 1, 656) and inp.block.data_ptr() == block.data_ptr()
    assert inp.bytes_for("block") == pytest.approx(inp.bytes_per_call * 656 / 576)
    o, lse = inp.reference([0, 2], "block")
    row = inp.rows[0][2]
    keys = ref.decode_block_tokens(block.numpy()[row[row >= 0]])
    q = ref.bf16_to_f64(inp.q[2].view(torch.int16).numpy())
    want_o, want_lse = ref.attention(q, keys, inp.sm_scale)
    np.testing.assert_allclose(o[1], want_o, rtol=1e-12)
    np.testing.assert_allclose(lse[1], want_lse, rtol=1e-12)
    with pytest.raises(ValueError, match="no block pool"):
        peers_inputs.CaseInputs(torch, case, pool, 2, 5).reference([0], "block")
    with pytest.raises(ValueError, match="as many tokens"):
        peers_inputs.CaseInputs(torch, case, pool, 2, 5, block_pool=block[:64])


# ---- fp8mla on the block-scaled pool (CPU backend) ----


def _pools(torch, tokens=64 * 70):
    import peers_inputs

    cpu = torch.device("cpu")
    return (peers_inputs.make_pool(torch, cpu, tokens, 11, chunk=1000),
            peers_inputs.make_block_pool(torch, cpu, tokens, 12, chunk=1000))


@pytest.mark.parametrize("case", [pc.Case("dense", 3, 8, 700, 64),
                                  pc.Case("sparse", 4, 16, 256, 1),
                                  pc.Case("sparse", 3, 128, 512, 64)], ids=lambda c: c.name)
def test_fp8mla_block_peer_on_cpu(case):
    torch = torch_and("fp8mla")
    import peer_fp8mla
    import peers_inputs

    pool, block = _pools(torch)
    inp = peers_inputs.CaseInputs(torch, case, pool, 2, 5, block_pool=block)
    requests = pc.check_requests(case.bs)
    ref_block, _ = inp.reference(requests, "block")
    ref_fp8, _ = inp.reference(requests)
    peer = peer_fp8mla.Fp8mlaBlockPeer(peer_fp8mla.load()[0])
    assert peer.name == "fp8mla_block" and peer.pool == "block"
    runs = peer.prepare(inp)
    assert len(runs) == inp.calls == 2
    inp.poison_out()
    runs[0]()
    got, finite = inp.output_rows(requests)
    assert finite and ref.rel_l2(got, ref_block) <= 5e-3
    assert ref.rel_l2(got, ref_fp8) > 0.1  # it reads the block pool, not the 576-byte one
    runs[1]()  # call 1 reads other tokens: another answer
    assert ref.rel_l2(inp.output_rows(requests)[0], ref_block) > 0.1
    with pytest.raises(ValueError, match="no block pool"):
        peer.prepare(peers_inputs.CaseInputs(torch, case, pool, 2, 5))


# ---- the FlashMLA peer (FlashMLA stubbed by a torch reference of its sparse FP8 decode) ----


class FakeFlashMLA:
    """flashmla_vllm's get_mla_metadata / flash_mla_with_kvcache as the peer calls them,
    computed with torch on the CPU from the 656-byte tokens as FlashMLA's interface documents
    them (indices: global slots, -1 none; out [b, s_q, h_q, 512]), checking the arguments'
    shapes and dtypes and that a FlashMLASchedMeta only sees one shape."""

    def __init__(self, torch, cache_dtype=None):
        self.torch = torch
        self.metas = []
        self.calls = 0
        self.cache_dtype = cache_dtype or torch.uint8  # the cache dtype this build takes

    def get_mla_metadata(self):
        meta = type("Meta", (), {"config": None})()
        self.metas.append(meta)
        return meta, None

    def flash_mla_with_kvcache(self, q, k_cache, block_table, cache_seqlens, head_dim_v, meta,
                               num_splits=None, softmax_scale=None, causal=False,
                               is_fp8_kvcache=False, indices=None, out=None):
        torch = self.torch
        b, s_q, h_q, d = q.shape
        assert q.dtype == torch.bfloat16 and d == 576 and h_q in (64, 128)
        if k_cache.dtype != self.cache_dtype:
            raise RuntimeError(f"k_cache dtype {k_cache.dtype}: expected {self.cache_dtype}")
        assert tuple(k_cache.shape[1:]) == (64, 1, 656)
        assert block_table is None and cache_seqlens is None and num_splits is None
        assert head_dim_v == 512 and is_fp8_kvcache and not causal
        assert indices.dtype == torch.int32 and tuple(indices.shape[:2]) == (b, s_q)
        assert tuple(out.shape) == (b, s_q, h_q, 512) and out.is_contiguous()
        config = (b, s_q, h_q, indices.shape[-1])
        if meta.config is None:  # FlashMLA fills the metadata on its first call
            meta.config = config
        assert meta.config == config
        flat = k_cache.view(torch.uint8).view(-1, 656)
        for i in range(b):
            for j in range(s_q):
                row = indices[i, j]
                tok = flat[row[row >= 0].long()]
                codes = tok[:, :512].view(torch.float8_e4m3fn).double().view(-1, 4, 128)
                scales = tok[:, 512:528].contiguous().view(torch.float32).double()
                rope = tok[:, 528:].contiguous().view(torch.bfloat16).double()
                kv = torch.cat([(codes * scales.unsqueeze(-1)).view(-1, 512), rope], dim=1)
                p = torch.softmax(softmax_scale * (q[i, j].double() @ kv.T), dim=-1)
                out[i, j] = (p @ kv[:, :512]).to(torch.bfloat16)
        self.calls += 1
        return out, None


def _run_flashmla(torch, case, peers, block=True, calls=2):
    pool, block_pool = _pools(torch)
    args = mla_peers.parse_args(["--calls", str(calls)])
    args.peer_list = list(peers)

    def timer(runs):  # every call once more, as the graph would replay them
        for run in runs:
            run()
        return 50.0

    return mla_peers.run_case(torch, case, pool, peers, args, {"read_ceiling_gbs": 1000.0},
                              timer, lambda: None, block_pool if block else None)


def test_flashmla_peer_takes_the_cache_dtype_the_build_accepts():
    torch = pytest.importorskip("torch")
    import peer_flashmla

    fake = FakeFlashMLA(torch, cache_dtype=torch.float8_e4m3fn)
    peer = peer_flashmla.FlashmlaPeer(fake)
    (row,) = _run_flashmla(torch, pc.Case("sparse", 3, 64, 256, 1), {"flashmla": (peer, "stub")})
    assert row["status"] == "ok" and row["check_rel_l2"] < 5e-3, row


@pytest.mark.parametrize("heads", [16, 64, 128])
def test_flashmla_peer_with_a_stub(heads):
    torch = pytest.importorskip("torch")
    import peer_flashmla

    fake = FakeFlashMLA(torch)
    peer = peer_flashmla.FlashmlaPeer(fake)
    case = pc.Case("sparse", 3, heads, 256, 1)
    (row,) = _run_flashmla(torch, case, {"flashmla": (peer, "stub")})
    assert row["status"] == "ok" and row["check_rel_l2"] < 5e-3, row
    # 656 bytes a valid slot: 3 rows of 256, about 5% of them -1
    assert 0.9 * 3 * 256 * 656 < row["bytes_per_call"] <= 3 * 256 * 656
    assert ("padded to 64 heads" in row["note"]) == (heads < 64)
    # One FlashMLASchedMeta a timed call, each filled by its first call and reused after.
    assert len(fake.metas) == 2 and all(m.config is not None for m in fake.metas)
    # The cache-dtype trial, the check's call, then each call in the timer.
    assert fake.calls == 1 + 1 + 2
    assert peer_flashmla.padded_heads(8) == 64 and peer_flashmla.padded_heads(65) == 128
    with pytest.raises(ValueError, match="at most 128"):
        peer_flashmla.padded_heads(129)


def test_flashmla_padded_output_needs_publish(monkeypatch):
    """Without publish() the padded output's rows never reach inputs.out: the check sees the
    NaN poison (so the harness's publish call is what makes the padded rows checked)."""
    torch = pytest.importorskip("torch")
    import peer_flashmla

    monkeypatch.delattr(peer_flashmla.FlashmlaPeer, "publish")
    peer = peer_flashmla.FlashmlaPeer(FakeFlashMLA(torch))
    (row,) = _run_flashmla(torch, pc.Case("sparse", 3, 16, 256, 1), {"flashmla": (peer, "")})
    assert row["status"].startswith("wrong: unwritten or NaN")


def test_flashmla_dense_case_and_missing_block_pool_are_error_rows():
    torch = pytest.importorskip("torch")
    import peer_flashmla

    peers = {"flashmla": (peer_flashmla.FlashmlaPeer(FakeFlashMLA(torch)), "stub")}
    (row,) = _run_flashmla(torch, pc.Case("dense", 3, 8, 700, 64), peers)
    assert row["status"].startswith("error: NotImplementedError: dense cases:"), row
    assert row["us"] is None
    (row,) = _run_flashmla(torch, pc.Case("sparse", 3, 64, 256, 1), peers, block=False)
    assert row["status"].startswith("error: ValueError: no block pool"), row


def test_run_case_block_and_fp8_peers_side_by_side():
    """fp8mla (576-byte pool), fp8mla_block and the stubbed FlashMLA (656-byte pool) on one
    sparse case: each checked against its own pool's reference, GB/s over its own bytes, and
    the summary compares the pairs."""
    torch = torch_and("fp8mla")
    import peer_flashmla
    import peer_fp8mla

    module = peer_fp8mla.load()[0]
    peers = {"fp8mla": (peer_fp8mla.Fp8mlaPeer(module), ""),
             "fp8mla_block": (peer_fp8mla.Fp8mlaBlockPeer(module), ""),
             "flashmla": (peer_flashmla.FlashmlaPeer(FakeFlashMLA(torch)), "")}
    rows = _run_flashmla(torch, pc.Case("sparse", 4, 16, 256, 1), peers)
    by = {r["peer"]: r for r in rows}
    assert [r["status"] for r in rows] == ["ok"] * 3, rows
    assert all(r["check_rel_l2"] < 5e-3 for r in rows)
    assert by["fp8mla_block"]["bytes_per_call"] == pytest.approx(
        by["fp8mla"]["bytes_per_call"] * 656 / 576)
    assert by["flashmla"]["bytes_per_call"] == by["fp8mla_block"]["bytes_per_call"]
    lines = mla_peers.speedups(rows)
    assert len(lines) == 2  # fp8mla_block vs flashmla, fp8mla vs flashmla (no flashinfer row)
    assert "flashmla/fp8mla_block 1.00" in lines[0] and "flashmla/fp8mla 1.00" in lines[1]


def test_flashmla_not_importable(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashmla_vllm", None)  # import flashmla_vllm fails
    peers = mla_peers.load_peers(["flashmla"])
    peer, desc = peers["flashmla"]
    assert peer is None and desc.startswith("not importable: ModuleNotFoundError: ")
    assert not mla_peers.reads_block_pool(peers)  # no block pool made for it
    row = report.row(pc.Case("sparse", 1, 8, 512, 1), "flashmla", desc)
    assert row["status"] == desc and row["us"] is None


def test_carried_flashmla_without_a_gpu():
    """With the carried package on PYTHONPATH and no GPU: a 'not importable' reason (its
    extension needs CUDA 13's runtime, or no CUDA device is visible), not a crash. Run apart,
    so no FlashMLA library stays loaded in this process."""
    pytest.importorskip("torch")
    carry = os.path.join(ROOT, ".device_carry", "flashmla")
    if not os.path.isdir(os.path.join(carry, "flashmla_vllm")):
        pytest.skip("no .device_carry/flashmla (scripts/device/carry_flashmla.sh)")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import mla_peers, torch; "
            "p, d = mla_peers.load_peers(['flashmla'])['flashmla']; "
            "print('GPU' if torch.cuda.is_available() else d)")
    env = dict(os.environ, PYTHONPATH=carry)
    res = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "bench", "peers")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    if res.stdout.strip() == "GPU":
        pytest.skip("a CUDA device is visible: the peer may load")
    assert res.stdout.startswith("not importable: "), res.stdout
