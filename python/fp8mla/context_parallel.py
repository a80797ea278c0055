"""Context parallelism over NCCL (include/fp8mla/context_parallel.h): one batch's contexts spread
over the ranks of a group, each rank decoding its share of every request and merging the
all-gathered partial states."""

from . import _fp8mla as _ext
from ._tensors import as_real, for_ext
from .api import _outputs, _plan_options, _problem_args, _stream

NcclComm = _ext.NcclComm
ContextParallelPlan = _ext.ContextParallelPlan


def nccl_unique_id():
    """A fresh NCCL unique id (128 bytes) for NcclComm(id, rank, world, device_id): one rank
    makes it and sends it to the others (e.g. with torch.distributed.broadcast_object_list). The
    process that makes it serves the group's bootstrap until every rank has joined.

    NCCL is loaded at run time: FP8MLA_NCCL_LIBRARY when set, else the process's own
    libnccl.so.2 (PyTorch's, once torch has loaded it), else the loader's. RuntimeError when
    none loads.
    NcclComm(id, rank, world, device_id) joins the group (blocking until every rank has);
    NcclComm.borrow(nccl_comm, device_id) wraps an ncclComm_t the caller owns (an int).
    """
    return _ext.nccl_unique_id()


def plan_context_parallel(comm, qo_indptr, kv_indptr, kv_indices, kv_len, *, num_heads,
                          page_size, num_pages, sm_scale, kv_format="fp8_e4m3", causal=True,
                          device=None, **options):
    """This rank's plan of a batch whose contexts are spread over comm's ranks
    (fp8mla::plan_context_parallel): rank k of world n takes pages [k m, (k + 1) m) of each
    request (m = ceil(pages / n)); the page table lists the full contexts, with page ids of
    this rank's pool for its own pages. Arguments as plan()'s (dense only; causal
    multi-token rows are masked as over the whole context); device defaults to comm's
    ("cuda:<device_id>"); options are plan()'s (cuda_graph=True with max_* for
    replan_context_parallel). Keeps comm alive.
    """
    if device is None:
        device = f"cuda:{comm.device_id}"
    args = _problem_args(qo_indptr, kv_indptr, kv_indices, kv_len, num_heads, page_size,
                         num_pages, sm_scale, kv_format, causal, 0, None, device, host_pages=True)
    return _ext.plan_context_parallel(comm, args, _plan_options(**options))


def replan_context_parallel(plan, qo_indptr, kv_indptr, kv_indices, kv_len, *, num_heads,
                            page_size, num_pages, sm_scale, kv_format="fp8_e4m3", causal=True,
                            device=None):
    """Re-plans a graph-mode ContextParallelPlan in place for new lengths and page tables
    (fp8mla::replan_context_parallel); qo_indptr must equal the planned one."""
    if device is None:
        device = f"cuda:{plan.device_id}"
    args = _problem_args(qo_indptr, kv_indptr, kv_indices, kv_len, num_heads, page_size,
                         num_pages, sm_scale, kv_format, causal, 0, None, device, host_pages=True)
    _ext.replan_context_parallel(plan, args)


def run_context_parallel(plan, q_nope, q_pe, ckv_cache, kpe_cache=None, *, out=None, lse=None,
                         return_lse=False, ckv_scale=1.0, kpe_scale=1.0, stream=None):
    """Decode of the whole contexts on every rank (fp8mla::run_context_parallel): this rank's
    share into its slot of the exchange buffers, an NCCL all-gather of (out, lse) on `stream`,
    and the merge into out / lse. Arguments as run()'s for the full batch (out and lse dense
    over their rows); ckv_cache / kpe_cache are this rank's pool. Every rank calls it, in the
    same order as its other collectives. No allocation inside (out / lse are allocated here
    when None) and no host sync: capturable in a CUDA graph.
    """
    out, lse = _outputs(q_nope, out, lse, return_lse)
    _ext.run_context_parallel(plan, for_ext(q_nope), for_ext(q_pe), for_ext(ckv_cache),
                              for_ext(kpe_cache), for_ext(out), for_ext(lse),
                              as_real(ckv_scale, "ckv_scale"), as_real(kpe_scale, "kpe_scale"),
                              _stream(stream, q_nope))
    return (out, lse) if return_lse else out
