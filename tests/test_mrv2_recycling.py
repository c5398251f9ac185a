"""Token Recycling's device table for vLLM 0.34 (vllm_adapter/mrv2/recycling.py)
against a plain dict model, on CPU tensors (no vLLM: the class needs torch
only, so this runs in the fast tier). The engine tier
(tests/test_vllm034_engine.py) runs it inside vLLM 0.34's engine loop."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from vllm_specplug.vllm_adapter.mrv2.recycling import DeviceRecycling

VOCAB = 50
SLOTS = 4


class OneHotModel:
    """compute_logits: the 'hidden state' row is [input token, position];
    the target's argmax after token t at position p is ``rule(t, p)``."""

    def __init__(self, rule):
        self.rule = rule

    def compute_logits(self, hidden):
        out = torch.zeros((hidden.shape[0], VOCAB + 3))   # padded vocabulary
        for i, (t, p) in enumerate(hidden.long().tolist()):
            out[i, self.rule(t, p)] = 1.0
        return out


def batch(rows, prompt_len=None):
    """rows: (slot, tokens, first position, scored offsets within the row);
    ``prompt_len`` per slot tells which rows prefill (none if not given)."""
    ids, pos, starts, where, slot_of_logit = [], [], [0], [], []
    for slot, tokens, first, scored in rows:
        base = len(ids)
        ids += tokens
        pos += list(range(first, first + len(tokens)))
        starts.append(len(ids))
        where += [base + j for j in scored]
        slot_of_logit += [slot] * len(scored)
    hidden = torch.tensor([[t, p] for t, p in zip(ids, pos)], dtype=torch.float32)
    return SimpleNamespace(
        input_ids=torch.tensor(ids + [0, 0]), positions=torch.tensor(pos + [0, 0]),
        num_tokens=len(ids), num_reqs=len(rows),
        has_prefill=prompt_len is not None and any(
            first < int(prompt_len[slot]) for slot, _, first, _ in rows),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        idx_mapping=torch.tensor([r[0] for r in rows], dtype=torch.int32),
        logits_indices=torch.tensor(where, dtype=torch.long),
        expanded_idx_mapping=torch.tensor(slot_of_logit + [0], dtype=torch.int32)), hidden


class DictModel:
    """The same table as dicts: shared, or one per slot over a warm column.
    Prompt bigrams go to the slot's own table; with the shared table, to a
    table per slot for them alone, read where the shared one knows nothing."""

    def __init__(self, shared, warm=None):
        self.shared, self.warm = shared, warm
        self.tables = {}
        self.prompts = {}   # slot -> its prompt bigrams (shared table only)

    def table(self, slot):
        return self.tables.setdefault(None if self.shared else slot, {})

    def get(self, slot, t):
        v = self.table(slot).get(t)
        if v is None and self.warm is not None:
            v = int(self.warm[t]) if 0 <= self.warm[t] < VOCAB else None
        if v is None and self.shared:
            v = self.prompts.get(slot, {}).get(t)
        return v

    def learn(self, rows, rule, prompt_len, bigrams=True):
        if bigrams:
            for slot, tokens, first, _ in rows:
                for j in range(len(tokens) - 1):
                    if first + j + 1 < prompt_len[slot] and self.get(slot, tokens[j]) is None:
                        own = self.prompts.setdefault(slot, {}) if self.shared \
                            else self.table(slot)
                        own[tokens[j]] = tokens[j + 1]
        for slot, tokens, first, scored in rows:
            for j in scored:
                self.table(slot)[tokens[j]] = rule(tokens[j], first + j)

    def chain(self, slot, last, k):
        out = []
        for _ in range(k):
            last = self.get(slot, last)
            if last is None:
                break
            out.append(last)
        return out


def drive(shared, seed, warm=None, steps=30):
    rng = np.random.default_rng(seed)
    salt = int(rng.integers(1, 7))

    def rule(t, p):
        return (t * 7 + salt + (p % 3 == 0)) % VOCAB

    dev = DeviceRecycling(vocab_size=VOCAB, max_num_reqs=SLOTS, device=torch.device("cpu"),
                          shared=shared, warm=warm, prompt_bigrams=True)
    dev.bind(OneHotModel(rule))
    ref = DictModel(shared, None if warm is None else warm[:, 0])
    prompt_len = torch.tensor([int(rng.integers(3, 12)) for _ in range(SLOTS)])
    position = [0] * SLOTS
    checked = drafted = 0
    for _ in range(steps):
        slots = rng.permutation(SLOTS)[: int(rng.integers(1, SLOTS + 1))]
        rows = []
        for slot in slots.tolist():
            n = int(rng.integers(1, 6))
            tokens = rng.integers(0, 12, n).tolist()     # few tokens: many repeats
            scored = sorted(rng.choice(n, int(rng.integers(1, n + 1)), replace=False).tolist())
            rows.append((slot, tokens, position[slot], scored))
            position[slot] += n
        ib, hidden = batch(rows, prompt_len)
        dev.learn(ib, hidden, prompt_len)
        ref.learn(rows, rule, prompt_len.tolist())
        lasts = rng.integers(0, 14, len(rows))
        idx = torch.tensor([r[0] for r in rows])
        tokens, valid = dev.chain(idx, torch.tensor(lasts), 5)
        for i, (slot, *_r) in enumerate(rows):
            want = ref.chain(slot, int(lasts[i]), 5)
            got = tokens[i][valid[i]].tolist()
            assert got == want, (slot, int(lasts[i]), got, want)
            assert valid[i].tolist() == [j < len(want) for j in range(5)]
            checked += 1
            drafted += bool(want)
        if rng.random() < 0.1:
            slot = int(rng.integers(0, SLOTS))
            dev.reset_slot(slot)
            if not shared:
                ref.tables.pop(slot, None)
            ref.prompts.pop(slot, None)
            position[slot] = 0
    return checked, drafted


def test_shared_table_matches_the_dict_model():
    for seed in range(6):
        checked, drafted = drive(True, seed)
        assert drafted >= checked // 2, (checked, drafted)


def test_private_tables_match_the_dict_model_and_stay_apart():
    for seed in range(6):
        checked, drafted = drive(False, seed)
        assert drafted >= checked // 3, (checked, drafted)


def test_warm_matrix_is_read_under_private_tables_and_restored_on_reset():
    warm = np.full((VOCAB, 2), -1, dtype=np.int32)
    warm[40:45, 0] = [41, 42, 43, 44, 99]        # 99: outside the vocabulary, dropped
    for shared in (False, True):
        drive(shared, 3, warm=warm)
        dev = DeviceRecycling(vocab_size=VOCAB, max_num_reqs=SLOTS,
                              device=torch.device("cpu"), shared=shared, warm=warm,
                              prompt_bigrams=False)
        tokens, valid = dev.chain(torch.tensor([1]), torch.tensor([40]), 6)
        assert tokens[0][valid[0]].tolist() == [41, 42, 43, 44]
        dev.bind(OneHotModel(lambda t, p: 7))
        ib, hidden = batch([(1, [41], 9, [0])])
        dev.learn(ib, hidden, torch.zeros(SLOTS, dtype=torch.long))
        tokens, valid = dev.chain(torch.tensor([1, 2]), torch.tensor([40, 40]), 3)
        assert tokens[0][valid[0]].tolist() == [41, 7]
        # another slot sees the request's lesson only when the table is shared
        assert tokens[1][valid[1]].tolist() == ([41, 7] if shared else [41, 42, 43])
        dev.reset()
        tokens, valid = dev.chain(torch.tensor([1]), torch.tensor([40]), 3)
        assert tokens[0][valid[0]].tolist() == [41, 42, 43]


def test_a_prompt_never_reaches_the_shared_table():
    """Issue 45 item 2: with the shared table (isolation "none") a prefilling
    request's prompt bigrams serve its own chains only; another slot, and the
    same slot once reassigned, never draft them. The target's lessons are
    shared as before."""
    dev = DeviceRecycling(vocab_size=VOCAB, max_num_reqs=SLOTS, device=torch.device("cpu"),
                          shared=True, warm=None, prompt_bigrams=True)
    dev.bind(OneHotModel(lambda t, p: 30))
    prompt_len = torch.tensor([4, 0, 0, 0])
    ib, hidden = batch([(0, [10, 11, 12, 13], 0, [3])], prompt_len)   # 13 -> 30 learned
    dev.learn(ib, hidden, prompt_len)
    tokens, valid = dev.chain(torch.tensor([0, 1]), torch.tensor([10, 10]), 4)
    assert tokens[0][valid[0]].tolist() == [11, 12, 13, 30]    # its own prompt, then shared
    assert tokens[1][valid[1]].tolist() == []                  # another slot: nothing
    tokens, valid = dev.chain(torch.tensor([1]), torch.tensor([13]), 1)
    assert tokens[0][valid[0]].tolist() == [30]                # the target's lesson: shared
    assert not bool((dev.table[:VOCAB] == 11).any())           # no prompt bigram in it
    dev.reset_slot(0)
    tokens, valid = dev.chain(torch.tensor([0]), torch.tensor([10]), 2)
    assert tokens[0][valid[0]].tolist() == []


def test_a_hash_collision_misses_and_never_drafts_another_tokens_entry():
    dev = DeviceRecycling(vocab_size=VOCAB, max_num_reqs=SLOTS, device=torch.device("cpu"),
                          shared=False, warm=None, prompt_bigrams=False, buckets=4)
    dev.bind(OneHotModel(lambda t, p: (t + 1) % VOCAB))
    ib, hidden = batch([(0, [2, 6], 20, [0, 1])])      # 2 and 6 share bucket 2: 6 wins
    dev.learn(ib, hidden, torch.zeros(SLOTS, dtype=torch.long))
    tokens, valid = dev.chain(torch.tensor([0, 0]), torch.tensor([6, 2]), 1)
    assert tokens[0, 0] == 7 and bool(valid[0, 0])
    assert not bool(valid[1, 0])                       # 2's entry was overwritten


def test_compute_logits_missing_fails_loudly():
    dev = DeviceRecycling(vocab_size=VOCAB, max_num_reqs=SLOTS, device=torch.device("cpu"),
                          shared=True, warm=None, prompt_bigrams=False)
    ib, hidden = batch([(0, [1], 0, [0])])
    try:
        dev.learn(ib, hidden, torch.zeros(SLOTS, dtype=torch.long))
    except RuntimeError as e:
        assert "load_model" in str(e)
    else:
        raise AssertionError("learn without a target module must fail")
    try:
        dev.bind(object())
    except RuntimeError as e:
        assert "compute_logits" in str(e)
    else:
        raise AssertionError("a target without compute_logits must fail")
