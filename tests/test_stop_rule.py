"""sam's learned stopping rule (``proposers/stop_rule.py``, ``sam_stop:
"learned"``): features against a brute-force computation, the model file's
validation, the cut rule's behaviour with cost, online calibration, bounds,
and the fit. No vLLM, no engine."""
from __future__ import annotations

import copy
import json
import math
import random

import numpy as np
import pytest

from vllm_specplug.options import SpecPlugConfigError, validate_options
from vllm_specplug.proposers import stop_rule as S
from vllm_specplug.proposers.sam import SamProposer


def _logit(p):
    p = min(max(p, 1e-3), 1 - 1e-3)
    return math.log(p / (1 - p))


# ------------------------------------------------------------------ features
def _brute_row(i, match_len, table_p, shares, ewma, drafts, since, in_prompt, gen, full,
               agree, support=None):
    """One position's features, computed one by one from their definitions."""
    prev_t = 1.0 if i == 0 else max(table_p[i - 1], 1e-3)
    cond = min(max(max(table_p[i], 1e-3) / prev_t, 1e-3), 1 - 1e-3)
    row = {"bias": 1.0, "depth_log": math.log(1 + i), "depth0": float(i == 0),
           "match_log": math.log(1 + match_len), "table_logit": math.log(cond / (1 - cond)),
           "ewma_logit": _logit(ewma), "ewma_drafts_log": math.log(1 + drafts),
           "since_reject_log": math.log(1 + since), "in_prompt": float(in_prompt),
           "generated_log": math.log(1 + gen), "last_full": full}
    if shares is None:
        row.update(share_logit=0.0, share_known=0.0, cum_share_log=0.0)
    else:
        cum = max(shares[i], 1e-3)
        prev = 1.0 if i == 0 else max(shares[i - 1], 1e-3)
        step = min(max(cum / prev, 1e-3), 1 - 1e-3)
        row.update(share_logit=math.log(step / (1 - step)), share_known=1.0,
                   cum_share_log=math.log(cum))
    row["depth_x_match"] = row["depth_log"] * row["match_log"]
    row["depth_x_ewma"] = row["depth_log"] * row["ewma_logit"]
    row["depth_x_table"] = row["depth_log"] * row["table_logit"]
    row["agree"] = 0.0 if agree is None else float(agree[i])
    row["other_known"] = float(agree is not None)
    sup = 0 if support is None else support[i]
    row.update(ctx_uni=float(sup >= 1), ctx_bi=float(sup >= 2),
               ctx_log=math.log(1 + min(sup, S.SUPPORT_CAP)))
    return [row[name] for name in S.FEATURES]


def _support(rng, n):
    """A random support list (None a third of the time): the lengths that
    SuffixAutomaton.support gives, including past SUPPORT_CAP."""
    if rng.random() < 0.3:
        return None
    return [rng.choice((0, 1, 2, 3, rng.randint(4, 100))) for _ in range(n)]


def test_features_match_their_definitions():
    rng = random.Random(1)
    for _ in range(200):
        n = rng.randint(1, 12)
        table = sorted((rng.random() for _ in range(n)), reverse=True)
        shares = None if rng.random() < 0.3 else list(np.cumprod([rng.random() for _ in range(n)]))
        args = (rng.randint(0, 40), table, shares, rng.random(), rng.randint(0, 50),
                rng.randint(0, 300), rng.random() < 0.5, rng.randint(0, 500),
                float(rng.random() < 0.5),
                None if rng.random() < 0.3 else np.array([float(rng.random() < 0.5)
                                                          for _ in range(n)]),
                _support(rng, n))
        X = S.features(n, *args)
        want = np.array([_brute_row(i, *args) for i in range(n)])
        np.testing.assert_allclose(X, want, rtol=1e-9, atol=1e-9)


def test_fast_logits_equal_the_feature_matrix_times_the_coefficients():
    """What propose runs (``logits``) is the model the fit sees (``features``)."""
    rng = random.Random(4)
    for _ in range(300):
        w = np.array([rng.uniform(-2, 2) for _ in S.FEATURES])
        n = rng.randint(1, 70)
        table = sorted((rng.random() for _ in range(n)), reverse=True)
        shares = None if rng.random() < 0.3 else list(np.cumprod([rng.random() for _ in range(n)]))
        agree = None if rng.random() < 0.3 else np.array([float(rng.random() < 0.5)
                                                          for _ in range(n)])
        args = (n, rng.randint(0, 40), table, shares, rng.random(), rng.randint(0, 50),
                rng.randint(0, 300), rng.random() < 0.5, rng.randint(0, 500),
                float(rng.random() < 0.5), agree, _support(rng, n))
        np.testing.assert_allclose(S.logits(w, *args), S.features(*args) @ w,
                                   rtol=1e-9, atol=1e-9)


def test_agreement_against_brute_force():
    rng = random.Random(2)
    for _ in range(300):
        base = [rng.randint(0, 3) for _ in range(rng.randint(1, 8))]
        others = [[rng.randint(0, 3) for _ in range(rng.randint(0, 8))]
                  for _ in range(rng.randint(0, 3))]
        got = S.agreement(base, others)
        if not others:
            assert got is None
            continue
        want = [float(any(o[:i + 1] == base[:i + 1] for o in others)) for i in range(len(base))]
        assert got.tolist() == want


def _earlier_next_counts(tokens, length):
    """Brute force: next-token counts after every earlier occurrence of the
    last ``length`` tokens (occurrences ending before the last token)."""
    pat = tokens[len(tokens) - length:]
    counts: dict[int, int] = {}
    for end in range(length, len(tokens)):
        if tokens[end - length:end] == pat:
            counts[tokens[end]] = counts.get(tokens[end], 0) + 1
    return counts


def _longest_earlier_match(tokens):
    best = 0
    for length in range(1, len(tokens)):
        if _earlier_next_counts(tokens, length):
            best = length
        else:
            break
    return best


def test_features_of_a_live_request_against_brute_force():
    """The rule's features inside sam, at every step of a replayed request:
    match length, the first position's continuation share, tokens
    generated and since the last rejection, the prompt flag."""
    rng = random.Random(3)
    phrase = [rng.randint(10, 40) for _ in range(12)]
    prompt = phrase + [rng.randint(10, 40) for _ in range(20)] + phrase[:6]
    out = phrase[6:] + [rng.randint(10, 40) for _ in range(15)] + phrase + phrase[:4]
    sam = SamProposer(8, sam_stop="learned", sam_global_tokens=0)
    sam.relative_token_cost = 0.05
    seen = []
    sam._stop.record = lambda req_id, source, tokens: seen.append(
        (source, sam._stop.last_features.copy()))
    tokens = prompt + out[:1]
    sam.start("r", tokens)
    # counted from the first verify step (the prefill's token is not counted)
    pos, generated, since, checked = 1, 0, 0, 0
    col = {name: i for i, name in enumerate(S.FEATURES)}
    while pos < len(out):
        seen.clear()
        draft = sam.propose("r", 8)
        L = _longest_earlier_match(tokens)
        if seen:
            source, X = seen[0]
            assert source == "dynamic"
            assert X[0, col["match_log"]] == pytest.approx(math.log1p(L))
            counts = _earlier_next_counts(tokens, L)
            share = max(counts.values()) / sum(counts.values())
            assert X[0, col["share_logit"]] == pytest.approx(_logit(share))
            assert X[0, col["generated_log"]] == pytest.approx(math.log1p(generated))
            assert X[0, col["since_reject_log"]] == pytest.approx(math.log1p(since))
            first_end = next(end for end in range(L, len(tokens))
                             if tokens[end - L:end] == tokens[len(tokens) - L:]) - 1
            assert X[0, col["in_prompt"]] == float(first_end < len(prompt))
            checked += 1
        a = 0
        while a < len(draft) and pos + a < len(out) and draft.tokens[a] == out[pos + a]:
            a += 1
        n = min(a + 1, len(out) - pos)
        sam.observe("r", out[pos:pos + n])
        if len(draft):
            since = since + n if a >= len(draft) else 1
        else:
            since += n
        generated += n
        tokens += out[pos:pos + n]
        pos += n
    assert checked >= 5


# ------------------------------------------------------------------ the file
def _good() -> dict:
    return json.loads(S.default_path().read_text())


def test_shipped_file_loads_and_round_trips():
    model = S.StopModel.load()
    assert set(model.coef) <= set(S.SOURCES) and "dynamic" in model.coef
    again = S.StopModel.from_dict(json.loads(json.dumps(model.to_dict())))
    for s, w in model.coef.items():
        np.testing.assert_allclose(again.coef[s], w, atol=1e-6)


def test_a_version_1_file_loads_without_the_ctx_terms():
    """Files fitted before the ctx_* features (version 1) still load: their
    coefficients as written, 0 for the features they lack."""
    data = copy.deepcopy(_good())
    n = len(S.V1_FEATURES)
    data.update(version=1, features=list(S.V1_FEATURES))
    for entry in data["sources"].values():
        entry["coef"] = entry["coef"][:n]
    model = S.StopModel.from_dict(data)
    assert S.FEATURES[:n] == S.V1_FEATURES and len(S.FEATURES) > n
    for name, entry in data["sources"].items():
        assert model.coef[name][:n].tolist() == entry["coef"]
        assert not model.coef[name][n:].any()
    # version 1 with version 2's features, and the other way round: refused
    bad = copy.deepcopy(data)
    bad["features"] = list(S.FEATURES)
    with pytest.raises(S.StopModelError, match="version 1's"):
        S.StopModel.from_dict(bad)
    bad = copy.deepcopy(data)
    bad["version"] = 2
    with pytest.raises(S.StopModelError, match="version 2's"):
        S.StopModel.from_dict(bad)


@pytest.mark.parametrize("mutate, words", [
    (lambda d: d.update(format="something-else"), "not a specplug-sam-stop file"),
    (lambda d: d.update(version=99), "version 99"),
    (lambda d: d.update(features=d["features"][:-1]), "features"),
    (lambda d: d["sources"].update(tree={"coef": d["sources"]["dynamic"]["coef"]}),
     "unknown source 'tree'"),
    (lambda d: d["sources"]["dynamic"].update(coef=d["sources"]["dynamic"]["coef"][:3]),
     "finite numbers"),
    (lambda d: d["sources"]["dynamic"]["coef"].__setitem__(0, float("nan")), "finite"),
    (lambda d: d["sources"]["dynamic"]["coef"].__setitem__(1, True), "finite"),
    (lambda d: d.update(sources={}), "at least one source"),
])
def test_bad_files_are_refused_with_a_clear_error(tmp_path, mutate, words):
    data = copy.deepcopy(_good())
    mutate(data)
    path = tmp_path / "stop.json"
    path.write_text(json.dumps(data))
    with pytest.raises(S.StopModelError, match="fit-stop") as e:
        S.StopModel.load(path)
    assert words in str(e.value) and str(path) in str(e.value)
    # as a sam option: refused before any engine starts, naming the key
    with pytest.raises(SpecPlugConfigError, match="sam_stop_file") as e:
        validate_options("sam", SamProposer.options, {"sam_stop": "learned",
                                                      "sam_stop_file": str(path)})
    assert words in str(e.value)


def test_unreadable_files_are_refused(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    for path in (bad, tmp_path / "missing.json"):
        with pytest.raises(S.StopModelError, match="cannot read it as JSON"):
            S.StopModel.load(path)
    with pytest.raises(SpecPlugConfigError, match="must be one of"):
        validate_options("sam", SamProposer.options, {"sam_stop": "trees"})


# ------------------------------------------------------------------ the cut
def _brute_cut(q, c):
    rates = [(1 + sum(q[:m])) / (1 + c * m) for m in range(len(q) + 1)]
    best = max(rates)
    return next(m for m, r in enumerate(rates) if r >= best - 1e-12)


def test_cut_is_the_rate_maximising_length_and_monotone_in_cost():
    rng = np.random.default_rng(0)
    for _ in range(300):
        q = np.cumprod(rng.uniform(0.3, 1.0, size=rng.integers(1, 20)))
        lengths = []
        for c in (0.0, 0.001, 0.01, 0.05, 0.08, 0.2, 0.5, 2.0):
            m, rate = S.best_cut(q, c)
            assert m == _brute_cut(q.tolist(), c)
            assert rate == pytest.approx((1 + q[:m].sum()) / (1 + c * m))
            lengths.append(m)
        assert lengths == sorted(lengths, reverse=True), lengths   # dearer: never longer
        assert lengths[0] == q.size                                # free: all of it
        # surer drafts are never cut shorter
        higher = np.minimum(q * 1.2, 1.0)
        for c in (0.01, 0.08, 0.3):
            assert S.best_cut(higher, c)[0] >= S.best_cut(q, c)[0]
    # of equal rates the shortest: a token that cannot be accepted is not kept
    assert S.best_cut(np.array([0.5, 0.0, 0.0]), 0.0)[0] == 1


def test_a_token_is_kept_only_while_its_chance_pays_its_cost():
    """At the cut, the last kept token's chance exceeds cost x the rate
    without it, and the next one's does not."""
    q = np.array([0.9, 0.8, 0.6, 0.4, 0.2, 0.1])
    for c in (0.05, 0.1, 0.2):
        m, _ = S.best_cut(q, c)
        rate = lambda k: (1 + q[:k].sum()) / (1 + c * k)  # noqa: E731
        if m:
            assert q[m - 1] > c * rate(m - 1)
        if m < q.size:
            assert q[m] <= c * rate(m) + 1e-12


# ------------------------------------------------------------------ online
def test_calibration_learns_that_a_source_fails_and_drafts_shrink():
    """A source whose drafts are always rejected at the first token: its
    calibrated chances fall, so the cut keeps fewer tokens (removing the
    calibration's update makes this fail)."""
    stop = S.LearnedStop(S.StopModel.load())
    stop.start("r", 10)
    raw = np.cumprod(np.full(8, 0.9))
    before = stop.calibrated("dynamic", raw)
    m0 = stop.cut("dynamic", before, 0.08, explore=False)
    for _ in range(300):
        stop.drafted("r", "dynamic", raw, stop.calibrated("dynamic", raw))
        stop.observe("r", drafted=8, accepted=0, committed=1)
    after = stop.calibrated("dynamic", raw)
    assert after[0] < 0.3 * before[0]
    assert stop.cut("dynamic", after, 0.08, explore=False) < m0
    # another source is not affected
    np.testing.assert_allclose(stop.calibrated("global", raw), before)


def test_learned_sam_drafts_and_accepts_on_repetitive_text():
    """Drafts only change speed; a floor on accepted draft tokens so the
    rule is exercised (greedy identity is the engine test's)."""
    from vllm_specplug.bench.simulate import replay_many

    rng = random.Random(5)
    block = [rng.randint(0, 200) for _ in range(40)]
    reqs = [([1, 2, 3] + block, block * 3) for _ in range(3)]
    for stop in ("table", "learned"):
        sam = SamProposer(16, sam_stop=stop)
        sam.relative_token_cost = 0.05
        res = replay_many(sam, reqs, 16)
        assert res["accepted"] >= 200, (stop, res)
        assert res["tau"] > 3.0, (stop, res)


# ------------------------------------------------------------------ the fit
def test_fit_logistic_recovers_known_coefficients():
    from vllm_specplug.bench.stop_fit import fit_logistic

    rng = np.random.default_rng(0)
    X = np.column_stack([np.ones(20000), rng.normal(size=(20000, 2))])
    w = np.array([0.5, -1.0, 2.0])
    y = (rng.random(20000) < 1 / (1 + np.exp(-X @ w))).astype(float)
    got = fit_logistic(X, y, l2=1e-6)
    np.testing.assert_allclose(got, w, atol=0.1)


def test_fit_stop_writes_a_file_sam_loads(tmp_path, monkeypatch):
    """``specplug fit-stop`` end to end on small records: the file it writes
    loads, drives sam, and does not depend on the shipped file (a stale
    shipped file must not stop a refit)."""
    from vllm_specplug.bench import stop_fit
    from vllm_specplug.bench.simulate import replay_many

    rng = random.Random(7)
    recs = tmp_path / "recs.jsonl"
    with recs.open("w") as f:
        for i in range(24):
            block = [rng.randint(0, 60) for _ in range(30)]
            noise = [rng.randint(0, 60) for _ in range(20)]
            f.write(json.dumps({"prompt_ids": block + [1, 2], "pos": i,
                                "output_ids": block[:20] + noise + block}) + "\n")
    out = tmp_path / "stop.json"
    monkeypatch.setattr(S, "default_path", lambda: tmp_path / "no_shipped_file.json")
    stop_fit.main([str(recs)], str(out), "even", [0.05], rounds=1)
    data = json.loads(out.read_text())
    assert data["fitted_on"] == {"recs": 12}
    model = S.StopModel.load(out)
    assert set(model.coef) >= {"dynamic"}
    sam = SamProposer(16, sam_stop="learned", sam_stop_file=str(out))
    sam.relative_token_cost = 0.05
    rows = [json.loads(line) for line in recs.read_text().splitlines()]
    res = replay_many(sam, [(r["prompt_ids"], r["output_ids"]) for r in rows[1::2]], 16)
    assert res["accepted"] >= 100, res
    with pytest.raises(SystemExit, match="relative token cost"):
        stop_fit.cost_values(["1.5"])


@pytest.mark.parametrize("spec, words", [
    ({"sam_stop": "learned", "sam_min_accept_prob": 0.3}, "sam_min_accept_prob"),
    ({"sam_stop_file": str(S.default_path()), "sam_min_accept_prob": 0.3},
     "read only by the learned rule"),
    ({"sam_stop": "table", "sam_stop_file": str(S.default_path())},
     "read only by the learned rule"),
])
def test_contradictory_stop_options_are_refused_before_the_engine(spec, words):
    from vllm_specplug.config import translate

    for method in ("sam", "sam_tr"):
        with pytest.raises(SpecPlugConfigError, match=words):
            translate({"method": method, "num_speculative_tokens": 8, **spec})
    # the learned rule with the shipped file (named or not) is accepted
    for extra in ({}, {"sam_stop_file": str(S.default_path())}):
        translate({"method": "sam", "num_speculative_tokens": 8, "sam_stop": "learned", **extra})


# ------------------------------------------------------------------ fused kernels
def _random_state(stop: S.LearnedStop, rng: random.Random) -> None:
    """Calibration sums and the request's counters, as traffic would leave them."""
    for arr in (stop.calib_hit, stop.calib_est):
        arr[:] = np.array([rng.uniform(0, 40) for _ in range(arr.size)]).reshape(arr.shape)
    r = stop._req["r"]
    r.num = [rng.uniform(0, 5) for _ in S.SOURCES]
    r.den = [n + rng.uniform(0, 5) for n in r.num]
    r.drafts = [rng.randint(0, 60) for _ in S.SOURCES]
    r.since_reject, r.generated = rng.randint(0, 300), rng.randint(0, 500)
    r.last_full = float(rng.random() < 0.5)


def test_fused_score_equals_the_numpy_functions():
    """What propose runs (``LearnedStop.score``, one numba kernel) is
    ``cumprod(conditional)``, ``calibrated`` and ``best_cut``: the same
    chances to 1e-12 and the same cut, with and without shares (also too
    few of them), agreement and support, past the last calibration band."""
    rng = random.Random(7)
    for trial in range(400):
        model = S.StopModel({s: np.array([rng.uniform(-2, 2) for _ in S.FEATURES])
                             for s in ("dynamic", "global")})
        stop = S.LearnedStop(model)
        stop.start("r", rng.randint(2, 200))
        _random_state(stop, rng)
        n = rng.randint(1, 24)
        table = sorted((rng.random() for _ in range(n)), reverse=True)
        shares = (None if trial % 4 == 0 else
                  list(np.cumprod([rng.random() for _ in range(n if trial % 4 > 1 else n - 1)])))
        agree = None if trial % 3 == 0 else np.array([float(rng.random() < 0.5)
                                                      for _ in range(n)])
        support = None if trial % 5 == 0 else _support(rng, n)
        source = ("dynamic", "global")[trial % 2]
        cost = rng.uniform(0.0, 0.4)
        args = (rng.randint(0, 40), table, shares, n, rng.random() < 0.5, agree, support)
        raw = np.cumprod(stop.conditional("r", source, *args))
        q = stop.calibrated(source, raw)
        m, rate = S.best_cut(q, cost)
        got_raw, got_q, got_m, got_rate = stop.score("r", source, *args, cost)
        np.testing.assert_allclose(got_raw, raw, rtol=1e-12, atol=0)
        np.testing.assert_allclose(got_q, q, rtol=1e-12, atol=0)
        assert (got_m, got_rate) == (m, pytest.approx(rate, rel=1e-12))


def test_fused_score_refuses_too_few_estimates():
    stop = S.LearnedStop(S.StopModel.load())
    stop.start("r", 10)
    with pytest.raises(ValueError, match="fewer estimates"):
        stop.score("r", "dynamic", 3, [0.9, 0.8], None, 3, False, None, None, 0.05)


def test_fused_calibration_update_equals_numpy_add_at():
    """``observe``'s calibration update (a numba kernel) against the numpy
    formulation it replaced, over a stream of drafts whose estimates include
    values exactly on the bins' edges (an edge belongs to the bin above it)."""
    rng = random.Random(11)
    stop = S.LearnedStop(S.StopModel.load())
    stop.start("r", 10)
    est, hit = stop.calib_est.copy(), stop.calib_hit.copy()
    for trial in range(500):
        s = rng.randrange(len(S.SOURCES))
        k = rng.randint(1, 20)
        raw = np.cumprod([rng.uniform(0.5, 1.0) for _ in range(k)])
        if trial % 5 == 0:
            raw = np.sort(rng.choice(S.CALIB_EDGES.tolist()) * np.ones(k))[::-1].copy()
        drafted = rng.randint(1, k + 3)
        accepted = rng.randint(0, min(drafted, k))
        stop._req["r"].pending = (s, raw, raw)
        stop.observe("r", drafted=drafted, accepted=accepted, committed=accepted + 1)
        n = min(drafted, k)
        est[s] *= S.CALIB_DECAY ** n
        hit[s] *= S.CALIB_DECAY ** n
        bins = np.searchsorted(S.CALIB_EDGES, raw[:n], side="right")
        bands = S.CALIB_BAND[np.minimum(np.arange(n), S.CALIB_BAND.size - 1)]
        np.add.at(est[s], (bands, bins), raw[:n])
        np.add.at(hit[s], (bands, bins), (np.arange(n) < accepted).astype(np.float64))
        np.testing.assert_allclose(stop.calib_est, est, rtol=1e-13, atol=0)
        np.testing.assert_allclose(stop.calib_hit, hit, rtol=1e-13, atol=0)
    assert stop.calib_hit.sum() > 0
