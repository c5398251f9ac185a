"""Paired A/B of the draining valuation: plain, sam (batch_drain auto), sam
(batch_drain off) alive together; the workload's odd-half batch run by each in
rotating order, ROUNDS times; seconds per batch, outputs checked against plain."""
import json, os, statistics, sys, time
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def main():
    from vllm import SamplingParams
    from vllm_specplug.bench.engine import (METHOD_CONFIGS, build_llm, counter_delta,
                                            read_drafter_stats, read_spec_counters)
    from vllm_specplug.bench.workloads import batch_plan, build_messages, load_workload
    from vllm_specplug.models import default_model_path

    workload, limit, bs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    method = os.environ.get("METHOD", "sam")
    rounds = int(os.environ.get("ROUNDS", 5))
    # a fresh chunk of ``limit`` prompts each round (no prefix cache or
    # repeated outputs between rounds); every engine runs the same chunk
    all_rows = load_workload(workload, half="odd")
    sp = SamplingParams(temperature=0, max_tokens=48)
    base = METHOD_CONFIGS[method]
    cfgs = {"plain": None, "auto": dict(base, batch_drain="auto"),
            "off": dict(base, batch_drain="off")}
    extra = {}
    if os.environ.get("SYNC"):   # plain without async scheduling (as every spec engine here)
        cfgs["plain_sync"] = None
        extra["plain_sync"] = {"async_scheduling": False}
    llms = {n: build_llm(default_model_path(), c, **extra.get(n, {})) for n, c in cfgs.items()}
    for llm in llms.values():
        llm.chat([[{"role": "user", "content": "Say hello."}]],
                 SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    names = list(cfgs)
    secs = {n: [] for n in names}
    counters = {n: [] for n in names}
    last_ids = {}
    for r in range(rounds):
        rows = all_rows[r * limit:(r + 1) * limit]
        plan = batch_plan(rows, bs)
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            llm = llms[n]
            before = read_spec_counters(llm)
            t = time.perf_counter()
            ids = []
            for idx in plan:   # single-turn sessions only (odd half, turn 0 first)
                msgs = [build_messages(rows[i], []) for i in idx]
                outs = llm.chat(msgs, sp, use_tqdm=False)
                ids += [list(o.outputs[0].token_ids) for o in outs]
            dt = time.perf_counter() - t
            secs[n].append(dt)
            counters[n].append(counter_delta(read_spec_counters(llm), before))
            last_ids.setdefault(n, []).extend(ids)
            print(f"round {r} {n}: {dt:.2f} s", counters[n][-1].get("draft_tokens"),
                  counters[n][-1].get("accepted"), flush=True)
    out = {"workload": workload, "limit": limit, "batch_size": bs, "method": method,
           "seconds": secs,
           "median": {n: statistics.median(v) for n, v in secs.items()},
           "paired_ratio_vs_plain": {n: [p / x for p, x in zip(secs["plain"], v)]
                                     for n, v in secs.items()},
           "draft_tokens": {n: [c.get("draft_tokens") for c in v] for n, v in counters.items()},
           "accepted": {n: [c.get("accepted") for c in v] for n, v in counters.items()},
           "drain": {n: (read_drafter_stats(llms[n]) or {}).get("drain") for n in names}}
    out["identical_to_plain"] = {n: last_ids[n] == last_ids["plain"] for n in names}
    for n in names:
        rs = out["paired_ratio_vs_plain"][n]
        print(f"{n}: median {out['median'][n]:.2f} s, x plain paired median "
              f"{statistics.median(rs):.3f} (min {min(rs):.3f}, max {max(rs):.3f})")
    print("RESULT", json.dumps(out), flush=True)
    for llm in llms.values():
        llm.llm_engine.engine_core.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
