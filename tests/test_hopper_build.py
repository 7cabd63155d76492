"""The layer's Triton kernels compile for an H100 under the installed Triton, on a machine
without a GPU (``tests/hopper_build.py``): the interpreter, which runs the other kernel
tests, executes the kernels as Python and accepts code that Triton's compiler rejects."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Triton compiles on Linux")

# What a training and a decoding step of the layer launch, whatever the Triton version.
ATTENTION_KERNELS = {
    "_attention_fwd_kernel", "_attention_bwd_dq_kernel", "_attention_bwd_dkdv_kernel", "_select_blocks_kernel",
    "_fwd_kernel", "_dq_kernel", "_dkv_kernel", "window_dq_kernel", "window_dkv_kernel",
    "_gated_sum_fwd_kernel", "_gated_sum_bwd_kernel",
}


def test_kernels_compile_for_hopper():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("hopper_build.py")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    outcome = json.loads(result.stdout)
    assert not outcome["failures"], "\n\n".join(f"{name}:\n{error}" for name, error in outcome["failures"].items())
    assert ATTENTION_KERNELS <= set(outcome["compiled"]), ATTENTION_KERNELS - set(outcome["compiled"])
