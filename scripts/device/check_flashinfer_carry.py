"""Checks .device_carry/flashinfer: the import, then BatchMLAPagedAttentionWrapper.plan() for the
fa3 backend with a bf16 query and an FP8 e4m3 cache, which loads the generated module
batch_mla_attention_dtype_q_bf16_dtype_kv_e4m3_..._sm90 (the carried prebuilt one, or a JIT
compile from the carried headers) and calls its native plan. Python 3.12 (the carried tvm_ffi).

On a GPU (scripts/device/run_peers.sh runs it first, to time the module's load or compile) the
plan completes. Without one, FlashInfer's device queries are answered as an H100's (sm_90, 132
SMs, 227 KB of shared memory a block), its JIT target is sm_90a and pinned host buffers are plain
ones; everything else is FlashInfer's own code, and the native plan is where it stops. Exit 0
when the module loaded (the carry is complete for the device), 1 otherwise.

    PYTHONPATH=.device_carry/flashinfer python3.12 scripts/device/check_flashinfer_carry.py
"""

import os
import sys
import time
import types


def fake_hopper(torch, patch=setattr):
    """Patches FlashInfer's device queries (by name, in every loaded flashinfer module) to an
    H100's answers, and makes pinned allocations plain when CUDA is absent. `patch(obj, name,
    value)` does the patching (pytest's monkeypatch.setattr undoes it after a test)."""
    props = types.SimpleNamespace(major=9, minor=0, multi_processor_count=132,
                                  shared_memory_per_multiprocessor=233472,
                                  shared_memory_per_block_optin=232448, name="H100 (faked)")
    fakes = {
        "get_compute_capability": lambda device=None: (9, 0),
        "_get_compute_capability": lambda device=None: (9, 0),
        "is_sm90a_supported": lambda device=None: True,
        "get_device_sm_count": lambda device=None: 132,
        "get_device_properties": lambda device=None: props,
    }
    for name, mod in list(sys.modules.items()):
        if name.startswith("flashinfer") and mod is not None:
            for attr, fn in fakes.items():
                if hasattr(mod, attr):
                    patch(mod, attr, fn)
    if not torch.cuda.is_available():
        real_empty = torch.empty

        def empty(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return real_empty(*args, **kwargs)

        patch(torch, "empty", empty)


def main():
    stage = "import torch"
    try:
        import torch

        if not torch.cuda.is_available():
            # FlashInfer reads its JIT targets from the GPUs; without one, name the device's.
            os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
        stage = "from flashinfer.mla import BatchMLAPagedAttentionWrapper"
        t0 = time.time()
        from flashinfer.mla import BatchMLAPagedAttentionWrapper
        import flashinfer
        from flashinfer.jit import env as jit_env

        print(f"ok: {stage} (flashinfer {flashinfer.__version__} from "
              f"{os.path.dirname(flashinfer.__file__)}, {time.time() - t0:.1f} s)")
        print(f"    JIT workspace {jit_env.FLASHINFER_WORKSPACE_DIR}")
        cuda = torch.cuda.is_available()
        if not cuda:
            fake_hopper(torch)
        import flashinfer.mla._batch_mla._backends._fa_common as fa_common

        loaded = {}
        real_get = fa_common.get_batch_mla_module

        def traced_get(*args):
            t = time.time()
            module = real_get(*args)
            loaded["module"] = module
            loaded["seconds"] = time.time() - t
            return module

        fa_common.get_batch_mla_module = traced_get
        import flashinfer.mla._batch_mla._backends.fa3_backend as fa3

        fa3.get_batch_mla_module = traced_get

        stage = "wrapper construction"
        bs, heads, page, ctx = 4, 16, 64, 4096
        device = torch.device("cuda" if cuda else "cpu")
        ws = torch.empty(128 << 20, dtype=torch.uint8, device=device)
        w = BatchMLAPagedAttentionWrapper(ws, backend="fa3")
        pages = ctx // page
        qo_indptr = torch.arange(bs + 1, dtype=torch.int32)
        kv_indptr = torch.arange(bs + 1, dtype=torch.int32) * pages
        kv_indices = torch.randperm(bs * pages).to(torch.int32).to(device)
        kv_len = torch.full((bs,), ctx, dtype=torch.int32)
        stage = "plan() (validation, module load or JIT compile, native plan)"
        try:
            from flashinfer.mla import MLAPlanMetadata

            w.plan(metadata=MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, kv_len),
                   num_heads=heads, head_dim_ckv=512, head_dim_kpe=64, page_size=page,
                   causal=False, sm_scale=192 ** -0.5, q_data_type=torch.bfloat16,
                   kv_data_type=torch.float8_e4m3fn, query_layout="split",
                   kv_cache_layout="split")
            print(f"ok: plan() completed on {torch.cuda.get_device_name()}; the fa3 module "
                  f"loaded or compiled in {loaded.get('seconds', 0.0):.1f} s")
        except Exception as e:  # the native plan needs CUDA
            if "module" not in loaded:
                raise
            print(f"ok: plan() loaded the fa3 module in {loaded['seconds']:.1f} s "
                  f"({type(loaded['module']).__name__}) and stopped in the native plan, as "
                  f"expected without CUDA: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        return 0
    except Exception as e:
        print(f"FAILED at {stage}: {type(e).__name__}: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
