"""Where numba caches the plugin's kernels, and what happens when it cannot
(``vllm_specplug.jit``). The engine-level cold-start measurement is
``scripts/measure_cold_start.py`` (docs/architecture.md, "Cold start"); the
warm-up's own check is tests/test_warmup.py."""
from __future__ import annotations

import logging

import numba
import numpy as np
import pytest

from vllm_specplug import jit


def _add(a):
    return a + 1


def _twice(a):
    return 2 * a


@pytest.fixture
def fresh_checks(monkeypatch):
    monkeypatch.setattr(jit, "_checked", {})


def test_cache_folder_default_and_override(monkeypatch, tmp_path, fresh_checks):
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("VLLM_SPECPLUG_CACHE", str(tmp_path / "root"))
    saved = numba.config.CACHE_DIR
    assert jit.cache_folder() == str(tmp_path / "root" / "numba")
    fn = jit.njit(_add)
    assert fn(np.int64(1)) == 2
    # cached in our folder, and numba's global setting is left as it was
    assert fn._cache._cache_path.startswith(str(tmp_path / "root" / "numba"))
    assert list((tmp_path / "root" / "numba").rglob("*.nbi"))
    assert numba.config.CACHE_DIR == saved
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "mine"))
    assert jit.cache_folder() == str(tmp_path / "mine")
    assert jit.njit(_twice)._cache._cache_path.startswith(str(tmp_path / "mine"))


def test_unwritable_cache_folder_compiles_uncached_with_one_warning(monkeypatch, tmp_path,
                                                                    caplog, fresh_checks):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    # a folder that cannot be created (its parent is a file), even as root
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(blocker / "numba"))
    with caplog.at_level(logging.WARNING, logger="vllm_specplug"):
        first, second = jit.njit(_add), jit.njit(_twice)
        assert first(np.int64(1)) == 2 and second(np.int64(3)) == 6
    warnings = [r for r in caplog.records if "numba cannot write its cache folder" in r.message]
    assert len(warnings) == 1, caplog.text
    assert "NUMBA_CACHE_DIR" in warnings[0].getMessage()
    assert type(first._cache).__name__ == "NullCache"


def test_numba_alone_raises_without_a_writable_cache(monkeypatch, tmp_path, fresh_checks):
    """What ``jit.njit`` guards against: with no writable cache location,
    ``numba.njit(cache=True)`` raises when the kernel is defined (here the
    other locations numba would try are taken away), so importing the global
    store failed; ``jit.njit`` compiles uncached."""
    from numba.core import caching

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(caching.CacheImpl, "_locator_classes",
                        [caching.UserProvidedCacheLocator])
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(blocker / "numba"))
    with pytest.raises(RuntimeError, match="no locator available"):
        numba.njit(cache=True)(_add)
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(blocker / "numba"))
    assert jit.njit(_add)(np.int64(4)) == 5
