"""Test-session setup shared by the kernel tests.

Without CUDA the Triton kernels run under Triton's interpreter on CPU tensors. The
variable must be set before triton is first imported, which is why it lives here.
"""

import gc
import os

import pytest
import torch
from filelock import FileLock

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETED = not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1"


def _fix_interpreter_index_for_numpy_2_4():
    """Triton 3.6's interpreter turns a scalar into a Python int with ``int(array)``,
    which NumPy >= 2.4 refuses for its 1-element arrays; loops whose bounds depend on
    the program id then fail. Convert through the single element instead."""
    import triton.runtime.interpreter as interpreter

    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_lang_tensor


if INTERPRETED:
    _fix_interpreter_index_for_numpy_2_4()


def nan_filled(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A stand-in for a kernel module's buffer allocator: NaN (-7 for integer dtypes), so
    that whatever a kernel leaves unwritten shows in the results."""
    return torch.full(shape, float("nan") if dtype.is_floating_point else -7, dtype=dtype, device=device)


@pytest.fixture
def poison(monkeypatch):
    """``poison(module, name="_allocate")``: the module's allocator returns ``nan_filled``
    buffers for the rest of the test."""

    def apply(module, name: str = "_allocate") -> None:
        monkeypatch.setattr(module, name, nan_filled)

    return apply


@pytest.fixture
def deterministic(monkeypatch):
    """``torch.use_deterministic_algorithms(True)`` for the test, restored after. cuBLAS
    then needs a fixed workspace, which PyTorch checks for in the environment."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@pytest.fixture
def large_gpu_memory(tmp_path_factory):
    """For tests that allocate tens of GB: pytest-xdist's workers run them one at a time
    (a lock file in the session's temporary directory, which the workers share), and each
    returns what it cached, which the caching allocator would otherwise keep from the other
    workers for the rest of the session."""
    with FileLock(tmp_path_factory.getbasetemp().parent / "large-gpu-memory.lock"):
        torch.cuda.empty_cache()
        yield
        gc.collect()
        torch.cuda.empty_cache()


def launched_constexprs(monkeypatch, module) -> list[dict]:
    """The keyword arguments of every ``launch`` of ``module``'s kernels from now on, in order."""
    launches = []
    original = module.launch

    def recording(kernel, grid, *args, **kwargs):
        launches.append({"kernel": getattr(kernel, "__name__", kernel), **kwargs})
        return original(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(module, "launch", recording)
    return launches
