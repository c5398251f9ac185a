"""Registers the engine tier's stand-in ``vllm._C`` ops in every Python
process started with this folder on ``PYTHONPATH`` and
``SPECPLUG_VLLM034_STANDINS=1`` (the served test's ``vllm serve`` and its
engine-core process). Test support only: see ``tests/vllm034_cpu_ops.py``."""
import os
import sys

if os.environ.get("SPECPLUG_VLLM034_STANDINS") == "1":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import vllm034_cpu_ops

    vllm034_cpu_ops.register()
