"""Stage A of the tiny pair: corpus (A1), tokenizer (A2), target training (A3).

Writes, below --root (the repository root layout, later packed by run_stage_a.sh):
  models/tiny-target/   config.json, generation_config.json, model-*.safetensors (+ index),
                        tiktoken.model, tokenizer_config.json                (bf16, sharded)
  build-tiny/stage_a/   prompts_train.npy (N, 256) uint16, prompts_heldout.npy (M, 256) uint16,
                        heldout_val.npy (held-out token stream, capped), stage_a.json (metrics)
Every step logs with flush; training stops at a wall-clock deadline and still saves.
Usage: python3 tools/tiny/stage_a.py --root DIR [--smoke] [--t0 EPOCH] [--budget-s S] [--standin]
"""
import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from common import (N_MERGEABLE, KIMI_PAT, NanGuard, TokMeta, log, make_encoding, now, python_info,  # noqa: E402
                    ranks_from_hf_merges, read_tiktoken, set_t0, tokenizer_config,
                    train_bpe_python, write_json, write_tiktoken)
import corpus  # noqa: E402

SEQ = 512
PROMPT_WIN = 256


def train_tokenizer(texts, n_mergeable, deadline, allow_python=False):
    """Byte-level BPE with the Kimi pre-tokenizer -> ranked byte tokens (len <= n_mergeable)."""
    try:
        if allow_python and os.environ.get("TINY_FORCE_PY_BPE"):
            raise ImportError("forced python BPE")
        from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(KIMI_PAT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        trainer = trainers.BpeTrainer(vocab_size=n_mergeable + 64, min_frequency=2,
                                      show_progress=False, special_tokens=[],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        t = time.time()
        tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
        merges = json.loads(tok.to_str())["model"]["merges"]
        ranked = ranks_from_hf_merges(merges, n_mergeable)
        log(f"tokenizer: HF tokenizers BPE trained in {time.time() - t:.1f}s, {len(merges)} merges "
            f"-> {len(ranked)} ranks")
        return ranked, "hf-tokenizers"
    except Exception as e:  # noqa: BLE001 - any failure falls back to the pure-Python trainer
        log(f"tokenizer: HF tokenizers path unavailable ({type(e).__name__}: {e}); "
            f"using the pure-Python BPE trainer")
    small, total = [], 0
    for t in texts:
        small.append(t)
        total += len(t)
        if total > 6_000_000:
            break
    ranked = train_bpe_python(small, n_mergeable, deadline_s=deadline)
    log(f"tokenizer: python BPE -> {len(ranked)} ranks from {total / 1e6:.1f} MB")
    return ranked, "python-bpe"


def encode_docs(enc, texts, meta, threads, deadline=None):
    """[BOS] doc [EOS] for every text, concatenated -> uint16 numpy stream.
    Stops early (keeping what is encoded) once `deadline` (seconds since t0) has passed."""
    parts = []
    bos = np.array([meta.bos], np.uint16)
    eos = np.array([meta.eos], np.uint16)
    chunk = 1024
    for i in range(0, len(texts), chunk):
        if deadline is not None and now() > deadline:
            log(f"A2: tokenization deadline reached after {i} of {len(texts)} files")
            break
        batch = texts[i:i + chunk]
        try:
            ids = enc.encode_ordinary_batch(batch, num_threads=threads)
        except TypeError:
            ids = [enc.encode_ordinary(t) for t in batch]
        for x in ids:
            parts += [bos, np.asarray(x, dtype=np.uint16), eos]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


def verify_tokenizer(enc, meta, held, ranks):
    """Round trips on held-out text, special ids, vocabulary size. Raises on failure."""
    if len(ranks) + len(meta.specials) != meta.vocab_size:
        raise RuntimeError("vocab size mismatch")
    n_vocab = getattr(enc, "n_vocab", None)
    if n_vocab is not None and n_vocab != meta.vocab_size:
        raise RuntimeError(f"tiktoken n_vocab {n_vocab} != {meta.vocab_size}")
    bad, nbytes, ntok = 0, 0, 0
    for t in held[:300]:
        ids = enc.encode_ordinary(t)
        if enc.decode_bytes(ids) != t.encode("utf-8"):
            bad += 1
        nbytes += len(t.encode("utf-8"))
        ntok += len(ids)
    for name, tid in meta.specials.items():
        got = enc.encode(name, allowed_special="all")
        if got != [tid]:
            raise RuntimeError(f"special {name} encodes to {got}, expected [{tid}]")
    probe = "def f(x):\n    return x  # Kimi's 中文、日本語 ÄÖ 12345 \u00a0\n\n"
    if enc.decode(enc.encode_ordinary(probe)) != probe:
        raise RuntimeError("probe string does not round-trip")
    if bad:
        raise RuntimeError(f"{bad} held-out files do not round-trip")
    bpt = nbytes / max(ntok, 1)
    log(f"tokenizer verified: {min(len(held), 300)} held-out files round-trip, "
        f"{bpt:.2f} bytes/token, specials {dict(list(meta.specials.items())[:3])}...")
    return bpt


def windows(stream, n, length, seed):
    rng = np.random.default_rng(seed)
    if len(stream) <= length + 1:
        raise RuntimeError(f"token stream too short ({len(stream)}) for windows of {length}")
    offs = np.sort(rng.integers(0, len(stream) - length - 1, size=n))
    return np.stack([stream[o:o + length] for o in offs]).astype(np.uint16)


def eval_loss(model, val, V, device, batch=32, autocast=True):
    import torch
    import torch.nn.functional as F
    model.eval()
    tot, cnt = 0.0, 0
    with torch.no_grad():
        for i in range(0, val.shape[0], batch):
            w = torch.from_numpy(val[i:i + batch].astype(np.int64)).to(device)
            x, y = w[:, :-1], w[:, 1:]
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16,
                                enabled=autocast and device.type == "cuda"):
                logits = model(input_ids=x).logits
            loss = F.cross_entropy(logits.float().reshape(-1, V), y.reshape(-1), reduction="sum")
            tot += float(loss)
            cnt += y.numel()
    model.train()
    return tot / max(cnt, 1)


def train_target(args, meta, train_stream, val_windows, device, deadline):
    import torch
    import torch.nn.functional as F
    from dflash import lr_at
    import target as tgt
    if args.standin:
        model = tgt.StandInLM(meta.vocab_size).to(device)
    else:
        model = tgt.new_hf_model(meta, device)
    V = meta.vocab_size
    n_params = sum(p.numel() for p in model.parameters())
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "embed" in name or "norm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    balancer = tgt.BiasBalancer(model, tgt.TARGET_ARCH["num_experts_per_tok"])
    guard = NanGuard(model, groups, args, device)
    opt = guard.make_opt()
    data = torch.from_numpy(train_stream.astype(np.int32)).to(device)
    N = data.shape[0]
    ar = torch.arange(SEQ + 1, device=device)
    B = args.batch
    g = torch.Generator(device=device)
    g.manual_seed(1)
    model.train()
    t_start = time.time()
    rel_start = now()
    t_end_abs = deadline
    step, seen, last_loss = 0, 0, float("nan")
    log(f"A3: training {n_params / 1e6:.2f} M params, batch {B}x{SEQ}, lr {args.lr}, "
        f"stream {N / 1e6:.1f} M tokens, until t={deadline:.0f}s")
    while True:
        if now() >= t_end_abs or (args.max_steps and step >= args.max_steps):
            break
        frac = (now() - rel_start) / max(t_end_abs - rel_start, 1e-6)
        lr = lr_at(frac, step, args.lr, args.warmup) * guard.lr_scale
        for grp in opt.param_groups:
            grp["lr"] = lr
        idx = torch.randint(0, N - SEQ - 1, (B,), device=device, generator=g)
        w = data[idx[:, None] + ar].long()
        x, y = w[:, :-1], w[:, 1:]
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16,
                            enabled=device.type == "cuda"):
            logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.float().reshape(-1, V), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        balancer.update()
        step += 1
        seen += B * SEQ
        if step == 1 or step % args.log_every == 0:
            last_loss = float(loss)
            if not math.isfinite(last_loss):
                opt = guard.rollback(opt)
                continue
            guard.snapshot()
            el = time.time() - t_start
            log(f"A3 step {step} loss {last_loss:.4f} lr {lr:.2e} frac {frac:.3f} "
                f"{seen / 1e6:.1f} M tok, {seen / max(el, 1e-6) / 1e3:.0f} k tok/s, "
                f"last-router load max/mean {balancer.imbalance():.2f}")
    balancer.close()
    if step:
        guard.finish(loss)
    el = time.time() - t_start
    final_loss = float(loss) if step else float("nan")
    log(f"A3: done {step} steps, {seen / 1e6:.1f} M tokens in {el:.0f}s, last loss {final_loss:.4f}")
    val = eval_loss(model, val_windows, V, device)
    log(f"A3: held-out loss (fp32 master, bf16 autocast) {val:.4f} nats/token")
    return model, {"steps": step, "tokens": seen, "train_seconds": el, "last_train_loss": final_loss,
                   "val_loss_master": val, "params": n_params,
                   "epochs": seen / max(N, 1)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True, help="output root (repo layout)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--standin", action="store_true", help="local test without transformers")
    ap.add_argument("--local-fallbacks", action="store_true",
                    help="local tests: allow the pure-Python tokenizer paths without tiktoken")
    ap.add_argument("--t0", type=float, default=None, help="epoch seconds the command started")
    ap.add_argument("--budget-s", type=float, default=430.0, help="python wall budget from t0")
    ap.add_argument("--reserve-s", type=float, default=45.0, help="time kept for eval+save")
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    if args.t0:
        set_t0(args.t0)
    import torch
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    log(f"stage A start: {python_info()}, torch {torch.__version__}, device {dev}, "
        f"smoke={args.smoke}, standin={args.standin}")
    if dev.type == "cuda":
        log(f"GPU: {torch.cuda.get_device_name(0)}")
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if args.smoke:
        max_train, max_held, tok_bytes = 3_000_000, 400_000, 3_000_000
        n_prompts, n_held_prompts = 512, 64
        args.batch = min(args.batch, 8)
        args.max_steps = args.max_steps or 30
        args.log_every = 10
        args.warmup = 5
    else:
        max_train, max_held, tok_bytes = 240_000_000, 3_000_000, 24_000_000
        n_prompts, n_held_prompts = 16384, 512
    budget_end = args.budget_s
    tdir = os.path.join(args.root, "models", "tiny-target")
    wdir = os.path.join(args.root, "build-tiny", "stage_a")
    os.makedirs(wdir, exist_ok=True)
    metrics = {"smoke": args.smoke, "python": python_info(), "torch": torch.__version__}

    # A1 ------------------------------------------------------------------------------------
    train_texts, held_texts, cstats = corpus.collect(max_train, max_held)
    metrics["corpus"] = cstats
    if len(train_texts) < 20 or len(held_texts) < 3:
        raise RuntimeError(f"corpus too small: {len(train_texts)} train / {len(held_texts)} held-out")

    # A2 ------------------------------------------------------------------------------------
    sample, total = [], 0
    for t in train_texts:
        sample.append(t)
        total += len(t)
        if total >= tok_bytes:
            break
    log(f"A2: training the tokenizer on {len(sample)} files ({total / 1e6:.1f} MB)")
    ranked, how = train_tokenizer(sample, N_MERGEABLE, deadline=budget_end * 0.35,
                                  allow_python=args.standin)
    meta = TokMeta(len(ranked))
    if meta.vocab_size != 8192:
        log(f"WARNING: vocabulary is {meta.vocab_size}, not 8192 (BPE ran out of merges)")
    tokd = os.path.join(wdir, "tokenizer")
    os.makedirs(tokd, exist_ok=True)
    tk_path = os.path.join(tokd, "tiktoken.model")
    write_tiktoken(tk_path, ranked)
    write_json(os.path.join(tokd, "tokenizer_config.json"), tokenizer_config(meta, 2048))
    ranks = read_tiktoken(tk_path)
    enc = make_encoding(ranks, meta, allow_python_fallback=args.standin or args.local_fallbacks)
    bpt = verify_tokenizer(enc, meta, held_texts, ranks)
    threads = max(1, min(16, os.cpu_count() or 1))
    t = time.time()
    train_stream = encode_docs(enc, train_texts, meta, threads, deadline=budget_end * 0.4)
    held_stream = encode_docs(enc, held_texts, meta, threads)
    log(f"A2: tokenized train {len(train_stream) / 1e6:.2f} M tokens, held-out "
        f"{len(held_stream) / 1e6:.3f} M tokens in {time.time() - t:.1f}s ({threads} threads)")
    del train_texts
    metrics["tokenizer"] = {"method": how, "n_mergeable": meta.n_mergeable,
                            "vocab_size": meta.vocab_size, "bytes_per_token_heldout": bpt,
                            "specials": meta.specials, "train_tokens": int(len(train_stream)),
                            "heldout_tokens": int(len(held_stream))}

    # prompts for stage B ----------------------------------------------------------------------
    np.save(os.path.join(wdir, "prompts_train.npy"), windows(train_stream, n_prompts, PROMPT_WIN, 11))
    np.save(os.path.join(wdir, "prompts_heldout.npy"),
            windows(held_stream, n_held_prompts, PROMPT_WIN, 12))
    n_val = max(1, min(16 if args.smoke else 256, len(held_stream) // (SEQ + 1)))
    val = held_stream[:n_val * (SEQ + 1)].reshape(n_val, SEQ + 1)
    np.save(os.path.join(wdir, "heldout_val.npy"), val)
    log(f"A2: wrote prompts and {n_val} validation windows of {SEQ + 1}")

    # A3 ------------------------------------------------------------------------------------
    train_deadline = budget_end - args.reserve_s
    model, tstats = train_target(args, meta, train_stream, val, dev, train_deadline)
    metrics["train"] = tstats
    import target as tgt
    tok_files = [tk_path, os.path.join(tokd, "tokenizer_config.json")]
    if args.standin:
        model.save(tdir, tok_files)
        sizes = {f: os.path.getsize(os.path.join(tdir, f)) for f in os.listdir(tdir)}
    else:
        sizes = tgt.save_hf_model(model, tdir, tok_files)
    metrics["target_files"] = sizes
    metrics["target_bytes"] = sum(sizes.values())
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    reloaded, is_hf = tgt.load_any(tdir, dev, torch.float32)
    if is_hf:
        metrics["router_bias_sync"] = tgt.sync_router_bias_from_files(reloaded, tdir)
    metrics["val_loss_bf16_checkpoint_fp32"] = eval_loss(reloaded, val, meta.vocab_size, dev,
                                                         autocast=False)
    log(f"A3: held-out loss of the saved bf16 checkpoint (fp32 compute): "
        f"{metrics['val_loss_bf16_checkpoint_fp32']:.4f} nats/token")
    metrics["t_end"] = now()
    write_json(os.path.join(wdir, "stage_a.json"), metrics)
    print("\n==== stage A summary ====", flush=True)
    rows = [
        ("corpus train / held-out files", f"{cstats['train_files']} / {cstats['heldout_files']}"),
        ("corpus train MiB", f"{cstats['train_bytes'] / 2**20:.1f}"),
        ("tokenizer", f"{how}, {meta.vocab_size} ids ({meta.n_mergeable} mergeable)"),
        ("bytes/token (held-out)", f"{bpt:.3f}"),
        ("train tokens in stream", f"{len(train_stream) / 1e6:.1f} M"),
        ("target params", f"{tstats['params'] / 1e6:.2f} M"),
        ("steps / tokens seen", f"{tstats['steps']} / {tstats['tokens'] / 1e6:.1f} M"),
        ("tokens/s", f"{tstats['tokens'] / max(tstats['train_seconds'], 1e-6) / 1e3:.0f} k"),
        ("val loss (master, nats/tok)", f"{tstats['val_loss_master']:.4f}"),
        ("val loss (bf16 ckpt, fp32)", f"{metrics['val_loss_bf16_checkpoint_fp32']:.4f}"),
        ("target on disk", f"{metrics['target_bytes'] / 2**20:.1f} MiB"),
        ("wall", f"{now():.0f} s"),
    ]
    for k, v in rows:
        print(f"  {k:32s} {v}", flush=True)


if __name__ == "__main__":
    main()
