"""FlashInfer's real MLA wrapper signatures, read from the flashinfer-python 0.6.18.post1 and 0.7.4
wheels (tests/python/run.sh downloads them into $FP8MLA_FLASHINFER_WHEELS; the source is parsed
with ast, nothing is imported), against fp8mla's wrapper:

  * every parameter of __init__ / plan / run in either version is either honoured or explicitly
    rejected (a table below; a new FlashInfer parameter fails the test until it is sorted);
  * fp8mla's signature has every one of them, FlashInfer's positional parameters in the same
    order (positional calls bind the same way), and the same literal defaults;
  * each rejected parameter, given, raises NotImplementedError or ValueError naming it;
  * MLAPlanMetadata has FlashInfer's fields and constructors.
"""

import ast
import glob
import inspect
import os
import zipfile

import numpy as np
import pytest

import fp8mla
import fp8mla.mla

WHEELS = os.environ.get("FP8MLA_FLASHINFER_WHEELS")
VERSIONS = ("0.6.18.post1", "0.7.4")

# Parameters fp8mla computes with (their semantics are tested in test_wrapper_flashinfer.py and
# test_flashinfer_deepseek_mla.py).
HONOURED = {
    "__init__": {"float_workspace_buffer", "use_cuda_graph", "qo_indptr", "kv_indptr",
                 "kv_indices", "kv_len_arr", "backend"},
    "plan": {"qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr", "num_heads", "head_dim_ckv",
             "head_dim_kpe", "page_size", "causal", "sm_scale", "q_data_type", "kv_data_type",
             "metadata", "cum_seq_lens_q", "block_tables", "seq_lens", "max_q_len",
             "query_layout", "kv_cache_layout", "lse_mode", "output_dtype", "scale_mode",
             "enable_pdl", "use_profiler", "output_scale", "skip_softmax", "use_sinks"},
    "run": {"q_nope", "q_pe", "ckv_cache", "kpe_cache", "out", "lse", "return_lse",
            "return_lse_base_on_e", "query", "kv_cache", "ckv_scale", "kpe_scale"},
}
# Parameters (or values) fp8mla refuses: (value to pass, exceptions allowed). The default of each
# is accepted (it asks for nothing fp8mla lacks).
REJECTED = {
    "__init__": {"backend": ("cutlass", (NotImplementedError,))},
    "plan": {
        "use_profiler": (True, (NotImplementedError,)),
        "output_scale": ("per-tensor", (NotImplementedError,)),
        "skip_softmax": (True, (NotImplementedError,)),
        "use_sinks": (True, (NotImplementedError,)),
        "enable_pdl": (False, (NotImplementedError,)),
        "scale_mode": ("bmm-tensor", (NotImplementedError,)),
        "head_dim_kpe": (0, (NotImplementedError,)),
        "head_dim_ckv": (256, (NotImplementedError,)),
        "kv_data_type": ("float16", (NotImplementedError,)),
    },
    "run": {
        "profiler_buffer": (np.zeros(8, np.uint8), (ValueError,)),
        "kv_len": (np.array([5], np.int32), (ValueError,)),
        "page_table": (np.zeros((1, 2), np.int32), (ValueError,)),
        "o_scale": (1.0, (ValueError,)),
        "ckv_scale_arr": (np.ones((2, 4, 4), np.float32), (NotImplementedError,)),
        "sinks": (np.zeros(2, np.float32), (ValueError,)),
        "skip_softmax_threshold_scale_factor": (1.0, (ValueError,)),
        "bmm1_scale": (1.0, (ValueError,)),
        "bmm2_scale": (1.0, (ValueError,)),
    },
}


def wheel(version):
    if not WHEELS:
        pytest.skip("FP8MLA_FLASHINFER_WHEELS is not set (tests/python/run.sh downloads the "
                    "wheels and sets it)")
    found = glob.glob(os.path.join(WHEELS, f"flashinfer_python-{version}-*.whl"))
    assert found, f"no flashinfer_python-{version} wheel in {WHEELS}"
    return found[0]


def wrapper_class(version):
    """The ast.ClassDef of BatchMLAPagedAttentionWrapper in the wheel's flashinfer/mla."""
    with zipfile.ZipFile(wheel(version)) as z:
        for name in sorted(z.namelist()):
            if not (name.startswith("flashinfer/mla") and name.endswith(".py")):
                continue
            source = z.read(name).decode()
            if "class BatchMLAPagedAttentionWrapper" not in source:
                continue
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.ClassDef) and node.name == "BatchMLAPagedAttentionWrapper":
                    return node
    raise AssertionError(f"BatchMLAPagedAttentionWrapper not found in {version}")


def metadata_class(version):
    with zipfile.ZipFile(wheel(version)) as z:
        for name in sorted(z.namelist()):
            if name.startswith("flashinfer/mla") and name.endswith(".py"):
                tree = ast.parse(z.read(name).decode())
                for node in ast.walk(tree):
                    if isinstance(node, ast.ClassDef) and node.name == "MLAPlanMetadata":
                        return node
    return None


def implementation(cls, method):
    """The method's implementation (the last def of that name not decorated @overload)."""
    defs = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == method]
    real = [d for d in defs if not any(
        (isinstance(x, ast.Name) and x.id == "overload") or
        (isinstance(x, ast.Attribute) and x.attr == "overload") for x in d.decorator_list)]
    assert real, f"no implementation of {method}"
    return real[-1]


def params(fn):
    """[(name, kind, default literal or ..., has default)] without self."""
    a = fn.args
    positional = a.posonlyargs + a.args
    out = []
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for arg, d in zip(positional, defaults):
        if arg.arg != "self":
            out.append((arg.arg, "positional", d))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append((arg.arg, "keyword", d))
    return out


def literal(node):
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        return ...


METHODS = ("__init__", "plan", "run")


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("method", METHODS)
def test_every_flashinfer_parameter_is_accepted_or_rejected(version, method):
    fi = params(implementation(wrapper_class(version), method))
    ours = inspect.signature(getattr(fp8mla.mla.BatchMLAPagedAttentionWrapper, method))
    ours_params = [p for p in ours.parameters.values() if p.name != "self"]
    ours_names = {p.name: p for p in ours_params}
    known = HONOURED[method] | set(REJECTED[method])
    unsorted = [n for n, _, _ in fi if n not in known]
    assert not unsorted, (f"flashinfer {version} {method}() has parameters fp8mla neither "
                          f"honours nor rejects: {unsorted}")
    missing = [n for n, _, _ in fi if n not in ours_names]
    assert not missing, f"fp8mla's {method}() lacks flashinfer {version}'s {missing}"
    # Positional calls bind the same way: FlashInfer's positional parameters are ours, in order.
    fi_positional = [n for n, kind, _ in fi if kind == "positional"]
    ours_positional = [p.name for p in ours_params if p.kind in (
        inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    assert ours_positional[: len(fi_positional)] == fi_positional, (version, method)
    for name, _, default in fi:
        if default is None:
            continue
        value = literal(default)
        if value is ...:
            continue
        ours_default = ours_names[name].default
        if name == "float_workspace_buffer":
            continue  # fp8mla defaults it to None (the CPU); FlashInfer requires it
        assert ours_default == value, f"{method}({name}) default: flashinfer {version} " \
                                      f"{value!r}, fp8mla {ours_default!r}"


def test_the_wheels_differ_where_fp8mla_covers_both():
    """0.7.4 adds the structural forms and contract keywords 0.6.18 lacks: both are read."""
    old = {n for n, _, _ in params(implementation(wrapper_class(VERSIONS[0]), "run"))}
    new = {n for n, _, _ in params(implementation(wrapper_class(VERSIONS[1]), "run"))}
    assert "query" in new and "query" not in old
    assert {"q_nope", "ckv_scale", "o_scale"} <= old & new


def planned(**plan_kw):
    w = fp8mla.BatchMLAPagedAttentionWrapper(None, num_pages=4)
    kw = dict(num_heads=2, head_dim_ckv=512, head_dim_kpe=64, page_size=4, causal=False,
              sm_scale=0.1, q_data_type="bfloat16", kv_data_type="float8_e4m3fn")
    kw.update(plan_kw)
    w.plan(np.array([0, 1], np.int32), np.array([0, 2], np.int32), np.array([0, 1], np.int32),
           np.array([5], np.int32), **kw)
    return w


@pytest.mark.parametrize("method,name", [(m, n) for m in METHODS for n in REJECTED[m]])
def test_rejected_parameters_raise_naming_themselves(method, name):
    value, errors = REJECTED[method][name]
    with pytest.raises(errors, match=name):
        if method == "__init__":
            fp8mla.BatchMLAPagedAttentionWrapper(None, **{name: value})
        elif method == "plan":
            planned(**{name: value})
        else:
            w = planned()
            q = np.zeros((1, 2, 576), np.uint16)
            pool = np.zeros((4, 4, 576), np.uint8)
            kw = dict(ckv_scale=1.0, kpe_scale=1.0)
            if name == "ckv_scale_arr":
                kw.pop("ckv_scale")
            w.run(query=q, kv_cache=pool, **kw, **{name: value})


def test_plan_metadata_matches_flashinfer():
    node = metadata_class("0.7.4")
    assert node is not None
    fields = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign)]
    ours = [f.name for f in __import__("dataclasses").fields(fp8mla.mla.MLAPlanMetadata)]
    assert ours == fields
    ctors = {n.name: [a.arg for a in n.args.args + n.args.kwonlyargs if a.arg != "cls"]
             for n in node.body if isinstance(n, ast.FunctionDef)}
    for name in ("csr", "dense", "dual"):
        sig = inspect.signature(getattr(fp8mla.mla.MLAPlanMetadata, name))
        assert list(sig.parameters) == ctors[name], name
