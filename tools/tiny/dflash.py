"""DFlash block-diffusion drafter (z-lab layout) in plain PyTorch, plus its training pieces.

Owns: the drafter module (Qwen3-style non-causal layers with per-head q/k RMSNorm, GQA, RoPE,
SwiGLU; target-feature context injected as extra K/V in every layer), the config.json it ships
with, safetensors save/load with the z-lab weight names, random-anchor sampling, the
context/block attention mask, and the decayed block cross-entropy.

Math of one drafter call (research notes ddtree-dflash.md section 3.1):
  c   = hidden_norm(fc(F))                F: taps of committed positions, (T, n_taps*H)
  h   = E_target[[anchor, MASK x L]]      block at positions a .. a+L
  per layer: x = input_ln(h); q = rope(q_norm(q_proj x)); K = [rope(k_norm(k_proj c)); rope(k_norm(k_proj x))]
             V = [v_proj c; v_proj x]; block queries see context keys at positions < a and all
             keys of their own block (no causal mask); h += o_proj(attn); h += mlp(post_ln(h))
  logits = lm_head_target(norm(h))[1..L]
Embedding and lm_head are the target's (frozen, passed in); the checkpoint holds neither.
Works on torch 1.13 (local CPU tests) and current torch (device).
"""
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import load_safetensors, save_safetensors, write_json, read_json


def default_target_layer_ids(n_target_layers, n_draft_layers):
    """build_target_layer_ids of z-lab/ddtree: evenly spaced from layer 1 to layer N_t - 3."""
    if n_draft_layers == 1:
        return [n_target_layers // 2]
    start, end = 1, n_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (n_draft_layers - 1))) for i in range(n_draft_layers)]


def make_config(hidden_size, n_layers, n_heads, n_kv_heads, head_dim, intermediate_size,
                n_target_layers, target_layer_ids, mask_token_id, vocab_size, block_size=8,
                rope_theta=50000.0, rms_norm_eps=1e-6, max_position_embeddings=2048):
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": block_size,
        "num_target_layers": n_target_layers,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": rms_norm_eps,
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": max_position_embeddings,
        "layer_types": ["full_attention"] * n_layers,
        "sliding_window": None,
        "use_sliding_window": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
        "torch_dtype": "bfloat16",
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
    }


class RMSNorm(nn.Module):
    """Qwen3/HF RMSNorm: normalise in fp32, cast back, then scale by the weight."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dt)


def rope_cos_sin(pos, head_dim, theta):
    """pos: (...,) int positions -> cos, sin (..., head_dim) fp32, HF rotate_half layout."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=pos.device) / head_dim))
    fr = pos.float()[..., None] * inv
    emb = torch.cat([fr, fr], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    """x: (B, heads, S, D); cos/sin: (B, S, D)."""
    d = x.shape[-1] // 2
    rot = torch.cat([-x[..., d:], x[..., :d]], dim=-1)
    c, s = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    return x * c + rot * s


# Training uses torch's fused SDPA when present; evaluation and fixtures set this to False so
# the plain fp32 softmax(QK^T/sqrt(d))V below is used (the "exact math" the engine is checked against).
USE_SDPA = True


def attention(q, k, v, mask):
    """q: (B, n, Q, d), k/v: (B, n, K, d), mask: (B, 1, Q, K) bool True = visible."""
    if USE_SDPA and hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    s = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s.float(), dim=-1).to(v.dtype)
    return torch.matmul(p, v)


class DraftLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        H, hd = cfg["hidden_size"], cfg["head_dim"]
        self.nh, self.nkv, self.hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], hd
        eps = cfg["rms_norm_eps"]
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(H, self.nh * hd, bias=False)
        self.self_attn.k_proj = nn.Linear(H, self.nkv * hd, bias=False)
        self.self_attn.v_proj = nn.Linear(H, self.nkv * hd, bias=False)
        self.self_attn.o_proj = nn.Linear(self.nh * hd, H, bias=False)
        self.self_attn.q_norm = RMSNorm(hd, eps)
        self.self_attn.k_norm = RMSNorm(hd, eps)
        self.mlp = nn.Module()
        I = cfg["intermediate_size"]
        self.mlp.gate_proj = nn.Linear(H, I, bias=False)
        self.mlp.up_proj = nn.Linear(H, I, bias=False)
        self.mlp.down_proj = nn.Linear(I, H, bias=False)
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)

    def _heads(self, x, n):
        B, S, _ = x.shape
        return x.view(B, S, n, self.hd).transpose(1, 2)  # (B, n, S, hd)

    def forward(self, h, c, blk_cs, ctx_cs, mask):
        """h: (B, Q, H) block states; c: (B, T, H) context; mask: (B, 1, Q, T+Q) bool (True = see)."""
        a = self.self_attn
        x = self.input_layernorm(h)
        q = apply_rope(a.q_norm(self._heads(a.q_proj(x), self.nh)), *blk_cs)
        kb = apply_rope(a.k_norm(self._heads(a.k_proj(x), self.nkv)), *blk_cs)
        vb = self._heads(a.v_proj(x), self.nkv)
        kc = apply_rope(a.k_norm(self._heads(a.k_proj(c), self.nkv)), *ctx_cs)
        vc = self._heads(a.v_proj(c), self.nkv)
        k = torch.cat([kc, kb], dim=2)
        v = torch.cat([vc, vb], dim=2)
        if self.nkv != self.nh:
            rep = self.nh // self.nkv
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        o = attention(q, k, v, mask)
        B, _, Q, _ = o.shape
        h = h + a.o_proj(o.transpose(1, 2).reshape(B, Q, self.nh * self.hd))
        x = self.post_attention_layernorm(h)
        m = self.mlp
        return h + m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))


class DFlashDrafter(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        H = cfg["hidden_size"]
        self.n_taps = len(cfg["dflash_config"]["target_layer_ids"])
        self.block_size = cfg["block_size"]
        self.mask_token_id = cfg["dflash_config"]["mask_token_id"]
        self.fc = nn.Linear(self.n_taps * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg["rms_norm_eps"])
        self.layers = nn.ModuleList([DraftLayer(cfg) for _ in range(cfg["num_hidden_layers"])])
        self.norm = RMSNorm(H, cfg["rms_norm_eps"])
        for mod in self.modules():
            if isinstance(mod, nn.Linear):
                nn.init.normal_(mod.weight, std=0.02)

    def forward(self, feats, anchors, anchor_tokens, embed_w, ctx_valid=None):
        """Block hidden states after the final norm.

        feats: (B, T, n_taps*H) target taps at positions 0..T-1 (only positions < anchor are seen)
        anchors: (B, nb) long, block b of row i occupies positions anchors[i,b] .. +block_size-1
        anchor_tokens: (B, nb) long token at the anchor position
        embed_w: (V, H) the target's embedding table
        ctx_valid: optional (B, T) bool, extra restriction on visible context positions
        returns (B, nb, block_size, H)
        """
        B, T, _ = feats.shape
        nb, L1 = anchors.shape[1], self.block_size
        dev = feats.device
        ids = torch.full((B, nb, L1), self.mask_token_id, dtype=torch.long, device=dev)
        ids[:, :, 0] = anchor_tokens
        h = F.embedding(ids.view(B, nb * L1), embed_w)
        c = self.hidden_norm(self.fc(feats))
        blk_pos = (anchors[:, :, None] + torch.arange(L1, device=dev)).view(B, nb * L1)
        ctx_pos = torch.arange(T, device=dev).expand(B, T)
        hd, theta = self.cfg["head_dim"], self.cfg["rope_theta"]
        blk_cs = rope_cos_sin(blk_pos, hd, theta)
        ctx_cs = rope_cos_sin(ctx_pos, hd, theta)
        mask = build_mask(anchors, T, L1, ctx_valid)
        for layer in self.layers:
            h = layer(h, c, blk_cs, ctx_cs, mask)
        return self.norm(h).view(B, nb, L1, -1)


def build_mask(anchors, T, L1, ctx_valid=None):
    """(B, 1, nb*L1, T + nb*L1) bool: context j visible iff j < anchor; own block fully visible."""
    B, nb = anchors.shape
    dev = anchors.device
    ctx = torch.arange(T, device=dev)[None, None, :] < anchors[:, :, None]  # (B, nb, T)
    if ctx_valid is not None:
        ctx = ctx & ctx_valid[:, None, :]
    ctx = ctx[:, :, None, :].expand(B, nb, L1, T).reshape(B, nb * L1, T)
    blk_id = torch.arange(nb, device=dev).repeat_interleave(L1)
    blk = (blk_id[:, None] == blk_id[None, :])[None].expand(B, nb * L1, nb * L1)
    return torch.cat([ctx, blk], dim=2)[:, None]


def sample_anchors(gen_start, T, nb, block_size, generator=None):
    """Distinct random anchors per row in [gen_start[i], T - block_size] (labels stay inside T).

    gen_start: (B,) long, first position whose token is a target-greedy output. Returns (B, nb) sorted.
    """
    B = gen_start.shape[0]
    dev = gen_start.device
    pos = torch.arange(T, device=dev)[None, :]
    ok = (pos >= gen_start[:, None]) & (pos <= T - block_size)
    if int(ok.sum(1).min()) < nb:
        raise ValueError(f"sample_anchors: a row has fewer than {nb} valid anchor positions")
    score = torch.rand(B, T, device=dev, generator=generator)
    score = torch.where(ok, score, torch.full_like(score, -1.0))
    return score.topk(nb, dim=1).indices.sort(dim=1).values


def block_loss(drafter, feats, seq, anchors, embed_w, lm_head_w, gamma=4.0):
    """Decayed block CE: positions k=1..L of each block predict seq[anchor+k], weight exp(-(k-1)/gamma).

    seq: (B, T) long tokens (target-greedy in the label region). Returns (loss, per-position acc (L,)).
    """
    L1 = drafter.block_size
    anchor_tok = seq.gather(1, anchors)
    hid = drafter(feats, anchors, anchor_tok, embed_w)               # (B, nb, L1, H)
    logits = F.linear(hid[:, :, 1:], lm_head_w).float()              # (B, nb, L, V)
    lab_pos = anchors[:, :, None] + torch.arange(1, L1, device=seq.device)
    labels = seq.gather(1, lab_pos.view(seq.shape[0], -1)).view(lab_pos.shape)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    ce = ce.view(labels.shape)
    w = torch.exp(-torch.arange(L1 - 1, device=seq.device, dtype=torch.float32) / gamma)
    loss = (ce * w).sum(-1).mean() / w.sum()
    with torch.no_grad():
        acc = (logits.argmax(-1) == labels).float().mean(dim=(0, 1))
    return loss, acc


def state_dict_for_save(drafter):
    """z-lab weight names (no prefix), bf16."""
    sd = {}
    for k, v in drafter.state_dict().items():
        sd[k] = v.detach().to(torch.bfloat16).contiguous()
    return sd


def expected_weight_names(cfg):
    names = ["fc.weight", "hidden_norm.weight", "norm.weight"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    return sorted(names)


def save_drafter(drafter, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    sd = state_dict_for_save(drafter)
    if sorted(sd) != expected_weight_names(drafter.cfg):
        raise RuntimeError(f"drafter weight names differ from the z-lab layout: {sorted(sd)}")
    save_safetensors(os.path.join(out_dir, "model.safetensors"), sd)
    write_json(os.path.join(out_dir, "config.json"), drafter.cfg)


def load_drafter(out_dir, dtype=torch.float32, device="cpu"):
    cfg = read_json(os.path.join(out_dir, "config.json"))
    d = DFlashDrafter(cfg)
    sd = load_safetensors(os.path.join(out_dir, "model.safetensors"))
    missing = set(d.state_dict()) ^ set(sd)
    if missing:
        raise RuntimeError(f"drafter checkpoint names mismatch: {sorted(missing)}")
    d.load_state_dict({k: v.to(torch.float32) for k, v in sd.items()})
    return d.to(device=device, dtype=dtype).eval()


def count_params(module):
    return sum(p.numel() for p in module.parameters())


def lr_at(frac, step, base_lr, warmup_steps, min_ratio=0.1):
    """Linear warmup by steps, then cosine over the wall-clock fraction frac in [0, 1]."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    frac = min(max(frac, 0.0), 1.0)
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))
