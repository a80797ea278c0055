"""torch integration on the CPU backend (torch CPU tensors): the wrapper, SGLang's call
sequence with torch.float8_e4m3fn pool views, the custom op (opcheck) and torch.compile.
Skipped when torch is not installed (tests/python/run.sh installs it unless FP8MLA_PY_TORCH=0)."""

import pytest

torch = pytest.importorskip("torch")

import torch_cases as cases  # noqa: E402

DEVICE = "cpu"


@pytest.mark.parametrize("fmt,page_size,heads,kv_lens,qo_lens,causal", [
    ("fp8_e4m3", 1, 8, [30, 5], [1, 1], False),
    ("bf16", 16, 16, [100, 17], [2, 1], True),
    ("fp8_e4m3_block", 64, 4, [200], [4], True),
])
def test_wrapper_formats(rng, fmt, page_size, heads, kv_lens, qo_lens, causal):
    cases.case_wrapper_formats(rng, DEVICE, fmt, page_size, heads, kv_lens, qo_lens, causal)


def test_sglang_sequence(rng):
    cases.case_sglang_sequence(rng, DEVICE)


def test_custom_op_opcheck(rng):
    cases.case_opcheck(rng, DEVICE)


def test_torch_compile_fullgraph(rng):
    cases.case_compile(rng, DEVICE, "aot_eager")


def test_low_level(rng):
    cases.case_low_level(rng, DEVICE)


def test_cache(rng):
    cases.case_cache(rng, DEVICE)


def test_index_tensors_are_checked_and_converted():
    """torch index arrays (int64 by default) are converted to int32, or refused with the
    argument named: floats, extra dimensions, values beyond int32."""
    import fp8mla

    qo, kvp, kl = torch.tensor([0, 1]), torch.tensor([0, 2]), torch.tensor([100])
    kw = dict(num_heads=8, page_size=64, num_pages=4, sm_scale=0.1)
    p = fp8mla.plan(qo, kvp, torch.tensor([3, 1]), kl, **kw)
    assert p.batch == 1 and p.total_q == 1
    for kvi, message in [(torch.tensor([1.0, 2.0]), "kv_indices: expected an integer tensor"),
                         (torch.tensor([[1, 2]]), "kv_indices: expected 1 dimension"),
                         (torch.tensor([1, 2**31]), "kv_indices: values .* do not fit in int32")]:
        with pytest.raises(ValueError, match=message):
            fp8mla.plan(qo, kvp, kvi, kl, **kw)


def test_graph_buffers_take_host_index_arrays():
    """copy_into, which fills a graph-mode wrapper's constructor buffers at every plan(): a host
    int32 numpy array into a torch buffer (its fast path) writes the first len(src) entries and
    nothing else; the buffer's own memory is left as it is; a short buffer is a ValueError
    naming the argument."""
    import numpy as np

    from fp8mla._tensors import copy_into
    dst = torch.full((8,), -5, dtype=torch.int32)
    copy_into(dst, np.array([3, 1, 4], np.int32), "kv_indptr")
    assert dst.tolist() == [3, 1, 4, -5, -5, -5, -5, -5]
    copy_into(dst, torch.tensor([9, 9], dtype=torch.int32), "kv_indptr")  # the generic path
    assert dst.tolist() == [9, 9, 4, -5, -5, -5, -5, -5]
    own = dst.numpy()[:4]  # the same memory: a no-op
    copy_into(dst, own, "kv_indices")
    assert dst.tolist() == [9, 9, 4, -5, -5, -5, -5, -5]
    with pytest.raises(ValueError, match="^kv_len_arr: the CUDA graph buffer .* holds 2 entries, "
                                         "fewer than the 3 planned"):
        copy_into(dst[:2], np.zeros(3, np.int32), "kv_len_arr")
    assert dst.tolist() == [9, 9, 4, -5, -5, -5, -5, -5]


def test_replan_step_host_tensors(rng):
    cases.case_replan_step_host_tensors(rng, DEVICE)
