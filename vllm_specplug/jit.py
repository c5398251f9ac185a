"""Numba for the plugin's compiled kernels, and where their on-disk cache goes.

Every kernel (the global store's and the static corpus automaton's) is
decorated with :func:`njit` from here instead of ``numba.njit(cache=True)``:

* the compiled code is cached in ``NUMBA_CACHE_DIR`` when that is set, else in
  ``<cache root>/numba`` (``~/.cache/vllm_specplug/numba``; the
  ``VLLM_SPECPLUG_CACHE`` variable moves the cache root), so a second engine
  start loads the kernels instead of compiling them again;
* when that folder cannot be created or written (a read-only home in a
  container, say), the kernels compile uncached: every process compiles them
  again while its engine starts, and one warning says so. numba's own
  ``cache=True`` raises instead when it finds no writable cache location.

Compilation itself happens while the engine starts (``warmup``), never in a
request. No vLLM, no torch.
"""
from __future__ import annotations

import logging
import os
import tempfile
from typing import Callable

import numba

logger = logging.getLogger("vllm_specplug")

# folder -> None (writable) or the reason it is not; checked once per folder
_checked: dict[str, str | None] = {}


def cache_folder() -> str:
    """Where the kernels' compiled code is cached: ``NUMBA_CACHE_DIR`` if set,
    else ``<cache root>/numba``."""
    env = os.environ.get("NUMBA_CACHE_DIR")
    if env:
        return env
    from .models import cache_root

    return str(cache_root() / "numba")


def writable_cache_folder() -> str | None:
    """The cache folder, created if needed, or None (with one warning per
    folder) when it cannot be written."""
    folder = cache_folder()
    if folder not in _checked:
        try:
            os.makedirs(folder, exist_ok=True)
            tempfile.TemporaryFile(dir=folder).close()
            _checked[folder] = None
        except OSError as e:
            _checked[folder] = str(e)
            logger.warning(
                "vllm_specplug: numba cannot write its cache folder %s (%s); the plugin's "
                "kernels compile uncached, again in every process (while the engine "
                "starts). Set NUMBA_CACHE_DIR (or VLLM_SPECPLUG_CACHE) to a writable "
                "folder to keep them.", folder, e)
    return folder if _checked[folder] is None else None


def njit(fn: Callable) -> Callable:
    """``numba.njit(cache=True)`` with the cache in :func:`cache_folder`; an
    uncached ``numba.njit`` when that folder is not writable."""
    folder = writable_cache_folder()
    if folder is None:
        return numba.njit(fn)
    # numba picks a function's cache folder when it is decorated, from
    # numba.config.CACHE_DIR: set it for our kernels only
    saved = numba.config.CACHE_DIR
    numba.config.CACHE_DIR = folder
    try:
        return numba.njit(cache=True)(fn)
    finally:
        numba.config.CACHE_DIR = saved
