"""The learned stopping rule's state and arithmetic, checked exactly against
references written here from the definitions (``proposers/stop_rule.py``):
the per-request acceptance average and counters ``observe`` keeps, the
calibration sums and their decay, the calibrated chances, exploration
counting, the pending draft, preemption, and the model file's messages
and metadata. Written for the survivors of the mutation run of 2026-12-05
(``scripts/mutation.sh stop_rule``; docs/testing.md). No vLLM, no engine."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
from test_stop_rule import _good

from vllm_specplug.proposers import stop_rule as S

GLOBAL = S.SOURCES.index("global")


def _model(seed: int = 0) -> S.StopModel:
    rng = np.random.default_rng(seed)
    return S.StopModel({s: rng.normal(0.0, 0.3, len(S.FEATURES)) for s in S.SOURCES})


def _bin(q: float) -> int:
    """Calibration bin of an estimate: the first edge above it (edges are
    upper bounds; the last bin runs to 1)."""
    for i, edge in enumerate(S.CALIB_EDGES):
        if q < edge:
            return i
    return len(S.CALIB_EDGES)


def _band(i: int) -> int:
    return int(S.CALIB_BAND[min(i, len(S.CALIB_BAND) - 1)])


def _reference_observe(ref: dict, raw: np.ndarray, drafted: int, accepted: int,
                       committed: int) -> None:
    """The state ``observe`` keeps, from its docstring and the module's
    constants, one position at a time."""
    rejected = accepted < drafted
    ref["generated"] += committed
    ref["since"] = 1 if rejected else ref["since"] + committed
    ref["full"] = 0.0 if rejected else 1.0
    ref["num"] = (1 - S.EWMA_RATE) * ref["num"] + accepted
    ref["den"] = (1 - S.EWMA_RATE) * ref["den"] + accepted + (1 if rejected else 0)
    ref["drafts"] += 1
    n = min(drafted, raw.size)
    ref["est"] *= S.CALIB_DECAY ** n
    ref["hit"] *= S.CALIB_DECAY ** n
    for i in range(n):
        ref["est"][_band(i), _bin(raw[i])] += raw[i]
        ref["hit"][_band(i), _bin(raw[i])] += 1.0 if i < accepted else 0.0


def test_observe_keeps_the_request_average_counters_and_calibration_exactly():
    stop = S.LearnedStop(_model())
    stop.start("r", 10)
    r = stop._req["r"]
    # a fresh request: nothing drafted, nothing accepted, the last draft not full
    assert (r.num, r.den, r.drafts) == ([0.0] * 3, [0.0] * 3, [0] * 3)
    assert r.last_full == 0.0 and r.generated == 0 and r.since_reject == 0
    assert stop.last_features is None and stop.proposals == [0] * len(S.SOURCES)
    ref = {"generated": 0, "since": 0, "full": 0.0, "num": 0.0, "den": 0.0, "drafts": 0,
           "est": np.zeros((S.N_BANDS, S.N_BINS)), "hit": np.zeros((S.N_BANDS, S.N_BINS))}
    raw = np.linspace(0.97, 0.02, 18)      # 18 positions: every depth band, most bins
    steps = [(18, 5, 6), (3, 3, 4), (16, 15, 16), (7, 0, 1), (2, 2, 3)]
    for drafted, accepted, committed in steps:
        stop.drafted("r", "global", raw, raw)
        stop.observe("r", drafted, accepted, committed)
        _reference_observe(ref, raw, drafted, accepted, committed)
        assert r.generated == ref["generated"] and r.since_reject == ref["since"]
        assert r.last_full == ref["full"]
        assert r.num[GLOBAL] == pytest.approx(ref["num"], abs=1e-12)
        assert r.den[GLOBAL] == pytest.approx(ref["den"], abs=1e-12)
        assert r.drafts[GLOBAL] == ref["drafts"]
        np.testing.assert_allclose(stop.calib_est[GLOBAL], ref["est"], atol=1e-12)
        np.testing.assert_allclose(stop.calib_hit[GLOBAL], ref["hit"], atol=1e-12)
        assert r.pending is None
    # other sources untouched
    assert not stop.calib_est[S.SOURCES.index("dynamic")].any()
    assert r.num[0] == r.den[0] == 0.0
    # a step with no draft of this rule: only the counters of committed tokens move
    stop.observe("r", 0, 0, 1)
    assert r.since_reject == ref["since"] + 1 and r.generated == ref["generated"] + 1
    assert r.drafts[GLOBAL] == ref["drafts"]


def test_conditional_uses_the_request_average_with_its_prior():
    """The acceptance average enters as (accepted + 1) / (verified + 2), and
    the chance is the logistic of the feature row times the coefficients."""
    model = _model(1)
    stop = S.LearnedStop(model)
    stop.record = lambda *a: None
    stop.start("r", 10)
    raw = np.full(6, 0.8)
    for drafted, accepted in ((6, 2), (6, 6), (4, 1)):
        stop.drafted("r", "global", raw, raw)
        stop.observe("r", drafted, accepted, accepted + 1)
    r = stop._req["r"]
    table = [0.9, 0.8, 0.6, 0.5, 0.3]
    got = stop.conditional("r", "global", 7, table, None, 5, False)
    ewma = (r.num[GLOBAL] + 1.0) / (r.den[GLOBAL] + 2.0)
    X = S.features(5, 7, table, None, ewma, r.drafts[GLOBAL], r.since_reject, False,
                   r.generated, r.last_full)
    np.testing.assert_allclose(stop.last_features, X)
    np.testing.assert_allclose(got, 1.0 / (1.0 + np.exp(-(X @ model.coef["global"]))))


def test_calibrated_scales_by_each_band_and_bin_and_caps_at_one():
    stop = S.LearnedStop(_model())
    rng = np.random.default_rng(3)
    s = GLOBAL
    stop.calib_est[s] = rng.uniform(1.0, 30.0, (S.N_BANDS, S.N_BINS))
    stop.calib_hit[s] = stop.calib_est[s] * rng.uniform(0.2, 2.5, (S.N_BANDS, S.N_BINS))
    q = np.sort(rng.uniform(0.01, 0.99, 20))[::-1]
    q[0] = 0.97                            # a high estimate whose bin's ratio exceeds 1
    stop.calib_est[s][_band(0), _bin(0.97)] = 40.0
    stop.calib_hit[s][_band(0), _bin(0.97)] = 80.0
    want, low = [], 1.0
    for i, v in enumerate(q):
        b, d = _bin(v), _band(i)
        ratio = ((stop.calib_hit[s, d, b] + S.CALIB_PRIOR * v)
                 / (stop.calib_est[s, d, b] + S.CALIB_PRIOR * v))
        low = min(low, v * ratio, 1.0)
        want.append(low)
    got = stop.calibrated("global", q)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert got[0] == 1.0


def test_exploration_goes_one_past_the_cut_on_every_sixteenth_draft_of_a_source():
    stop = S.LearnedStop(_model())
    q = np.array([0.9, 0.8, 0.1, 0.05])    # cut at 2 at this cost
    m = S.best_cut(q, 0.3)[0]
    assert m == 2
    lengths = [stop.cut("global", q, 0.3, explore=True) for _ in range(48)]
    assert [i for i, n in enumerate(lengths, 1) if n == m + 1] == [16, 32, 48]
    assert set(lengths) == {m, m + 1}
    assert stop.proposals[GLOBAL] == 48 and stop.proposals[0] == 0
    # without exploration nothing is counted
    assert stop.cut("global", q, 0.3, explore=False) == m and stop.proposals[GLOBAL] == 48
    # a draft kept whole cannot go past its end
    full = np.full(5, 0.99)
    assert S.best_cut(full, 0.01)[0] == 5
    assert [stop.cut("dynamic", full, 0.01, explore=True) for _ in range(16)] == [5] * 16


def test_the_pending_draft_is_returned_only_for_its_source_and_length():
    stop = S.LearnedStop(_model())
    stop.start("r", 4)
    assert stop.pending_q("r", "global", 1) is None
    q = np.array([0.9, 0.7, 0.4])
    stop.drafted("r", "global", q + 0.01, q)
    assert stop.pending_q("r", "dynamic", 2) is None        # another source
    assert stop.pending_q("r", "global", 4) is None         # longer than the draft
    np.testing.assert_array_equal(stop.pending_q("r", "global", 2), q[:2])


def test_a_preempted_request_keeps_its_counters_and_drops_its_pending_draft():
    stop = S.LearnedStop(_model())
    stop.start("r", 4)
    raw = np.array([0.9, 0.8, 0.7])
    stop.drafted("r", "global", raw, raw)
    stop.observe("r", 3, 1, 2)
    stop.drafted("r", "global", raw, raw)
    before = copy.deepcopy((stop._req["r"].num, stop._req["r"].den, stop._req["r"].drafts,
                            stop._req["r"].generated, stop._req["r"].prompt_len))
    stop.start("r", 50)                   # preempted, recomputed: same request
    r = stop._req["r"]
    assert (r.num, r.den, r.drafts, r.generated, r.prompt_len) == before
    assert r.pending is None and stop.pending_q("r", "global", 1) is None
    stop.start("other", 7)
    assert stop._req["other"].prompt_len == 7 and len(stop) == 2
    stop.finish("r")
    stop.finish("r")                      # twice, and an unknown id: no error
    stop.finish("never-started")
    assert len(stop) == 1


def test_logits_grow_their_depth_table_for_long_drafts(monkeypatch):
    """Drafts deeper than the precomputed log1p(depth) table (64) score as
    the feature matrix does."""
    monkeypatch.setattr(S, "_DEPTH_LOG", np.log1p(np.arange(64, dtype=np.float64)))
    w = _model(5).coef["dynamic"]
    rng = np.random.default_rng(5)
    for depths in (64, 65, 100):
        table = np.sort(rng.uniform(0.01, 1.0, depths))[::-1]
        shares = np.sort(rng.uniform(0.01, 1.0, depths))[::-1]
        args = (depths, 9, table, shares, 0.6, 3, 2, True, 40, 1.0)
        np.testing.assert_allclose(S.logits(w, *args), S.features(*args) @ w, atol=1e-10)


def test_estimates_and_shares_above_one_count_as_one():
    """Inputs are probabilities: values above 1 (a table or share estimate
    a rounding pushed past it) are clipped to 1 in the features and the
    fast path alike, and the logit of 1 is finite."""
    w = _model(6).coef["global"]
    over = ([1.4, 1.2, 0.5], [1.3, 0.9, 0.4])
    capped = ([1.0, 1.0, 0.5], [1.0, 0.9, 0.4])
    for fn in (lambda *a: S.features(*a), lambda *a: S.logits(w, *a)):
        a = fn(3, 4, over[0], over[1], 0.5, 1, 1, False, 3, 0.0)
        b = fn(3, 4, capped[0], capped[1], 0.5, 1, 1, False, 3, 0.0)
        np.testing.assert_allclose(a, b)
    assert S._logit(1.0) == pytest.approx(math.log((1 - 1e-3) / 1e-3))
    assert S._logit(5.0) == S._logit(1.0) and S._logit(-1.0) == S._logit(0.0)


# ------------------------------------------------------------------ the file
def test_the_model_keeps_the_file_metadata_but_not_its_coefficients():
    data = _good()
    data["fitted_on"] = "tuning halves"
    model = S.StopModel.from_dict(data)
    assert model.meta["format"] == S.FORMAT and model.meta["fitted_on"] == "tuning halves"
    assert "sources" not in model.meta and model.meta["features"] == list(S.FEATURES)
    assert S.StopModel(model.coef).meta == {}
    w = np.zeros(len(S.FEATURES))
    w[0] = 0.12345678
    assert S.StopModel({"global": w}).to_dict()["sources"]["global"]["coef"][0] == 0.123457


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("features"), "its features None are not version 2's"),
    (lambda d: d.update(features=["bias"]), "its features ['bias'] are not version 2's"),
    (lambda d: d.update(sources={}),
     "'sources' must map at least one source to its coefficients"),
    (lambda d: d["sources"].update(dynamic=[0.0] * len(S.FEATURES)),
     "source 'dynamic': 'coef' must be"),
    (lambda d: d["sources"]["global"]["coef"].__setitem__(3, 1000.0),
     "source 'global': 'coef' must be"),
    (lambda d: d["sources"]["global"]["coef"].__setitem__(3, -1000.5),
     "source 'global': 'coef' must be"),
])
def test_refusals_name_the_problem_and_only_a_given_hint(mutate, message):
    data = copy.deepcopy(_good())
    mutate(data)
    with pytest.raises(S.StopModelError) as e:
        S.StopModel.from_dict(data, "m.json")
    text = str(e.value)
    assert text.startswith("sam_stop_file 'm.json': ") and message in text
    if message.startswith("'sources'"):                   # the whole message
        assert text == "sam_stop_file 'm.json': " + message
    with pytest.raises(S.StopModelError) as e:
        S.StopModel.from_dict(data, "m.json", "do this")
    assert str(e.value) == text + "; do this"             # a hint only when given


def test_a_file_that_is_not_json_is_named_with_the_fix(tmp_path):
    path = tmp_path / "stop.json"
    path.write_text("{not json")
    with pytest.raises(S.StopModelError) as e:
        S.StopModel.load(path)
    assert str(e.value).startswith(f"sam_stop_file {str(path)!r}: cannot read it as JSON")
    assert str(e.value).endswith("; refit it with `specplug fit-stop`, or unset sam_stop_file")
