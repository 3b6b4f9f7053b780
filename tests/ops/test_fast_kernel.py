"""FastKernel (nsa/ops/triton/jit.py): a launch whose argument key was seen before goes straight
to the compiled kernel Triton chose then; a new key (alignment, integer, dtype, constexpr,
launch option) goes through Triton. On the CPU Triton's path is a stand-in that records its
calls; on a GPU a real kernel runs both ways."""

from types import SimpleNamespace

import pytest
import torch
import triton.language as tl
from triton import knobs
from triton.runtime.jit import JITFunction

from nsa.ops.triton import jit


def _toy(X, Y, N, scale, FLAG: tl.constexpr, BLOCK: tl.constexpr = 16):
    pass


class _Compiled:
    """A compiled kernel as FastKernel calls it: ``run`` with the launcher's arguments."""

    function = "function"
    packed_metadata = ("metadata",)

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


class _TritonPath:
    """Triton's own launch (``jitted[grid](*args, **kwargs)``), recorded: returns the compiled
    kernel, as Triton does."""

    def __init__(self, jitted):
        self.params, self.fn = jitted.params, jitted.fn
        self.compiled = _Compiled()
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, args, kwargs))
            return self.compiled
        return launch


@pytest.fixture
def toy(monkeypatch):
    active = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 7)
    monkeypatch.setattr(jit, "driver", SimpleNamespace(active=active))
    kernel = jit.FastKernel(JITFunction(_toy))
    kernel.kernel = _TritonPath(kernel.kernel)
    return kernel


def _args(x=None, y=None, n=16, scale=0.5):
    x = torch.zeros(64, dtype=torch.bfloat16) if x is None else x
    y = torch.zeros(64, dtype=torch.float32) if y is None else y
    return x, y, n, scale


def test_a_repeated_launch_goes_to_the_compiled_kernel(toy):
    x, y, n, scale = args = _args()
    toy[(3,)](*args, FLAG=True, num_warps=4)
    toy[(3, 2)](*args, FLAG=True, num_warps=4)
    assert len(toy.kernel.launches) == 1
    # grid padded to 3 dims, the current stream, tensors as addresses, constexprs in the
    # signature's order (BLOCK's default included), no launch hooks
    assert toy.kernel.compiled.calls == [
        (3, 2, 1, 7, "function", ("metadata",), None, None, None, x.data_ptr(), y.data_ptr(),
         n, scale, True, 16)]


@pytest.mark.parametrize("change", [
    dict(x=torch.zeros(65, dtype=torch.bfloat16)[1:]),  # address not a multiple of 16
    dict(x=torch.zeros(64, dtype=torch.float16)),       # dtype
    dict(n=17), dict(n=1), dict(n=2 ** 31),             # divisibility, the constant 1, width
    dict(scale=2),                                      # an int where a float was
])
def test_a_new_argument_key_goes_through_triton(toy, change):
    toy[(1,)](*_args(), FLAG=True)
    toy[(1,)](*_args(**change), FLAG=True)
    assert len(toy.kernel.launches) == 2 and not toy.kernel.compiled.calls


@pytest.mark.parametrize("options", [dict(FLAG=False), dict(FLAG=True, BLOCK=32),
                                     dict(FLAG=True, num_warps=8)])
def test_new_constexprs_or_options_go_through_triton(toy, options):
    toy[(1,)](*_args(), FLAG=True)
    toy[(1,)](*_args(), **options)
    assert len(toy.kernel.launches) == 2


def test_other_tensors_of_the_same_key_go_to_the_compiled_kernel(toy):
    toy[(1,)](*_args(scale=0.5), FLAG=True)
    x, y, n, scale = _args(scale=3.0)  # new tensors, another float
    toy[(1,)](x, y, n, scale, FLAG=True)
    assert len(toy.kernel.launches) == 1
    assert toy.kernel.compiled.calls[0][9:13] == (x.data_ptr(), y.data_ptr(), n, 3.0)


def test_runtime_arguments_by_name(toy):
    x, y, n, scale = _args()
    toy[(1,)](x, y, N=n, scale=scale, FLAG=True)
    assert toy.kernel.launches[0][1] == (x, y, n, scale)  # Triton gets them in order
    toy[(1,)](x, y, n, scale=scale, FLAG=True)
    assert len(toy.kernel.launches) == 1 and len(toy.kernel.compiled.calls) == 1
    with pytest.raises(TypeError, match="missing arguments"):
        toy[(1,)](x, y, FLAG=True)


def test_launch_hooks_and_grid_functions_go_through_triton(toy, monkeypatch):
    toy[(1,)](*_args(), FLAG=True)
    toy[lambda meta: (1,)](*_args(), FLAG=True)

    def hook(metadata):
        pass
    knobs.runtime.launch_exit_hook.add(hook)  # Triton's chains of hooks (proton's way)
    try:
        toy[(1,)](*_args(), FLAG=True)
    finally:
        knobs.runtime.launch_exit_hook.remove(hook)
    chain = knobs.runtime.launch_enter_hook
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)  # a hook set directly
    toy[(1,)](*_args(), FLAG=True)
    assert len(toy.kernel.launches) == 4 and not toy.kernel.compiled.calls
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", chain)
    toy[(1,)](*_args(), FLAG=True)  # no hook: the compiled kernel
    assert len(toy.kernel.compiled.calls) == 1


def test_the_remembered_keys_are_bounded(toy, monkeypatch):
    monkeypatch.setattr(jit, "MAX_KEYS", 4)
    for n in range(16, 16 * 7, 16):
        toy[(1,)](*_args(n=n), FLAG=True)
    assert len(toy.compiled) <= 4


def _constexpr_first(X, C: tl.constexpr, N):
    pass


def test_a_constexpr_before_a_runtime_parameter_is_refused():
    with pytest.raises(TypeError, match="must follow"):
        jit.FastKernel(JITFunction(_constexpr_first))


def test_the_offline_tools_get_the_triton_function(toy):
    assert isinstance(jit.triton_function(toy), _TritonPath)
    assert jit.triton_function(_toy) is _toy


def _scale(X, Y, N, alpha, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offsets, mask=offsets < N)
    tl.store(Y + offsets, x * alpha, mask=offsets < N)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_both_paths_compute_the_same():
    kernel = jit.kernel(_scale)
    assert isinstance(kernel, jit.FastKernel)
    base = torch.randn(1 + 4096, device="cuda")
    for x in (base[:4096], base[16:16 + 4000], base[1:], base[16:16 + 4000], base[1:]):
        for _ in range(2):
            y = torch.full_like(x, float("nan"))
            kernel[(4096 // 128 + 1,)](x, y, x.numel(), 0.5, BLOCK=128)
            torch.testing.assert_close(y, x * 0.5, rtol=0, atol=0)
    # keys: aligned 4096 elements, aligned 4000 (not a multiple of 16), misaligned 4096
    assert len(kernel.compiled) == 3
