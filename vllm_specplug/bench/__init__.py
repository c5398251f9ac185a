"""Spec-Bench style harness on vLLM's runtime (``specplug bench``)."""
