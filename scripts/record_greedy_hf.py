"""Greedy outputs of the embedded model for offline replay (no vLLM engine).

    python scripts/record_greedy_hf.py specbench PER_CATEGORY MAX_TOKENS OUT.jsonl
    python scripts/record_greedy_hf.py multiturn QUESTIONS MAX_TOKENS OUT.jsonl

Hugging Face ``generate`` (greedy, one CPU thread, batches of 8 left-padded
chat prompts), so the outputs are the model's greedy answers but not
necessarily token for token those of vLLM's engine. ``specbench``: the first
PER_CATEGORY prompts of each Spec-Bench category; ``multiturn``: the first
QUESTIONS two-turn questions, the second turn asked with the first answer in
the context. Rows: ``{"id", "category", "pos", ["turn"], "prompt_ids",
"output_ids"}`` (read by scripts/measure_global_store.py). The files in
results/runs/global_store/ were made with ``specbench 8 128`` and
``multiturn 24 128``.
"""
import json, sys, time
import torch
from transformers import AutoTokenizer, AutoModelForCausalLM
from vllm_specplug.models import default_model_path
torch.set_num_threads(1)
path = default_model_path()
tok = AutoTokenizer.from_pretrained(path)
tok.padding_side = "left"
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
from vllm_specplug.bench.prompts import spec_bench_path
rows = [json.loads(l) for l in open(spec_bench_path())]
MAXT = int(sys.argv[3])
BATCH = 8
eos = tok.eos_token_id

def prompt_ids(msgs):
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)

def gen_batch(msg_list):
    ps = [prompt_ids(m) for m in msg_list]
    L = max(len(p) for p in ps)
    x = torch.tensor([[eos] * (L - len(p)) + p for p in ps])
    att = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in ps])
    with torch.no_grad():
        out = model.generate(x, attention_mask=att, max_new_tokens=MAXT, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos)
    outs = []
    for row in out[:, L:].tolist():
        if eos in row:
            row = row[: row.index(eos) + 1]
        outs.append(row)
    return ps, outs

which = sys.argv[1]
per = int(sys.argv[2])
f = open(sys.argv[4], 'w')
t0 = time.time()
if which == 'specbench':
    from collections import defaultdict
    seen = defaultdict(int)
    items = []
    for r in rows:
        c = r['category']
        if seen[c] >= per: continue
        seen[c] += 1
        items.append((r, seen[c] - 1))
    for i in range(0, len(items), BATCH):
        chunk = items[i:i + BATCH]
        ps, os_ = gen_batch([[{"role": "user", "content": r['turns'][0]}] for r, _ in chunk])
        for (r, pos), p, o in zip(chunk, ps, os_):
            f.write(json.dumps({"id": r['question_id'], "category": r['category'], "pos": pos,
                                "prompt_ids": p, "output_ids": o}) + "\n")
        f.flush(); print(i, time.time() - t0, flush=True)
elif which == 'multiturn':
    qs = [r for r in rows if len(r['turns']) >= 2][:per]
    for i in range(0, len(qs), BATCH):
        chunk = qs[i:i + BATCH]
        m1 = [[{"role": "user", "content": r['turns'][0]}] for r in chunk]
        p1, o1 = gen_batch(m1)
        m2 = [m + [{"role": "assistant", "content": tok.decode(o, skip_special_tokens=True)},
                   {"role": "user", "content": r['turns'][1]}] for m, o, r in zip(m1, o1, chunk)]
        p2, o2 = gen_batch(m2)
        for j, r in enumerate(chunk):
            for turn, (p, o) in enumerate(((p1[j], o1[j]), (p2[j], o2[j]))):
                f.write(json.dumps({"id": r['question_id'], "category": r['category'],
                                    "pos": i + j, "turn": turn, "prompt_ids": p,
                                    "output_ids": o}) + "\n")
        f.flush(); print(i, time.time() - t0, flush=True)
print("done", time.time() - t0)
