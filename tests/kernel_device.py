"""Where the kernel tests run: on the GPU where there is one, else on CPU tensors under the
Triton interpreter (``TRITON_INTERPRET=1``, which ``make test`` sets)."""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def gpu(test):
    """Marks ``test`` as a GPU test (``pytest -m gpu`` selects it), skipped without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason="needs CUDA")(test))


def skip_without_kernels() -> None:
    """Skips the calling test module where its kernels can run neither on a GPU nor under
    the interpreter; call it at module level."""
    if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
