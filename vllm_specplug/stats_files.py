"""Reading the drafter's stats file (``VLLM_SPECPLUG_STATS_FILE``).

The serving side writes it (``vllm_specplug.vllm_adapter.v1.stats_export``,
which describes the object); readers (``specplug bench soak``, tests, tools)
import this module, which needs neither vLLM nor the adapter.
"""
from __future__ import annotations

import json


def read(path: str) -> dict:
    """The last object written to ``path`` (replaced atomically: never partial)."""
    with open(path) as f:
        return json.load(f)
