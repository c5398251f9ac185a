"""Speculative methods as plain algorithms: no vLLM, no torch.

``base`` holds the contract every method implements (:class:`~.base.Proposer`,
:class:`~.base.Draft`, :class:`~.base.TargetTopK`, :class:`~.base.TargetHook`);
the other modules are the built-in methods, registered by name in
``vllm_specplug.registry``. Nothing is imported here, so importing one method
does not import the others.
"""
