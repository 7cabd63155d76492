"""Prepared kernel launches: ``launch(kernel, grid, *args, **options)`` does what
``kernel[grid](*args, **options)`` does, with less host time per launch.

A Triton launch first binds its arguments to the kernel's parameters, derives from them
the specialization (each tensor's dtype and 16-byte alignment, each integer's width and
divisibility by 16, ...), builds the cache key of the compiled variant and looks it up;
only then does the compiled kernel's launcher run. Skipping that dispatch took the
layer's launches (20 to 50 arguments each) from 71 to 61 us of host time on average on an
H100's host, 0.4 ms of an eager layer step at n = 8192, whose short sequences are bound by
the host (docs/benchmarks.md).

Here each kernel remembers its compiled variants by a fingerprint of the arguments that
holds everything the specialization can depend on, and more: each tensor's dtype and
alignment, each tensor descriptor's dtype, alignment, shape, strides, block shape and
padding, and every other argument's type and value (for parameters that are not
specialized on their value, ``do_not_specialize``, only the integer width, so that a
decoding step's changing lengths still find their variant). A launch whose fingerprint
was seen before goes straight to that compiled variant's launcher; any other takes
Triton's own path once and is remembered.

Interpreted kernels (``TRITON_INTERPRET=1``) take Triton's path every time.

A variant whose tiles need more shared memory than the GPU has (the launch tables were
measured on H100s, whose 227 KB a block few other GPUs have: 163 KB on an A100, 99 KB on
GeForce cards; float32 inputs need twice the bytes of bf16 ones) compiles again with one
pipeline stage fewer, down to one. Stages only set how many tiles load ahead, never what
a kernel computes. Only a variant that does not fit even then fails, naming the kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from inspect import Parameter
from typing import Any

import torch
from triton.runtime.errors import OutOfResources
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

__all__ = ["launch"]

# Compiled variants remembered per kernel; a kernel that sees more fingerprints (a new
# length at every call, say) starts over rather than grow without bound.
_MAX_VARIANTS = 64
_INT32 = range(-(2**31), 2**31)


@dataclass
class _Variants:
    """A kernel's parameter names and defaults, which parameters are loose (not
    specialized on their value), and its compiled variants by fingerprint."""

    names: tuple[str, ...]
    defaults: dict[str, Any]
    loose: tuple[bool, ...]
    compiled: dict[tuple, Any] = field(default_factory=dict)

    @staticmethod
    def of(kernel) -> _Variants:
        params = kernel.params
        return _Variants(
            names=tuple(p.name for p in params),
            defaults={p.name: p.default for p in params if p.default is not Parameter.empty},
            loose=tuple(bool(p.do_not_specialize) for p in params),
        )

    def fingerprint(self, args: Sequence, options: dict) -> tuple:
        """What the compiled variant of a launch depends on: the current device, the
        positional arguments' fingerprints and the keyword arguments (constexprs and
        launch options, whose values Triton compiles in).

        One loop that tests each argument's type in place: with a function call per
        argument, one eager layer step's fingerprints took a third longer (48.5 against
        35.5 us for ten of its launches on an H100 host's CPU)."""
        positional = []
        for value, loose in zip(args, self.loose):
            kind = type(value)
            if kind is int:
                # Unspecialized integers go as i32, i64 or u64, by their range alone.
                positional.append((int, value in _INT32, value >= 2**63) if loose else (int, value))
            elif isinstance(value, torch.Tensor):
                positional.append((value.dtype, value.data_ptr() % 16 == 0))
            elif isinstance(value, TensorDescriptor):
                base = value.base
                positional.append((base.dtype, base.data_ptr() % 16 == 0, tuple(value.shape),
                                   tuple(value.strides), tuple(value.block_shape), value.padding))
            else:
                # The type too: 1.0 and True equal 1, but Triton types them apart.
                positional.append((kind, value))
        return torch.cuda.current_device(), tuple(positional), tuple(options.items())

    def arguments(self, args: Sequence, options: dict) -> list:
        """All the kernel's arguments in its parameters' order, constexprs included, as
        the compiled kernel's launcher takes them."""
        rest = self.names[len(args):]
        return [*args, *(options[name] if name in options else self.defaults[name] for name in rest)]


_VARIANTS: dict[JITFunction, _Variants] = {}

# Compiled with fused multiply-adds, as Triton does by default up to 3.9: the kernels were
# tuned and their errors measured that way, and Triton 3.10 turns the default off (3.9
# warns where a launch leaves it unset). A launch may still pass its own.
_COMPILE_DEFAULTS = {"enable_fp_fusion": True}
# Triton's pipeline stages on NVIDIA GPUs where a launch does not set them.
_DEFAULT_STAGES = 3


def _first_launch(kernel, grid: tuple[int, ...], args: Sequence, options: dict):
    """``kernel[grid](*args, **options)`` with the compile defaults, with fewer pipeline
    stages where the variant does not fit the GPU's shared memory (module docstring).
    Returns what Triton's call returns: the compiled kernel, or None."""
    options = {**_COMPILE_DEFAULTS, **options}
    while True:
        try:
            return kernel[grid](*args, **options)
        except OutOfResources as error:
            stages = options.get("num_stages", _DEFAULT_STAGES)
            if error.name != "shared memory":
                raise
            if stages <= 1:
                name = getattr(kernel, "__name__", type(kernel).__name__)
                raise RuntimeError(
                    f"{name} needs {error.required} bytes of shared memory even in one pipeline stage, and this "
                    f"GPU has {error.limit} a block: run the layer under bf16 or fp16 autocast (half the bytes of "
                    "float32 tiles), or with a smaller dim_head"
                ) from error
            options = {**options, "num_stages": stages - 1}


def launch(kernel, grid: tuple[int, ...], *args, **options) -> None:
    """``kernel[grid](*args, **options)``, through the compiled variant that an earlier
    launch of the same fingerprint compiled or found (see the module docstring).
    ``grid``: a tuple of one to three ints. Tensors and descriptors go as positional
    arguments: keyword arguments enter the fingerprint as they are, which suits the
    constexprs and launch options they are for. Kernels compile with fused multiply-adds
    unless ``options`` pass ``enable_fp_fusion=False``, and in fewer stages than
    ``options`` ask where those do not fit the GPU's shared memory."""
    if not isinstance(kernel, JITFunction):
        _first_launch(kernel, grid, args, options)
        return
    variants = _VARIANTS.get(kernel)
    if variants is None:
        variants = _VARIANTS[kernel] = _Variants.of(kernel)
    key = variants.fingerprint(args, options)
    compiled = variants.compiled.get(key)
    if compiled is None:
        compiled = _first_launch(kernel, grid, args, options)
        if compiled is not None:  # None where Triton compiles asynchronously
            if len(variants.compiled) >= _MAX_VARIANTS:
                variants.compiled.clear()
            variants.compiled[key] = compiled
        return
    compiled[(*grid, 1, 1)[:3]](*variants.arguments(args, options))
