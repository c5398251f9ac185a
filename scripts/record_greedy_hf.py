"""Greedy outputs of the embedded model for offline replay (no vLLM engine).

    python scripts/record_greedy_hf.py specbench PER_CATEGORY MAX_TOKENS OUT.jsonl
    python scripts/record_greedy_hf.py multiturn QUESTIONS MAX_TOKENS OUT.jsonl
    python scripts/record_greedy_hf.py workload NAME HALF MAX_TOKENS OUT.jsonl [LIMIT]
    python scripts/record_greedy_hf.py topk RECORDS.jsonl K OUT.npz

Hugging Face ``generate`` (greedy, one CPU thread, batches of 8 left-padded
chat prompts), so the outputs are the model's greedy answers but not
necessarily token for token those of vLLM's engine. ``specbench``: the first
PER_CATEGORY prompts of each Spec-Bench category; ``multiturn``: the first
QUESTIONS two-turn questions, the second turn asked with the first answer in
the context. Rows: ``{"id", "category", "pos", ["turn"], "prompt_ids",
"output_ids"}`` (read by scripts/measure_global_store.py). The files in
results/runs/global_store/ were made with ``specbench 8 128`` and
``multiturn 24 128``.

``workload``: a workload of ``vllm_specplug.bench.workloads`` (HALF "even",
"odd" or "all"; LIMIT: the first LIMIT sessions), turn by turn: every
session's turn t is generated (in batches of 8) before any turn t+1, and
turn t+1 is asked with the session's earlier prompts and the model's own
earlier outputs in its context (``build_messages``, chat template applied).
Rows as above plus ``"session"``, ``"turn"``; ``pos`` is the session's
position within its category in the whole workload (so ``pos % 2`` is the
half, as in ``workloads.select``).

``topk``: the target's top-K next tokens along each record's prompt and
output, one forward pass per record (no padding): for output position j, the
K highest-probability tokens (and their log-probabilities) of the
distribution that predicts ``output_ids[j]``. Written as an .npz beside the
records (the replay of Token Recycling and ``sam_tr`` feeds them,
``bench.curves.load_records``): ``ids`` int32 and ``logprobs`` float16,
``[total output tokens, K]``, rows of record i at ``offsets[i]:offsets[i+1]``;
``argmax_agrees[i]``: how many of record i's output tokens are the forward
pass's argmax (``generate`` ran in left-padded batches, so a few may differ).
"""
import json
import sys
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vllm_specplug.bench.prompts import spec_bench_path
from vllm_specplug.models import default_model_path

torch.set_num_threads(1)
BATCH = 8


def load_model():
    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return tok, model


def prompt_ids(tok, msgs):
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def gen_batch(tok, model, msg_list, max_tokens):
    eos = tok.eos_token_id
    ps = [prompt_ids(tok, m) for m in msg_list]
    L = max(len(p) for p in ps)
    x = torch.tensor([[eos] * (L - len(p)) + p for p in ps])
    att = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in ps])
    with torch.no_grad():
        out = model.generate(x, attention_mask=att, max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos)
    outs = []
    for row in out[:, L:].tolist():
        if eos in row:
            row = row[: row.index(eos) + 1]
        outs.append(row)
    return ps, outs


def record_specbench(per, max_tokens, f):
    from collections import defaultdict

    tok, model = load_model()
    rows = [json.loads(line) for line in open(spec_bench_path())]
    seen = defaultdict(int)
    items = []
    for r in rows:
        c = r['category']
        if seen[c] >= per:
            continue
        seen[c] += 1
        items.append((r, seen[c] - 1))
    t0 = time.time()
    for i in range(0, len(items), BATCH):
        chunk = items[i:i + BATCH]
        ps, os_ = gen_batch(tok, model, [[{"role": "user", "content": r['turns'][0]}]
                                         for r, _ in chunk], max_tokens)
        for (r, pos), p, o in zip(chunk, ps, os_):
            f.write(json.dumps({"id": r['question_id'], "category": r['category'], "pos": pos,
                                "prompt_ids": p, "output_ids": o}) + "\n")
        f.flush()
        print(i, time.time() - t0, flush=True)


def record_multiturn(per, max_tokens, f):
    tok, model = load_model()
    rows = [json.loads(line) for line in open(spec_bench_path())]
    qs = [r for r in rows if len(r['turns']) >= 2][:per]
    t0 = time.time()
    for i in range(0, len(qs), BATCH):
        chunk = qs[i:i + BATCH]
        m1 = [[{"role": "user", "content": r['turns'][0]}] for r in chunk]
        p1, o1 = gen_batch(tok, model, m1, max_tokens)
        m2 = [m + [{"role": "assistant", "content": tok.decode(o, skip_special_tokens=True)},
                   {"role": "user", "content": r['turns'][1]}] for m, o, r in zip(m1, o1, chunk)]
        p2, o2 = gen_batch(tok, model, m2, max_tokens)
        for j, r in enumerate(chunk):
            for turn, (p, o) in enumerate(((p1[j], o1[j]), (p2[j], o2[j]))):
                f.write(json.dumps({"id": r['question_id'], "category": r['category'],
                                    "pos": i + j, "turn": turn, "prompt_ids": p,
                                    "output_ids": o}) + "\n")
        f.flush()
        print(i, time.time() - t0, flush=True)


def session_positions(rows):
    """Each session's position within the category of its first turn, over
    the whole workload (``workloads.select``'s rule for halves)."""
    from collections import defaultdict

    from vllm_specplug.bench.workloads import session_key

    position, per_category = {}, defaultdict(int)
    for r in rows:
        key = session_key(r)
        if key not in position:
            position[key] = per_category[r["category"]]
            per_category[r["category"]] += 1
    return position


def record_workload(name, half, max_tokens, f, limit=None):
    from vllm_specplug.bench.workloads import (batch_plan, build_messages, load_workload,
                                               session_key)

    tok, model = load_model()
    position = session_positions(load_workload(name))
    rows = load_workload(name, None if half == "all" else half, limit)
    history: dict[str, list] = {}
    results: list = [None] * len(rows)
    t0 = time.time()
    for batch in batch_plan(rows, BATCH):
        msgs = [build_messages(rows[i], history.get(session_key(rows[i]), [])) for i in batch]
        ps, os_ = gen_batch(tok, model, msgs, max_tokens)
        for i, p, o in zip(batch, ps, os_):
            r = rows[i]
            key = session_key(r)
            history.setdefault(key, []).append(
                (r["prompt"], tok.decode(o, skip_special_tokens=True)))
            results[i] = {"id": r["id"], "category": r["category"], "pos": position[key],
                          "session": r["session"], "turn": r["turn"], "prompt_ids": p,
                          "output_ids": o}
        print(len([x for x in results if x is not None]), "/", len(rows),
              round(time.time() - t0, 1), flush=True)
    for res in results:  # sessions in file order, each session's turns in order
        f.write(json.dumps(res) + "\n")


def record_topk(records_path, k, out_path):
    tok, model = load_model()
    rows = [json.loads(line) for line in open(records_path) if line.strip()]
    ids_all, lp_all, offsets, agrees = [], [], [0], []
    t0 = time.time()
    for i, r in enumerate(rows):
        p, o = r["prompt_ids"], r["output_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([p + o])).logits[0, len(p) - 1:len(p) - 1 + len(o)]
        logp = torch.log_softmax(logits.float(), dim=-1)
        vals, idx = torch.topk(logp, k, dim=-1)
        ids_all.append(idx.numpy().astype(np.int32))
        lp_all.append(vals.numpy().astype(np.float16))
        offsets.append(offsets[-1] + len(o))
        agrees.append(int((idx[:, 0].numpy() == np.asarray(o)).sum()))
        if i % 16 == 0:
            print(i, round(time.time() - t0, 1), flush=True)
    np.savez_compressed(out_path, ids=np.concatenate(ids_all), logprobs=np.concatenate(lp_all),
                        offsets=np.asarray(offsets, dtype=np.int64),
                        argmax_agrees=np.asarray(agrees, dtype=np.int32), k=np.int32(k))
    total = offsets[-1]
    print("agree", sum(agrees), "/", total, round(time.time() - t0, 1), "s")


def main(argv):
    which = argv[0]
    t0 = time.time()
    if which == "topk":
        record_topk(argv[1], int(argv[2]), argv[3])
    elif which == "workload":
        with open(argv[4], "w") as f:
            record_workload(argv[1], argv[2], int(argv[3]), f,
                            int(argv[5]) if len(argv) > 5 else None)
    else:
        with open(argv[3], "w") as f:
            (record_specbench if which == "specbench" else record_multiturn)(
                int(argv[1]), int(argv[2]), f)
    print("done", time.time() - t0)


if __name__ == "__main__":
    main(sys.argv[1:])
