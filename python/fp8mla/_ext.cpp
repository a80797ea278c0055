// fp8mla._fp8mla: the nanobind module over the C++ API (include/fp8mla/*.h).
//
// Tensors come in through DLPack (nb::ndarray without constraints: numpy on the CPU, torch or
// cupy on CUDA) and become fp8mla::TensorView with element strides and the array's device. This
// layer checks only what DLPack itself can get wrong (unknown dtype or device, more than 4 dims)
// and the Python types of scalar arguments (TypeError naming the argument; an integer beyond the
// C++ type is a ValueError, never truncated); shapes, strides and dtypes per argument are the
// library's checks, so messages are the same in C++ and Python. fp8mla::Error becomes ValueError
// (ErrorCode::invalid_argument), OutOfMemoryError (out_of_memory: a MemoryError and a
// RuntimeError) or RuntimeError (everything else) with the same message. plan(), run(),
// merge_states() and append() release the GIL while the library works. The conversions of the
// arguments are in _ext_args.h. The Python package (fp8mla/*.py) allocates outputs and maps
// framework dtypes (torch.float8_e4m3fn, ml_dtypes.bfloat16) before calling in here.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "fp8mla/attention.h"
#include "fp8mla/cache.h"
#include "fp8mla/context_parallel.h"
#include "fp8mla/error.h"
#include "fp8mla/format.h"
#include "fp8mla/page_table.h"
#include "fp8mla/tensor.h"
#include "_ext_args.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using namespace fp8mla::ext_args;  // NOLINT: the argument conversions, this module's own

// replan() and replan_context_parallel(): a plan and the Problem's arguments.
template <class P, void (*Replan)(P&, const fp8mla::Problem&)>
void def_replan(nb::module_& m, const char* name) {
  m.def(
      name,
      [](P& p, const nb::tuple& problem) {
        ProblemArgs pa;
        fill_problem(pa, problem);
        nb::gil_scoped_release release;
        Replan(p, pa.problem);
      },
      "plan"_a, "problem"_a);
}

// fp8mla.OutOfMemoryError: ErrorCode::out_of_memory, both a MemoryError and (as before) a
// RuntimeError. Made in NB_MODULE.
PyObject* out_of_memory_error = nullptr;

void translate_error(const std::exception_ptr& e, void*) {
  try {
    std::rethrow_exception(e);
  } catch (const Error& err) {
    PyObject* type = err.code() == ErrorCode::invalid_argument ? PyExc_ValueError
                     : err.code() == ErrorCode::out_of_memory  ? out_of_memory_error
                                                               : PyExc_RuntimeError;
    PyErr_SetString(type, err.what());
  }
}

NanPolicy parse_nan(const std::string& nan) {
  if (nan == "propagate") return NanPolicy::propagate;
  if (nan == "error") return NanPolicy::error;
  bad("nan", "expected \"propagate\" or \"error\", got \"" + nan + "\"");
}

}  // namespace

NB_MODULE(_fp8mla, m) {
  m.doc() = "fp8mla native module (use the fp8mla package, not this module directly)";
  {
    nb::object bases = nb::make_tuple(nb::handle(PyExc_MemoryError),
                                      nb::handle(PyExc_RuntimeError));
    out_of_memory_error = PyErr_NewExceptionWithDoc(
        "fp8mla.OutOfMemoryError",
        "fp8mla ran out of memory (ErrorCode::out_of_memory): a pool, host or device allocation "
        "could not be satisfied. A MemoryError and a RuntimeError.",
        bases.ptr(), nullptr);
    if (out_of_memory_error == nullptr) throw nb::python_error();
    m.attr("OutOfMemoryError") = nb::handle(out_of_memory_error);
  }
  nb::register_exception_translator(&translate_error);

  m.attr("DIM_CKV") = fp8mla::kDimCkv;
  m.attr("DIM_KPE") = fp8mla::kDimKpe;
  m.attr("MAX_HEADS") = fp8mla::kMaxHeads;
  m.attr("MAX_PAGE_SIZE") = fp8mla::kMaxPageSize;

  nb::enum_<KvFormat>(m, "KvFormat", "Latent KV cache formats (see include/fp8mla/format.h).")
      .value("bf16", KvFormat::bf16, "576 x bf16 per token (1152 bytes)")
      .value("fp8_e4m3", KvFormat::fp8_e4m3,
             "576 x e4m3fn per token (576 bytes), one float scale per cache")
      .value("fp8_e4m3_block", KvFormat::fp8_e4m3_block,
             "512 e4m3 + 4 float32 scales + 64 bf16 per token (656 bytes)");

  m.def("version", [] { return std::string(fp8mla::version()); });
  m.def("cuda_available", &fp8mla::cuda_available);
  m.def("format_name", [](KvFormat f) { return std::string(fp8mla::format_name(f)); });
  m.def(
      "parse_format", [](const std::string& s) { return fp8mla::parse_format(s); }, "name"_a);
  m.def(
      "token_bytes", [](KvFormat f) { return fp8mla::token_bytes(f); }, "format"_a);

  // ---- Plan ----
  nb::class_<fp8mla::Plan>(m, "Plan",
                           "A validated, partitioned batch (made by fp8mla.plan(); opaque).")
      .def_prop_ro("batch", &fp8mla::Plan::batch)
      .def_prop_ro("total_q", &fp8mla::Plan::total_q)
      .def_prop_ro("num_heads", &fp8mla::Plan::num_heads)
      .def_prop_ro("topk", &fp8mla::Plan::topk)
      .def_prop_ro("kv_format", &fp8mla::Plan::kv_format)
      .def_prop_ro(
          "device",
          [](const fp8mla::Plan& p) { return std::string(fp8mla::device_name(p.device())); })
      .def_prop_ro("partial_rows", &fp8mla::Plan::partial_rows)
      .def_prop_ro(
          "kernel_name", [](const fp8mla::Plan& p) { return std::string(p.kernel_name()); },
          "the kernel family every run of the plan launches (chosen once by plan())")
      .def_prop_ro("num_splits",
                   [](const fp8mla::Plan& p) {
                     auto s = p.num_splits();
                     return std::vector<std::int32_t>(s.begin(), s.end());
                   })
      .def_prop_ro(
          "tiles",
          [](const fp8mla::Plan& p) {
            using Tile = std::tuple<int, int, int, int, int, int, int, int>;
            std::vector<Tile> out;
            for (const fp8mla::WorkTile& t : p.tiles())
              out.emplace_back(t.request, t.q_begin, t.q_count, t.head_begin, t.head_count,
                               t.kv_begin, t.kv_end, t.split);
            return out;
          },
          "(request, q_begin, q_count, head_begin, head_count, kv_begin, kv_end, split) per tile")
      .def("__repr__", [](const fp8mla::Plan& p) {
        return "fp8mla.Plan(batch=" + std::to_string(p.batch()) +
               ", total_q=" + std::to_string(p.total_q()) +
               ", num_heads=" + std::to_string(p.num_heads()) +
               ", kv_format=" + fp8mla::format_name(p.kv_format()) +
               ", device=" + fp8mla::device_name(p.device()) +
               ", kernel=" + p.kernel_name() +
               ", tiles=" + std::to_string(p.tiles().size()) + ")";
      });

  m.def(
      "plan_defaults",
      [] {
        const fp8mla::PlanOptions o;
        nb::dict d;
        d["sm_count"] = o.sm_count;
        d["ctas_per_sm"] = o.ctas_per_sm;
        d["min_chunk_tokens"] = o.min_chunk_tokens;
        d["num_threads"] = o.num_threads;
        d["cpu_reference"] = o.cpu_reference;
        d["exact_scores"] = o.exact_scores;
        d["max_tile_rows"] = o.max_tile_rows;
        return d;
      },
      "fp8mla::PlanOptions' defaults for the options the Python layer passes: {name: value}");

  m.def(
      "plan",
      [](const nb::tuple& problem, const nb::dict& options) {
        ProblemArgs pa;
        fill_problem(pa, problem);
        const fp8mla::PlanOptions o = plan_options(options);
        nb::gil_scoped_release release;
        return fp8mla::plan(pa.problem, o);
      },
      "problem"_a, "options"_a);

  m.def(
      "replan",
      [](fp8mla::Plan& p, const nb::tuple& problem) {
        ProblemArgs pa;
        fill_problem(pa, problem);
        nb::gil_scoped_release release;
        fp8mla::replan(p, pa.problem);
      },
      "plan"_a, "problem"_a);
  m.def(
      "replan_on_stream",
      [](fp8mla::Plan& p, const nb::tuple& problem, std::uintptr_t stream) {
        ProblemArgs pa;
        fill_problem(pa, problem);
        nb::gil_scoped_release release;
        fp8mla::replan(p, pa.problem, as_stream(stream));
      },
      "plan"_a, "problem"_a, "stream"_a,
      "fp8mla::replan(plan, problem, stream): the stream-ordered graph-mode replan");

  // The per-step re-plan of an engine (the wrapper's replan_step): a Problem parsed once, of
  // which each step replaces only the three host index arrays, so a step pays neither the
  // tuple's parsing nor a new DLPack import of the borrowed page table (3.3-3.8 us of host time
  // a step on an H100 host).
  nb::class_<StepProblem>(m, "StepProblem",
                          "A Problem tuple (api._problem_args) parsed once for replan_step().")
      .def(
          "__init__",
          [](StepProblem* t, const nb::tuple& problem) {
            ProblemArgs pa;
            fill_problem(pa, problem);
            new (t) StepProblem{std::move(pa), {}, {}, {}};
          },
          "problem"_a)
      .def(
          "arrays",
          [](const StepProblem& t) {
            return std::make_tuple(t.qo_indptr, t.kv_indptr, t.kv_len);
          },
          "The last replan_step_host() call's (qo_indptr, kv_indptr, kv_len), as lists.");
  m.def(
      "replan_step",
      [](fp8mla::Plan& p, const StepProblem& t, nb::handle qo_indptr, nb::handle kv_indptr,
         nb::handle kv_len, std::uintptr_t stream, bool ordered) {
        Args keep;
        fp8mla::Problem problem = t.pa.problem;
        problem.qo_indptr =
            host_span<const std::int32_t>(keep.in(qo_indptr, "qo_indptr"), "qo_indptr", DType::i32);
        problem.kv_indptr =
            host_span<const std::int32_t>(keep.in(kv_indptr, "kv_indptr"), "kv_indptr", DType::i32);
        problem.kv_len =
            host_span<const std::int32_t>(keep.in(kv_len, "kv_len"), "kv_len", DType::i32);
        nb::gil_scoped_release release;
        if (ordered) {
          fp8mla::replan(p, problem, as_stream(stream));
        } else {
          fp8mla::replan(p, problem);
        }
      },
      "plan"_a, "step"_a, "qo_indptr"_a, "kv_indptr"_a, "kv_len"_a, "stream"_a, "ordered"_a,
      "fp8mla::replan with a StepProblem's fields and new qo_indptr / kv_indptr / kv_len; "
      "ordered: on `stream` (the stream-ordered graph-mode replan)");
  // replan_step for host int32 arrays given by address (the wrapper's path for contiguous CPU
  // int32 torch tensors, which it checks): no DLPack import and no Python copy, the two costs
  // that made up a third of a step's re-plan on the device hosts. The arrays are copied into the
  // StepProblem before the re-plan, which reads only those copies. Returns (total_q, n_pages):
  // qo_indptr[batch] and kv_indptr[batch].
  m.def(
      "replan_step_host",
      [](fp8mla::Plan& p, StepProblem& t, std::uintptr_t qo_indptr, std::uintptr_t kv_indptr,
         std::uintptr_t kv_len, std::int64_t batch, std::uintptr_t stream, bool ordered) {
        if (batch < 1 || batch > std::numeric_limits<std::int32_t>::max() - 1)
          bad("kv_len_arr", "expected 1 to 2^31 - 2 entries, got " + std::to_string(batch));
        const auto take = [&](std::vector<std::int32_t>& dst, std::uintptr_t address,
                              std::int64_t n, const char* name) {
          if (address == 0) bad(name, "the host address is null");
          const auto* src = reinterpret_cast<const std::int32_t*>(address);
          dst.assign(src, src + n);
        };
        std::vector<std::int32_t> qo, kvp, kvl;
        take(qo, qo_indptr, batch + 1, "qo_indptr");
        take(kvp, kv_indptr, batch + 1, "kv_indptr");
        take(kvl, kv_len, batch, "kv_len");
        fp8mla::Problem problem = t.pa.problem;
        problem.qo_indptr = qo;
        problem.kv_indptr = kvp;
        problem.kv_len = kvl;
        {
          nb::gil_scoped_release release;
          if (ordered) {
            fp8mla::replan(p, problem, as_stream(stream));
          } else {
            fp8mla::replan(p, problem);
          }
        }
        // Kept only once planned: a refused step leaves the last plan and its arrays.
        t.qo_indptr = std::move(qo);
        t.kv_indptr = std::move(kvp);
        t.kv_len = std::move(kvl);
        return std::make_tuple(t.qo_indptr.back(), t.kv_indptr.back());
      },
      "plan"_a, "step"_a, "qo_indptr"_a, "kv_indptr"_a, "kv_len"_a, "batch"_a, "stream"_a,
      "ordered"_a,
      "replan_step with the three arrays given as host addresses of batch + 1, batch + 1 and "
      "batch int32 entries; returns (total_q, n_pages)");

  // An engine's per-step page table (fp8mla.sglang.page_table): the token table and the output
  // buffer imported once; each step's row ids (on the token table's device) and host lengths come
  // by address, which the Python layer checks (dtype, device, length, contiguity), so a step
  // pays no DLPack import.
  nb::class_<PageFill>(m, "PageFill", "fill_page_table's token table and output, imported once.")
      .def(
          "__init__",
          [](PageFill* t, nb::handle tokens, nb::handle table, int page_size) {
            new (t) PageFill{};
            t->tokens = t->keep.in(tokens, "tokens");
            t->table = t->keep.out(table, "table");
            t->page_size = page_size;
          },
          "tokens"_a, "table"_a, "page_size"_a)
      .def(
          "fill",
          [](PageFill& t, std::uintptr_t rows, bool rows_i64, std::uintptr_t kv_len,
             std::int64_t batch, std::uintptr_t stream, std::uintptr_t kv_indptr) {
            if (batch < 0 || (batch > 0 && (rows == 0 || kv_len == 0)))
              bad("rows", "expected host and device addresses of " + std::to_string(batch) +
                              " entries");
            if (kv_indptr == 0) bad("kv_indptr", "expected the address of a host int32 array");
            TensorView r = fp8mla::make_view(reinterpret_cast<void*>(rows),
                                             rows_i64 ? DType::i64 : DType::i32, {batch},
                                             t.tokens.device, t.tokens.device_id);
            const std::span<const std::int32_t> lens(
                reinterpret_cast<const std::int32_t*>(kv_len), static_cast<std::size_t>(batch));
            const std::span<std::int32_t> indptr(reinterpret_cast<std::int32_t*>(kv_indptr),
                                                 static_cast<std::size_t>(batch) + 1);
            nb::gil_scoped_release release;
            fp8mla::fill_page_table(t.tokens, r, lens, t.page_size, t.table, as_stream(stream),
                                    indptr);
          },
          "rows"_a, "rows_i64"_a, "kv_len"_a, "batch"_a, "stream"_a, "kv_indptr"_a,
          "fp8mla::fill_page_table with this token table and output: rows (the token table's "
          "device, int64 when rows_i64 else int32) and kv_len (host int32) of batch entries, by "
          "address; the running sum of the pages into kv_indptr (host int32, batch + 1 entries)");

  m.def(
      "run",
      [](const fp8mla::Plan& p, nb::handle q_nope, nb::handle q_pe, nb::handle ckv, nb::handle kpe,
         nb::handle out, nb::handle lse, float ckv_scale, float kpe_scale,
         nb::handle sparse_indices, std::uintptr_t stream) {
        Args keep;
        fp8mla::RunArgs a = run_args(keep, p.kv_format(), q_nope, q_pe, ckv, kpe, out, lse,
                                     ckv_scale, kpe_scale, stream);
        a.sparse_indices = keep.in(sparse_indices, "sparse_indices");
        nb::gil_scoped_release release;
        fp8mla::run(p, a);
      },
      "plan"_a, "q_nope"_a.none(), "q_pe"_a.none(), "ckv_cache"_a.none(), "kpe_cache"_a.none(),
      "out"_a.none(), "lse"_a.none(), "ckv_scale"_a, "kpe_scale"_a, "sparse_indices"_a.none(),
      "stream"_a);

  m.def(
      "merge_states",
      [](nb::handle v, nb::handle s, nb::handle v_out, nb::handle s_out, std::uintptr_t stream) {
        Args keep;
        TensorView tv = keep.in(v, "v");
        TensorView ts = keep.in(s, "s");
        TensorView tvo = keep.out(v_out, "v_out");
        TensorView tso = keep.out(s_out, "s_out");
        nb::gil_scoped_release release;
        fp8mla::merge_states(tv, ts, tvo, tso, as_stream(stream));
      },
      "v"_a, "s"_a, "v_out"_a.none(), "s_out"_a.none(), "stream"_a);

  // ---- context parallelism (NCCL) ----
  m.def(
      "nccl_unique_id",
      [] {
        const fp8mla::NcclId id = fp8mla::nccl_unique_id();
        return nb::bytes(id.bytes.data(), id.bytes.size());
      },
      "a fresh NCCL unique id (128 bytes)");

  nb::class_<fp8mla::NcclComm>(m, "NcclComm", "One rank's NCCL communicator on one CUDA device.")
      .def(
          "__init__",
          [](fp8mla::NcclComm* self, nb::bytes id, int rank, int world, int device_id) {
            fp8mla::NcclId nid;
            if (id.size() != nid.bytes.size())
              bad("id", "expected " + std::to_string(nid.bytes.size()) +
                            " bytes (from "
                            "nccl_unique_id()), got " +
                            std::to_string(id.size()));
            std::memcpy(nid.bytes.data(), id.c_str(), nid.bytes.size());
            nb::gil_scoped_release release;  // blocks until every rank has joined
            new (self) fp8mla::NcclComm(nid, rank, world, device_id);
          },
          "id"_a, "rank"_a, "world"_a, "device_id"_a)
      .def_static(
          "borrow",
          [](std::uintptr_t comm, int device_id) {
            return fp8mla::NcclComm::borrow(reinterpret_cast<void*>(comm), device_id);
          },
          "nccl_comm"_a, "device_id"_a)
      .def_prop_ro("rank", &fp8mla::NcclComm::rank)
      .def_prop_ro("world", &fp8mla::NcclComm::world)
      .def_prop_ro("device_id", &fp8mla::NcclComm::device_id)
      .def_prop_ro("handle", [](const fp8mla::NcclComm& c) {
        return reinterpret_cast<std::uintptr_t>(c.handle());
      });

  nb::class_<fp8mla::ContextParallelPlan>(m, "ContextParallelPlan",
                                          "One rank's plan of a context-parallel batch (opaque).")
      .def_prop_ro("local", &fp8mla::ContextParallelPlan::local, nb::rv_policy::reference_internal)
      .def_prop_ro("rank", [](const fp8mla::ContextParallelPlan& p) { return p.comm().rank(); })
      .def_prop_ro("world", [](const fp8mla::ContextParallelPlan& p) { return p.comm().world(); })
      .def_prop_ro("device_id",
                   [](const fp8mla::ContextParallelPlan& p) { return p.comm().device_id(); })
      .def_prop_ro(
          "kv_len", [](const fp8mla::ContextParallelPlan& p) { return p.shard().kv_len; },
          "this rank's tokens per request");

  m.def(
      "plan_context_parallel",
      [](const fp8mla::NcclComm& comm, const nb::tuple& problem, const nb::dict& options) {
        ProblemArgs pa;
        fill_problem(pa, problem);
        const fp8mla::PlanOptions o = plan_options(options);
        nb::gil_scoped_release release;
        return fp8mla::plan_context_parallel(pa.problem, comm, o);
      },
      nb::keep_alive<0, 1>(),  // the plan uses the communicator
      "comm"_a, "problem"_a, "options"_a);

  def_replan<fp8mla::ContextParallelPlan, &fp8mla::replan_context_parallel>(
      m, "replan_context_parallel");

  m.def(
      "run_context_parallel",
      [](const fp8mla::ContextParallelPlan& p, nb::handle q_nope, nb::handle q_pe, nb::handle ckv,
         nb::handle kpe, nb::handle out, nb::handle lse, float ckv_scale, float kpe_scale,
         std::uintptr_t stream) {
        Args keep;
        const fp8mla::RunArgs a = run_args(keep, p.local().kv_format(), q_nope, q_pe, ckv, kpe, out,
                                           lse, ckv_scale, kpe_scale, stream);
        nb::gil_scoped_release release;
        fp8mla::run_context_parallel(p, a);
      },
      "plan"_a, "q_nope"_a.none(), "q_pe"_a.none(), "ckv_cache"_a.none(), "kpe_cache"_a.none(),
      "out"_a.none(), "lse"_a.none(), "ckv_scale"_a, "kpe_scale"_a, "stream"_a);

  // ---- PagedLatentCache ----
  nb::class_<fp8mla::PagedLatentCache>(m, "PagedLatentCache")
      .def(
          "__init__",
          [](fp8mla::PagedLatentCache* self, std::int64_t num_pages, int page_size, KvFormat format,
             float scale, const std::string& device, int device_id) {
            fp8mla::CacheConfig c;
            c.num_pages = num_pages;
            c.page_size = page_size;
            c.format = format;
            c.scale = scale;
            c.device = parse_device(device);
            c.device_id = device_id;
            new (self) fp8mla::PagedLatentCache(c);
          },
          "num_pages"_a, "page_size"_a, "format"_a, "scale"_a, "device"_a, "device_id"_a)
      .def_prop_ro("num_pages",
                   [](const fp8mla::PagedLatentCache& c) { return c.config().num_pages; })
      .def_prop_ro("page_size",
                   [](const fp8mla::PagedLatentCache& c) { return c.config().page_size; })
      .def_prop_ro("format", [](const fp8mla::PagedLatentCache& c) { return c.config().format; })
      .def_prop_ro("scale", [](const fp8mla::PagedLatentCache& c) { return c.config().scale; })
      .def_prop_ro("device",
                   [](const fp8mla::PagedLatentCache& c) {
                     return std::string(fp8mla::device_name(c.config().device));
                   })
      .def_prop_ro("device_id",
                   [](const fp8mla::PagedLatentCache& c) { return c.config().device_id; })
      .def_prop_ro("free_pages", &fp8mla::PagedLatentCache::free_pages)
      .def_prop_ro("capacity_tokens", &fp8mla::PagedLatentCache::capacity_tokens)
      .def("allocate", &fp8mla::PagedLatentCache::allocate, "n"_a)
      .def(
          "release",
          [](fp8mla::PagedLatentCache& c, nb::handle pages) {
            Args keep;
            c.release(host_span<const std::int32_t>(keep.in(pages, "pages"), "pages", DType::i32));
          },
          "pages"_a)
      .def("is_allocated", &fp8mla::PagedLatentCache::is_allocated, "page"_a)
      .def(
          "append",
          [](fp8mla::PagedLatentCache& c, nb::handle slots, nb::handle ckv, nb::handle kpe,
             const std::string& nan, std::uintptr_t stream) {
            Args keep;
            TensorView ts = keep.in(slots, "slots");
            TensorView tc = keep.in(ckv, "ckv");
            TensorView tk = keep.in(kpe, "kpe");
            NanPolicy policy = parse_nan(nan);
            nb::gil_scoped_release release;
            c.append(ts, tc, tk, policy, as_stream(stream));
          },
          "slots"_a, "ckv"_a, "kpe"_a, "nan"_a, "stream"_a)
      .def(
          "storage",
          [](nb::handle self) {
            auto& c = nb::cast<fp8mla::PagedLatentCache&>(self);
            TensorView s = c.storage();
            const std::size_t shape[3] = {static_cast<std::size_t>(s.shape[0]),
                                          static_cast<std::size_t>(s.shape[1]),
                                          static_cast<std::size_t>(s.shape[2])};
            const std::int64_t strides[3] = {s.stride[0], s.stride[1], s.stride[2]};
            const int device_type =
                s.device == DeviceKind::cuda ? nb::device::cuda::value : nb::device::cpu::value;
            // The array keeps the cache object alive (owner = self).
            return ArrayOut(s.data, 3, shape, self, strides, nb::dtype<std::uint8_t>(), device_type,
                            s.device_id);
          },
          "The cache bytes, uint8 [num_pages, page_size, token_bytes] (DLPack; no copy).")
      .def(
          "read_token",
          [](const fp8mla::PagedLatentCache& c, std::int64_t slot) {
            std::vector<float> out(fp8mla::kDimQk);
            c.read_token(slot, out);
            return out;
          },
          "slot"_a);

  // ---- codecs (host arrays; the Python layer allocates `out`) ----
  m.def(
      "fp8_e4m3_encode",
      [](nb::handle x, nb::handle out) {
        Args keep;
        auto in = host_span<const float>(keep.in(x, "x"), "x", DType::f32);
        auto o = host_span<std::uint8_t>(keep.out(out, "out"), "out", DType::u8);
        if (in.size() != o.size()) bad("out", "size differs from x");
        for (std::size_t i = 0; i < in.size(); ++i) o[i] = fp8mla::float_to_fp8_e4m3(in[i]);
      },
      "x"_a, "out"_a.none());
  m.def(
      "fp8_e4m3_decode",
      [](nb::handle x, nb::handle out) {
        Args keep;
        TensorView tx = keep.in(x, "x");
        if (tx.dtype == DType::fp8_e4m3) tx.dtype = DType::u8;
        auto in = host_span<const std::uint8_t>(tx, "x", DType::u8);
        auto o = host_span<float>(keep.out(out, "out"), "out", DType::f32);
        if (in.size() != o.size()) bad("out", "size differs from x");
        for (std::size_t i = 0; i < in.size(); ++i) o[i] = fp8mla::fp8_e4m3_to_float(in[i]);
      },
      "x"_a, "out"_a.none());
  m.def(
      "bf16_encode",
      [](nb::handle x, nb::handle out) {
        Args keep;
        auto in = host_span<const float>(keep.in(x, "x"), "x", DType::f32);
        auto o = host_span<std::uint16_t>(keep.out(out, "out"), "out", DType::bf16);
        if (in.size() != o.size()) bad("out", "size differs from x");
        for (std::size_t i = 0; i < in.size(); ++i) o[i] = fp8mla::float_to_bf16(in[i]);
      },
      "x"_a, "out"_a.none());
  m.def(
      "bf16_decode",
      [](nb::handle x, nb::handle out) {
        Args keep;
        auto in = host_span<const std::uint16_t>(keep.in(x, "x"), "x", DType::bf16);
        auto o = host_span<float>(keep.out(out, "out"), "out", DType::f32);
        if (in.size() != o.size()) bad("out", "size differs from x");
        for (std::size_t i = 0; i < in.size(); ++i) o[i] = fp8mla::bf16_to_float(in[i]);
      },
      "x"_a, "out"_a.none());
  m.def(
      "encode_tokens",
      [](KvFormat format, float scale, nb::handle values, nb::handle out, const std::string& nan) {
        Args keep;
        auto in = host_span<const float>(keep.in(values, "values"), "values", DType::f32);
        auto o = host_span<std::uint8_t>(keep.out(out, "out"), "out", DType::u8);
        const auto tb = static_cast<std::size_t>(fp8mla::token_bytes(format));
        const std::size_t n = in.size() / fp8mla::kDimQk;
        if (in.size() != n * fp8mla::kDimQk)
          bad("values", "size must be a multiple of 576 (ckv 512 + kpe 64 per token)");
        if (o.size() != n * tb) bad("out", "size must be tokens * token_bytes(format)");
        const NanPolicy policy = parse_nan(nan);
        if (policy == NanPolicy::error) {
          // All-or-nothing: check every token before writing any.
          std::vector<std::uint8_t> scratch(tb);
          for (std::size_t t = 0; t < n; ++t) {
            try {
              fp8mla::encode_token(format, scale, in.subspan(t * fp8mla::kDimQk, fp8mla::kDimQk),
                                   scratch, policy);
            } catch (const Error& e) {
              throw Error(e.code(), "values[" + std::to_string(t) + "]", e.what());
            }
          }
        }
        for (std::size_t t = 0; t < n; ++t)
          fp8mla::encode_token(format, scale, in.subspan(t * fp8mla::kDimQk, fp8mla::kDimQk),
                               o.subspan(t * tb, tb), NanPolicy::propagate);
      },
      "format"_a, "scale"_a, "values"_a, "out"_a.none(), "nan"_a);
  m.def(
      "decode_tokens",
      [](KvFormat format, float scale, nb::handle data, nb::handle out) {
        Args keep;
        TensorView td = keep.in(data, "data");
        if (td.dtype == DType::fp8_e4m3) td.dtype = DType::u8;
        auto in = host_span<const std::uint8_t>(td, "data", DType::u8);
        auto o = host_span<float>(keep.out(out, "out"), "out", DType::f32);
        const auto tb = static_cast<std::size_t>(fp8mla::token_bytes(format));
        const std::size_t n = in.size() / tb;
        if (in.size() != n * tb) bad("data", "size must be a multiple of token_bytes(format)");
        if (o.size() != n * fp8mla::kDimQk) bad("out", "size must be tokens * 576");
        for (std::size_t t = 0; t < n; ++t)
          fp8mla::decode_token(format, scale, in.subspan(t * tb, tb),
                               o.subspan(t * fp8mla::kDimQk, fp8mla::kDimQk));
      },
      "format"_a, "scale"_a, "data"_a, "out"_a.none());
}
