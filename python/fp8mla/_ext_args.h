// Python arguments as the library's types, for the nanobind module (_ext.cpp): DLPack arrays as
// fp8mla::TensorView (kept alive by Args until the call ends), Python scalars checked by type
// (TypeError naming the argument; an integer beyond the C++ type is a ValueError, never
// truncated), and the tuples and dicts the Python layer builds (api._problem_args,
// api._plan_options) as fp8mla::Problem and fp8mla::PlanOptions.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
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
#include "fp8mla/tensor.h"

namespace fp8mla::ext_args {

namespace nb = nanobind;

// The library's types by short name, here and in _ext.cpp (which uses this namespace).
using fp8mla::DeviceKind;
using fp8mla::DType;
using fp8mla::Error;
using fp8mla::ErrorCode;
using fp8mla::KvFormat;
using fp8mla::NanPolicy;
using fp8mla::TensorView;

using ArrayRo = nb::ndarray<nb::ro>;  // any framework, dtype, device; read-only is fine
using ArrayRw = nb::ndarray<>;        // must be writable (outputs)
// Returned arrays: a nanobind array object with __dlpack__ and the buffer protocol, so
// numpy.from_dlpack / torch.from_dlpack / memoryview all take it.
using ArrayOut = nb::ndarray<nb::array_api>;

[[noreturn]] inline void bad(const std::string& argument, const std::string& message) {
  throw Error(ErrorCode::invalid_argument, argument, message);
}

// DLPack dtype -> library dtype. uint16 is taken as bf16 bits (numpy has no bfloat16).
inline DType map_dtype(nb::dlpack::dtype dt, const std::string& name) {
  using Code = nb::dlpack::dtype_code;
  const auto code = static_cast<Code>(dt.code);
  if (dt.lanes == 1) {
    if (code == Code::UInt && dt.bits == 8) return DType::u8;
    if (code == Code::UInt && dt.bits == 16) return DType::bf16;
    if (code == Code::Int && dt.bits == 32) return DType::i32;
    if (code == Code::Float && dt.bits == 32) return DType::f32;
    if (code == Code::Float && dt.bits == 16) return DType::f16;
    if (code == Code::Bfloat && dt.bits == 16) return DType::bf16;
    if (code == Code::Float8_E4M3FN && dt.bits == 8) return DType::fp8_e4m3;
  }
  bad(name + ".dtype", "unsupported DLPack dtype (code " + std::to_string(dt.code) + ", " +
                           std::to_string(dt.bits) + " bits, " + std::to_string(dt.lanes) +
                           " lanes); expected one of uint8, uint16 (bf16 bits), int32, float32, "
                           "float16, bfloat16, float8_e4m3fn");
}

// DLPack device -> library device. Pinned host memory counts as host memory.
inline DeviceKind map_device(int device_type, const std::string& name) {
  if (device_type == nb::device::cpu::value || device_type == nb::device::cuda_host::value)
    return DeviceKind::cpu;
  if (device_type == nb::device::cuda::value || device_type == nb::device::cuda_managed::value)
    return DeviceKind::cuda;
  bad(name + ".device", "unsupported DLPack device type " + std::to_string(device_type) +
                            "; expected CPU or CUDA memory");
}

template <class Array>
TensorView view_of(const Array& a, const std::string& name) {
  if (a.ndim() > static_cast<std::size_t>(fp8mla::kMaxDims))
    bad(name + ".ndim", "at most " + std::to_string(fp8mla::kMaxDims) + " dimensions, got " +
                            std::to_string(a.ndim()));
  TensorView v;
  v.data = const_cast<void*>(static_cast<const void*>(a.data()));
  v.dtype = map_dtype(a.dtype(), name);
  v.ndim = static_cast<int>(a.ndim());
  for (std::size_t i = 0; i < a.ndim(); ++i) {
    v.shape[i] = static_cast<std::int64_t>(a.shape(i));
    v.stride[i] = a.stride(i);
  }
  v.device = map_device(a.device_type(), name);
  v.device_id = a.device_id();
  return v;
}

// Converts Python arguments to views and keeps the imported arrays alive until the call ends
// (the views point into them). None gives an undefined view.
class Args {
 public:
  TensorView in(const nb::handle& obj, const std::string& name) {
    return keep(obj, name, "an array or tensor", ro_);
  }
  TensorView out(const nb::handle& obj, const std::string& name) {
    return keep(obj, name, "a writable array or tensor", rw_);
  }

 private:
  template <class Array>
  TensorView keep(const nb::handle& obj, const std::string& name, const char* what,
                  std::vector<Array>& kept) {
    if (obj.is_none()) return {};
    Array a;
    if (!nb::try_cast(obj, a, false))
      throw nb::type_error((name + ": expected " + what +
                            " with DLPack support (numpy, torch, cupy), got " +
                            std::string(nb::type_name(obj.type()).c_str()))
                               .c_str());
    kept.push_back(a);
    return view_of(kept.back(), name);
  }

  std::vector<ArrayRo> ro_;
  std::vector<ArrayRw> rw_;
};

// An integer argument as T: TypeError naming it unless it is a Python integer (or has
// __index__; not bool or float), ValueError when it does not fit in T.
template <class T>
T int_arg(nb::handle h, const std::string& name) {
  PyObject* o = h.ptr();
  if (PyBool_Check(o) || !PyIndex_Check(o))
    throw nb::type_error(
        (name + ": expected an integer, got " + nb::type_name(h.type()).c_str()).c_str());
  nb::object index = nb::steal(PyNumber_Index(o));
  if (!index.is_valid()) throw nb::python_error();
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (overflow == 0 && v == -1 && PyErr_Occurred()) throw nb::python_error();
  if (overflow != 0 || v < static_cast<long long>(std::numeric_limits<T>::min()) ||
      v > static_cast<long long>(std::numeric_limits<T>::max()))
    bad(name, nb::str(h).c_str() + std::string(" is outside [") +
                  std::to_string(std::numeric_limits<T>::min()) + ", " +
                  std::to_string(std::numeric_limits<T>::max()) + "]");
  return static_cast<T>(v);
}

// A real argument: TypeError naming it unless it is a Python number (not bool or str).
inline float real_arg(nb::handle h, const std::string& name) {
  PyObject* o = h.ptr();
  if (PyBool_Check(o) || !(PyFloat_Check(o) || PyLong_Check(o) || PyNumber_Check(o)) ||
      PyUnicode_Check(o))
    throw nb::type_error(
        (name + ": expected a number, got " + nb::type_name(h.type()).c_str()).c_str());
  const double v = PyFloat_AsDouble(o);
  if (v == -1.0 && PyErr_Occurred()) throw nb::python_error();
  return static_cast<float>(v);  // beyond float's range: +-inf, which the library rejects
}

// A string argument: TypeError naming it otherwise.
inline std::string str_arg(nb::handle h, const std::string& name) {
  std::string v;
  if (!nb::try_cast(h, v, false))
    throw nb::type_error(
        (name + ": expected a string, got " + nb::type_name(h.type()).c_str()).c_str());
  return v;
}

// A bool argument: True or False, or an integer 0 or 1 (numpy's bool has __index__ too).
inline bool flag_arg(nb::handle h, const std::string& name) {
  if (PyBool_Check(h.ptr())) return h.ptr() == Py_True;
  if (!PyIndex_Check(h.ptr()))
    throw nb::type_error(
        (name + ": expected a bool, got " + nb::type_name(h.type()).c_str()).c_str());
  const long long v = int_arg<long long>(h, name);
  if (v != 0 && v != 1) bad(name, "expected a bool (or 0 / 1), got " + std::to_string(v));
  return v == 1;
}

// A host, contiguous array of `dtype` read as a flat span (None gives an empty span).
template <class T>
std::span<T> host_span(const TensorView& v, const std::string& name, DType dtype) {
  if (!v.defined()) return {};
  if (v.dtype != dtype)
    bad(name + ".dtype", std::string("expected ") + fp8mla::dtype_name(dtype) + ", got " +
                             fp8mla::dtype_name(v.dtype));
  if (v.device != DeviceKind::cpu)
    bad(name + ".device", "expected a host (CPU) array, got " + v.describe());
  if (v.numel() == 0) return {};  // DLPack may give an empty array any strides
  if (!v.is_contiguous()) bad(name, "expected a contiguous array, got " + v.describe());
  return {static_cast<T*>(v.data), static_cast<std::size_t>(v.numel())};
}

inline DeviceKind parse_device(const std::string& device) {
  if (device == "cpu") return DeviceKind::cpu;
  if (device == "cuda") return DeviceKind::cuda;
  bad("device", "expected \"cpu\" or \"cuda\", got \"" + device + "\"");
}

// "bf16" / "f16": the query and output element types a Problem takes.
inline DType parse_q_dtype(const std::string& name, const char* argument) {
  if (name == "bf16") return DType::bf16;
  if (name == "f16") return DType::f16;
  bad(argument, "expected \"bf16\" or \"f16\", got \"" + name + "\"");
}

// Everything a Problem refers to, kept alive for the duration of plan()/replan().
struct ProblemArgs {
  Args keep;
  fp8mla::Problem problem;
};

// A ProblemArgs kept between calls (_ext.StepProblem): its arrays stay alive with it. The step
// arrays hold the last successful replan_step_host() call's qo_indptr / kv_indptr / kv_len,
// copied in, so the plan's inputs stay readable (StepProblem.arrays) after the caller rewrites
// its own.
struct StepProblem {
  ProblemArgs pa;
  std::vector<std::int32_t> qo_indptr, kv_indptr, kv_len;
};

// fill_page_table's fixed arguments kept between calls (_ext.PageFill): an engine's token table
// and the page-table buffer a graph-mode wrapper borrows, each imported once.
struct PageFill {
  Args keep;
  TensorView tokens, table;
  int page_size = 1;
};

// The Problem of plan / replan / plan_context_parallel / replan_context_parallel, from the one
// tuple api._problem_args builds: (qo_indptr, kv_indptr, kv_indices, kv_len, num_heads,
// page_size, num_pages, kv_format, causal, sm_scale, topk, sparse_indices, causal_len, device,
// device_id, q_dtype, out_dtype, borrowed_kv_indices); array entries may be None. The borrowed
// page table is the caller's array itself: the plan keeps its address (the Python layer keeps
// the array alive as long as the plan).
inline void fill_problem(ProblemArgs& pa, const nb::tuple& a) {
  if (a.size() != 18) bad("problem", "expected the 18 fields of api._problem_args");
  const nb::handle qo_indptr = a[0], kv_indptr = a[1], kv_indices = a[2], kv_len = a[3];
  const nb::handle sparse_indices = a[11], causal_len = a[12];
  fp8mla::Problem& p = pa.problem;
  p.num_heads = int_arg<int>(a[4], "num_heads");
  p.page_size = int_arg<int>(a[5], "page_size");
  p.num_pages = int_arg<std::int64_t>(a[6], "num_pages");
  if (!nb::try_cast(a[7], p.kv_format, false))
    throw nb::type_error("kv_format: expected a fp8mla.KvFormat");
  p.causal = flag_arg(a[8], "causal");
  p.sm_scale = real_arg(a[9], "sm_scale");
  p.topk = int_arg<int>(a[10], "topk");
  p.device = parse_device(str_arg(a[13], "device"));
  p.device_id = int_arg<int>(a[14], "device_id");
  p.q_dtype = parse_q_dtype(str_arg(a[15], "q_dtype"), "q_dtype");
  p.out_dtype = parse_q_dtype(str_arg(a[16], "out_dtype"), "out_dtype");
  p.borrowed_kv_indices = pa.keep.in(a[17], "borrowed_kv_indices");
  p.qo_indptr =
      host_span<const std::int32_t>(pa.keep.in(qo_indptr, "qo_indptr"), "qo_indptr", DType::i32);
  p.kv_indptr =
      host_span<const std::int32_t>(pa.keep.in(kv_indptr, "kv_indptr"), "kv_indptr", DType::i32);
  // A page table on the GPU stays there (Problem::device_kv_indices; plan() checks it there).
  const TensorView pages = pa.keep.in(kv_indices, "kv_indices");
  if (pages.defined() && pages.device == DeviceKind::cuda) {
    p.device_kv_indices = pages;
  } else {
    p.kv_indices = host_span<const std::int32_t>(pages, "kv_indices", DType::i32);
  }
  p.kv_len = host_span<const std::int32_t>(pa.keep.in(kv_len, "kv_len"), "kv_len", DType::i32);
  p.sparse_indices = host_span<const std::int32_t>(pa.keep.in(sparse_indices, "sparse_indices"),
                                                   "sparse_indices", DType::i32);
  p.causal_len =
      host_span<const std::int32_t>(pa.keep.in(causal_len, "causal_len"), "causal_len", DType::i32);
}

// fp8mla::PlanOptions from the dict the Python layer builds (api._plan_options: every key).
inline fp8mla::PlanOptions plan_options(const nb::dict& d) {
  fp8mla::PlanOptions o;
  const auto get = [&](const char* key) {
    if (!d.contains(key)) bad(key, "missing from the options dict (api._plan_options)");
    return d[key];
  };
  o.sm_count = int_arg<int>(get("sm_count"), "sm_count");
  o.ctas_per_sm = int_arg<int>(get("ctas_per_sm"), "ctas_per_sm");
  o.min_chunk_tokens = int_arg<int>(get("min_chunk_tokens"), "min_chunk_tokens");
  o.num_threads = int_arg<int>(get("num_threads"), "num_threads");
  o.cpu_reference = flag_arg(get("cpu_reference"), "cpu_reference");
  o.cuda_graph = flag_arg(get("cuda_graph"), "cuda_graph");
  o.max_batch = int_arg<int>(get("max_batch"), "max_batch");
  o.max_total_q = int_arg<int>(get("max_total_q"), "max_total_q");
  o.max_kv_indices = int_arg<std::int64_t>(get("max_kv_indices"), "max_kv_indices");
  o.max_qo_len = int_arg<int>(get("max_qo_len"), "max_qo_len");
  o.exact_scores = flag_arg(get("exact_scores"), "exact_scores");
  o.max_tile_rows = int_arg<int>(get("max_tile_rows"), "max_tile_rows");
  o.any_scale_ratio = flag_arg(get("any_scale_ratio"), "any_scale_ratio");
  std::string family;
  if (!nb::try_cast(get("kernel_family"), family, false))
    throw nb::type_error("kernel_family: expected a string");
  o.kernel_family = fp8mla::parse_kernel_family(family);
  return o;
}

inline void* as_stream(std::uintptr_t stream) {
  return reinterpret_cast<void*>(stream);
}

// run()'s arguments (and run_context_parallel()'s) from Python objects kept alive by `keep`.
inline fp8mla::RunArgs run_args(Args& keep, KvFormat format, nb::handle q_nope, nb::handle q_pe,
                         nb::handle ckv, nb::handle kpe, nb::handle out, nb::handle lse,
                         float ckv_scale, float kpe_scale, std::uintptr_t stream) {
  fp8mla::RunArgs a;
  a.q_nope = keep.in(q_nope, "q_nope");
  a.q_pe = keep.in(q_pe, "q_pe");
  a.kv.format = format;
  a.kv.ckv = keep.in(ckv, "ckv_cache");
  a.kv.kpe = keep.in(kpe, "kpe_cache");
  a.kv.ckv_scale = ckv_scale;
  a.kv.kpe_scale = kpe_scale;
  a.out = keep.out(out, "out");
  a.lse = keep.out(lse, "lse");
  a.stream = as_stream(stream);
  return a;
}

}  // namespace fp8mla::ext_args
