"""BatchMLAPagedAttentionWrapper.replan_step(): an engine's per-step re-plan of a graph-mode
wrapper (the wrapper's docstring says what it takes). Two paths: contiguous CPU int32 torch
tensors (what SGLang passes) go to the native module by address, the host time of a decode
step mattering most there; anything else is copied to host int32 arrays first."""

from . import _fp8mla as _ext
from ._flashinfer_args import renamed
from ._tensors import for_ext, host_i32, host_i32_address, length


def replan_step(w, qo_indptr, kv_indptr, kv_len_arr):
    """wrapper ``w``'s replan_step()."""
    p = w._problem
    if not w._use_cuda_graph or p is None or p["borrowed"] is None:
        raise RuntimeError("replan_step() needs a graph-mode wrapper constructed with a "
                           "kv_indices buffer and a plan() made first")
    if _by_address(w, p, qo_indptr, kv_indptr, kv_len_arr):
        return
    try:
        qo = host_i32(qo_indptr, "qo_indptr")
        kvp = host_i32(kv_indptr, "kv_indptr")
        kvl = host_i32(kv_len_arr, "kv_len_arr")
    except ValueError as e:
        raise renamed(e) from None
    batch = length(kvl)
    for name, a in (("qo_indptr", qo), ("kv_indptr", kvp)):
        if length(a) != batch + 1:
            raise ValueError(f"{name}: expected len(kv_len_arr) + 1 = {batch + 1} entries, "
                             f"got {length(a)}")
    problem = dict(p, qo=qo, kvp=kvp, kvl=kvl, batch=batch, total_q=int(qo[batch]),
                   n_pages=int(kvp[batch]))
    pages = _pool_pages(w)
    try:
        if batch > 0 and _reuses_last_build(w, pages):
            stream = w._plan_stream(problem)
            _ext.replan_step(w._plan, _step_problem(w, p), qo, kvp, kvl, stream or 0,
                             stream is not None)
        else:
            w._build(pages, problem)
    except ValueError as e:
        raise renamed(e) from None
    w._problem = problem
    w._fill_graph_buffers(qo, kvp, kvl)


def _by_address(w, p, qo_indptr, kv_indptr, kv_len_arr):
    """replan_step()'s path for the engines' case, three contiguous CPU int32 torch tensors of
    consistent lengths over the last build's Problem: the native module copies them from their
    addresses (no Python copy, no DLPack import). False when it does not apply."""
    a = host_i32_address(qo_indptr)
    b = host_i32_address(kv_indptr)
    c = host_i32_address(kv_len_arr)
    if a is None or b is None or c is None:
        return False
    batch = c[1]
    if (a[1] != batch + 1 or b[1] != batch + 1 or batch == 0
            or not _reuses_last_build(w, _pool_pages(w))):
        return False  # the general path's errors and re-builds
    stream = w._plan_stream(p)
    try:
        total_q, n_pages = _ext.replan_step_host(
            w._plan, _step_problem(w, p), a[0], b[0], c[0], batch, stream or 0,
            stream is not None)
    except ValueError as e:
        raise renamed(e) from None
    # The arrays of this plan are the step's copies (read back only if a later build needs
    # them): the caller may rewrite its tensors.
    w._problem = dict(p, qo=None, kvp=None, kvl=None, batch=batch, total_q=total_q,
                      n_pages=n_pages)
    w._fill_graph_buffers(qo_indptr, kv_indptr, kv_len_arr)
    return True


def _pool_pages(w):
    """The pool size the next build plans for."""
    return w._num_pages if w._num_pages is not None else w._planned_pages


def _reuses_last_build(w, pages):
    """Whether a step changes only the three arrays of the last build's Problem (one was made,
    for this pool): then it re-plans through a StepProblem instead of building."""
    return w._args is not None and pages == w._planned_pages


def _step_problem(w, p):
    """The last build's Problem fields, converted and checked then, parsed once into a
    StepProblem (with the borrowed table's DLPack import) that every step reuses; each step
    gives its own three arrays."""
    if w._step is None:
        w._step = _ext.StepProblem((None, None, None, None) + w._args[4:-1]
                                   + (for_ext(p["borrowed"]),))
    return w._step
