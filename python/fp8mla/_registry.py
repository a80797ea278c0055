"""Integer keys for live wrappers, so the torch custom op (which takes only tensors and
scalars) can find its plan. Torch-free: every wrapper registers when it is made, outside any
torch.compile trace; the entry goes away with the wrapper."""

import itertools
import weakref

_owners = {}  # key -> weakref to an object with _run_native(...)
_keys = itertools.count(1)


def register(owner):
    """Registers ``owner`` and returns its int key (dropped when ``owner`` is collected)."""
    key = next(_keys)
    _owners[key] = weakref.ref(owner)
    weakref.finalize(owner, _owners.pop, key, None)
    return key


def lookup(key):
    """The live owner of ``key``; RuntimeError when there is none."""
    ref = _owners.get(key)
    owner = ref() if ref is not None else None
    if owner is None:
        raise RuntimeError(f"fp8mla::mla_decode: no live plan is registered under key {key}")
    return owner
