"""``specplug train-eagle``: train an EAGLE-1 head for a target model.

Stages (each cached in the output folder, so a rerun skips what is done):

1. ``data.jsonl``: the target's own greedy answers to the prompts (vLLM
   offline, one batch, the chat template), as token ids of prompt + answer;
2. ``features.npy`` (float16, memory-mapped) + ``tokens.npy`` + ``index.npy``:
   the target's last hidden states (after its final norm) from transformers;
3. training (EAGLE paper): input ``(embed(t[i+1]), f[i])`` at position i ->
   predict ``f[i+1]``; loss = SmoothL1(pred, f[i+1]) + 0.1 x cross-entropy of
   ``lm_head(pred)`` against the target's distribution ``lm_head(f[i+1])``;
   uniform noise on the input features; AdamW; causal attention over whole
   sequences; loss on the answer positions. ``fc`` starts as ``[small |
   identity]``, the decoder layer from PyTorch's default init (the target's
   last layer is an option, ``init="last"``, measured worse). A checkpoint
   each epoch (``checkpoint.pt``, for ``--resume``); the head is saved with
   ``save_head`` in ``head/``; ``report.json`` holds timings and the held-out
   (last 5% of sequences) top-1 accuracy ``argmax lm_head(pred) ==
   argmax lm_head(f[i+1])``.
"""
from __future__ import annotations

import gc
import hashlib
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .head import EagleHead, EagleHeadConfig, save_head

DATA_FILE = "data.jsonl"
DATA_META = "data.meta.json"
FEATURES_FILE = "features.npy"
TOKENS_FILE = "tokens.npy"
INDEX_FILE = "index.npy"
FEATURES_META = "features.meta.json"
CHECKPOINT_FILE = "checkpoint.pt"
REPORT_FILE = "report.json"
HEAD_DIR = "head"


class TrainError(RuntimeError):
    """A bad trainer input (prompts file, target, output folder)."""


@dataclass
class TrainArgs:
    out: str
    target: str | None = None            # default: the embedded model
    prompts: str | None = None           # jsonl with "prompt" or "text"; default: built-in
    num_prompts: int = 600
    max_tokens: int = 128
    epochs: int = 3
    lr: float = 1e-3
    batch_size: int = 8                  # sequences per step
    resume: bool = False
    seed: int = 0
    holdout: float = 0.05
    noise: float = 0.2                   # EAGLE's uniform noise std (scaled by 512 / hidden)
    ce_weight: float = 0.1
    only_data: bool = False              # stop after stage 1 (generation)
    stop_after: int | None = None        # stop after this many epochs (as if interrupted)
    init: str = "random"                 # decoder layer init: "random" or "last" (target's)
    progress: bool = True
    max_model_len: int = 2048
    extra: dict = field(default_factory=dict)


# --------------------------------------------------------------------------
# Prompts


def load_prompt_texts(path: str | None) -> list[str]:
    """Prompts from a JSONL file (``prompt`` or ``text`` per row), or the
    built-in set (``vllm_specplug/data/eagle_prompts.jsonl``)."""
    if path is None:
        from .prompts import load_builtin_prompts

        return load_builtin_prompts()
    from ..corpus_files import CorpusReadError, jsonl_records

    if not Path(path).is_file():
        raise TrainError(f"--prompts {path}: no such file")
    out = []
    try:
        for n, row in jsonl_records(path):
            text = row.get("prompt", row.get("text")) if isinstance(row, dict) else None
            if not isinstance(text, str) or not text.strip():
                raise TrainError(f"--prompts {path}, line {n}: no 'prompt' or 'text' string "
                                 f"field")
            out.append(text)
    except (CorpusReadError, UnicodeDecodeError) as e:
        raise TrainError(f"--prompts {e}") from None
    if not out:
        raise TrainError(f"--prompts {path}: no prompts")
    return out


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _file_sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


# --------------------------------------------------------------------------
# Stage 1: the target's greedy answers (vLLM)


def generate_data(target: str, prompts: list[str], out: Path, max_tokens: int, *,
                  max_model_len: int = 2048, progress: bool = True) -> dict:
    """Write ``data.jsonl`` (rows ``{"prompt", "prompt_ids", "output_ids"}``);
    skipped when ``data.meta.json`` says the same inputs made it."""
    meta = {"target": os.path.abspath(target), "max_tokens": max_tokens,
            "num_prompts": len(prompts), "prompts_sha": _sha(prompts)}
    data, meta_path = out / DATA_FILE, out / DATA_META
    if data.exists() and _read_json(meta_path) == meta:
        return {"skipped": True}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    prompt_ids = []
    limit = max_model_len - max_tokens
    for p in prompts:
        text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        prompt_ids.append(ids[-limit:] if len(ids) > limit else ids)
    from ..offline_engine import build_llm
    from vllm import SamplingParams

    t0 = time.time()
    llm = build_llm(target, None, max_model_len=max_model_len)
    t1 = time.time()
    try:
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids],
                            SamplingParams(temperature=0, max_tokens=max_tokens),
                            use_tqdm=progress)
    finally:
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001
            pass
        del llm
        gc.collect()
    t2 = time.time()
    tmp = data.with_name(data.name + ".tmp")
    n_out = 0
    with open(tmp, "w") as f:
        for p, ids, o in zip(prompts, prompt_ids, outs):
            out_ids = list(o.outputs[0].token_ids)
            n_out += len(out_ids)
            f.write(json.dumps({"prompt": p, "prompt_ids": ids, "output_ids": out_ids}) + "\n")
    os.replace(tmp, data)
    _write_json(meta_path, meta)
    return {"skipped": False, "engine_start_s": round(t1 - t0, 1),
            "generate_s": round(t2 - t1, 1), "prompt_tokens": sum(map(len, prompt_ids)),
            "output_tokens": n_out, "output_tok_per_s": round(n_out / max(t2 - t1, 1e-9), 1)}


def read_data(out: Path) -> list[dict]:
    with open(out / DATA_FILE) as f:
        return [json.loads(line) for line in f if line.strip()]


# --------------------------------------------------------------------------
# Stage 2: target features (transformers)


def load_target(target: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    model.eval()
    return model


@torch.inference_mode()
def extract_features(model, rows: list[dict], out: Path, *, data_sha: str,
                     token_budget: int = 4096, progress: bool = True) -> dict:
    """``features.npy`` float16 [N, h] (memory-mapped), ``tokens.npy`` int32
    [N], ``index.npy`` int64 [S, 3] (start, length, prompt length); skipped
    when ``features.meta.json`` matches the data."""
    meta_path = out / FEATURES_META
    hidden = model.config.hidden_size
    want = {"data_sha": data_sha, "hidden_size": hidden, "complete": True}
    if _read_json(meta_path) == want and (out / FEATURES_FILE).exists():
        return {"skipped": True}
    seqs = [r["prompt_ids"] + r["output_ids"] for r in rows]
    lens = np.array([len(s) for s in seqs], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    index = np.stack([starts, lens, [len(r["prompt_ids"]) for r in rows]], axis=1)
    total = int(lens.sum())
    tokens = np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs])
    feats = np.lib.format.open_memmap(out / (FEATURES_FILE + ".tmp"), mode="w+",
                                      dtype=np.float16, shape=(total, hidden))
    order = np.argsort(-lens, kind="stable")
    batches, cur = [], []
    for i in order:  # longest first, padded tokens <= token_budget
        if cur and (len(cur) + 1) * lens[cur[0]] > token_budget:
            batches.append(cur)
            cur = []
        cur.append(int(i))
    if cur:
        batches.append(cur)
    from tqdm import tqdm

    t0 = time.time()
    bar = tqdm(total=total, desc="features", unit="tok", disable=not progress)
    for b in batches:
        L = int(lens[b].max())
        ids = torch.zeros(len(b), L, dtype=torch.long)
        att = torch.zeros(len(b), L, dtype=torch.long)
        for j, i in enumerate(b):
            ids[j, :lens[i]] = torch.from_numpy(tokens[starts[i]:starts[i] + lens[i]])
            att[j, :lens[i]] = 1
        o = model(input_ids=ids, attention_mask=att, output_hidden_states=True,
                  logits_to_keep=1)
        hs = o.hidden_states[-1]
        for j, i in enumerate(b):
            feats[starts[i]:starts[i] + lens[i]] = hs[j, :lens[i]].to(torch.float16).numpy()
        bar.update(int(lens[b].sum()))
    bar.close()
    feats.flush()
    del feats
    os.replace(out / (FEATURES_FILE + ".tmp"), out / FEATURES_FILE)
    np.save(out / TOKENS_FILE, tokens)
    np.save(out / INDEX_FILE, index)
    _write_json(meta_path, want)
    dt = time.time() - t0
    return {"skipped": False, "features_s": round(dt, 1), "tokens": total,
            "tok_per_s": round(total / max(dt, 1e-9), 1)}


class FeatureStore:
    """The stage-2 arrays of an output folder (features memory-mapped)."""

    def __init__(self, out: Path):
        self.features = np.load(out / FEATURES_FILE, mmap_mode="r")
        self.tokens = np.load(out / TOKENS_FILE)
        self.index = np.load(out / INDEX_FILE)

    def __len__(self) -> int:
        return len(self.index)

    def batch(self, seq_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                 torch.Tensor]:
        """Right-padded ``tokens [B, L]``, ``features [B, L, h]`` (float32),
        ``lengths [B]``, ``prompt_lengths [B]``."""
        rows = self.index[seq_ids]
        L = int(rows[:, 1].max())
        h = self.features.shape[1]
        tok = torch.zeros(len(seq_ids), L, dtype=torch.long)
        feat = torch.zeros(len(seq_ids), L, h, dtype=torch.float32)
        for j, (s, n, _) in enumerate(rows):
            tok[j, :n] = torch.from_numpy(self.tokens[s:s + n].astype(np.int64))
            feat[j, :n] = torch.from_numpy(np.asarray(self.features[s:s + n], dtype=np.float32))
        return tok, feat, torch.from_numpy(rows[:, 1].copy()), torch.from_numpy(rows[:, 2].copy())


# --------------------------------------------------------------------------
# Stage 3: training


INIT_MODES = ("random", "last")


def init_head(model, cfg: EagleHeadConfig, mode: str = "random", seed: int = 0) -> EagleHead:
    """``fc = [N(0, 0.02) | identity]`` (the head starts from the feature
    itself) and the decoder layer either PyTorch's default init (``random``)
    or the target's last layer without its input_layernorm (``last``).
    Measured on SmolLM2-135M (300 sequences, 1 epoch): held-out top-1 0.22
    from ``random``, 0.02 from ``last``: the last layer writes into the
    target's un-normalised residual stream, so its outputs are far larger than
    the post-norm features the head must predict (initial SmoothL1 40 vs 0.76)."""
    if mode not in INIT_MODES:
        raise TrainError(f"init {mode!r}: expected one of {INIT_MODES}")
    torch.manual_seed(seed)
    head = EagleHead(cfg)
    state = head.state_dict()
    if mode == "last":
        last = model.model.layers[-1].state_dict()
        for k in state:
            src = k[len("layers.0."):]
            if k.startswith("layers.0.") and src in last and last[src].shape == state[k].shape:
                state[k] = last[src].detach().clone().float()
    h = cfg.hidden_size
    fc = torch.empty(h, 2 * h)
    torch.nn.init.normal_(fc[:, :h], std=0.02)
    fc[:, h:] = torch.eye(h)
    state["fc.weight"] = fc
    head.load_state_dict(state)
    return head


def target_head_config(model) -> EagleHeadConfig:
    return EagleHeadConfig.from_dict(model.config.to_dict(), where="target config")


def _loss_positions(lengths: torch.Tensor, prompt_lengths: torch.Tensor, L: int) -> torch.Tensor:
    """Bool ``[B, L-1]``: pair i (input t[i+1], f[i] -> f[i+1]) is trained
    when t[i+1] is an answer token (i+1 >= prompt length) and i+1 < length."""
    i = torch.arange(L - 1)[None]
    return (i + 1 >= prompt_lengths[:, None]) & (i + 1 < lengths[:, None])


def head_step(head: EagleHead, embed_w: torch.Tensor, lm_w: torch.Tensor, tok: torch.Tensor,
              feat: torch.Tensor, lengths: torch.Tensor, prompt_lengths: torch.Tensor, *,
              noise: float = 0.0, ce_weight: float = 0.1, train: bool = True,
              chunk: int = 512) -> dict:
    """One batch: forward, losses, top-1 accuracy (and gradients when
    ``train``). The CE runs in chunks of positions so the [N, vocab] logits
    stay small; its gradient is accumulated into ``pred`` and backpropagated
    with the SmoothL1 loss in one pass."""
    B, L = tok.shape
    sel = _loss_positions(lengths, prompt_lengths, L)
    n = int(sel.sum())
    if n == 0:
        return {"n": 0}
    f_in = feat[:, :-1]
    if noise > 0 and train:
        f_in = f_in + (torch.rand_like(f_in) - 0.5) * (noise * 512 / f_in.shape[-1])
    emb = F.embedding(tok[:, 1:], embed_w)
    pos = torch.arange(L - 1)[None].expand(B, L - 1)
    with torch.set_grad_enabled(train):
        pred_all, _, _ = head.forward_batched(emb, f_in, pos)
        pred = pred_all[sel]
    tgt = feat[:, 1:][sel]
    pred_d = pred.detach().requires_grad_(train)
    ce_sum, correct = 0.0, 0
    for s in range(0, n, chunk):
        p = pred_d[s:s + chunk]
        with torch.no_grad():
            t_logits = tgt[s:s + chunk] @ lm_w.T
            t_prob = t_logits.softmax(-1)
            t_top = t_logits.argmax(-1)
        with torch.set_grad_enabled(train):
            logits = p @ lm_w.T
            ce = -(t_prob * logits.log_softmax(-1)).sum()
            if train:
                (ce * (ce_weight / n)).backward()
        correct += int((logits.detach().argmax(-1) == t_top).sum())
        ce_sum += float(ce.detach())
    with torch.set_grad_enabled(train):
        vloss = F.smooth_l1_loss(pred, tgt)
    if train:
        torch.autograd.backward([vloss, pred], [torch.ones_like(vloss), pred_d.grad])
    ce_mean = ce_sum / n
    return {"n": n, "correct": correct, "vloss": float(vloss.detach()), "ce": ce_mean,
            "loss": float(vloss.detach()) + ce_weight * ce_mean}


def _batches(seq_ids: list[int], store: FeatureStore, batch_size: int,
             rng: random.Random) -> list[list[int]]:
    """Shuffled batches of similar lengths (sorted within windows of 8 batches)."""
    ids = list(seq_ids)
    rng.shuffle(ids)
    out = []
    win = batch_size * 8
    for w in range(0, len(ids), win):
        chunk = sorted(ids[w:w + win], key=lambda i: int(store.index[i, 1]))
        out.extend(chunk[k:k + batch_size] for k in range(0, len(chunk), batch_size))
    rng.shuffle(out)
    return out


def evaluate(head: EagleHead, store: FeatureStore, seq_ids: list[int], embed_w, lm_w, *,
             batch_size: int = 8) -> dict:
    head.eval()
    n = correct = 0
    vl = ce = 0.0
    with torch.no_grad():
        for b in range(0, len(seq_ids), batch_size):
            tok, feat, lens, plens = store.batch(seq_ids[b:b + batch_size])
            r = head_step(head, embed_w, lm_w, tok, feat, lens, plens, train=False)
            if r["n"]:
                n += r["n"]
                correct += r["correct"]
                vl += r["vloss"] * r["n"]
                ce += r["ce"] * r["n"]
    head.train()
    return {"positions": n, "top1": correct / max(n, 1), "vloss": vl / max(n, 1),
            "ce": ce / max(n, 1)}


def _lr_at(step: int, total: int, lr: float) -> float:
    warm = max(1, min(100, total // 20))
    if step < warm:
        return lr * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def train_head(model, store: FeatureStore, out: Path, args: TrainArgs) -> dict:
    cfg = target_head_config(model)
    embed_w = model.get_input_embeddings().weight.detach().float()
    lm_w = model.get_output_embeddings().weight.detach().float()
    S = len(store)
    n_hold = max(1, math.ceil(S * args.holdout)) if S >= 2 else 0
    train_ids, hold_ids = list(range(S - n_hold)), list(range(S - n_hold, S))
    head = init_head(model, cfg, args.init, args.seed)
    head.train()
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.0)
    rng = random.Random(args.seed)
    steps_per_epoch = math.ceil(len(train_ids) / args.batch_size)
    total_steps = steps_per_epoch * args.epochs
    start_epoch, step, history = 0, 0, []
    ckpt_path = out / CHECKPOINT_FILE
    resumed = False
    if args.resume and ckpt_path.exists():
        ck = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        if ck.get("config") != asdict(cfg):
            raise TrainError(f"{ckpt_path}: checkpoint of another head config; remove it or "
                             f"drop --resume")
        head.load_state_dict(ck["head"])
        opt.load_state_dict(ck["optimizer"])
        start_epoch, step, history = ck["epoch"], ck["step"], ck["history"]
        torch.set_rng_state(ck["torch_rng"])
        rng.setstate(_rng_state_from_list(ck["py_rng"]))
        resumed = True
    else:
        torch.manual_seed(args.seed)
    from tqdm import tqdm

    t0 = time.time()
    init_eval = None
    if start_epoch == 0 and hold_ids:
        init_eval = evaluate(head, store, hold_ids, embed_w, lm_w, batch_size=args.batch_size)
    last_epoch = args.epochs if args.stop_after is None else min(args.epochs, args.stop_after)
    for epoch in range(start_epoch, last_epoch):
        batches = _batches(train_ids, store, args.batch_size, rng)
        bar = tqdm(batches, desc=f"epoch {epoch + 1}/{args.epochs}", disable=not args.progress)
        n = correct = 0
        loss_sum = 0.0
        te = time.time()
        for b in bar:
            tok, feat, lens, plens = store.batch(b)
            for g in opt.param_groups:
                g["lr"] = _lr_at(step, total_steps, args.lr)
            opt.zero_grad(set_to_none=True)
            r = head_step(head, embed_w, lm_w, tok, feat, lens, plens, noise=args.noise,
                          ce_weight=args.ce_weight)
            if not r["n"]:
                continue
            torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
            opt.step()
            step += 1
            n += r["n"]
            correct += r["correct"]
            loss_sum += r["loss"] * r["n"]
            bar.set_postfix(loss=f"{loss_sum / n:.3f}", acc=f"{correct / n:.3f}")
        bar.close()
        ev = evaluate(head, store, hold_ids, embed_w, lm_w, batch_size=args.batch_size) \
            if hold_ids else None
        history.append({"epoch": epoch + 1, "train_loss": loss_sum / max(n, 1),
                        "train_top1": correct / max(n, 1), "positions": n,
                        "seconds": round(time.time() - te, 1), "heldout": ev})
        if args.progress:
            print(f"epoch {epoch + 1}: train loss {loss_sum / max(n, 1):.4f} top-1 "
                  f"{correct / max(n, 1):.3f}" + (f"; held-out top-1 {ev['top1']:.3f}" if ev
                                                   else ""), flush=True)
        tmp = ckpt_path.with_name(ckpt_path.name + ".tmp")
        torch.save({"head": head.state_dict(), "optimizer": opt.state_dict(),
                    "epoch": epoch + 1, "step": step, "history": history,
                    "config": asdict(cfg), "torch_rng": torch.get_rng_state(),
                    "py_rng": _rng_state_to_list(rng.getstate())}, tmp)
        os.replace(tmp, ckpt_path)
    final = history[-1]["heldout"] if history else None
    save_head(head, cfg, out / HEAD_DIR, extra_config={"specplug_train": {
        "target": os.path.abspath(args.target or ""), "epochs": args.epochs,
        "train_sequences": len(train_ids), "heldout_sequences": len(hold_ids),
        "heldout_top1": None if final is None else round(final["top1"], 4)}})
    return {"resumed": resumed, "train_s": round(time.time() - t0, 1),
            "train_sequences": len(train_ids), "heldout_sequences": len(hold_ids),
            "initial_heldout": init_eval, "history": history,
            "heldout_top1": None if final is None else final["top1"]}


def _rng_state_to_list(state) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _rng_state_from_list(state) -> tuple:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


# --------------------------------------------------------------------------


def run(args: TrainArgs) -> dict:
    """All stages; returns (and writes to ``report.json``) timings and accuracy."""
    if args.target is None:
        from ..models import default_model_path

        args.target = default_model_path()
    if not Path(args.target).is_dir():
        raise TrainError(f"--target {args.target}: no such model folder (no model hub is used)")
    for name in ("num_prompts", "max_tokens", "epochs", "batch_size"):
        if getattr(args, name) < 1:
            raise TrainError(f"--{name.replace('_', '-')} must be at least 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = load_prompt_texts(args.prompts)[:args.num_prompts]
    report: dict[str, Any] = {"args": {k: v for k, v in asdict(args).items() if k != "extra"}}
    t = time.time()
    report["generate"] = generate_data(args.target, prompts, out, args.max_tokens,
                                       max_model_len=args.max_model_len,
                                       progress=args.progress)
    report["generate"]["wall_s"] = round(time.time() - t, 1)
    if args.only_data:
        _write_json(out / REPORT_FILE, report)
        return report
    rows = read_data(out)
    torch.manual_seed(args.seed)
    t = time.time()
    model = load_target(args.target)
    report["features"] = extract_features(model, rows, out, data_sha=_file_sha(out / DATA_FILE),
                                          progress=args.progress)
    report["features"]["wall_s"] = round(time.time() - t, 1)
    store = FeatureStore(out)
    t = time.time()
    report["train"] = train_head(model, store, out, args)
    report["train"]["wall_s"] = round(time.time() - t, 1)
    report["head"] = str((out / HEAD_DIR).resolve())
    # token frequencies of the target's answers: the head's draft vocabulary
    from .draft_vocab import count_tokens, load_draft_vocab, write_draft_vocab

    vocab = int(model.config.vocab_size)
    write_draft_vocab(out / HEAD_DIR, count_tokens((r["output_ids"] for r in rows), vocab),
                      f"target answers to {len(rows)} training prompts")
    report["draft_vocab_tokens"] = int(len(load_draft_vocab(out / HEAD_DIR, vocab)))
    _write_json(out / REPORT_FILE, report)
    return report
