"""Loading the plugin and every proposer class imports no numba: importing it
before vLLM's worker starts breaks in-process engines
(VLLM_ENABLE_V1_MULTIPROCESSING=0; vLLM 0.32's Triton-override scan then
fails on llvmlite). numba is imported when a store or corpus is built."""
from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm_specplug import registry
for name in registry.proposer_names():
    registry.get_proposer_class(name)
print("numba" in sys.modules)
"""


def test_plugin_load_imports_no_numba():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout
