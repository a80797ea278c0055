"""The SGLang plugin (fp8mla.sglang) against the real sglang package (the version CI installs,
tests/python/requirements-sglang.txt), on the CPU backend, through SGLang's own classes where they
construct on a CPU: plugin discovery through the installed entry point and SGLang's
load_plugins(), the attention registry and argument choices, the DeepSeek forward-method
dispatch, and the backend's decode / target-verify / extend call sequences with SGLang's
ReqToTokenPool, MLATokenToKVPool (FP8 and bf16, page sizes 1 and 64), RadixAttention layers and
ForwardBatch, each layer's output against a float64 reference over the pool's stored values.

What cannot construct on a CPU is stood in for, and named here: SGLang's ModelRunner (a
namespace with the attributes the backend reads; SGLang's parallel context is set with its own
override()), the CUDA graph itself (the capture / replay call sequence runs eagerly: what a
replay reads is the wrapper and page-table buffer captured, rewritten by the replay's
init_forward_metadata_out_graph), and spec_info (an object with draft_token_num).

FP8MLA_SGLANG_DEVICE=cuda runs the same tests on the GPU (the device's pools, batches and the
fp8mla CUDA backend; references on the CPU): scripts/device/gpu_checks.sh's sglang step. There,
when sgl_kernel is not installed (its wheel is more than a device call carries), a stand-in
(sgl_kernel_stand_in.py) satisfies the imports SGLang makes of it on CUDA; none of its ops runs
on the plugin's paths, and one that did would raise.
"""

import importlib.metadata
import math
import os
import types

import pytest

torch = pytest.importorskip("torch")
if os.environ.get("FP8MLA_SGLANG_DEVICE", "cpu") != "cpu":
    import sgl_kernel_stand_in

    sgl_kernel_stand_in.install()
sglang = pytest.importorskip("sglang")

import fp8mla  # noqa: E402
import fp8mla.sglang  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from sglang_requests import Scheduler, forward_batch  # noqa: E402

HEADS = 16
SCALING = 1.0 / math.sqrt(192)
CONTEXT = 512
DEVICE = os.environ.get("FP8MLA_SGLANG_DEVICE", "cpu")
if DEVICE != "cpu" and not torch.cuda.is_available():
    pytest.skip(f"FP8MLA_SGLANG_DEVICE={DEVICE}: no CUDA device", allow_module_level=True)


def bf16(*shape, gen, scale=1.0):
    """Random bf16 values drawn on the CPU (the same draws on every device), on DEVICE."""
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).to(DEVICE)


@pytest.fixture(scope="module", autouse=True)
def parallel_context():
    """SGLang's parallel widths, as a one-GPU server publishes them."""
    with get_parallel().override(attn_tp_size=1, attn_dcp_size=1, dcp_enabled=False):
        yield


def test_entry_point_is_installed():
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    ours = [ep for ep in eps if ep.name == "fp8mla"]
    assert ours, "fp8mla's entry point is not in sglang.srt.plugins (pyproject.toml)"
    assert ours[0].value == "fp8mla.sglang:register"
    assert ours[0].load() is fp8mla.sglang.register


def test_sglang_load_plugins_registers_the_backend():
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.plugins import load_plugins

    load_plugins()  # SGLang's own discovery: runs every installed general plugin
    assert "fp8mla" in ATTENTION_BACKEND_CHOICES
    assert ATTENTION_BACKENDS["fp8mla"] is fp8mla.sglang.create_backend
    fp8mla.sglang.register()  # idempotent
    assert ATTENTION_BACKEND_CHOICES.count("fp8mla") == 1


def test_sglang_argument_parsing_accepts_the_backend():
    """SGLang's argparse choices are its list, extended by the plugin before parsing."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    fp8mla.sglang.register()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "m", "--attention-backend", "fp8mla",
                              "--kv-cache-dtype", "fp8_e4m3"])
    assert args.attention_backend == "fp8mla"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "m", "--attention-backend", "no_such_backend"])


def runner(page_size, kv_dtype, pool_tokens=2048, layers=2, req_slots=8):
    """The attributes of SGLang's ModelRunner the backend reads, over real SGLang pools."""
    cfg = types.SimpleNamespace(num_attention_heads=HEADS, kv_lora_rank=512,
                                qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                                scaling=SCALING, context_len=CONTEXT)
    return types.SimpleNamespace(
        model_config=cfg, device=DEVICE, dtype=torch.bfloat16, kv_cache_dtype=kv_dtype,
        page_size=page_size, use_mla_backend=True, kv_index_translator=None,
        req_to_token_pool=ReqToTokenPool(size=req_slots, max_context_len=CONTEXT,
                                         device=DEVICE, enable_memory_saver=False),
        token_to_kv_pool=MLATokenToKVPool(size=pool_tokens, page_size=page_size, dtype=kv_dtype,
                                          kv_lora_rank=512, qk_rope_head_dim=64,
                                          layer_num=layers, device=DEVICE,
                                          enable_memory_saver=False))


def layers(n):
    return [RadixAttention(HEADS, 576, SCALING, 1, layer_id=i, v_head_dim=512) for i in range(n)]


def write_tokens(r, layer_list, slots, gen):
    """Random latent k (nope 512, rope 64) for `slots` in every layer, written as SGLang writes
    them (set_kv_buffer of the concatenated token: cast to the pool dtype, unscaled)."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    for layer in layer_list:
        k = bf16(len(slots), 1, 576, gen=gen, scale=0.5)
        r.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(slots, physical=True), k, None)


def reference(q_nope, q_pe, pool, rows, qo_lens, causal):
    """float64: request i's q tokens over the pool tokens of rows[i], causal aligned to the end."""
    q_nope, q_pe, pool = q_nope.cpu(), q_pe.cpu(), pool.cpu()
    rows = [row.cpu() for row in rows]
    out = torch.zeros(q_nope.shape[0], HEADS, 512, dtype=torch.float64)
    kv = pool.double().reshape(-1, 576)
    t = 0
    for row, qo in zip(rows, qo_lens):
        k = kv[row]
        q = torch.cat([q_nope[t:t + qo], q_pe[t:t + qo]], -1).double()
        s = torch.einsum("thd,nd->thn", q, k) * SCALING
        if causal:
            n = len(row)
            visible = torch.arange(n)[None, :] <= (n - qo + torch.arange(qo))[:, None]
            s = s.masked_fill(~visible[:, None, :], float("-inf"))
        out[t:t + qo] = torch.einsum("thn,nd->thd", torch.softmax(s, -1), k[:, :512])
        t += qo
    return out


def check(o, want, what):
    want = want.cpu()
    o = o.reshape(want.shape).double().cpu()
    err = torch.linalg.norm(o - want) / torch.linalg.norm(want)
    assert err < 1e-2, f"{what}: relative L2 error {float(err):.2e}"


def batch(mode, bs, req, seqs, slots, prefix=None, extend=None, spec=None):
    fb = forward_batch(mode, bs, req, seqs, slots, DEVICE)
    fb.extend_prefix_lens_cpu = prefix
    fb.extend_seq_lens_cpu = extend
    fb.spec_info = spec
    return fb


def extend_layers(be, r, ls, fb, reqs, lens, qo, gen, what):
    """forward_extend of every layer with fresh q and k (what SGLang's DeepSeek attention passes
    a backend outside its absorb-core list: q and k with the rope part concatenated, 576 wide,
    v = k's latent part; k written to the pool), each output against the float64 reference over
    the requests' first `lens` tokens, causal."""
    n = sum(qo)
    for layer in ls:
        q = bf16(n, HEADS, 576, gen=gen)
        k = bf16(n, 1, 576, gen=gen, scale=0.5)
        o = be.forward_extend(q.view(n, -1), k, k[..., :512], layer, fb)
        rows = [r.req_to_token_pool.req_to_token[req, :m] for req, m in zip(reqs, lens)]
        pool = r.token_to_kv_pool.get_key_buffer(layer.layer_id).float()
        check(o, reference(q[..., :512], q[..., 512:], pool, rows, qo, True),
              f"{what} layer {layer.layer_id}")


def make_backend(r):
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    fp8mla.sglang.register()
    return ATTENTION_BACKENDS["fp8mla"](r)


@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_decode_verify_extend_sequences(page_size, kv_dtype):
    """A prefill with a cached prefix, decode steps and a target verify, per layer, through the
    backend as SGLang's model runner drives it; each output against the float64 reference."""
    gen = torch.Generator().manual_seed(5)
    r = runner(page_size, kv_dtype)
    be = make_backend(r)
    ls = layers(2)
    sched = Scheduler(r, gen)
    pool = lambda layer: r.token_to_kv_pool.get_key_buffer(layer.layer_id).float()  # noqa: E731
    reqs = [1, 4, 6]
    prefixes = [70, 0, 130]
    for req, n in zip(reqs, prefixes):
        write_tokens(r, ls, sched.grow(req, n), gen)

    # Extend with a cached prefix: new tokens causal over prefix + themselves (absorbed MLA).
    ext = [5, 9, 1]
    slots = torch.cat([sched.grow(req, n + e) for req, n, e in zip(reqs, prefixes, ext)])
    fb = batch(ForwardMode.EXTEND, 3, reqs, [n + e for n, e in zip(prefixes, ext)], slots,
               prefix=prefixes, extend=ext)
    be.init_forward_metadata(fb)
    extend_layers(be, r, ls, fb, reqs, [n + e for n, e in zip(prefixes, ext)], ext, gen, "extend")

    # Decode steps: one token a request; q given as one 576-wide tensor (no q_rope).
    lens = [n + e for n, e in zip(prefixes, ext)]
    for step in range(2):
        lens = [n + 1 for n in lens]
        slots = torch.cat([sched.grow(req, n) for req, n in zip(reqs, lens)])
        fb = batch(ForwardMode.DECODE, 3, reqs, lens, slots)
        be.init_forward_metadata(fb)
        for layer in ls:
            q = bf16(3, HEADS, 576, gen=gen)
            k = bf16(3, 1, 576, gen=gen, scale=0.5)
            o = be.forward_decode(q.view(3, -1), k, k[..., :512], layer, fb)
            rows = [r.req_to_token_pool.req_to_token[req, :n] for req, n in zip(reqs, lens)]
            want = reference(q[..., :512], q[..., 512:], pool(layer), rows, [1] * 3, False)
            check(o, want, f"decode step {step} layer {layer.layer_id}")
            # The absorb-core form (q_rope apart), the cache already written.
            o2 = be.forward_decode(q[..., :512].reshape(3, -1), None, None, layer, fb,
                                   q_rope=q[..., 512:].reshape(3, -1))
            assert torch.equal(o, o2)

    # Target verify: draft_token_num tokens a request, written before attention, causal.
    ndt = 3
    slots = torch.cat([sched.grow(req, n + ndt) for req, n in zip(reqs, lens)])
    spec = types.SimpleNamespace(draft_token_num=ndt)
    fb = batch(ForwardMode.TARGET_VERIFY, 3, reqs, lens, slots, spec=spec)
    be.init_forward_metadata(fb)
    extend_layers(be, r, ls, fb, reqs, [n + ndt for n in lens], [ndt] * 3, gen, "verify")


@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_long_extend_chunks_run_on_the_gathered_cast(page_size, kv_dtype):
    """Extend with a prefix: on an FP8 pool a batch whose longest chunk has at least
    gather_min_new_tokens new tokens runs on the gathered cast (its pages cast to bf16 each layer,
    then the bf16 kernel), a shorter one, or one past gather_max_bytes, on the FP8 pool; a bf16
    pool is read as stored. Each output against the float64 reference."""
    from fp8mla.sglang import backend

    gen = torch.Generator().manual_seed(9)
    r = runner(page_size, kv_dtype)
    be = make_backend(r)
    assert (be.gather_min_new_tokens, be.gather_max_bytes) == (backend.GATHER_MIN_NEW_TOKENS,
                                                               backend.GATHER_MAX_BYTES)
    be.gather_min_new_tokens = 8  # the threshold at the test's size
    ls = layers(2)
    sched = Scheduler(r, gen)
    reqs, lens = [2, 5], [40, 97]
    for req, n in zip(reqs, lens):
        write_tokens(r, ls, sched.grow(req, n), gen)
    fp8 = kv_dtype == torch.float8_e4m3fn
    for ext, max_bytes, gathered in (([9, 3], None, fp8), ([4, 7], None, False),
                                     ([3, 12], 1, False)):
        be.gather_max_bytes = max_bytes or backend.GATHER_MAX_BYTES
        slots = torch.cat([sched.grow(req, n + e) for req, n, e in zip(reqs, lens, ext)])
        fb = batch(ForwardMode.EXTEND, 2, reqs, [n + e for n, e in zip(lens, ext)], slots,
                   prefix=lens, extend=ext)
        be.init_forward_metadata(fb)
        assert (be.forward_metadata.gather_pages is not None) == gathered, (ext, max_bytes)
        lens = [n + e for n, e in zip(lens, ext)]
        extend_layers(be, r, ls, fb, reqs, lens, ext, gen, f"extend {ext}")


def test_pool_read_as_stored():
    """The FP8 pool reaches the kernels as float8_e4m3fn bytes (no cast to the model dtype)."""
    r = runner(1, torch.float8_e4m3fn)
    be = make_backend(r)
    ckv, kpe = be._cache(layers(1)[0])
    assert ckv.dtype == torch.float8_e4m3fn and kpe.dtype == torch.float8_e4m3fn
    buf = r.token_to_kv_pool.get_key_buffer(0)
    assert ckv.data_ptr() == buf.data_ptr() and ckv.shape[-1] == 512 and kpe.shape[-1] == 64
    assert be.kv_scales == {"ckv_scale": 1.0, "kpe_scale": 1.0}


@pytest.mark.parametrize("page_size", [1, 64])
def test_graph_capture_and_replay_sequence(page_size):
    """SGLang's CUDA-graph runner: init_cuda_graph_state, then per batch size capture
    (init_forward_metadata_out_graph(in_capture=True) + the layers' forward), then each replay
    (init_forward_metadata_out_graph(in_capture=False) for the new batch, and the captured
    forward). The wrapper and page-table buffer of the capture are the ones the replay reads;
    padded lanes (seq_len fill value 1, req slot 0) as SGLang pads them."""
    gen = torch.Generator().manual_seed(9)
    r = runner(page_size, torch.float8_e4m3fn)
    be = make_backend(r)
    ls = layers(2)
    sched = Scheduler(r, gen)
    pool = lambda layer: r.token_to_kv_pool.get_key_buffer(layer.layer_id).float()  # noqa: E731
    be.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    fill = be.get_cuda_graph_seq_len_fill_value()
    # Capture at bs 4 with a dummy batch (SGLang captures with filler requests).
    sched.grow(0, 1)
    cap = batch(ForwardMode.DECODE, 4, [0] * 4, [fill] * 4,
                torch.zeros(4, dtype=torch.int64))
    be.init_forward_metadata_out_graph(cap, in_capture=True)
    captured = be.forward_metadata.wrapper
    for replay in range(3):
        reqs = [2, 5, 3]
        for req in reqs:
            write_tokens(r, ls, sched.grow(req, sched.rows.get(req, 0) + 37 * (replay + 1)),
                         gen)
        lens = [sched.rows[req] for req in reqs]
        # Padded to the captured size: a fourth lane on req slot 0 with the fill length.
        fb = batch(ForwardMode.DECODE, 4, reqs + [0], lens + [fill],
                   torch.zeros(4, dtype=torch.int64))
        be.init_forward_metadata_out_graph(fb, in_capture=False)
        assert be.forward_metadata.wrapper is captured
        for layer in ls:
            q = bf16(4, HEADS, 576, gen=gen)
            o = be.forward_decode(q.view(4, -1), None, None, layer, fb)
            rows = [r.req_to_token_pool.req_to_token[req, :n] for req, n in
                    zip(reqs + [0], lens + [fill])]
            check(o, reference(q[..., :512], q[..., 512:], pool(layer), rows, [1] * 4, False),
                  f"replay {replay} layer {layer.layer_id}")


def test_extend_without_prefix_runs_the_ragged_prefill():
    """An extend batch without a cached prefix runs the non-absorbed form (q, k [T, H, 192],
    v [T, H, 128]) causal within each request, as SGLang's flashinfer MLA backend does."""
    gen = torch.Generator().manual_seed(3)
    r = runner(1, torch.bfloat16)
    be = make_backend(r)
    ext = [7, 12]
    fb = batch(ForwardMode.EXTEND, 2, [1, 2], ext, torch.arange(19, dtype=torch.int64) + 1,
               prefix=[0, 0], extend=ext)
    be.init_forward_metadata(fb)
    layer = RadixAttention(HEADS, 192, SCALING, HEADS, layer_id=0, v_head_dim=128)
    q = bf16(19, HEADS, 192, gen=gen)
    k = bf16(19, HEADS, 192, gen=gen)
    v = bf16(19, HEADS, 128, gen=gen)
    o = be.forward_extend(q, k, v, layer, fb, save_kv_cache=False).view(19, HEADS, 128)
    q, k, v, t = q.cpu(), k.cpu(), v.cpu(), 0
    for e in ext:
        s = torch.einsum("qhd,khd->hqk", q[t:t + e].double(), k[t:t + e].double()) * SCALING
        s = s.masked_fill(torch.ones(e, e, dtype=torch.bool).triu(1), float("-inf"))
        want = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v[t:t + e].double())
        check(o[t:t + e], want, "ragged prefill")
        t += e


def test_model_routing_follows_the_batch():
    """SGLang's DeepSeek models ask the handler registered under the backend's name: absorbed MLA
    for decode, verify and extend with a prefix; the ragged MHA form without a prefix."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
    )
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    make_backend(runner(1, torch.bfloat16))
    handler = AttentionBackendRegistry.get_handler("fp8mla")
    assert handler is fp8mla.sglang.routing.handle_attention_fp8mla
    attn = types.SimpleNamespace()
    slots = torch.zeros(2, dtype=torch.int64)
    assert handler(attn, batch(ForwardMode.DECODE, 2, [1, 2], [5, 6], slots)) == \
        AttnForwardMethod.MLA
    assert handler(attn, batch(ForwardMode.EXTEND, 2, [1, 2], [5, 6], slots, prefix=[0, 0],
                               extend=[5, 6])) == AttnForwardMethod.MHA
    assert handler(attn, batch(ForwardMode.EXTEND, 2, [1, 2], [5, 6], slots, prefix=[3, 0],
                               extend=[2, 6])) == AttnForwardMethod.MLA
    spec = types.SimpleNamespace(draft_token_num=2)
    assert handler(attn, batch(ForwardMode.TARGET_VERIFY, 2, [1, 2], [5, 6], slots,
                               spec=spec)) == AttnForwardMethod.MLA


def test_refuses_what_it_does_not_serve():
    r = runner(1, torch.bfloat16)
    r.use_mla_backend = False
    with pytest.raises(ValueError, match="MLA models"):
        make_backend(r)
    r = runner(1, torch.float16)
    with pytest.raises(NotImplementedError, match="dtype"):
        make_backend(r)
    be = make_backend(runner(1, torch.bfloat16))
    with pytest.raises(NotImplementedError, match="topk_indices"):
        be.forward_decode(torch.zeros(1, HEADS * 576), None, None, layers(1)[0], None,
                          topk_indices=torch.zeros(1))
