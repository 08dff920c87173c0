"""CPU self-test of the tiny-pair tooling parts that do not need transformers or a GPU.

Covers: the DDTree builder (worked example of ddtree-dflash.md 1.6 and a brute-force optimality
check), the greedy walk, the DFlash mask semantics (context strictly before the anchor, blocks
mutually invisible, many-block training forward == one-block inference forward), the block loss,
safetensors and tiktoken.model round trips, HF-merge -> rank conversion, the pure-Python BPE, and
the speculative loop: real per-path verification with a stand-in target must reproduce plain
greedy token for token and agree with the oracle tau.
Run: OMP_NUM_THREADS=1 /usr/bin/python3 tools/tiny/selftest.py    (prints "N passed, N failed")
"""
import itertools
import math
import os
import random
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import common  # noqa: E402
import ddtree  # noqa: E402
import dflash  # noqa: E402
import target as tgt  # noqa: E402

PASSED, FAILED = 0, 0


def check(cond, what):
    global PASSED, FAILED
    if cond:
        PASSED += 1
    else:
        FAILED += 1
        print(f"FAIL: {what}", flush=True)


def test_tree_example():
    lp = [[math.log(.6), math.log(.3), math.log(.1)], [math.log(.7), math.log(.2), math.log(.1)],
          [math.log(.8), math.log(.1), math.log(.1)]]
    ids = [[ord("a"), ord("b"), ord("c")], [ord("d"), ord("e"), ord("f")],
           [ord("g"), ord("h"), ord("i")]]
    tok, par, dep = ddtree.build_tree(lp, ids, 5)
    check([chr(t) for t in tok[1:]] == list("adgbd"), f"example tokens {tok}")
    check(par == [-1, 0, 1, 2, 0, 4], f"example parents {par}")
    check(dep == [0, 1, 2, 3, 1, 2], f"example depths {dep}")
    ch = ddtree.children_map(tok, par)
    post = {0: ord("b"), 4: ord("d"), 5: ord("x")}
    acc, bonus = ddtree.walk(ch, lambda i: post.get(i, -1))
    check(acc == [0, 4, 5] and bonus == ord("x"), f"walk {acc} {bonus}")


def test_tree_optimal():
    rng = random.Random(5)
    for trial in range(40):
        L, K = rng.randint(1, 4), rng.randint(1, 4)
        lp, ids = [], []
        for d in range(L):
            p = sorted([rng.random() + 1e-3 for _ in range(K)], reverse=True)
            s = sum(p) * (1 + rng.random())
            lp.append([math.log(x / s) for x in p])
            ids.append(rng.sample(range(50), K))
        B = rng.randint(1, 12)
        tok, par, dep = ddtree.build_tree(lp, ids, B)
        # brute force: all rank tuples of length 1..L, best B scores
        scores = []
        for d in range(1, L + 1):
            for r in itertools.product(range(K), repeat=d):
                scores.append(sum(lp[i][r[i]] for i in range(d)))
        scores.sort(reverse=True)
        best = sum(math.exp(s) for s in scores[:B])
        got_scores = []
        for i in range(1, len(tok)):
            s, j = 0.0, i
            path = []
            while j != 0:
                path.append(j)
                j = par[j]
            for n in path:
                s += lp[dep[n] - 1][ids[dep[n] - 1].index(tok[n])]
            got_scores.append(s)
        got = sum(math.exp(s) for s in got_scores)
        check(len(tok) - 1 == min(B, len(scores)), f"tree size trial {trial}")
        check(abs(got - best) < 1e-9, f"tree optimality trial {trial}: {got} vs {best}")
        check(all(par[i] < i for i in range(1, len(par))), "parents precede children")
        ddtree.children_map(tok, par)  # raises on duplicate siblings


def small_cfg(H=32, vocab=50, layers=2, taps=(0, 1)):
    return dflash.make_config(hidden_size=H, n_layers=layers, n_heads=4, n_kv_heads=2, head_dim=8,
                              intermediate_size=48, n_target_layers=4, target_layer_ids=list(taps),
                              mask_token_id=vocab - 1, vocab_size=vocab)


def test_dflash_mask():
    torch.manual_seed(0)
    cfg = small_cfg()
    d = dflash.DFlashDrafter(cfg).double()
    for p in d.parameters():  # non-trivial norm weights
        p.data.add_(torch.randn_like(p) * 0.05)
    B, T, H, V = 2, 30, 32, 50
    feats = torch.randn(B, T, 2 * H, dtype=torch.float64)
    emb = torch.randn(V, H, dtype=torch.float64)
    anchors = torch.tensor([[3, 10, 17], [5, 6, 20]])
    atok = torch.randint(0, V - 1, (B, 3))
    out = d(feats, anchors, atok, emb)
    # one block at a time == many blocks at once
    for b in range(3):
        one = d(feats, anchors[:, b:b + 1], atok[:, b:b + 1], emb)
        check(torch.allclose(one[:, 0], out[:, b], atol=1e-10), f"block {b} independent of others")
    # features at/after the anchor are invisible; before it they matter
    f2 = feats.clone()
    f2[0, 10:] += 1.0
    out2 = d(f2, anchors, atok, emb)
    check(torch.allclose(out2[0, 0], out[0, 0], atol=1e-10), "context at >= anchor invisible (b0)")
    check(torch.allclose(out2[0, 1], out[0, 1], atol=1e-10), "context at == anchor invisible (b1)")
    check(not torch.allclose(out2[0, 2], out[0, 2], atol=1e-6), "context before anchor visible")
    # bidirectional inside the block: the anchor token changes every block position
    at2 = atok.clone()
    at2[1, 1] = (at2[1, 1] + 1) % (V - 1)
    out3 = d(feats, anchors, at2, emb)
    check(all(not torch.allclose(out3[1, 1, k], out[1, 1, k]) for k in range(8)),
          "anchor reaches every block position")
    # mask shape and content
    m = dflash.build_mask(torch.tensor([[2, 5]]), 6, 8)
    check(tuple(m.shape) == (1, 1, 16, 22), "mask shape")
    check(m[0, 0, 0, :6].tolist() == [True, True, False, False, False, False], "mask ctx row")
    check(m[0, 0, 9, 6:].tolist() == [False] * 8 + [True] * 8, "mask block row")
    # anchors
    g = torch.Generator().manual_seed(1)
    a = dflash.sample_anchors(torch.tensor([10, 20]), 40, 5, 8, generator=g)
    check(bool((a[0] >= 10).all() and (a[1] >= 20).all() and (a <= 32).all()), "anchor range")
    check(all(len(set(r.tolist())) == 5 for r in a), "anchors distinct")


def test_loss_and_io():
    torch.manual_seed(1)
    cfg = small_cfg()
    d = dflash.DFlashDrafter(cfg)
    B, T, H, V = 4, 40, 32, 50
    feats = torch.randn(B, T, 2 * H)
    emb = torch.randn(V, H)
    head = torch.randn(V, H) * 0.1
    seq = torch.randint(0, V - 1, (B, T))
    starts = torch.tensor([5, 8, 10, 3])
    opt = torch.optim.Adam(d.parameters(), lr=3e-3)
    anchors = dflash.sample_anchors(starts, T, 4, 8, generator=torch.Generator().manual_seed(2))
    first = None
    for _ in range(60):
        loss, acc = dflash.block_loss(d, feats, seq, anchors, emb, head)
        if first is None:
            first = float(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    check(float(loss) < first * 0.7, f"block loss decreases on a fixed batch {first} -> {float(loss)}")
    check(acc.shape == (7,), "per-position accuracy shape")
    with tempfile.TemporaryDirectory() as tmp:
        dflash.save_drafter(d, tmp)
        cfg2 = common.read_json(os.path.join(tmp, "config.json"))
        check(cfg2["dflash_config"]["mask_token_id"] == V - 1, "config mask id")
        sd = common.load_safetensors(os.path.join(tmp, "model.safetensors"))
        check(sorted(sd) == dflash.expected_weight_names(cfg), "z-lab weight names")
        check(all(v.dtype == torch.bfloat16 for v in sd.values()), "bf16 weights")
        d2 = dflash.load_drafter(tmp)
        ref = {k: v.to(torch.bfloat16).float() for k, v in d.state_dict().items()}
        check(all(torch.equal(ref[k], v) for k, v in d2.state_dict().items()), "reload == bf16 rounding")


def test_tokenizer_io():
    texts = ["def foo(bar):\n    return bar + 1\n", "class Baz:\n    x = 'it''s'\n"] * 50
    ranked = common.train_bpe_python(texts, 300)
    check(len(ranked) > 256 and ranked[:256] == [bytes([b]) for b in range(256)], "python BPE ranks")
    meta = common.TokMeta(len(ranked))
    with tempfile.TemporaryDirectory() as tmp:
        p = os.path.join(tmp, "tiktoken.model")
        common.write_tiktoken(p, ranked)
        ranks = common.read_tiktoken(p)
        check(len(ranks) == len(ranked), "tiktoken.model round trip")
    enc = common.PyTiktoken(ranks, meta.specials)
    s = "def foo(x):  # 中文、日本語 ÄÖ 12345\n\n\treturn x's\n"
    ids = enc.encode_ordinary(s)
    check(enc.decode(ids) == s, "PyTiktoken round trip")
    check(enc.encode("[UNK]", allowed_special="all") == [meta.mask], "mask special id")
    check(meta.vocab_size == len(ranked) + 16 and meta.pad == meta.vocab_size - 1, "special layout")
    # HF merge list -> ranks: parts must exist, duplicates are skipped
    b2u = common.bytes_to_unicode()
    u = lambda bs: "".join(b2u[b] for b in bs)  # noqa: E731
    merges = [[u(b"a"), u(b"b")], u(b"ab") + " " + u(b"c"), [u(b"b"), u(b"c")],
              [u(b"a"), u(b"bc")], [u(b" "), u(b"x")]]
    r = common.ranks_from_hf_merges(merges, 1000)
    check(r[256:] == [b"ab", b"abc", b"bc", b" x"], f"merge conversion {r[256:]}")
    check(common.ranks_from_hf_merges(merges, 258)[256:] == [b"ab", b"abc"], "merge truncation")
    pats = common.compile_kimi_regex().findall("Hello World's 中文、日本語 x=12345\n\n  y")
    check(pats[:3] == ["Hello", " World's", " "] and "中文" in pats and "123" in pats,
          f"Kimi pattern split {pats}")


def test_spec_loop():
    torch.manual_seed(4)
    V, H = 60, 32
    lm = tgt.StandInLM(V, H=H, n_layers=4, nh=2).double().eval()
    target = tgt.Target(lm, [1, 2], is_hf=False)
    cfg = small_cfg(H=H, vocab=V, taps=(1, 2))
    d = dflash.DFlashDrafter(cfg).double().eval()
    dflash.USE_SDPA = False
    P, n_eval = 6, 20
    prompts = torch.randint(0, V - 2, (3, P))
    greedy = target.greedy(prompts, n_eval + 8)
    seqs = torch.cat([prompts, greedy], 1)
    _, feats = target.forward_taps(seqs)
    starts = torch.full((3,), P)
    for kind in ("chain", 4, 16):
        means, rounds, hist = ddtree.oracle_tau(d, feats, seqs, starts, n_eval, target.embed_w,
                                                target.lm_head_w, kind)
        outs, taus = ddtree.verify_loop(d, target, [prompts[i] for i in range(3)], n_eval, kind,
                                        V - 1, "cpu")
        for i in range(3):
            check(outs[i] == greedy[i, :n_eval].tolist(), f"verify == greedy ({kind}, prompt {i})")
            vt = sum(taus[i]) / len(taus[i])
            check(abs(vt - means[i]) < 1e-9, f"verify tau {vt} == oracle tau {means[i]} ({kind})")
    # a drafter that is always right must reach tau = 8 on every full round
    class Perfect:
        block_size = 8

    def perfect_topk(drafter, feats, s, anchor_tok, embed_w, lm_head_w, K):
        B = s.shape[0]
        lp = torch.full((B, 7, K), -5.0)
        lp[:, :, 0] = -0.01
        ids = torch.zeros(B, 7, K, dtype=torch.long)
        for b in range(B):
            for k in range(7):
                ids[b, k, 0] = seqs[b, int(s[b]) + 1 + k]
                for j in range(1, K):
                    ids[b, k, j] = (ids[b, k, 0] + j) % V
        return lp, ids
    orig = ddtree.draft_topk
    ddtree.draft_topk = perfect_topk
    try:
        means, _, hist = ddtree.oracle_tau(Perfect(), feats, seqs, starts, 16, target.embed_w,
                                           target.lm_head_w, 8)
        check(all(abs(m - 8.0) < 1e-9 for m in means), f"perfect drafter tau 8: {means}")
    finally:
        ddtree.draft_topk = orig


def test_sizes_and_taps():
    check(dflash.default_target_layer_ids(61, 6) == [1, 12, 24, 35, 47, 58], "Kimi taps formula")
    check(dflash.default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33], "Qwen3 taps formula")
    n_t = tgt.param_count(tgt.TARGET_ARCH, common.VOCAB_SIZE)
    cfg = dflash.make_config(hidden_size=256, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=64,
                             intermediate_size=768, n_target_layers=6, target_layer_ids=[1, 2, 3],
                             mask_token_id=8190, vocab_size=8192)
    n_d = dflash.count_params(dflash.DFlashDrafter(cfg))
    check(2 * (n_t + n_d) <= 40e6, f"pair fits 40 MB in bf16: {2 * (n_t + n_d) / 1e6:.1f} MB")


def test_bias_balancer():
    class Gate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(4, 3))
            self.register_buffer("e_score_correction_bias", torch.zeros(4))

        def forward(self, x):
            return x @ self.weight.t()

    m = torch.nn.Module()
    m.gate = Gate()
    with torch.no_grad():
        m.gate.weight[0] = torch.tensor([5.0, 0, 0])   # expert 0 always wins
    bal = tgt.BiasBalancer(m, top_k=1, gamma=0.1)
    m.train()
    m.gate(torch.ones(10, 3))
    bal.update()
    b = m.gate.e_score_correction_bias
    check(float(b[0]) < 0 and all(float(b[i]) > 0 for i in (1, 2, 3)), f"balancer direction {b}")
    check(abs(bal.imbalance() - 4.0) < 1e-6, f"imbalance {bal.imbalance()}")
    bal.close()


def main():
    torch.set_num_threads(1)
    for t in (test_tree_example, test_tree_optimal, test_dflash_mask, test_loss_and_io,
              test_tokenizer_io, test_sizes_and_taps, test_bias_balancer, test_spec_loop):
        t()
        print(f"{t.__name__}: done", flush=True)
    print(f"{PASSED} passed, {FAILED} failed", flush=True)
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
