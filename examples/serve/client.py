"""Ask a server started by serve.sh, with the OpenAI client, then read its
speculative-decoding counters from /metrics.

    bash examples/serve/serve.sh &          # wait for "Application startup complete"
    python examples/serve/client.py         # --base-url http://127.0.0.1:8000 --model smollm2

The questions share one template (a short product description to JSON), the
kind of traffic where `sam` drafts long copies: the answers repeat the keys,
and each copies values from its own prompt.
"""
from __future__ import annotations

import argparse
import json
import re
import urllib.request

TEMPLATE = ("Turn this product note into JSON with the keys name, price_eur, colour, "
            "weight_kg. Output only the JSON object.\n\nNote: {note}")
NOTES = [
    "The Alder desk lamp costs 39.90 euros, comes in matte black and weighs 1.2 kg.",
    "Birch side table: oak colour, 7.5 kg, 129 euros.",
    "Cedar office chair, grey fabric, 14 kilos, priced at 249.00 EUR.",
    "Dune floor rug (sand colour) weighs 3.1 kg and sells for 89 euros.",
]
COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens")


def spec_counters(base_url: str) -> dict:
    """Sum of each speculative-decoding counter on the server's /metrics page."""
    text = urllib.request.urlopen(base_url + "/metrics", timeout=10).read().decode()
    out = {}
    for name in COUNTERS:
        pattern = rf"^{re.escape(name)}_total(?:{{[^}}]*}})? ([0-9.e+]+)$"
        out[name.split(":")[1]] = int(sum(float(v) for v in re.findall(pattern, text, re.M)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="smollm2", help="the served model name")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default=None, metavar="PATH",
                    help="also write the replies' token ids and the counters here")
    args = ap.parse_args(argv)

    from openai import OpenAI

    client = OpenAI(base_url=args.base_url + "/v1", api_key="none")
    replies = []
    for note in NOTES:  # one at a time: each answer enters sam's global store for the next
        r = client.chat.completions.create(
            model=args.model, temperature=0, max_tokens=args.max_tokens,
            messages=[{"role": "user", "content": TEMPLATE.format(note=note)}],
            extra_body={"return_token_ids": True})  # vLLM's extension: the output token ids
        replies.append(r.choices[0])
        print(f"--- {note}\n{r.choices[0].message.content.strip()}")
    c = spec_counters(args.base_url)
    rate = c["spec_decode_num_accepted_tokens"] / max(1, c["spec_decode_num_draft_tokens"])
    print(f"\nserver counters: {c['spec_decode_num_drafts']} drafts, "
          f"{c['spec_decode_num_draft_tokens']} draft tokens, "
          f"{c['spec_decode_num_accepted_tokens']} accepted ({rate:.0%})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"counters": c, "texts": [r.message.content for r in replies],
                       "token_ids": [r.model_extra["token_ids"] for r in replies]}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
