"""Example vllm-specplug plugin: a scorer and a proposer registered by entry points."""
