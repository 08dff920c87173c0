"""Stage B of the tiny pair: drafter data (B1), DFlash drafter training (B2), fixtures (B4),
speculative evaluation (B3).

Reads (below --root): models/tiny-target/ and build-tiny/stage_a/{prompts_train,prompts_heldout}.npy.
Writes (below --out-root, default --root):
  models/tiny-dflash/              config.json, model.safetensors (bf16, z-lab names)
  build-tiny/stage_b/stage_b.json  metrics (tau per tree kind, verify check, training curve)
  build-tiny/stage_b/fixtures/dflash_expected.json   reference values for the C engine
B1 regenerates responses with the target (greedy, KV cache, batched prompts of equal length);
B2 trains on random anchors inside the greedy region (labels are the target's own greedy tokens);
B4 and B3 run in float32 from the saved bf16 checkpoints.
Usage: python3 tools/tiny/stage_b.py --root DIR [--out-root DIR] [--smoke] [--t0 EPOCH] [--budget-s S]
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from common import (NanGuard, TokMeta, log, now, python_info, read_json, read_tiktoken,  # noqa: E402
                    set_t0, write_json)


def tok_meta(tdir):
    cfg_path = os.path.join(tdir, "tokenizer_config.json")
    n = read_json(cfg_path).get("num_mergeable_tokens")
    if n is None:
        n = len(read_tiktoken(os.path.join(tdir, "tiktoken.model")))
    return TokMeta(int(n))


def gen_data(target, prompts, plens, T, batch, deadline, device):
    """B1: prompt (first P tokens of a window) + greedy continuation to total length T."""
    import torch
    seqs, starts = [], []
    n_used, b = 0, 0
    t = time.time()
    last = 0.0
    while n_used < prompts.shape[0]:
        if now() + 0.9 * last > deadline:   # do not start a batch that would end well past it
            log(f"B1: generation deadline reached after {n_used} prompts")
            break
        tb = time.time()
        P = plens[b % len(plens)]
        chunk = prompts[n_used:n_used + batch, :P]
        n_used += chunk.shape[0]
        b += 1
        pr = torch.from_numpy(chunk.astype(np.int64)).to(device)
        with torch.no_grad():
            cont = target.greedy(pr, T - P)
        seqs.append(torch.cat([pr, cont], 1).to(torch.int32))
        starts.append(torch.full((pr.shape[0],), P, dtype=torch.int32, device=device))
        last = time.time() - tb
        el = time.time() - t
        tot = sum(s.shape[0] for s in seqs)
        log(f"B1: batch {b} P={P} x{pr.shape[0]} done in {last:.1f}s; {tot} sequences, "
            f"{tot * T / max(el, 1e-6) / 1e3:.0f} k seq-tokens/s")
    if not seqs:
        raise RuntimeError("B1 produced no sequences")
    return torch.cat(seqs, 0), torch.cat(starts, 0)


def compute_feats(target, seqs, batch, dtype):
    import torch
    out = []
    for i in range(0, seqs.shape[0], batch):
        _, f = target.forward_taps(seqs[i:i + batch].long(), want_logits=False)
        out.append(f.to(dtype))
    return torch.cat(out, 0)


def train_drafter(args, drafter, target, seqs, starts, feats, device, deadline):
    import torch
    from dflash import block_loss, lr_at, sample_anchors
    embed_w = target.embed_w.detach().float()
    lm_w = target.lm_head_w.detach().float()
    decay = [p for n, p in drafter.named_parameters() if p.ndim >= 2]
    nodecay = [p for n, p in drafter.named_parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": nodecay, "weight_decay": 0.0}]
    N, T = seqs.shape
    g = torch.Generator(device=device)
    g.manual_seed(2)
    rel_start = now()
    step, curve = 0, []
    log(f"B2: training drafter on {N} sequences of {T}, batch {args.batch} x {args.anchors} blocks, "
        f"lr {args.lr}, until t={deadline:.0f}s")
    loss = None
    guard = NanGuard(drafter, groups, args, device)
    opt = guard.make_opt()
    while now() < deadline and not (args.max_steps and step >= args.max_steps):
        frac = (now() - rel_start) / max(deadline - rel_start, 1e-6)
        lr = lr_at(frac, step, args.lr, args.warmup) * guard.lr_scale
        for grp in opt.param_groups:
            grp["lr"] = lr
        idx = torch.randint(0, N, (args.batch,), device=device, generator=g)
        seq = seqs[idx].long()
        anchors = sample_anchors(starts[idx].long(), T, args.anchors, drafter.block_size, generator=g)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16,
                            enabled=device.type == "cuda"):
            loss, acc = block_loss(drafter, feats[idx], seq, anchors, embed_w, lm_w)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        if step == 1 or step % args.log_every == 0:
            lv = float(loss)
            if not np.isfinite(lv):
                opt = guard.rollback(opt)
                continue
            guard.snapshot()
            accs = [round(float(a), 3) for a in acc]
            curve.append({"step": step, "t": round(now(), 1), "loss": round(lv, 4), "acc": accs})
            log(f"B2 step {step} loss {lv:.4f} lr {lr:.2e} acc@k {accs}")
    guard.finish(loss)
    log(f"B2: done, {step} steps")
    return {"steps": step, "curve": curve, "final_loss": float(loss) if loss is not None else None}


def fixtures(target, drafter, prompts, lens, n_greedy, device, meta):
    """B4: small reference values for the engine's target + DFlash forward (float32)."""
    import torch
    from ddtree import build_tree, draft_topk
    cases = []
    for row, P in zip(prompts, lens):
        ids = torch.from_numpy(row[:P].astype(np.int64)).to(device)[None]
        greedy = target.greedy(ids, n_greedy)[0]
        logits, _ = target.forward_taps(ids)
        lp_t = torch.log_softmax(logits[0, -1].float(), -1)
        tv, ti = lp_t.topk(8)
        full = torch.cat([ids[0], greedy])[None]
        _, feats_full = target.forward_taps(full)
        rounds = []
        for k in (0, 4):                       # first round after prefill, and a later one
            s = P + k                          # anchor position; context = positions < s
            lp, tid = draft_topk(drafter, feats_full, torch.tensor([s], device=device),
                                 full[0, s:s + 1], target.embed_w, target.lm_head_w, 8)
            tokens, parents, depths = build_tree(lp[0].tolist(), tid[0].tolist(), 8)
            rounds.append({
                "anchor_pos": s,
                "anchor_id": int(full[0, s]),
                "context_ids": [int(x) for x in full[0, :s]],
                "taps_last_context_position": [round(float(x), 6) for x in feats_full[0, s - 1]],
                "draft_top8_ids": tid[0].tolist(),
                "draft_top8_logprobs": [[round(float(x), 6) for x in r] for r in lp[0]],
                "ddtree_b8": {"tokens": tokens[1:], "parents": parents, "depths": depths},
            })
        cases.append({
            "prompt_ids": [int(x) for x in ids[0]],
            "greedy_ids": [int(x) for x in greedy],
            "target_top8_after_prompt": {"ids": ti.tolist(),
                                         "logprobs": [round(float(x), 6) for x in tv]},
            "rounds": rounds,
        })
    return {
        "what": "Reference values for the tiny pair, computed in float32 from the bf16 "
                "checkpoints (models/tiny-target, models/tiny-dflash). greedy_ids: plain greedy "
                "continuation (KV cache). Per round: the drafter sees the target taps of "
                "context_ids (positions 0..anchor_pos-1) and the block [anchor_id, mask x 7] at "
                "positions anchor_pos..anchor_pos+7; draft_top8_* are the top-8 of "
                "log_softmax(lm_head(norm(h))) at block positions 1..7 (row k-1 = position k). "
                "taps_last_context_position: concatenated tapped layer outputs at anchor_pos-1. "
                "ddtree_b8: best-first tree (budget 8; ties by lower depth, parent, rank), "
                "tokens of nodes 1..8, parents/depths including the root at index 0.",
        "target_layer_ids": drafter.cfg["dflash_config"]["target_layer_ids"],
        "mask_token_id": drafter.mask_token_id,
        "block_size": drafter.block_size,
        "bos_id": meta.bos,
        "cases": cases,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out-root", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--t0", type=float, default=None)
    ap.add_argument("--budget-s", type=float, default=495.0)
    ap.add_argument("--eval-reserve-s", type=float, default=95.0)
    ap.add_argument("--gen-frac", type=float, default=0.30, help="share of the budget for B1")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=200)
    ap.add_argument("--draft-layers", type=int, default=3)
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    if args.t0:
        set_t0(args.t0)
    import torch
    import dflash
    import ddtree
    import target as tgt
    out_root = args.out_root or args.root
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    log(f"stage B start: {python_info()}, torch {torch.__version__}, device {dev}, smoke={args.smoke}")
    tdir = os.path.join(args.root, "models", "tiny-target")
    adir = os.path.join(args.root, "build-tiny", "stage_a")
    ddir = os.path.join(out_root, "models", "tiny-dflash")
    bdir = os.path.join(out_root, "build-tiny", "stage_b")
    os.makedirs(bdir, exist_ok=True)
    meta = tok_meta(tdir)
    prompts = np.load(os.path.join(adir, "prompts_train.npy"))
    held = np.load(os.path.join(adir, "prompts_heldout.npy"))
    if args.smoke:
        T, plens, gen_batch = 96, [32, 48], 64
        n_eval_prompts, p_eval, n_eval, n_verify, n_verify_new = 4, 32, 24, 2, 16
        args.batch, args.anchors, args.max_steps, args.log_every, args.warmup = 8, 4, 20, 5, 5
        kinds = ["chain", 8, 32]
        prompts = prompts[:256]
    else:
        T, plens, gen_batch = 512, [64, 128, 192, 256], 1024
        n_eval_prompts, p_eval, n_eval, n_verify, n_verify_new = 64, 128, 256, 8, 96
        kinds = ["chain", 32, 8, 16, 64]
    budget = args.budget_s
    if args.smoke:   # step counts, not the clock, bound the smoke run
        gen_deadline, train_deadline, eval_deadline = budget * 0.3, budget * 0.7, budget - 2
    else:
        gen_deadline = budget * args.gen_frac
        train_deadline = budget - args.eval_reserve_s
        eval_deadline = budget - 15
    metrics = {"smoke": args.smoke, "python": python_info(), "torch": torch.__version__}

    # target --------------------------------------------------------------------------------
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True   # B1/B2 only; strict fp32 for B3/B4
        torch.backends.cudnn.allow_tf32 = True
    model, is_hf = tgt.load_any(tdir, dev, torch.float32)
    if is_hf:
        metrics["router_bias_sync"] = tgt.sync_router_bias_from_files(model, tdir)
    n_t = len(model.model.layers)
    H = model.model.embed_tokens.weight.shape[1]
    taps = dflash.default_target_layer_ids(n_t, args.draft_layers)
    target = tgt.Target(model, taps, is_hf)
    log(f"target loaded ({'transformers' if is_hf else 'stand-in'}): {n_t} layers, hidden {H}, "
        f"vocab {target.embed_w.shape[0]}, taps {taps}")
    if target.embed_w.shape[0] != meta.vocab_size:
        raise RuntimeError(f"target vocab {target.embed_w.shape[0]} != tokenizer {meta.vocab_size}")
    # KV-cache greedy must equal recomputation (guards the B1 data and the fixtures).
    pr = torch.from_numpy(held[:2, :40].astype(np.int64)).to(dev)
    g_cache = target.greedy(pr, 12)
    seq = pr
    for _ in range(12):
        nxt = target._call(seq, use_cache=False).logits[:, -1].argmax(-1)
        seq = torch.cat([seq, nxt[:, None]], 1)
    same = bool((seq[:, 40:] == g_cache).all())
    log(f"check: cached greedy == recomputed greedy: {same}")
    metrics["cache_vs_recompute_greedy_equal"] = same

    # B1 ------------------------------------------------------------------------------------
    seqs, starts = gen_data(target, prompts, plens, T, gen_batch, gen_deadline, dev)
    feats = compute_feats(target, seqs, 128 if not args.smoke else 16,
                          torch.bfloat16 if dev.type == "cuda" else torch.float32)
    log(f"B1: {seqs.shape[0]} sequences x {T}, features {tuple(feats.shape)} "
        f"({feats.numel() * feats.element_size() / 2**30:.2f} GiB)")
    metrics["b1"] = {"sequences": int(seqs.shape[0]), "T": T, "prompt_lens": plens,
                     "greedy_tokens": int(sum(T - int(s) for s in starts.tolist()))}

    # B2 ------------------------------------------------------------------------------------
    if is_hf:
        dims = dict(hidden_size=H, n_layers=args.draft_layers, n_heads=4, n_kv_heads=2, head_dim=64,
                    intermediate_size=768)
    else:
        dims = dict(hidden_size=H, n_layers=args.draft_layers, n_heads=2, n_kv_heads=1,
                    head_dim=H // 2, intermediate_size=2 * H)
    cfg = dflash.make_config(**dims, n_target_layers=n_t, target_layer_ids=taps,
                             mask_token_id=meta.mask, vocab_size=meta.vocab_size, block_size=8,
                             rope_theta=50000.0, rms_norm_eps=1e-6,
                             max_position_embeddings=int(getattr(model.config, "max_position_embeddings", 2048))
                             if is_hf else 2048)
    torch.manual_seed(3)
    drafter = dflash.DFlashDrafter(cfg).to(dev)
    log(f"B2: drafter {dflash.count_params(drafter) / 1e6:.2f} M params, config {dims}")
    dflash.USE_SDPA = True
    if args.smoke:   # always run the smoke's few steps, even after a slow B1
        train_deadline = max(train_deadline, now() + 10)
    metrics["b2"] = train_drafter(args, drafter, target, seqs, starts, feats, dev, train_deadline)
    del feats
    dflash.save_drafter(drafter, ddir)
    log(f"B2: saved {ddir}: {sorted(os.listdir(ddir))}, "
        f"{os.path.getsize(os.path.join(ddir, 'model.safetensors')) / 2**20:.2f} MiB")
    try:  # cross-check our safetensors writer with the reference library when it is installed
        from safetensors.torch import load_file
        ref = load_file(os.path.join(ddir, "model.safetensors"))
        ok = sorted(ref) == dflash.expected_weight_names(cfg) and all(
            v.dtype == torch.bfloat16 for v in ref.values())
        log(f"check: safetensors library reads the drafter file, names/dtypes ok: {ok}")
        metrics["safetensors_lib_check"] = ok
    except ImportError:
        log("safetensors library not installed; skipped the cross-check")

    # B4 + B3 in strict float32 from the saved checkpoints -------------------------------------
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dflash.USE_SDPA = False
    drafter = dflash.load_drafter(ddir, torch.float32, dev)
    fx = fixtures(target, drafter, held[:3], [24, 40, 64] if not args.smoke else [16, 24, 32],
                  32, dev, meta)
    write_json(os.path.join(bdir, "fixtures", "dflash_expected.json"), fx)
    log("B4: wrote fixtures/dflash_expected.json")

    n_gen = n_eval + drafter.block_size
    ep = torch.from_numpy(held[:n_eval_prompts, :p_eval].astype(np.int64)).to(dev)
    eg = target.greedy(ep, n_gen)
    eseq = torch.cat([ep, eg], 1)
    _, efeats = target.forward_taps(eseq)
    estarts = torch.full((ep.shape[0],), p_eval, dtype=torch.long, device=dev)
    log(f"B3: {ep.shape[0]} held-out prompts of {p_eval} tokens, {n_eval} new tokens each")
    results = {}
    for kind in kinds:
        r = ddtree.oracle_tau(drafter, efeats, eseq, estarts, n_eval, target.embed_w,
                              target.lm_head_w, kind, deadline=eval_deadline, now=now)
        if r is None:
            log(f"B3: deadline reached before kind {kind} finished")
            break
        means, rounds, hist = r
        results[str(kind)] = {"mean_tau": float(np.mean(means)), "min_prompt_tau": float(min(means)),
                              "max_prompt_tau": float(max(means)), "rounds": int(sum(rounds)),
                              "tau_histogram": hist}
        log(f"B3: {'chain (B=7)' if kind == 'chain' else f'DDTree B={kind}'}: mean tau "
            f"{results[str(kind)]['mean_tau']:.3f} over {len(means)} prompts, hist {hist}")
    metrics["b3_oracle"] = results
    # Real verification on a few prompts: outputs must equal plain greedy token for token.
    vcheck = {}
    for kind in (32, "chain") if not args.smoke else (8,):
        outs, taus = ddtree.verify_loop(drafter, target, [ep[i] for i in range(min(n_verify, ep.shape[0]))],
                                        n_verify_new, kind, meta.pad, dev, deadline=eval_deadline, now=now)
        mism = []
        for i, o in enumerate(outs):
            ref = eg[i, :n_verify_new].tolist()
            if o != ref:
                first = next(j for j in range(n_verify_new) if o[j] != ref[j])
                mism.append({"prompt": i, "first_mismatch": first})
        flat = [t for ts in taus for t in ts]
        vcheck[str(kind)] = {"prompts": len(outs), "new_tokens": n_verify_new, "mismatches": mism,
                             "mean_tau": float(np.mean(flat)) if flat else None}
        log(f"B3 verify {kind}: {len(outs)} prompts, mismatching prompts {len(mism)} {mism}, "
            f"tau {vcheck[str(kind)]['mean_tau']}")
    metrics["b3_verify"] = vcheck
    chain = results.get("chain", {}).get("mean_tau")
    tree32 = results.get("32", {}).get("mean_tau")
    metrics["targets"] = {
        "ddtree32_tau_ge_3": (tree32 is not None and tree32 >= 3.0),
        "ddtree32_over_chain_ge_1.15": (tree32 is not None and chain is not None
                                        and tree32 >= 1.15 * chain),
        "ratio": (tree32 / chain) if (tree32 and chain) else None,
    }
    metrics["drafter_bytes"] = os.path.getsize(os.path.join(ddir, "model.safetensors"))
    metrics["t_end"] = now()
    write_json(os.path.join(bdir, "stage_b.json"), metrics)
    print("\n==== stage B summary ====", flush=True)
    print(f"  {'sequences for drafter':32s} {metrics['b1']['sequences']} x {T}", flush=True)
    print(f"  {'drafter steps':32s} {metrics['b2']['steps']}, final loss {metrics['b2']['final_loss']}", flush=True)
    for k, v in results.items():
        name = "chain (B=7)" if k == "chain" else f"DDTree B={k}"
        print(f"  {'tau ' + name:32s} {v['mean_tau']:.3f}", flush=True)
    for k, v in vcheck.items():
        print(f"  {'verify ' + k + ' mismatches':32s} {len(v['mismatches'])}/{v['prompts']} "
              f"(tau {v['mean_tau']})", flush=True)
    print(f"  {'targets':32s} {metrics['targets']}", flush=True)
    print(f"  {'drafter on disk':32s} {metrics['drafter_bytes'] / 2**20:.2f} MiB", flush=True)
    print(f"  {'wall':32s} {now():.0f} s", flush=True)


if __name__ == "__main__":
    main()
