"""Checks of the model and head folders users name, in one place.

Everything here runs before the engine starts (``Proposer.check_options`` /
``check_model``) and raises ``SpecPlugConfigError`` naming the key to change.
No vLLM, no torch: the EAGLE package's full head check
(``vllm_specplug.eagle.loading.check_head_folder``, torch) is imported only when
it is called, and a basic file check stands in when it does not import.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os

from .options import SpecPlugConfigError

logger = logging.getLogger("vllm_specplug")

#: Weight files an EAGLE head folder may hold (one of them).
HEAD_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


# ---------------------------------------------------------------------- models
def model_config(model: str) -> dict | None:
    """A local model folder's config.json (None if there is none)."""
    path = os.path.join(str(model), "config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


# ---------------------------------------------------------------------- heads
def check_head_path(path: str, method: str) -> str:
    """The head folder ``speculative_config['model']`` names, checked; returns
    it as an absolute path (workers may run elsewhere)."""
    where = f"speculative_config['model'] for method {method!r}"
    if not path:
        raise SpecPlugConfigError(
            f"{where} is required: the folder of a trained EAGLE head (config.json and "
            f"model.safetensors, as vllm_specplug.eagle writes it)")
    if not os.path.isdir(path):
        what = "a file" if os.path.exists(path) else "no such folder"
        raise SpecPlugConfigError(
            f"{where}: {path!r} is {what}; give the local folder of a trained EAGLE head "
            f"(config.json and model.safetensors)")
    if not _run_head_checker(path, None, method):
        if model_config(path) is None:
            raise SpecPlugConfigError(
                f"{where}: {path!r} has no readable config.json; give the folder of a "
                f"trained EAGLE head")
        if not any(os.path.isfile(os.path.join(path, f)) for f in HEAD_WEIGHT_FILES):
            raise SpecPlugConfigError(
                f"{where}: {path!r} has no weights ({' or '.join(HEAD_WEIGHT_FILES)}); "
                f"give the folder of a trained EAGLE head")
    return os.path.abspath(path)


def _head_checker():
    """``vllm_specplug.eagle.loading.check_head_folder(path, target_config)`` when
    that module is installed and imports (None: the basic checks here)."""
    try:
        if importlib.util.find_spec("vllm_specplug.eagle.loading") is None:
            return None
        module = importlib.import_module("vllm_specplug.eagle.loading")
    except Exception as e:  # noqa: BLE001 - a broken optional module
        logger.warning("vllm_specplug: vllm_specplug.eagle.loading does not import (%s); "
                       "checking the EAGLE head folder's files only", e)
        return None
    return getattr(module, "check_head_folder", None)


def _run_head_checker(path: str, target_config: dict | None, method: str) -> bool:
    """Run the EAGLE package's head check (errors name the key); False when
    there is none."""
    checker = _head_checker()
    if checker is None:
        return False
    try:
        checker(path, target_config)
    except Exception as e:  # noqa: BLE001 - reported with the key
        msg = str(e)
        if "speculative_config['model']" in msg:
            raise
        raise SpecPlugConfigError(
            f"speculative_config['model'] for method {method!r}: {path!r} is not a usable "
            f"EAGLE head: {msg}") from e
    return True


def check_draft_vocab(options: dict, method: str) -> None:
    """``draft_vocab`` against the head folder (its ``draft_vocab.json`` is
    read and validated before the engine starts)."""
    from .eagle.draft_vocab import DraftVocabError, choose_draft_vocab

    try:
        choose_draft_vocab(options["model"], int(options.get("draft_vocab", 0)), None)
    except DraftVocabError as e:
        raise SpecPlugConfigError(
            f"speculative_config['draft_vocab'] for method {method!r}: {e}") from None


def check_head_against_model(path: str, model: str, method: str) -> None:
    """The head must fit the target (hidden size, vocabulary: from the
    target's ``config.json``; skipped when the model is not a local folder)."""
    target = model_config(model)
    if target is None or _run_head_checker(path, target, method):
        return
    head = model_config(path)
    if head is None:
        return
    head = head.get("text_config", head)
    target = target.get("text_config", target)
    for key in ("hidden_size", "vocab_size"):
        h, t = head.get(key), target.get(key)
        if isinstance(h, int) and isinstance(t, int) and h != t:
            raise SpecPlugConfigError(
                f"speculative_config['model'] for method {method!r}: the EAGLE head "
                f"{path!r} has {key} {h}, but the target model has {t}: it was trained "
                f"for another model; give a head trained on this one")
