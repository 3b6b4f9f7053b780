"""Bad input, fuzzed: hypothesis drives ``nsa_attention``, ``nsa_select``, the attention layer
and the CLI's config parsing with random shapes, dtypes, devices, parameters and cu_seqlens.

Every case is built valid and then broken in at most one place, so the test knows which
argument is at fault. A valid case must return a correct result: the right shape, dtype and
device, no NaN or inf, and (where it is small enough) the float64 oracle of
``tests/ops/naive_reference.py`` on the blocks the package selected, those blocks being a
correct selection modulo near-ties. A broken case must raise a ``ValueError`` whose message
names the broken argument. Any other exception fails the test.
"""

from __future__ import annotations

import math
import re
import typing
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import nsa
from nsa.config_tree import field_paths, is_section, replace_fields
from nsa.layers.attention import BRANCHES, KV_SHARING, AttentionConfig, NSAttention
from nsa.layers.compressor import COMPRESSORS
from nsa.models.config import MODEL_PRESETS
from nsa.ops.triton_support import TRITON_AVAILABLE, TRITON_INTERPRET
from nsa.train.config import TRAIN_PRESETS, RunConfig, TrainConfig, build_config
from tests.ops.helpers import (
    assert_all_rel_close,
    assert_index_format,
    assert_rel_close,
    assert_selection_valid,
    forward_backward,
    make_inputs,
    to_double,
)
from tests.ops.naive_reference import naive_attention, naive_group_scores

FUZZ = dict(deadline=None, derandomize=True, database=None,
            suppress_health_check=[HealthCheck.too_slow])

FLOATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
# The Triton tests run CPU tensors through Triton's interpreter, which computes bfloat16 on the
# raw bit patterns (triton-lang/triton#11584); tests/ops/test_triton_backend.py covers bfloat16
# on a GPU.
INTERPRETED = (torch.float32, torch.float16)
needs_interpreter = pytest.mark.skipif(not (TRITON_AVAILABLE and TRITON_INTERPRET),
                                       reason="needs Triton's interpreter (a machine without CUDA)")
# Relative errors allowed against the float64 oracle (NSA_SPEC.md; float16 as the Triton
# tests), and how close two block scores of one head may be and still be ordered either way.
TOL = {torch.float64: 1e-9, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}
SCORE_TOL = {torch.float64: 1e-9, torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}
# Up to which B·T·HQ and block sizes a valid result is compared with the (slow) oracle, which
# loops over every token of a selected block.
ORACLE_ROWS, ORACLE_BLOCK = 256, 64

TENSORS = ("q", "k", "v", "k_cmp", "v_cmp", "gates", "k_win", "v_win")
# The dims checked against another tensor (q sets B, T, HQ and Dk; k sets H, v sets Dv, and
# in nsa_select k_cmp sets H).
CHECKED_DIMS = {
    "attention": dict(k=(0, 1, 3), v=(0, 1, 2), k_cmp=(0, 1, 2, 3), v_cmp=(0, 1, 2, 3),
                      gates=(0, 1, 2, 3), k_win=(0, 1, 2, 3), v_win=(0, 1, 2, 3)),
    "select": dict(k_cmp=(0, 1, 3)),
}
POSITIVE = ("cmp_block", "cmp_stride", "sel_block", "num_selected", "window")
NON_NEGATIVE = ("num_init", "num_local")
NOT_INTS = (True, False, 4.0, "4", None, [4])
BAD_SCALES = (0, 0.0, -1.0, -1e-300, math.inf, -math.inf, math.nan, "0.5", True, 1j, [0.5])
BAD_BACKENDS = ("cuda", "", None, 0, "Torch")


def names_one_of(message: str, names) -> bool:
    """Whether ``message`` contains one of ``names`` as a whole word."""
    return any(re.search(rf"(?<!\w){re.escape(n)}(?!\w)", message) for n in names)


# ---------------------------------------------------------------------------------------------
# nsa_attention and nsa_select
# ---------------------------------------------------------------------------------------------


@dataclass
class Case:
    """One call of an op and the names of its broken argument (empty when all are valid)."""

    op: str  # "attention" or "select"
    spec: dict  # what the valid inputs were built from: dims, dtype, device, seed, ...
    x: dict  # the tensor arguments by name (k_win, v_win absent when defaulted)
    kw: dict  # keyword arguments
    broken: tuple = ()

    def call(self):
        if self.op == "select":
            return nsa.nsa_select(self.x["q"], self.x["k_cmp"], **self.kw)
        windows = {n: self.x[n] for n in ("k_win", "v_win") if n in self.x}
        return nsa.nsa_attention(*(self.x[n] for n in TENSORS[:6]), **windows, **self.kw)

    def rebuild(self, **changes) -> None:
        """New valid tensors after changing some of ``spec``."""
        self.spec.update(changes)
        self.x = make_tensors(self.op, self.spec, self.kw)


def make_tensors(op: str, s: dict, kw: dict) -> dict:
    """Random valid tensors of ``op`` for the sizes, dtype, layout and device in ``s``."""
    x = make_inputs(s["B"], s["T"], s["HQ"], s["H"], s["Dk"], s["Dv"], dtype=s["dtype"],
                    seed=s["seed"], cmp_block=kw["cmp_block"], cmp_stride=kw["cmp_stride"],
                    cu_seqlens=kw["cu_seqlens"], separate_win=s["separate_win"])
    if op == "select":
        x = {n: x[n] for n in ("q", "k_cmp")}
    if s["strided"]:  # same values, [B, H, T, D] storage
        x = {n: t.transpose(1, 2).contiguous().transpose(1, 2) for n, t in x.items()}
    return {n: t.to(s["device"]) for n, t in x.items()}


@st.composite
def block_params(draw, op: str, large: bool = True):
    """Valid block sizes; with ``large``, now and then one near the int32 limit."""
    d = draw(st.integers(1, 4))
    factors = [1, 2, 3, 4] * 2 + [2**28] if large else [1, 2, 3, 4]
    num_init, num_local = draw(st.integers(0, 2)), draw(st.integers(0, 2))
    p = dict(cmp_block=d * draw(st.sampled_from(factors)), cmp_stride=d,
             sel_block=d * draw(st.sampled_from(factors)),
             num_selected=max(1, num_init + num_local) + draw(st.integers(0, 3)),
             num_init=num_init, num_local=num_local)
    if op == "attention":
        p["window"] = draw(st.integers(1, 45) | st.just(2**31 - 1) if large else st.integers(1, 45))
    return p


@st.composite
def cu_seqlens_for(draw, T: int):
    """Valid int32 boundaries of 1 to 4 sequences (some possibly empty) packing T tokens."""
    cuts = sorted(draw(st.lists(st.integers(0, T), max_size=3)))
    return torch.tensor([0, *cuts, T], dtype=torch.int32)


def break_block_param(draw, kw: dict) -> tuple:
    """Make one block parameter invalid: its value, its type, divisibility or the forced count."""
    kind = draw(st.sampled_from(["value", "type", "divide", "forced"]))
    if kind == "divide":
        d = draw(st.integers(2, 5))
        which, other = draw(st.sampled_from([("cmp_block", "sel_block"),
                                             ("sel_block", "cmp_block")]))
        kw.update({"cmp_stride": d, other: d * draw(st.integers(1, 3)),
                   which: d * draw(st.integers(0, 3)) + draw(st.integers(1, d - 1))})
        return ("cmp_stride",)
    if kind == "forced":
        num_init, num_local = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        kw.update(num_init=num_init, num_local=num_local,
                  num_selected=draw(st.integers(1, num_init + num_local - 1)))
        return ("num_selected",)
    name = draw(st.sampled_from([n for n in POSITIVE + NON_NEGATIVE if n in kw]))
    if kind == "type":
        kw[name] = draw(st.sampled_from(NOT_INTS))
    else:
        too_small = [0, -1, -(2**40)] if name in POSITIVE else [-1, -(2**40)]
        kw[name] = draw(st.sampled_from([*too_small, 2**31, 2**64]))
    return (name,)


def break_param(draw, case: Case) -> tuple:
    """Each ``break_*`` breaks one argument of ``case`` and returns the names that may stand
    for it in the error message."""
    return break_block_param(draw, case.kw)


def break_scale(draw, case: Case) -> tuple:
    """A scale that is no positive finite number, or one whose scale · log2(e) overflows the
    float32 scores of float32, bfloat16 and float16 inputs."""
    past_float32 = (3e38, 1e300) if case.spec["dtype"] != torch.float64 else ()
    case.kw["scale"] = draw(st.sampled_from(BAD_SCALES + past_float32))
    return ("scale",)


def break_backend(draw, case: Case) -> tuple:
    float64 = ("triton",) if case.spec["dtype"] == torch.float64 else ()
    case.kw["backend"] = draw(st.sampled_from(BAD_BACKENDS + float64))
    return ("backend",)


def break_cu_seqlens(draw, case: Case) -> tuple:
    """A malformed cu_seqlens next to tensors that fit a valid one (or B > 1)."""
    kinds = ["batch", "dtype", "type", "start", "decreasing", "end", "shape"]
    if case.spec["device"] == "cpu":
        kinds.append("device")
    kind = draw(st.sampled_from(kinds))
    T = case.spec["T"]
    cu = draw(cu_seqlens_for(T))
    case.kw["cu_seqlens"] = None if kind == "batch" else cu
    case.rebuild(B=draw(st.integers(2, 3)) if kind == "batch" else 1)
    values = cu.tolist()
    if kind == "dtype":
        bad = cu.to(draw(st.sampled_from([torch.int64, torch.int16, torch.float32])))
    elif kind == "type":
        bad = draw(st.sampled_from([values, tuple(values)]))
    elif kind == "start":
        bad = torch.tensor([draw(st.integers(1, 3)), *values[1:]], dtype=torch.int32)
    elif kind == "decreasing":
        i = draw(st.integers(1, len(values) - 1))
        values.insert(i, values[i] + draw(st.integers(1, 3)))
        bad = torch.tensor(values, dtype=torch.int32)
    elif kind == "end":
        values[-1] = T + draw(st.sampled_from([-1, 1, 2]))
        bad = torch.tensor(values, dtype=torch.int32)
    elif kind == "shape":
        bad = draw(st.sampled_from([cu[None], cu[:1], cu[0], cu[:0]]))
    elif kind == "device":
        bad = cu.to("meta")
    else:  # batch: B > 1
        bad = cu
    case.kw["cu_seqlens"] = bad
    return ("cu_seqlens",)


def break_tensor(draw, case: Case) -> tuple:
    """One tensor of the wrong type, rank, dtype, device or size, or inconsistent head counts."""
    kind = draw(st.sampled_from(["type", "rank", "dtype", "device", "dim", "heads", "head_dim"]))
    heads_of = "k" if case.op == "attention" else "k_cmp"
    if kind == "heads":  # HQ zero or not a multiple of H
        H = case.spec["H"]
        case.rebuild(HQ=draw(st.sampled_from([0, *(n for n in range(1, 4 * H) if n % H)])))
        return ("q", heads_of)
    if kind == "head_dim":  # a zero head dim throughout
        dim = draw(st.sampled_from(["Dk", "Dv"] if case.op == "attention" else ["Dk"]))
        case.rebuild(**{dim: 0})
        return ("q", heads_of) if dim == "Dk" else ("v",)
    if kind == "dim":
        name = draw(st.sampled_from([n for n in CHECKED_DIMS[case.op] if n in case.x]))
        t = case.x[name]
        dim = draw(st.sampled_from(CHECKED_DIMS[case.op][name]))
        shape = list(t.shape)
        shape[dim] = draw(st.sampled_from([shape[dim] + 1] + ([shape[dim] - 1] * (shape[dim] > 0))))
        case.x[name] = torch.zeros(shape, dtype=t.dtype, device=t.device)
        return (name,)
    name = draw(st.sampled_from(list(case.x)))
    t = case.x[name]
    if kind == "type":
        defaulted = name in ("k_win", "v_win")  # None is valid there
        nested = torch.zeros(t.shape).tolist()
        case.x[name] = draw(st.sampled_from([nested, 1.0, "q", *[None] * (not defaulted)]))
    elif kind == "rank":
        case.x[name] = draw(st.sampled_from([t[..., 0], t[None]]))
    elif kind == "dtype":
        other = draw(st.sampled_from([d for d in FLOATS if d != t.dtype]
                                     + [torch.int64, torch.bool, torch.complex64]))
        case.x[name] = t.float().to(other)
    else:  # device
        case.x[name] = t.to("cpu" if t.device.type == "meta" else "meta")
    return (name,)


FAULTS = (None, None, None, break_param, break_scale, break_backend, break_cu_seqlens,
          break_tensor, break_tensor)


@st.composite
def op_cases(draw, op: str, backends, dtypes, *, batch=3, length=40, heads=3, group=4, dim=16,
             large=True):
    """A valid call of ``op`` with random sizes and options, broken by at most one fault."""
    p = draw(block_params(op, large))
    spec = dict(B=draw(st.integers(1, batch)), T=draw(st.integers(0, length)),
                H=draw(st.integers(1, heads)), Dk=2 * draw(st.integers(1, dim // 2)),
                Dv=2 * draw(st.integers(1, dim // 2)), dtype=draw(st.sampled_from(dtypes)),
                seed=draw(st.integers(0, 2**16)), separate_win=draw(st.booleans()),
                strided=draw(st.booleans()), device=draw(st.sampled_from(["cpu"] * 4 + ["meta"])))
    spec["HQ"] = spec["H"] * draw(st.integers(1, group))
    cu_seqlens = None
    if draw(st.booleans()):
        spec["B"] = 1
        cu_seqlens = draw(cu_seqlens_for(spec["T"]))
    kw = dict(p, scale=draw(st.none() | st.floats(1e-3, 1e3)), cu_seqlens=cu_seqlens,
              backend=draw(st.sampled_from(backends)))
    case = Case(op, spec, make_tensors(op, spec, kw), kw)
    fault = draw(st.sampled_from(FAULTS))
    if fault is not None:
        case.broken = fault(draw, case)
    return case


def check_selection(case: Case, idx: torch.Tensor) -> None:
    """Index format of the spec, and a correct selection for the oracle's block scores."""
    event("compared with the oracle")
    q, k_cmp, kw = case.x["q"], case.x["k_cmp"], case.kw
    B, T, HQ = q.shape[:3]
    H = k_cmp.shape[2]
    assert_index_format(idx, B, T, H, sel_block=kw["sel_block"], num_selected=kw["num_selected"],
                        cu_seqlens=kw["cu_seqlens"])
    scores = naive_group_scores(q, k_cmp, cmp_block=kw["cmp_block"], cmp_stride=kw["cmp_stride"],
                                sel_block=kw["sel_block"], scale=kw["scale"],
                                cu_seqlens=kw["cu_seqlens"])
    assert_selection_valid(idx, scores, T, B=B, tol=SCORE_TOL[q.dtype] * (HQ // H), **kw)


def check_attention(case: Case, out: torch.Tensor) -> None:
    """Shape, dtype, device, finite values; output and gradients against the oracle."""
    q, v = case.x["q"], case.x["v"]
    B, T, HQ = q.shape[:3]
    assert out.shape == (B, T, HQ, v.shape[-1]), f"output shape {tuple(out.shape)}"
    assert (out.dtype, out.device) == (q.dtype, q.device), f"output {out.dtype} on {out.device}"
    if out.device.type == "meta":
        return
    assert torch.isfinite(out).all(), "non-finite output"
    if not 0 < B * T * HQ <= ORACLE_ROWS or case.kw["sel_block"] > ORACLE_BLOCK:
        return  # empty (T = 0: see tests/ops/test_robustness.py), or too slow for the oracle
    select_kw = {n: x for n, x in case.kw.items() if n != "window"}
    kw = {n: x for n, x in case.kw.items() if n != "backend"}
    idx = nsa.nsa_select(q, case.x["k_cmp"], **select_kw)
    check_selection(case, idx)
    ref = naive_attention(**to_double(case.x), selected=idx, **kw)
    assert_rel_close("output", out, ref, TOL[q.dtype])
    if case.kw["scale"] is None or case.kw["scale"] <= 1:  # else the softmax may saturate, and
        # its gradient cancel down to rounding noise
        do = torch.randn(out.shape, generator=torch.Generator().manual_seed(0),
                         dtype=torch.float64)
        out, grads = forward_backward(nsa.nsa_attention, case.x, do.to(q.dtype), **case.kw)
        ref, ref_grads = forward_backward(naive_attention, to_double(case.x), do, selected=idx,
                                          **kw)
        assert_all_rel_close(out, grads, ref, ref_grads, TOL[q.dtype])


def check_select(case: Case, idx: torch.Tensor) -> None:
    """Shape, dtype and device of the index; the selection against the oracle's scores."""
    q, k_cmp = case.x["q"], case.x["k_cmp"]
    B, T = q.shape[:2]
    expected = (B, T, k_cmp.shape[2], case.kw["num_selected"])
    assert tuple(idx.shape) == expected, f"index shape {tuple(idx.shape)}"
    assert idx.dtype in (torch.int32, torch.int64) and idx.device == q.device
    if idx.device.type != "meta" and B * T * q.shape[2] <= 4 * ORACLE_ROWS:
        check_selection(case, idx)


def run_case(case: Case) -> None:
    """A correct result for a valid case; a ValueError naming the broken argument otherwise."""
    event(f"broken: {', '.join(case.broken) or 'nothing'}")
    try:
        result = case.call()
    except ValueError as e:
        assert case.broken, f"valid input raised {e!r}"
        assert names_one_of(str(e), case.broken), f"{e!r} does not name {case.broken}"
        return
    assert not case.broken, f"invalid {case.broken} accepted"
    (check_attention if case.op == "attention" else check_select)(case, result)


@settings(max_examples=400, **FUZZ)
@given(op_cases("attention", backends=["torch", "auto"], dtypes=FLOATS))
def test_nsa_attention_fuzzed(case):
    run_case(case)


@needs_interpreter
@settings(max_examples=30, **FUZZ)
@given(op_cases("attention", backends=["triton"], dtypes=INTERPRETED, batch=2, length=12, heads=2,
                group=2, dim=4, large=False))  # see test_triton_rejects_oversized_tiles
def test_nsa_attention_triton_fuzzed(case):
    run_case(case)


@settings(max_examples=120, **FUZZ)
@given(op_cases("select", backends=["torch", "auto"], dtypes=FLOATS))
def test_nsa_select_fuzzed(case):
    run_case(case)


@needs_interpreter
@settings(max_examples=15, **FUZZ)
@given(op_cases("select", backends=["triton"], dtypes=INTERPRETED, batch=2, length=12, heads=2,
                group=2, dim=4, large=False))
def test_nsa_select_triton_fuzzed(case):
    run_case(case)


# ---------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------

LAYER_SIZES = ("dim", "num_heads", "num_kv_heads", "head_dim_k", "head_dim_v")
LAYER_CHOICES = dict(kv_sharing=KV_SHARING, compressor=COMPRESSORS,
                     force_branch=(None, *BRANCHES), backend=("torch", "auto"))


@st.composite
def layer_cases(draw):
    """AttentionConfig fields, valid or with one field broken, and the broken field's names."""
    H, G = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    fields = dict(dim=draw(st.integers(1, 12)), num_heads=G * H, num_kv_heads=H,
                  head_dim_k=2 * draw(st.integers(1, 4)), head_dim_v=draw(st.integers(1, 8)),
                  rope_base=draw(st.floats(1.0, 1e6)),
                  compressor_hidden=draw(st.none() | st.integers(1, 8)),
                  **draw(block_params("attention", large=False)),
                  **{n: draw(st.sampled_from(c)) for n, c in LAYER_CHOICES.items()})
    kind = draw(st.sampled_from([None, None, "size", "heads", "rope", "choice", "param"]))
    if kind == "size":
        name = draw(st.sampled_from(LAYER_SIZES))
        fields[name] = draw(st.integers(-3, 0))
        return fields, (name,)
    if kind == "heads":
        fields["num_heads"] = draw(st.sampled_from([n for n in range(1, 7) if n % H] or [3]))
        fields["num_kv_heads"] = H if fields["num_heads"] % H else 2
        return fields, ("num_heads", "num_kv_heads")
    if kind == "rope":
        fields["head_dim_k"] = 2 * draw(st.integers(0, 4)) + 1
        return fields, ("head_dim_k",)
    if kind == "choice":
        name = draw(st.sampled_from(list(LAYER_CHOICES)))
        optional = name == "force_branch"  # None is valid there
        fields[name] = draw(st.sampled_from(["cuda", "all", "", 0, *[None] * (not optional)]))
        return fields, (name,)
    if kind == "param":
        return fields, break_block_param(draw, fields)
    return fields, ()


@settings(max_examples=80, **FUZZ)
@given(layer_cases(), st.integers(1, 2), st.integers(0, 12),
       st.sampled_from([torch.float32, torch.float64, torch.bfloat16]), st.integers(0, 2**16))
def test_attention_layer_fuzzed(fields_broken, B, T, dtype, seed):
    fields, broken = fields_broken
    event(f"broken: {', '.join(broken) or 'nothing'}")
    try:
        config = replace_fields(AttentionConfig(), **fields)
    except ValueError as e:
        assert broken, f"valid config raised {e!r}"
        assert names_one_of(str(e), broken), f"{e!r} does not name {broken}"
        return
    assert not broken, f"invalid {broken} accepted"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        layer = NSAttention(config).to(dtype)
        x = torch.randn(B, T, config.dim, dtype=dtype)
        out = layer(x)
    assert out.shape == x.shape and out.dtype == dtype
    assert torch.isfinite(out).all(), "non-finite layer output"


# ---------------------------------------------------------------------------------------------
# build_config: the CLI's key=value overrides
# ---------------------------------------------------------------------------------------------

# Every field of the config tree by name (names are unique): its path and type.
HINTS = {path[-1]: (path, hint) for path, hint in field_paths(RunConfig).items()
         if not is_section(hint)}


def field_at(config, path):
    for name in path:
        config = getattr(config, name)
    return config


SPELLINGS = {bool: ["true", "False", "1", "0", "yes", "NO", "on", "off"]}


@st.composite
def typed_value(draw, hint, current):
    """(text, value) for a value of type ``hint`` (int, float, bool, str or an Optional); ints
    often near the preset's ``current`` value, to build more configs."""
    options = typing.get_args(hint) or (hint,)
    if type(None) in options and draw(st.booleans()):
        return draw(st.sampled_from(["none", "None", "null"])), None
    (kind,) = (t for t in options if t is not type(None))
    if kind is bool:
        text = draw(st.sampled_from(SPELLINGS[bool]))
        return text, text.lower() in ("true", "1", "yes", "on")
    if kind is int:
        near = [2 * current, current + 1] if isinstance(current, int) else []
        value = draw(st.one_of(*map(st.just, near), st.integers(-5, 5000)))
        return draw(st.sampled_from(["", " "])) + str(value), value
    if kind is float:
        value = draw(st.floats(-10.0, 1e4) | st.sampled_from([math.inf, -math.inf, math.nan]))
        return repr(value), value
    text = draw(st.text(max_size=8).map(str.strip))
    return text, text


@st.composite
def override_items(draw, preset: str):
    """(item, field name, expected value or ..., names an error must contain or None).

    ``...`` marks a field whose value is random text; the error names are set for items that
    must make build_config fail."""
    name = draw(st.sampled_from(sorted(HINTS)))
    path, hint = HINTS[name]
    section = path[0]
    kind = draw(st.sampled_from(["typed"] * 3 + ["text", "prefix", "unknown", "malformed"]))
    if kind == "unknown":
        key = draw(st.sampled_from(["", "lr_max", "model.lr" if section == "train" else "train.dim",
                                    "optim." + name, "model.train." + name, "dims"]))
        return f"{key}={draw(st.text(max_size=4))}", None, None, (repr(key),)
    if kind == "malformed":
        item = draw(st.text(max_size=10).filter(lambda s: "=" not in s))
        return item, None, None, (repr(item),)
    if kind == "text":
        return f"{name}={draw(st.text(max_size=10))}", name, ..., None
    defaults = (MODEL_PRESETS if section == "model" else TRAIN_PRESETS).get(preset)
    text, value = draw(typed_value(hint, field_at(defaults, path[1:]) if defaults else None))
    # a prefix: any of the sections on the field's path, in order
    kept = draw(st.lists(st.booleans(), min_size=len(path) - 1, max_size=len(path) - 1))
    prefix = [part for part, keep in zip(path, kept) if keep] if kind == "prefix" else []
    key = ".".join([*prefix, name])
    return f" {key} ={text}", name, value, None


@settings(max_examples=500, **FUZZ)
@given(st.sampled_from([*TRAIN_PRESETS] * 3 + ["huge"]).flatmap(
    lambda preset: st.tuples(st.just(preset), st.lists(override_items(preset), max_size=3))))
def test_build_config_fuzzed(preset_items):
    preset, items = preset_items
    overrides = [item for item, *_ in items]
    certain = [err for *_, err in items if err is not None]
    try:
        config = build_config(preset, overrides)
        event("built")
    except ValueError as e:
        event("ValueError")
        names = [repr(preset), *(n for _, n, _, _ in items if n), *sum(certain, ())]
        message = str(e)  # quoted names (a preset, a key, an item) may hold any characters
        assert any(n in message for n in names if "'" in n) or names_one_of(message, names), (
            f"{e!r} names none of {names}")
        return
    assert preset in TRAIN_PRESETS and not certain, f"{overrides} accepted"
    assert isinstance(config, RunConfig)
    last = {name: value for _, name, value, _ in items if name}
    for name, value in last.items():
        got = field_at(config, HINTS[name][0])
        if value is not ... and not (name == "seq_len" and value is None):
            assert repr(got) == repr(value), f"{name}: {got!r} != {value!r}"  # type, nan
    for f in TrainConfig.__dataclass_fields__:
        value = getattr(config.train, f)
        assert not isinstance(value, float) or math.isfinite(value), f"train.{f} = {value}"
    assert RunConfig.from_dict(config.to_dict()) == config


# ---------------------------------------------------------------------------------------------
# Bugs the fuzzing above found (fixed): regression tests
# ---------------------------------------------------------------------------------------------

LAYER_BASE = dict(dim=8, num_heads=2, num_kv_heads=1, head_dim_k=4, head_dim_v=4, cmp_block=4,
                  cmp_stride=2, sel_block=4, num_selected=2, num_local=1, window=3,
                  backend="torch")
# AttentionConfig fields that were not checked: TypeError or RuntimeError when the layer was
# built, or (rope_base <= 0, nan) NaN outputs.
INVALID_LAYER_FIELDS = [
    ("dim", "8"), ("dim", 8.5), ("dim", True), ("num_heads", None), ("head_dim_v", 2.0),
    ("rope_base", 0.0), ("rope_base", -1.0), ("rope_base", math.nan), ("rope_base", "x"),
    ("compressor_hidden", -1), ("compressor_hidden", 2.5),
]
# ModelConfig overrides build_config accepted, and that failed or gave NaN once the model ran.
INVALID_MODEL_OVERRIDES = ["rope_base=nan", "rope_base=0", "norm_eps=nan", "norm_eps=-1",
                           "mlp_hidden=-1", "compressor_hidden=-4"]


@pytest.mark.parametrize("name,value", INVALID_LAYER_FIELDS,
                         ids=[f"{n}={v!r}" for n, v in INVALID_LAYER_FIELDS])
def test_layer_fields_are_validated(name, value):
    with pytest.raises(ValueError, match=name):
        replace_fields(AttentionConfig(), **dict(LAYER_BASE, **{name: value}))


@pytest.mark.parametrize("override", INVALID_MODEL_OVERRIDES)
def test_model_overrides_are_validated(override):
    with pytest.raises(ValueError, match=override.partition("=")[0]):
        build_config("tiny", [override])


def test_empty_batch_torch_backend():
    x = make_inputs(0, 5, 2, 1, 4, 4, cmp_block=4, cmp_stride=2)
    out = nsa.nsa_attention(*(x[n] for n in TENSORS[:6]), cmp_block=4, cmp_stride=2,
                            sel_block=4, num_selected=2, num_local=1, window=3, backend="torch")
    assert out.shape == (0, 5, 2, 4)


@needs_interpreter
@pytest.mark.parametrize("op", ["attention", "select"])
def test_triton_rejects_oversized_tiles(op):
    """sel_block = 2**15 makes a [64 rows, 2**15] tile, over Triton's 2**20 elements."""
    p = dict(cmp_block=2, cmp_stride=1, sel_block=2**15, num_selected=1, num_init=0,
             num_local=0)
    x = make_inputs(1, 5, 2, 1, 4, 4, dtype=torch.float32, **p)
    with pytest.raises(ValueError, match="sel_block"):
        if op == "select":
            nsa.nsa_select(x["q"], x["k_cmp"], backend="triton", **p)
        else:
            nsa.nsa_attention(*(x[n] for n in TENSORS[:6]), window=3, backend="triton", **p)
