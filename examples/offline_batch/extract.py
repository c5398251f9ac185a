"""An offline batch job with `sam`: one extraction template over many records.

Every answer of a templated batch job shares its layout (here a JSON object
with the same six keys) and copies values from its own record, which is what
`sam` drafts from: the request's own prompt, and the outputs of requests that
finished before it (its global store). Greedy output is token-identical to
plain decoding; only the speed changes.

    python examples/offline_batch/extract.py                     # the embedded model
    python examples/offline_batch/extract.py --model /path/to/hf/model --method sam_tr

The model is --model, else $SPECPLUG_MODEL, else the embedded SmolLM2-135M
(`python -m vllm_specplug prepare-model` prints its folder). At the end it
prints vLLM's own speculative-decoding counters (drafts, draft tokens,
accepted tokens) and tau, the tokens generated per target step.
"""
from __future__ import annotations

import argparse
import json
import os

TEMPLATE = ("Extract the fields name, date_of_birth, city, email, employer, job_title as JSON "
            "from this record. Write date_of_birth as YYYY-MM-DD and use null for a field the "
            "record does not give. Output only the JSON object.\n\nRecord:\n{record}")

RECORDS = [
    "Daniel Johansson (born 28 November 1995) works as a financial advisor at Granite "
    "Construction Group in Cebu. Email: daniel.johansson@mail.com.",
    "NAME: NAKAMURA, Amara\nDOB: July 7, 1980\nLOCATION: Graz\n"
    "ROLE: paralegal (Granite Construction Group)\nEMAIL: amara.nakamura@webmail.io",
    "Hi team, please welcome Chloe Kowalski, who joins Meadow Pharmaceuticals as our new "
    "warehouse supervisor at the Valencia site. Chloe was born on 1957-04-09 and reads "
    "chloe.kowalski@mail.com.",
    "Omar Haddad, senior accountant, Northwind Logistics, Lyon. Born 3 March 1988. "
    "omar.haddad@northwind.example",
    "NAME: OKAFOR, Grace\nDOB: 12/01/1975\nLOCATION: Lagos\nROLE: data analyst (Blue Harbor Bank)"
    "\nEMAIL: grace.okafor@blueharbor.example",
    "Meeting note: Lukas Meyer (data engineer at Meadow Pharmaceuticals, based in Zurich, "
    "born 1992-10-30) will own the migration. Contact lukas.meyer@meadow.example.",
    "Sofia Rossi,1990-05-21,Milan,sofia.rossi@mail.com,Granite Construction Group,site engineer",
    "Priya Nair joined Blue Harbor Bank in Chennai as a loan officer. Date of birth: "
    "14 August 1984. Email priya.nair@blueharbor.example.",
]


def model_path(arg: str | None, tensor_parallel_size: int = 1) -> str:
    if arg:
        return arg
    if os.environ.get("SPECPLUG_MODEL"):
        return os.environ["SPECPLUG_MODEL"]
    from vllm_specplug.models import default_model_path, padded_heads_model_path

    # the embedded model's 9 attention heads do not split over 2 ranks: at TP > 1
    # use the same model with zero heads added (same outputs; docs/distributed.md)
    return padded_heads_model_path(tensor_parallel_size) if tensor_parallel_size > 1 \
        else default_model_path()


def messages(n: int) -> list[list[dict]]:
    """One chat per record (``n`` records, cycling through RECORDS)."""
    return [[{"role": "user", "content": TEMPLATE.format(record=RECORDS[i % len(RECORDS)])}]
            for i in range(n)]


def spec_counters(llm) -> dict:
    """vLLM's speculative-decoding counters (needs ``disable_log_stats=False``)."""
    names = {"vllm:spec_decode_num_drafts": "drafts",
             "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    out = dict.fromkeys(names.values(), 0)
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] = int(m.value)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model folder (default: $SPECPLUG_MODEL, "
                    "else the embedded model)")
    ap.add_argument("--method", default="sam", help="speculative method, or 'plain' (default sam)")
    ap.add_argument("--records", type=int, default=8, help="how many records (default 8)")
    ap.add_argument("--batch-size", type=int, default=4,
                    help="records per llm.chat call (default 4; later batches draft from the "
                         "outputs of earlier ones)")
    ap.add_argument("--max-tokens", type=int, default=80)
    ap.add_argument("--json", default=None, metavar="PATH",
                    help="also write the outputs' token ids, texts and counters here")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="ranks (examples/distributed/README.md; on CPU set "
                         "VLLM_CPU_OMP_THREADS_BIND='0|1' for 2)")
    ap.add_argument("--executor", default=None, choices=["mp", "ray"],
                    help="vLLM's distributed executor at TP > 1 (default: vLLM's choice)")
    args = ap.parse_args(argv)

    # CPU only: the KV cache size in GiB (vLLM's default is larger than this job needs)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    spec = None if args.method == "plain" else {"method": args.method}
    # float32 and enforce_eager: what vLLM's CPU backend runs; drop both on a GPU
    llm = LLM(model=model_path(args.model, args.tensor_parallel_size), speculative_config=spec,
              dtype="float32", enforce_eager=True, max_model_len=2048, disable_log_stats=False,
              tensor_parallel_size=args.tensor_parallel_size,
              distributed_executor_backend=args.executor)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    chats = messages(args.records)
    outs = []
    for i in range(0, len(chats), args.batch_size):
        outs += llm.chat(chats[i:i + args.batch_size], params, use_tqdm=False)

    for i, o in enumerate(outs):
        print(f"--- record {i}\n{o.outputs[0].text.strip()}")
    c = spec_counters(llm)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    tau = generated / max(1, generated - c["accepted"])
    rate = c["accepted"] / c["draft_tokens"] if c["draft_tokens"] else 0.0
    print(f"\n{args.method}: {generated} tokens generated; {c['drafts']} drafts, "
          f"{c['draft_tokens']} draft tokens, {c['accepted']} accepted ({rate:.0%}); "
          f"tau {tau:.2f} tokens per target step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"method": args.method, "counters": c, "tau": tau,
                       "token_ids": [list(o.outputs[0].token_ids) for o in outs],
                       "texts": [o.outputs[0].text for o in outs]}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
