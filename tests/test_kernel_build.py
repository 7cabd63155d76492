"""Every Triton kernel of the package compiles for an A100, an H100 and a GeForce RTX 50
card under the installed Triton, on a machine without a GPU (``tests/kernel_build.py``): the
interpreter, which runs the other kernel tests, executes the kernels as Python and accepts
code that Triton's compiler rejects, and each architecture takes its own path through the
compiler (on an H100, warpgroup matrix products and tensor-memory copies)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Triton compiles on Linux")


def package_kernels() -> set[str]:
    """The names of the package's Triton kernels (functions named ``*_kernel``)."""
    kernels_dir = Path(__file__).resolve().parent.parent / "native_sparse_attention" / "kernels"
    return {name for path in kernels_dir.glob("*.py")
            for name in re.findall(r"@triton\.jit[^\n]*\ndef (\w+_kernel)\(", path.read_text())}


@pytest.mark.parametrize("capability", [80, 90, 120], ids=["A100", "H100", "RTX-50"])
def test_kernels_compile(capability):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("kernel_build.py")
    result = subprocess.run([sys.executable, str(script), str(capability)], capture_output=True, text=True,
                            env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    outcome = json.loads(result.stdout)
    assert not outcome["failures"], "\n\n".join(f"{name}:\n{error}" for name, error in outcome["failures"].items())
    kernels = package_kernels()
    assert len(kernels) > 30
    assert kernels <= set(outcome["compiled"]), f"never launched: {sorted(kernels - set(outcome['compiled']))}"
