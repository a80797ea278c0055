"""The SGLang plugin's DSA backend (fp8mla.sglang.dsa: DeepSeek-V3.2 / GLM-5 sparse attention)
against the real sglang package, on fp8mla's CPU backend, through SGLang's own classes: its
DeepseekSparseAttnBackend (the subclass's metadata steps are SGLang's: eager, CUDA-graph capture
and replay), DSATokenToKVPool (FlashMLA's 656-byte FP8 rows, SGLang's raw 576-byte FP8 rows and
bf16, SGLang's page size 64), ReqToTokenPool, RadixAttention, ForwardBatch, and SGLang's index
transforms (transform_index_page_table_decode / _prefill) and pool writer (quantize_k_cache_separate
+ set_mla_kv_buffer_triton). Every output is checked against a float64 reference over the values
the pool stores, decoded here from the bytes, with each query token attending to the slots of its
top-k row (-1 skipped); outputs are poisoned (NaN) before each call.

SGLang's Triton kernels run on the CPU in Triton's interpreter (triton.runtime.interpreter), the
kernels' own code: the FP8 writer, the row scatter, the index transforms, the verify seqlens (its
launcher asserts CUDA tensors: the same launch without the asserts). The interpreter's float32 ->
e4m3 conversion loses a rounded-up mantissa's carry; it gets torch's round-to-nearest-even, what
the GPU computes.

Stood in for, and named here: SGLang's ModelRunner (a namespace with the attributes the backend
reads) and the model's hf_config; torch.cuda.get_device_capability (SGLang's constructor reads it;
(9, 0), an H100); SGLang's indexer (top-k rows drawn at random: distinct positions the token may
see, all of them when its context is shorter than top-k, -1 elsewhere); the CUDA graph itself
(capture / replay as SGLang's runner calls the backend, eagerly: the replay rewrites the captured
metadata and top-k buffers in place); SGLANG_OPT_USE_TOPK_V2=0 (that top-k of the indexer
is a CUDA JIT kernel). Fused top-k (SGLang's default: the indexer writes global slots) and unfused
(positions, through SGLang's transforms) both run. Bulk context tokens are stored with
dsa_rows.encode_rows, which test_pool_rows_are_sglang_writers_bytes checks against SGLang's writer
bit for bit; each step's new tokens go through SGLang's writer itself.
"""

import math
import os
import types

import pytest

torch = pytest.importorskip("torch")
if os.environ.get("FP8MLA_SGLANG_DEVICE", "cpu") != "cpu":
    # On CUDA, SGLang's DSA metadata runs CUDA-only kernels of sgl_kernel / DeepGEMM, which the
    # device carry does not have; test_sparse_plans.py covers fp8mla's CUDA side of this path.
    pytest.skip("the DSA backend's SGLang tests run on the CPU", allow_module_level=True)
sglang = pytest.importorskip("sglang")

import fp8mla  # noqa: E402
import fp8mla.sglang  # noqa: E402
from dsa_rows import (  # noqa: E402
    decode_rows,
    encode_rows,
    interpret_sglang_triton,
    sparse_reference,
)
from fp8mla.sglang import dsa, sparse  # noqa: E402
from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import (  # noqa: E402
    DSATokenToKVPool,
    KVWriteLoc,
    ReqToTokenPool,
)
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.runtime_context import get_context, get_parallel  # noqa: E402
from sglang_requests import Scheduler, forward_batch  # noqa: E402

DEVICE = "cpu"
HEADS = 8  # GLM-5 (64 heads) at TP8
SCALING = 1.0 / math.sqrt(256)
PAGE = 64  # SGLang's DSA page size on CUDA
CONTEXT = 1024
POOL = 4096
TOPK = 256
DRAFT = 3
FORMATS = ["fp8_e4m3_block", "fp8_e4m3", "bf16"]
@pytest.fixture(scope="module", autouse=True)
def sglang_dsa_context():
    """SGLang's published config for a DSA server (page 64, the DSA kernels SGLang resolves on a
    Hopper FP8 pool, 3 draft tokens), one GPU's parallel widths, and the CPU stand-ins."""
    mp = pytest.MonkeyPatch()
    config = get_context().override_server_args(
        page_size=PAGE, dsa_decode_backend="flashmla_kv", dsa_prefill_backend="flashmla_kv",
        speculative_num_draft_tokens=DRAFT)
    config.install()
    mp.setenv("SGLANG_OPT_USE_TOPK_V2", "0")
    mp.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    interpret_sglang_triton(mp)
    try:
        with get_parallel().override(attn_tp_size=1, attn_dcp_size=1, attn_dcp_rank=0,
                                     dcp_enabled=False, attn_cp_size=1):
            yield
    finally:
        mp.undo()
        config.restore()


@pytest.fixture
def gen(rng):
    """A torch generator seeded from the suite's fresh seed (conftest: FP8MLA_TEST_SEED)."""
    return torch.Generator().manual_seed(int(rng.integers(2**62)))


# ---- SGLang's objects ----

def runner(fmt, topk=TOPK, heads=HEADS, layers=2, pool_tokens=POOL, context=CONTEXT, **cfg):
    """The attributes of SGLang's ModelRunner the backend reads, over SGLang's DSA pools."""
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float8_e4m3fn
    dim = 656 if fmt == "fp8_e4m3_block" else 576
    pool = DSATokenToKVPool(size=pool_tokens, page_size=PAGE, kv_lora_rank=512, dtype=dtype,
                            qk_rope_head_dim=64, layer_num=layers, device=DEVICE,
                            index_head_dim=128, enable_memory_saver=False, kv_cache_dim=dim)
    hf = types.SimpleNamespace(architectures=["GlmMoeDsaForCausalLM"], index_topk=topk,
                               index_head_dim=128, index_n_heads=32)
    model = dict(hf_config=hf, num_attention_heads=heads, kv_lora_rank=512, qk_rope_head_dim=64,
                 qk_nope_head_dim=192, v_head_dim=256, scaling=SCALING, context_len=context)
    model.update(cfg)
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(**model), device=DEVICE, dtype=torch.bfloat16,
        kv_cache_dtype=dtype, page_size=PAGE, use_mla_backend=True, is_draft_worker=False,
        kv_index_translator=None, hisparse_coordinator=None, max_running_requests=8,
        req_to_token_pool=ReqToTokenPool(size=8, max_context_len=context, device=DEVICE,
                                         enable_memory_saver=False),
        token_to_kv_pool=pool)


def make_backend(r, fused=True, poison=True, monkeypatch=None):
    """The backend SGLang's attention registry builds for --attention-backend fp8mla; fused:
    SGLang's fused top-k (its indexer writes global slots), else its PAGED transforms."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    fp8mla.sglang.register()
    if monkeypatch is not None:
        monkeypatch.setenv("SGLANG_DSA_FUSE_TOPK", "1" if fused else "0")
        be = ATTENTION_BACKENDS["fp8mla"](r)
    else:
        be = ATTENTION_BACKENDS["fp8mla"](r)
        be.use_fused_topk = fused
    if poison:
        be._output = lambda rows, heads, like: torch.full(
            (rows, heads, 512), float("nan"), dtype=like.dtype, device=like.device)
    return be


def layers(n, heads=HEADS):
    return [RadixAttention(heads, 576, SCALING, 1, layer_id=i, v_head_dim=512) for i in range(n)]


def stored(r, layer_id, fmt):
    """float64 [pool tokens, 576]: the values the pool holds, decoded from its bytes here."""
    return decode_rows(r.token_to_kv_pool.kv_buffer[layer_id][:, 0], fmt)


def fill(r, ls, slots, fmt, gen):
    """Random latent tokens at `slots` in every layer, stored as SGLang's writer stores them."""
    for layer in ls:
        k = (torch.randn(len(slots), 576, generator=gen) * 0.5).to(torch.bfloat16)
        buf = r.token_to_kv_pool.kv_buffer[layer.layer_id]
        buf[slots.to(buf.device).long(), 0] = encode_rows(k, fmt).to(buf.device)


def bf16(*shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).to(DEVICE)


def topk_rows(gen, visible, topk):
    """The indexer stood in for: row t holds min(visible[t], topk) distinct positions < visible[t]
    (every position when the context is shorter than top-k) at random places, -1 elsewhere."""
    out = torch.full((len(visible), topk), -1, dtype=torch.int32)
    for t, n in enumerate(visible):
        pos = torch.randperm(n, generator=gen)[: min(n, topk)]
        where = torch.randperm(topk, generator=gen)[: len(pos)]
        out[t, where] = pos.to(torch.int32)
    return out


def to_slots(sched, reqs_of_rows, positions):
    """Global slots of request-local positions (what SGLang's fused top-k writes)."""
    out = positions.clone()
    for t, req in enumerate(reqs_of_rows):
        ok = positions[t] >= 0
        out[t, ok] = sched.slots(req, positions[t, ok]).to(torch.int32)
    return out


def reference(q, kv, slots):
    return sparse_reference(q, kv, slots, SCALING).cpu()


def check(o, want, what, heads=HEADS):
    o = o.view(-1, heads, 512).double().cpu()
    assert not torch.isnan(o).any(), f"{what}: unwritten (NaN) output"
    err = torch.linalg.norm(o - want) / torch.linalg.norm(want)
    assert err < 1e-2, f"{what}: relative L2 error {float(err):.2e}"


def batch(mode, req, seqs, slots, extend=None, prefix=None, spec=None):
    fb = forward_batch(mode, len(req), req, seqs, slots, DEVICE)
    fb.spec_info = spec
    if extend is not None:
        fb.extend_seq_lens_cpu = list(extend)
        fb.extend_prefix_lens_cpu = list(prefix)
        fb.extend_seq_lens = torch.tensor(extend, dtype=torch.int32, device=DEVICE)
        fb.extend_prefix_lens = torch.tensor(prefix, dtype=torch.int32, device=DEVICE)
        fb.extend_num_tokens = int(sum(extend))
    return fb


# ---- tests ----

def test_factory_builds_the_dsa_backend_and_routes_dsa_layers(monkeypatch):
    """--attention-backend fp8mla on a DSA model: SGLang's registry builds the subclass of its
    DSA backend; the DeepSeek dispatch follows SGLang's DSA rule (dense MHA where the backend
    chose use_mha for a short prompt on SM90, else absorbed sparse MLA), and a batch the backend
    routes to MHA runs SGLang's dense kernel, not fp8mla."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
    )
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    r = runner("fp8_e4m3_block")
    be = make_backend(r)
    assert isinstance(be, dsa.Fp8MlaDsaBackend) and isinstance(be, DeepseekSparseAttnBackend)
    assert be.kv_format == "fp8_e4m3_block" and be.dsa_decode_impl == "fp8mla"
    handler = AttentionBackendRegistry.get_handler("fp8mla")
    attn = types.SimpleNamespace(use_dsa=True)
    slots = torch.zeros(2, dtype=torch.int64)
    with forward_context(ForwardContext(attn_backend=be)):
        fb = batch(ForwardMode.DECODE, [1, 2], [5, 6], slots)
        be.set_dsa_prefill_impl(fb)
        assert handler(attn, fb) == AttnForwardMethod.MLA
        fb = batch(ForwardMode.EXTEND, [1, 2], [5, 6], torch.zeros(11, dtype=torch.int64),
                   extend=[5, 6], prefix=[0, 0])
        monkeypatch.setattr(be, "_get_device_sm", lambda: 90)
        be.set_dsa_prefill_impl(fb)
        assert be.use_mha and handler(attn, fb) == AttnForwardMethod.MHA_ONE_SHOT
        marker = torch.full((11, HEADS * 256), 7.0)
        monkeypatch.setattr(DeepseekSparseAttnBackend, "_forward_standard_mha",
                            lambda self, **kw: marker)
        layer = RadixAttention(HEADS, 256, SCALING, HEADS, layer_id=0, v_head_dim=256)
        o = be.forward_extend(torch.zeros(11, HEADS, 256), torch.zeros(11, HEADS, 256),
                              torch.zeros(11, HEADS, 256), layer, fb, save_kv_cache=False)
        assert o is marker
        monkeypatch.setattr(be, "_get_device_sm", lambda: 80)  # no MHA rule on an A100
        be.set_dsa_prefill_impl(fb)
        assert not be.use_mha and handler(attn, fb) == AttnForwardMethod.MLA
    # Non-DSA layers keep the MLA backend's routing.
    assert handler(types.SimpleNamespace(), batch(ForwardMode.DECODE, [1], [5], slots[:1])) == \
        AttnForwardMethod.MLA


@pytest.mark.parametrize("fmt", FORMATS)
def test_pool_rows_are_sglang_writers_bytes(fmt, gen):
    """SGLang's DSA pool writer (set_mla_kv_buffer: for FP8 its quantizer, 512 e4m3 codes, 4
    float32 scales, 64 bf16 rope values) stores the rows encode_rows() builds, and fp8mla's
    decoder of its format reads them as the values stored() decodes."""
    r = runner(fmt, layers=1)
    k = bf16(37, 1, 576, gen=gen, scale=0.5)
    loc = torch.randperm(POOL, generator=gen)[:37] + PAGE
    layer = layers(1)[0]
    r.token_to_kv_pool.set_mla_kv_buffer(layer, KVWriteLoc(loc.to(DEVICE), physical=True),
                                         k[..., :512], k[..., 512:])
    rows = r.token_to_kv_pool.kv_buffer[0][loc.to(DEVICE), 0].cpu()
    assert torch.equal(rows, encode_rows(k[:, 0], fmt))
    values = stored(r, 0, fmt)[loc]
    # fp8mla's decoder multiplies in float32: SGLang's scales (amax / 448) are no powers of two,
    # so code x scale rounds to float32 (fp8mla's own writer picks powers of two: exact).
    dec = torch.from_numpy(fp8mla.decode_tokens(rows.view(torch.uint8), fmt)).double()
    assert torch.allclose(dec, values, rtol=2.0**-23, atol=0.0)
    rel = torch.linalg.norm(values - k[:, 0].cpu().double()) / torch.linalg.norm(k.cpu().double())
    assert rel < (0.06 if fmt != "bf16" else 1e-12)


def decode_steps(r, be, ls, sched, reqs, fmt, gen, steps=2, topk=TOPK, heads=HEADS):
    """Decode steps as SGLang's model runner drives them: init_forward_metadata, then per layer
    forward_decode with the new token's k (written by SGLang's writer), q and the layer's top-k
    rows; each output against the reference."""
    fused = be.use_fused_topk
    for step in range(steps):
        lens = [sched.rows[req] + 1 for req in reqs]
        slots = torch.cat([sched.grow(req, n) for req, n in zip(reqs, lens)])
        fb = batch(ForwardMode.DECODE, reqs, lens, slots)
        be.init_forward_metadata(fb)
        for layer in ls:
            q = bf16(len(reqs), heads, 576, gen=gen)
            k = bf16(len(reqs), 1, 576, gen=gen, scale=0.5)
            pos = topk_rows(gen, lens, topk)
            want_slots = to_slots(sched, reqs, pos)
            given = want_slots if fused else pos
            if step == 0:  # the concatenated form (SGLang's DeepSeek code under fp8mla)
                o = be.forward_decode(q.view(len(reqs), -1), k, k[..., :512], layer, fb,
                                      topk_indices=given.to(DEVICE))
            else:  # the absorb-core form: q_rope and k_rope apart
                o = be.forward_decode(q[..., :512].reshape(len(reqs), -1), k[..., :512],
                                      k[..., :512], layer, fb, q_rope=q[..., 512:],
                                      k_rope=k[..., 512:], topk_indices=given.to(DEVICE))
            buf = r.token_to_kv_pool.kv_buffer[layer.layer_id]  # the new token, written
            assert torch.equal(buf[slots.to(buf.device), 0].cpu(), encode_rows(k[:, 0], fmt))
            check(o, reference(q, stored(r, layer.layer_id, fmt), want_slots),
                  f"decode step {step} layer {layer.layer_id}", heads)


@pytest.mark.parametrize("fused", [True, False], ids=["fused_topk", "paged_transform"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode(fmt, fused, gen, monkeypatch):
    """Decode on SGLang's DSA pool: each token over its top-k slots, the pool read as stored;
    contexts shorter and longer than top-k; the new token written by SGLang's writer first."""
    r = runner(fmt)
    be = make_backend(r, fused=fused, monkeypatch=monkeypatch)
    assert be.use_fused_topk == fused
    ls = layers(2)
    sched = Scheduler(r, gen)
    reqs, prompts = [1, 4, 6], [40, 700, 3]
    for req, n in zip(reqs, prompts):
        fill(r, ls, sched.grow(req, n), fmt, gen)
    decode_steps(r, be, ls, sched, reqs, fmt, gen)


@pytest.mark.parametrize("heads", [1, 128])
def test_decode_heads_and_topk_2048(heads, gen):
    """GLM-5 / DeepSeek-V3.2's top-k of 2048 (SGLang's 2048-wide transform kernel) over
    contexts of ~2500 tokens, at 1 and 128 heads (no padding to 64)."""
    r = runner("fp8_e4m3_block", topk=2048, heads=heads, layers=1, context=4096)
    be = make_backend(r, fused=False)
    ls = layers(1, heads)
    sched = Scheduler(r, gen)
    reqs = [2, 3]
    for req, n in zip(reqs, [2500, 900]):
        fill(r, ls, sched.grow(req, n), "fp8_e4m3_block", gen)
    decode_steps(r, be, ls, sched, reqs, "fp8_e4m3_block", gen, steps=1, topk=2048, heads=heads)


def test_minus_one_entries_are_skipped(gen):
    """-1 entries anywhere in a row are skipped: slot 0 (SGLang's padding slot) and the pool's
    last slot hold keys that would dominate any score they entered (what reading -1 as 0, or as
    index -1 from the end, would pick); a row of only -1 gives 0."""
    fmt = "fp8_e4m3_block"
    r = runner(fmt, layers=1)
    be = make_backend(r, fused=True)
    ls = layers(1)
    sched = Scheduler(r, gen)
    buf = r.token_to_kv_pool.kv_buffer[0]
    last = buf.shape[0] - 1
    sched.free.remove(last // PAGE)  # no request holds slot 0 or the last slot
    reqs, lens = [1, 2, 3], [90, 300, 90]
    for req, n in zip(reqs, lens):
        fill(r, ls, sched.grow(req, n), fmt, gen)
    q = bf16(3, HEADS, 576, gen=gen)
    strong = (q[0, 0].float().cpu() * 8).to(torch.bfloat16)[None]  # aligned with the queries
    for slot in (0, last):
        buf[slot, 0] = encode_rows(strong, fmt)[0].to(buf.device)
    fb = batch(ForwardMode.DECODE, reqs, lens, torch.zeros(3, dtype=torch.int64))
    be.init_forward_metadata(fb)
    pos = topk_rows(gen, lens, TOPK)  # -1 at random places in rows 0 and 2
    slots = to_slots(sched, reqs, pos)
    slots[2] = -1  # a row that sees nothing
    assert (slots[0] == -1).sum() > 0 and (slots[0, :-1] == -1).any()
    o = be.forward_decode(q.view(3, -1), None, None, ls[0], fb, topk_indices=slots.to(DEVICE))
    kv = stored(r, 0, fmt)
    want = reference(q, kv, slots)
    check(o[:2], want[:2], "rows with -1 entries")
    assert torch.equal(o.view(3, HEADS, 512)[2].cpu().float(), torch.zeros(HEADS, 512)), \
        "a row of -1 entries must give 0"
    # The same rows with the -1 entries read as slot 0 or the last slot differ: the check above
    # would fail if they were read.
    for slot in (0, last):
        wrong = torch.where(slots[:2] >= 0, slots[:2], torch.full_like(slots[:2], slot))
        assert torch.linalg.norm(reference(q[:2], kv, wrong) - want[:2]) > \
            0.1 * torch.linalg.norm(want[:2])


def test_topk_larger_than_context_and_pool(gen):
    """A top-k width (2048) beyond every request's context and beyond the pool itself (1088
    slots): each row lists its whole context, the rest -1."""
    fmt = "fp8_e4m3_block"
    r = runner(fmt, topk=2048, layers=1, pool_tokens=1024)
    be = make_backend(r, fused=False)
    ls = layers(1)
    sched = Scheduler(r, gen)
    for req, n in zip([1, 2, 3], [1, 64, 500]):
        fill(r, ls, sched.grow(req, n), fmt, gen)
    decode_steps(r, be, ls, sched, [1, 2, 3], fmt, gen, steps=1, topk=2048)


def extend_layers(r, be, ls, sched, fb, reqs, qo, kv_lens, fmt, gen, fused):
    """forward_extend of every layer (SGLang's DeepSeek code passes q and k concatenated): the
    new tokens' k written first; token i of request b sees positions < kv_len - qo + i + 1."""
    n = sum(qo)
    rows_req = [req for req, m in zip(reqs, qo) for _ in range(m)]
    visible = [kv - m + i + 1 for kv, m in zip(kv_lens, qo) for i in range(m)]
    for layer in ls:
        q = bf16(n, HEADS, 576, gen=gen)
        k = bf16(n, 1, 576, gen=gen, scale=0.5)
        pos = topk_rows(gen, visible, TOPK)
        want_slots = to_slots(sched, rows_req, pos)
        o = be.forward_extend(q.view(n, -1), k, k[..., :512], layer, fb,
                              topk_indices=(want_slots if fused else pos).to(DEVICE))
        check(o, reference(q, stored(r, layer.layer_id, fmt), want_slots),
              f"{fb.forward_mode.name} layer {layer.layer_id}")


@pytest.mark.parametrize("fused", [True, False], ids=["fused_topk", "paged_transform"])
@pytest.mark.parametrize("fmt", ["fp8_e4m3_block", "bf16"])
def test_target_verify(fmt, fused, gen, monkeypatch):
    """MTP / EAGLE target verify: DRAFT tokens a request, causal over the context and the drafts
    before them (SGLang's verify metadata and expanded-page-table transform)."""
    r = runner(fmt)
    be = make_backend(r, fused=fused, monkeypatch=monkeypatch)
    assert be.speculative_num_draft_tokens == DRAFT
    ls = layers(2)
    sched = Scheduler(r, gen)
    reqs, lens = [3, 5], [300, 17]
    for req, n in zip(reqs, lens):
        fill(r, ls, sched.grow(req, n), fmt, gen)
    slots = torch.cat([sched.grow(req, n + DRAFT) for req, n in zip(reqs, lens)])
    fb = batch(ForwardMode.TARGET_VERIFY, reqs, lens, slots,
               spec=types.SimpleNamespace(draft_token_num=DRAFT))
    be.init_forward_metadata(fb)
    extend_layers(r, be, ls, sched, fb, reqs, [DRAFT] * 2, [n + DRAFT for n in lens], fmt, gen,
                  fused)


@pytest.mark.parametrize("fused", [True, False], ids=["fused_topk", "paged_transform"])
def test_sparse_extend_with_prefix_in_chunks(fused, gen, monkeypatch):
    """Extend with a cached prefix on the sparse path (SGLang's PAGED prefill transform), run in
    chunks of max_rows query tokens (the last chunk shorter); SGLang's dense-MHA rule is off."""
    fmt = "fp8_e4m3_block"
    r = runner(fmt)
    be = make_backend(r, fused=fused, monkeypatch=monkeypatch)
    be.supports_mha_one_shot = False
    be.sparse.max_rows = 4
    ls = layers(2)
    sched = Scheduler(r, gen)
    reqs, prefix, ext = [1, 2], [150, 40], [5, 6]
    for req, n in zip(reqs, prefix):
        fill(r, ls, sched.grow(req, n), fmt, gen)
    slots = torch.cat([sched.grow(req, n + e) for req, n, e in zip(reqs, prefix, ext)])
    fb = batch(ForwardMode.EXTEND, reqs, [n + e for n, e in zip(prefix, ext)], slots,
               extend=ext, prefix=prefix)
    be.init_forward_metadata(fb)
    assert not be.use_mha
    extend_layers(r, be, ls, sched, fb, reqs, ext, [n + e for n, e in zip(prefix, ext)], fmt,
                  gen, fused)
    assert {key[0] for key in be.sparse._recent} == {4, 3}  # 11 tokens: 4 + 4 + 3


@pytest.mark.parametrize("fused", [True, False], ids=["fused_topk", "paged_transform"])
def test_graph_capture_and_replay(fused, gen, monkeypatch):
    """SGLang's CUDA-graph runner: init_cuda_graph_state, capture at bs 4 (metadata with
    in_capture=True, which makes the sparse plan, then the layers' forward on the captured
    top-k and q buffers), then replays: SGLang rewrites the captured metadata in place (its
    page_table_1 the PAGED transform reads), the replayed indexer rewrites the top-k buffer in
    place, and the captured forward runs again on them: the same plan, no new one."""
    fmt = "fp8_e4m3_block"
    r = runner(fmt)
    be = make_backend(r, fused=fused, monkeypatch=monkeypatch)
    ls = layers(2)
    sched = Scheduler(r, gen)
    be.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    fill_len = be.get_cuda_graph_seq_len_fill_value()
    fill(r, ls, sched.grow(0, fill_len), fmt, gen)
    cap = batch(ForwardMode.DECODE, [0] * 4, [fill_len] * 4, torch.zeros(4, dtype=torch.int64))
    be.init_forward_metadata_out_graph(cap, in_capture=True)
    captured = be.forward_metadata
    assert be.sparse.pinned(4, HEADS, TOPK, SCALING)
    topk_buf = torch.full((4, TOPK), -1, dtype=torch.int32, device=DEVICE)
    q_buf = bf16(4, HEADS, 576, gen=gen)
    for layer in ls:  # the captured forward (dummy batch; its output is not read)
        be.forward_decode(q_buf.view(4, -1), None, None, layer, cap, topk_indices=topk_buf)
    plans = dict(be.sparse._pinned)
    reqs = [2, 5, 3]
    for replay in range(3):
        for req in reqs:
            fill(r, ls, sched.grow(req, sched.rows.get(req, 0) + 37 * (replay + 1)), fmt, gen)
        lens = [sched.rows[req] for req in reqs]
        # Padded to the captured size: a fourth lane on req slot 0 with the fill length.
        fb = batch(ForwardMode.DECODE, reqs + [0], lens + [fill_len],
                   torch.zeros(4, dtype=torch.int64))
        be.init_forward_metadata_out_graph(fb, in_capture=False)
        assert be.forward_metadata is captured  # rewritten in place
        for layer in ls:
            pos = topk_rows(gen, lens + [fill_len], TOPK)
            want_slots = to_slots(sched, reqs + [0], pos)
            topk_buf.copy_((want_slots if fused else pos).to(DEVICE))
            q_buf.copy_(bf16(4, HEADS, 576, gen=gen))
            o = be.forward_decode(q_buf.view(4, -1), None, None, layer, fb,
                                  topk_indices=topk_buf)
            check(o, reference(q_buf, stored(r, layer.layer_id, fmt), want_slots),
                  f"replay {replay} layer {layer.layer_id}")
    assert be.sparse._pinned == plans and not be.sparse._recent
    # A batch size no capture planned cannot be planned inside a capture.
    monkeypatch.setattr(sparse, "is_capturing", lambda x: True)
    q_nope, q_pe = be._queries(q_buf[:2].reshape(2, -1), None, ls[0])
    with pytest.raises(RuntimeError, match="no sparse plan for 2 query tokens"):
        be._attend(q_nope, q_pe, ls[0], topk_buf[:2])


# ---- what is not served ----

@pytest.mark.parametrize("change, exc, words", [
    (dict(kv_lora_rank=256), NotImplementedError, ["kv_lora_rank 256", "512 + 64"]),
    (dict(qk_rope_head_dim=0), NotImplementedError, ["qk_rope_head_dim 0", "512 + 64"]),
    (dict(num_attention_heads=256), NotImplementedError, ["256 attention heads", "1..128"]),
])
def test_refuses_model_shapes(change, exc, words):
    with pytest.raises(exc) as e:
        make_backend(runner("fp8_e4m3_block", **change))
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_refuses_pools_and_parallelism():
    r = runner("fp8_e4m3_block")
    r.kv_cache_dtype = torch.float4_e2m1fn_x2
    with pytest.raises(NotImplementedError, match="float4_e2m1fn_x2.*bfloat16 or float8_e4m3fn"):
        make_backend(r)
    r = runner("bf16")
    r.token_to_kv_pool.kv_cache_dim = 528  # a rope-less (V32_NO_ROPE) row
    with pytest.raises(NotImplementedError, match="bfloat16 with 528 values a token"):
        make_backend(r)
    r = runner("fp8_e4m3_block")
    r.dtype = torch.float32
    with pytest.raises(NotImplementedError, match="model dtype torch.float32"):
        make_backend(r)
    r = runner("fp8_e4m3_block")
    r.hisparse_coordinator = object()
    with pytest.raises(NotImplementedError, match="HiSparse"):
        make_backend(r)
    r = runner("fp8_e4m3_block")
    r.model_config.hf_config.index_kpool = 4
    with pytest.raises(NotImplementedError, match="index_kpool 4.*serves 1"):
        make_backend(r)
    with get_parallel().override(dcp_enabled=True, attn_dcp_size=2):
        with pytest.raises(NotImplementedError, match="DCP"):
            make_backend(runner("fp8_e4m3_block"))


def test_refuses_calls_it_does_not_serve(gen):
    r = runner("fp8_e4m3_block", layers=1)
    be = make_backend(r)
    layer = layers(1)[0]
    sched = Scheduler(r, gen)
    fill(r, [layer], sched.grow(1, 10), "fp8_e4m3_block", gen)
    fb = batch(ForwardMode.DECODE, [1], [10], torch.zeros(1, dtype=torch.int64))
    be.init_forward_metadata(fb)
    q = bf16(1, HEADS, 576, gen=gen).view(1, -1)
    topk = torch.full((1, TOPK), -1, dtype=torch.int32)
    for name in ("attn_sink", "cos_sin_cache", "llama_4_scaling"):
        with pytest.raises(NotImplementedError, match=name):
            be.forward_decode(q, None, None, layer, fb, topk_indices=topk,
                              **{name: torch.zeros(HEADS)})
    with pytest.raises(ValueError, match="topk_indices: .*got None"):
        be.forward_decode(q, None, None, layer, fb)
    with pytest.raises(ValueError, match=r"topk_indices: expected \[<= 1 query tokens, topk\], "
                                         r"got shape \(2, 256\)"):
        be.forward_decode(q, None, None, layer, fb, topk_indices=topk.repeat(2, 1))
    wide = RadixAttention(HEADS, 192, SCALING, 1, layer_id=0, v_head_dim=128)
    with pytest.raises(ValueError, match="head_dim 192 and v_head_dim 128.*576 and 512"):
        be.forward_decode(q, None, None, wide, fb, topk_indices=topk)
