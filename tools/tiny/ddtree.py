"""DDTree / DFlash-chain reference for evaluating the tiny pair (greedy, batch-1 semantics).

Owns: the best-first tree builder (research notes ddtree-dflash.md section 1.3, Algorithm 1),
the top-1 chain, the greedy acceptance walk (section 2.2), and the speculative loop used by
stage B to measure tau. Two ways to obtain the target's verdict on a tree:

  oracle  - greedy decoding is deterministic, so the target's token at every tree node is the
            plain-greedy continuation whenever the node's path matches it; the walk therefore
            accepts the longest tree path equal to the greedy continuation and the bonus is the
            next greedy token. Exact by the definition of lossless greedy speculative decoding,
            and the drafter's context is the target taps of the greedy sequence.
  verify  - run the target for real: every root-to-leaf path is appended to the committed prefix
            (right-padded, so causal attention keeps the padding invisible), the argmax at every
            node is the posterior, the walk picks the path and the bonus, and the drafter context
            for the next round is the taps that these verify passes produced. Its output is
            compared with plain greedy token for token.

Tie rule of the heap: higher score first, then lower (depth, parent, rank). Scores are fp64 sums
of fp32 log-probabilities, recomputed along the path.
"""
import heapq

import torch


def build_tree(top_lp, top_id, budget):
    """Best-first DDTree of `budget` nodes (root excluded).

    top_lp, top_id: L lists of K floats / ints (per depth, sorted by decreasing log-prob).
    Returns (tokens, parents, depths): lists of length budget+1, index 0 = root
    (token None, parent -1, depth 0); nodes in pop order, so parents[i] < i.
    """
    L = len(top_lp)
    tokens, parents, depths, ranks = [None], [-1], [0], [None]
    if budget <= 0 or L == 0:
        return tokens, parents, depths
    K = min(budget, len(top_lp[0]))
    node_score = [0.0]
    heap = [(-float(top_lp[0][0]), 1, 0, 0)]  # (-score, depth, parent, rank)
    while len(tokens) <= budget and heap:
        negs, d, p, r = heapq.heappop(heap)
        i = len(tokens)
        tokens.append(int(top_id[d - 1][r]))
        parents.append(p)
        depths.append(d)
        ranks.append(r)
        node_score.append(-negs)
        if r + 1 < K:
            s = node_score[p] + float(top_lp[d - 1][r + 1])
            heapq.heappush(heap, (-s, d, p, r + 1))
        if d < L:
            s = -negs + float(top_lp[d][0])
            heapq.heappush(heap, (-s, d + 1, i, 0))
    return tokens, parents, depths


def chain_tree(top_id):
    """The DFlash chain: top-1 token at every depth, as a tree in the same format."""
    L = len(top_id)
    return [None] + [int(top_id[d][0]) for d in range(L)], [-1] + list(range(L)), list(range(L + 1))


def children_map(tokens, parents):
    ch = [dict() for _ in tokens]
    for i in range(1, len(tokens)):
        if tokens[i] in ch[parents[i]]:
            raise ValueError("duplicate sibling token in tree")
        ch[parents[i]][tokens[i]] = i
    return ch


def walk(ch, posterior):
    """Greedy walk: posterior(i) = target token at node i. Returns (accepted nodes incl. root, bonus)."""
    cur, acc = 0, [0]
    nxt = posterior(0)
    while nxt in ch[cur]:
        cur = ch[cur][nxt]
        acc.append(cur)
        nxt = posterior(cur)
    return acc, nxt


def leaf_paths(parents):
    """Root-to-leaf node paths (root excluded) and, per node, (path index, offset in path)."""
    n = len(parents)
    has_child = [False] * n
    for i in range(1, n):
        has_child[parents[i]] = True
    paths, where = [], {0: None}
    for i in range(1, n):
        if has_child[i]:
            continue
        path, j = [], i
        while j != 0:
            path.append(j)
            j = parents[j]
        path.reverse()
        for off, node in enumerate(path):
            where.setdefault(node, (len(paths), off))
        paths.append(path)
    return paths, where


@torch.no_grad()
def draft_topk(drafter, feats, s, anchor_tok, embed_w, lm_head_w, K):
    """One drafter call per row: context = feats[:, :s_i], anchor at s_i.

    feats (B, T, n_taps*H), s (B,) long, anchor_tok (B,) long -> (top_lp, top_id) (B, L, K) on CPU.
    """
    hid = drafter(feats, s[:, None], anchor_tok[:, None], embed_w)     # (B, 1, L1, H)
    logits = torch.nn.functional.linear(hid[:, 0, 1:], lm_head_w).float()
    lp = torch.log_softmax(logits, dim=-1)
    v, i = lp.topk(K, dim=-1)
    return v.cpu(), i.cpu()


def make_tree(kind, top_lp_row, top_id_row):
    """kind: 'chain' or an int budget."""
    if kind == "chain":
        return chain_tree(top_id_row.tolist())
    return build_tree(top_lp_row.tolist(), top_id_row.tolist(), int(kind))


@torch.no_grad()
def oracle_tau(drafter, feats, seqs, starts, n_eval, embed_w, lm_head_w, kind, deadline=None,
               now=None):
    """Mean tau per row for one tree kind under the oracle verdict.

    feats (B, T, C): taps of seqs; seqs (B, T) long = prompt + greedy; starts (B,) long = prompt
    length P (position of the first greedy token, the first anchor); rounds run until n_eval tokens
    exist, and every comparison has L greedy tokens after it (T >= P + n_eval + L + 1).
    Returns (list of per-row mean tau, list of per-row round counts, histogram of tau).
    """
    L = drafter.block_size - 1
    K = 1 if kind == "chain" else max(1, min(int(kind), embed_w.shape[0]))
    B, T = seqs.shape
    s = starts.clone()
    # n_eval new tokens: the prefill gives the first (the anchor at P); a round at anchor s has
    # produced s + 1 - P tokens so far, so rounds run while s < P + n_eval - 1.
    end = starts + n_eval - 1
    if int((end + L + 1).max()) > T:
        raise ValueError("oracle_tau: sequences shorter than P + n_eval + L + 1")
    taus = [[] for _ in range(B)]
    hist = [0] * (L + 2)
    seqs_cpu = seqs.cpu()
    while True:
        active = (s < end).nonzero().flatten()
        if active.numel() == 0:
            break
        if deadline is not None and now() > deadline:
            return None
        sa = s[active]
        lp, ids = draft_topk(drafter, feats[active], sa, seqs[active, sa], embed_w, lm_head_w, K)
        for j, row in enumerate(active.tolist()):
            tokens, parents, _ = make_tree(kind, lp[j], ids[j])
            ch = children_map(tokens, parents)
            base = int(s[row])
            # Oracle posterior: node at depth d on a path equal to the greedy tokens predicts the
            # next greedy token; off-path nodes are never reached by the walk.
            acc, _ = walk(ch, _OraclePosterior(seqs_cpu[row], base, tokens, parents))
            tau = len(acc)
            taus[row].append(tau)
            hist[tau] += 1
            s[row] = base + tau
    means = [sum(t) / len(t) for t in taus]
    return means, [len(t) for t in taus], hist


class _OraclePosterior:
    """posterior(i) for nodes on the greedy path: the greedy token after the node's depth."""

    def __init__(self, seq, base, tokens, parents):
        self.seq, self.base = seq, base
        self.depth = [0] * len(tokens)
        for i in range(1, len(tokens)):
            self.depth[i] = self.depth[parents[i]] + 1

    def __call__(self, i):
        return int(self.seq[self.base + self.depth[i] + 1])


@torch.no_grad()
def verify_loop(drafter, target, prompts, n_new, kind, pad_id, device, deadline=None, now=None):
    """Real speculative decoding with per-path target verification (greedy, exact method).

    prompts: list of 1-D long tensors. Returns (outputs: list of lists of n_new tokens, taus).
    The first token comes from the prefill (as in plain decoding), each round drafts from the
    committed taps, builds the tree, verifies every leaf path with the target, walks, commits.
    """
    L = drafter.block_size - 1
    K = 1 if kind == "chain" else max(1, min(int(kind), target.embed_w.shape[0]))
    outs, taus_all = [], []
    for prompt in prompts:
        if deadline is not None and now() > deadline:
            break
        ids = prompt.to(device)[None]
        logits, feats = target.forward_taps(ids)
        committed = ids[0].tolist() + [int(logits[0, -1].argmax())]
        ctx = feats[0]                                   # taps of committed[:-1]
        taus = []
        while len(committed) - len(prompt) < n_new:
            s = len(committed) - 1                       # anchor position
            seq_t = torch.tensor(committed, device=device)
            feats_full = torch.cat([ctx, ctx.new_zeros(L + 1, ctx.shape[1])], 0)[None]
            lp, tid = draft_topk(drafter, feats_full, torch.tensor([s], device=device),
                                 seq_t[s:s + 1], target.embed_w, target.lm_head_w, K)
            tokens, parents, _ = make_tree(kind, lp[0], tid[0])
            ch = children_map(tokens, parents)
            paths, where = leaf_paths(parents)
            rows = []
            for path in paths:
                row = committed + [tokens[n] for n in path]
                rows.append(row + [pad_id] * (s + 1 + L - len(row)))
            batch = torch.tensor(rows, device=device)
            vlogits, vfeats = target.forward_taps(batch)
            vpost = vlogits.argmax(-1).cpu()

            def posterior(i):
                if i == 0:
                    return int(vpost[0, s])
                pi, off = where[i]
                return int(vpost[pi, s + 1 + off])

            acc, bonus = walk(ch, posterior)
            # taps of the accepted nodes (root first) become context for the next round
            new_feats = [vfeats[0, s]]
            for n in acc[1:]:
                pi, off = where[n]
                new_feats.append(vfeats[pi, s + 1 + off])
            ctx = torch.cat([ctx, torch.stack(new_feats, 0)], 0)
            committed += [tokens[n] for n in acc[1:]] + [bonus]
            taus.append(len(acc))
        outs.append(committed[len(prompt):len(prompt) + n_new])
        taus_all.append(taus)
    return outs, taus_all
