"""``kernel``: the decorator of every Triton kernel the launch wrappers launch (``@kernel`` in
place of ``@triton.jit``; the ``@triton.jit`` helpers they call stay as they are).

Why: the op is host-bound at the m7c training shape. A forward+backward at 8 x 2k issues 22
launches, and on the H200 machine each took ~85 µs of host time through Triton 3.6's launch
path, ~1.9 of the op's ~4.1 ms: the binder specializes each of the 21-42 arguments (pointer
alignment, integer divisibility), the cache key is built from that list and the options, and
the C launcher asks the driver about every pointer (cuPointerGetAttribute). The GPU runs the
op's kernels in 1.6 ms (bench/NOTES.md, thirty-eighth session).

A ``FastKernel`` keys its launches by the arguments themselves: each tensor's dtype and
whether its address is a multiple of 16, each integer's value, each tensor descriptor's dtype,
block shape and padding, each other argument's type, and the keyword arguments (constexprs,
warps, stages) and the device. Those determine Triton's specialization (what it compiles for:
a multiple of 16 or not, an integer of 1, 32 or 64 bits), so a key seen before names the
compiled kernel Triton chose then, and the launch goes straight to that kernel's launcher with
the tensors' addresses as integers. A new key, a launch hook (profilers such as proton) or a
grid given as a function take Triton's own path, which compiles where needed and launches.
Under the interpreter (``TRITON_INTERPRET=1``) ``kernel`` is ``triton.jit``.
"""

from __future__ import annotations

import inspect

import torch
import triton
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

MAX_KEYS = 4096  # compiled launches a kernel remembers; past it the memory starts afresh


def kernel(fn):
    """``triton.jit(fn)``, wrapped in a ``FastKernel`` unless the interpreter runs it."""
    jitted = triton.jit(fn)
    return FastKernel(jitted) if isinstance(jitted, JITFunction) else jitted


def _hooked() -> bool:
    """Whether a launch hook is set (profilers such as proton add them to Triton's chains)."""
    return any(getattr(hook, "calls", True)
               for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
               if hook is not None)


def triton_function(fn):
    """The Triton function of a kernel: a FastKernel's JITFunction, anything else as it is (the
    offline compile tools take it)."""
    return fn.kernel if isinstance(fn, FastKernel) else fn


def argument_key(args) -> tuple[tuple, list]:
    """(the specialization key of a launch's positional arguments, the values its launcher
    takes: tensors as their addresses, everything else as given). Integers, most of the
    arguments (sizes, strides), are their own key and value: one test each."""
    key, values = list(args), list(args)
    for i, a in enumerate(args):
        if type(a) is int:
            continue
        if isinstance(a, torch.Tensor):
            address = a.data_ptr()
            key[i] = (a.dtype, address % 16 == 0)
            values[i] = address
        elif isinstance(a, TensorDescriptor):
            key[i] = (a.base.dtype, tuple(a.block_shape), a.padding)
        else:
            key[i] = type(a)
    return tuple(key), values


class FastKernel:
    """A Triton kernel (a ``JITFunction``) launched as ``k[grid](*args, **kwargs)``: its
    runtime parameters (all before its constexpr ones in the signature) by position or name,
    constexprs, ``num_warps`` and ``num_stages`` by name. The first launch of each argument
    key goes through Triton (module docstring); the later ones reuse its compiled kernel."""

    def __init__(self, jitted: JITFunction):
        params = jitted.params
        self.kernel = jitted
        self.runtime = sum(not p.is_constexpr for p in params)
        if any(p.is_constexpr for p in params[:self.runtime]):
            raise TypeError(f"{jitted.fn.__name__}: its constexpr parameters must follow the "
                            "runtime ones (FastKernel passes them in that order)")
        self.runtime_names = [p.name for p in params[:self.runtime]]
        self.constexprs = [p.name for p in params[self.runtime:]]
        self.defaults = {p.name: p.default for p in params[self.runtime:]
                         if p.default is not inspect.Parameter.empty}
        self.compiled = {}

    def __getattr__(self, name):
        # The JITFunction's attributes (arg_names, fn, params: the offline compile tools).
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args, kwargs):
        if len(args) < self.runtime:  # runtime arguments given by name join the positional
            missing = [n for n in self.runtime_names[len(args):] if n not in kwargs]
            if missing:
                raise TypeError(f"{self.kernel.fn.__name__}: missing arguments {missing}")
            args = (*args, *(kwargs.pop(n) for n in self.runtime_names[len(args):]))
        device = driver.active.get_current_device()
        arg_key, values = argument_key(args)
        key = (device, arg_key, tuple(kwargs.items()))
        known = self.compiled.get(key)
        if known is None or callable(grid) or _hooked():
            compiled = self.kernel[grid](*args, **kwargs)
            if len(self.compiled) >= MAX_KEYS:
                self.compiled.clear()
            # The constexprs' values in the signature's order: the key holds the keywords.
            self.compiled[key] = (compiled, [kwargs[n] if n in kwargs else self.defaults[n]
                                             for n in self.constexprs])
            return
        compiled, constants = known
        grid_x, grid_y, grid_z = (*grid, 1, 1)[:3]
        compiled.run(grid_x, grid_y, grid_z, driver.active.get_current_stream(device),
                     compiled.function, compiled.packed_metadata, None, None, None, *values,
                     *constants)
