"""The tiny target: a DeepSeek-V3/Kimi-architecture model (transformers DeepseekV3ForCausalLM).

Owns: the tiny architecture (TARGET_ARCH, Kimi-style MLA + sigmoid noaux_tc MoE + YaRN), building
and saving it with transformers, loading it back, and `Target`, a thin runner used by stage B:
layer-output taps through forward hooks (tap i = output of decoder layer i = the residual stream
after that layer, before the final norm), greedy continuation with the KV cache, and full
forwards. A small pure-PyTorch causal LM (`StandInLM`) with the same module layout lets the whole
pipeline be smoke-tested on a machine without transformers; it is never shipped.
"""
import math
import os
import shutil
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import load_safetensors, log, read_json, save_safetensors, write_json

# Kimi K2 text backbone, scaled down. MLA: q_lora 128, kv_lora 64, per head nope 32 + rope 32 for
# q/k and 32 for v; MoE: 16 routed experts, top-2, one shared expert, first layer dense, sigmoid
# scores with e_score_correction_bias, one group, normalised top-k weights times 2.827 (Kimi's).
TARGET_ARCH = dict(
    hidden_size=256,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=128,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
    intermediate_size=512,
    moe_intermediate_size=128,
    n_routed_experts=16,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.827,
    hidden_act="silu",
    rms_norm_eps=1e-5,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    initializer_range=0.02,
)
# Kimi-like YaRN: theta 50000, beta_fast = beta_slow = 1, mscale = mscale_all_dim = 1; factor 4
# over an original window of 512 (the training length) gives 2048 positions.
TARGET_ROPE = dict(rope_type="yarn", rope_theta=50000.0, factor=4.0,
                   original_max_position_embeddings=512, beta_fast=1.0, beta_slow=1.0,
                   mscale=1.0, mscale_all_dim=1.0)
# Kimi-config fields that DeepseekV3Config does not take as named arguments; kept in config.json.
TARGET_EXTRA = dict(scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1,
                    num_nextn_predict_layers=0)


def param_count(arch, vocab):
    """Analytic parameter count of the tiny DeepseekV3 (embedding and lm_head untied)."""
    H, nh = arch["hidden_size"], arch["num_attention_heads"]
    qk = arch["qk_nope_head_dim"] + arch["qk_rope_head_dim"]
    attn = (H * arch["q_lora_rank"] + arch["q_lora_rank"] + arch["q_lora_rank"] * nh * qk
            + H * (arch["kv_lora_rank"] + arch["qk_rope_head_dim"]) + arch["kv_lora_rank"]
            + arch["kv_lora_rank"] * nh * (arch["qk_nope_head_dim"] + arch["v_head_dim"])
            + nh * arch["v_head_dim"] * H)
    dense = 3 * H * arch["intermediate_size"]
    E, mi = arch["n_routed_experts"], arch["moe_intermediate_size"]
    moe = E * 3 * H * mi + arch["n_shared_experts"] * 3 * H * mi + E * H + E
    L, k = arch["num_hidden_layers"], arch["first_k_dense_replace"]
    return 2 * vocab * H + L * (attn + 2 * H) + k * dense + (L - k) * moe + H


def build_hf_config(meta, arch=None):
    """DeepseekV3Config for the tiny target; tries the transformers-5 form (rope_parameters)
    first, then the legacy rope_theta + rope_scaling form, with and without the Kimi extras."""
    from transformers import DeepseekV3Config
    arch = dict(arch or TARGET_ARCH)
    base = dict(arch, vocab_size=meta.vocab_size, bos_token_id=meta.bos, eos_token_id=meta.eos,
                pad_token_id=meta.pad)
    legacy = {k: v for k, v in TARGET_ROPE.items() if k not in ("rope_theta", "rope_type")}
    legacy.update(type="yarn", rope_type="yarn")
    attempts = [
        ("rope_parameters", dict(rope_parameters=dict(TARGET_ROPE)), True),
        ("rope_parameters, extras set later", dict(rope_parameters=dict(TARGET_ROPE)), False),
        ("rope_scaling", dict(rope_theta=TARGET_ROPE["rope_theta"], rope_scaling=legacy), True),
        ("rope_scaling, extras set later",
         dict(rope_theta=TARGET_ROPE["rope_theta"], rope_scaling=legacy), False),
    ]
    cfg, errors = None, []
    for name, rope_kw, with_extras in attempts:
        try:
            cfg = DeepseekV3Config(**base, **rope_kw, **(TARGET_EXTRA if with_extras else {}))
        except (TypeError, ValueError, KeyError) as e:
            errors.append(f"{name}: {type(e).__name__}: {e}")
            continue
        if not with_extras:
            for k, v in TARGET_EXTRA.items():
                setattr(cfg, k, v)
        break
    if cfg is None:
        raise RuntimeError("DeepseekV3Config rejected every form: " + " | ".join(errors))
    for e in errors:
        log(f"config attempt failed: {e}")
    rp = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    log(f"target config rope: {rp}")
    if not rp or rp.get("rope_type", rp.get("type")) != "yarn":
        raise RuntimeError(f"YaRN rope settings did not reach the config: {rp}")
    return cfg


def set_router_bias(model, seed=1234, scale=0.02):
    """Fixed non-zero e_score_correction_bias (a buffer HF never trains) so the checkpoint
    exercises the biased-selection / unbiased-weight split of noaux_tc routing."""
    g = torch.Generator().manual_seed(seed)
    n = 0
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            vals = (torch.rand(buf.shape, generator=g) * 2 - 1) * scale
            buf.data.copy_(vals.to(buf.dtype))
            n += 1
    return n


class BiasBalancer:
    """Auxiliary-loss-free load balancing (DeepSeek-V3): after every step, each router's
    e_score_correction_bias moves by gamma toward under-used experts,
    bias_e += gamma * sign(mean_load - load_e), with loads counted from that step's selection
    (sigmoid(x W^T) + bias, top-k). Inputs are captured by forward hooks on the router modules
    (any module holding both `weight` and `e_score_correction_bias`); if none is found the
    balancer is a no-op."""

    def __init__(self, model, top_k, gamma=1e-3):
        self.top_k, self.gamma = top_k, gamma
        self.gates = [(n, m) for n, m in model.named_modules()
                      if hasattr(m, "e_score_correction_bias") and isinstance(getattr(m, "weight", None), torch.Tensor)]
        self.inputs = {}
        self.hooks = []
        self.last_imbalance = float("nan")
        for n, m in self.gates:
            def hook(mod, inp, out, n=n):
                if mod.training:
                    self.inputs[n] = inp[0].detach()
            self.hooks.append(m.register_forward_hook(hook))
        log(f"bias balancer: {len(self.gates)} routers, gamma {gamma}")

    @torch.no_grad()
    def update(self):
        for n, m in self.gates:
            x = self.inputs.pop(n, None)
            if x is None:
                continue
            w = m.weight.float()
            b = m.e_score_correction_bias
            s = torch.sigmoid(x.reshape(-1, w.shape[1]).float() @ w.t()) + b.float()
            idx = s.topk(self.top_k, dim=-1).indices.flatten()
            load = torch.bincount(idx, minlength=w.shape[0]).float()
            b.add_((self.gamma * torch.sign(load.mean() - load)).to(b.dtype))
            self._load = load  # kept on the device; read only at log steps (no per-step sync)

    def imbalance(self):
        """max/mean expert load of the last updated router (a cheap health number for the log)."""
        load = getattr(self, "_load", None)
        return float(load.max() / load.mean().clamp_min(1e-9)) if load is not None else float("nan")

    def close(self):
        for h in self.hooks:
            h.remove()


def new_hf_model(meta, device, arch=None):
    from transformers import DeepseekV3ForCausalLM
    cfg = build_hf_config(meta, arch)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg)
    nb = set_router_bias(model)
    log(f"target: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params, "
        f"router biases set in {nb} layers, attn impl {getattr(cfg, '_attn_implementation', '?')}")
    return model.to(device)


def save_hf_model(model, out_dir, tok_files, shard="12MB"):
    """bf16 save_pretrained, sharded so no file exceeds ~15 MB, plus the tokenizer files."""
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out_dir, max_shard_size=shard)
    for src in tok_files:
        shutil.copy(src, os.path.join(out_dir, os.path.basename(src)))
    files = sorted(os.listdir(out_dir))
    sizes = {f: os.path.getsize(os.path.join(out_dir, f)) for f in files}
    log(f"saved target to {out_dir}: " + ", ".join(f"{f} {s / 2**20:.1f}M" for f, s in sizes.items()))
    big = [f for f, s in sizes.items() if s > 15 * 2**20]
    if big:
        raise RuntimeError(f"files over 15 MiB in {out_dir}: {big}")
    return sizes


def sync_router_bias_from_files(model, model_dir):
    """Make the in-memory e_score_correction_bias buffers equal to the checkpoint files.

    Guards against a loader that re-initialises buffers: the engine reads the files, so the
    Python reference must use the same biases. Returns a small report dict.
    """
    file_bias = {}
    for fn in sorted(os.listdir(model_dir)):
        if fn.endswith(".safetensors"):
            for k, v in load_safetensors(os.path.join(model_dir, fn)).items():
                if k.endswith("e_score_correction_bias"):
                    file_bias[k] = v.float()
    n_same = n_fixed = 0
    for name, buf in model.named_buffers():
        if not name.endswith("e_score_correction_bias"):
            continue
        key = next((k for k in file_bias if k.endswith(name) or name.endswith(k)), None)
        if key is None:
            continue
        want = file_bias[key].to(buf.device, buf.dtype)
        if torch.equal(buf, want):
            n_same += 1
        else:
            buf.data.copy_(want)
            n_fixed += 1
    rep = {"in_files": len(file_bias), "equal": n_same, "copied_from_files": n_fixed,
           "max_abs": max((float(v.abs().max()) for v in file_bias.values()), default=0.0)}
    log(f"router bias check: {rep}")
    if len(file_bias) == 0:
        log("WARNING: no e_score_correction_bias tensors in the checkpoint files")
    return rep


def load_hf_model(model_dir, device, dtype=torch.float32):
    from transformers import DeepseekV3ForCausalLM
    model = DeepseekV3ForCausalLM.from_pretrained(model_dir)
    return model.to(device=device, dtype=dtype).eval()


# ----------------------------------------------------------------------------- stand-in (tests)

class _StandInBlock(nn.Module):
    def __init__(self, H, nh):
        super().__init__()
        self.nh = nh
        self.ln1 = nn.LayerNorm(H)
        self.qkv = nn.Linear(H, 3 * H, bias=False)
        self.o = nn.Linear(H, H, bias=False)
        self.ln2 = nn.LayerNorm(H)
        self.up = nn.Linear(H, 2 * H, bias=False)
        self.down = nn.Linear(2 * H, H, bias=False)

    def forward(self, x):
        B, T, H = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.nh, H // self.nh).permute(2, 0, 3, 1, 4)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(H // self.nh)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        s = s.masked_fill(~causal, float("-inf"))
        a = torch.softmax(s.float(), -1).to(v.dtype) @ v
        x = x + self.o(a.transpose(1, 2).reshape(B, T, H))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class StandInLM(nn.Module):
    """Tiny causal LM with HF-like attributes (model.embed_tokens/layers/norm, lm_head)."""

    def __init__(self, vocab, H=64, n_layers=6, nh=4):
        super().__init__()
        self.cfg = {"vocab_size": vocab, "hidden_size": H, "num_hidden_layers": n_layers, "nh": nh}
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, H)
        self.model.layers = nn.ModuleList([_StandInBlock(H, nh) for _ in range(n_layers)])
        self.model.norm = nn.LayerNorm(H)
        self.lm_head = nn.Linear(H, vocab, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False, logits_to_keep=None, **kw):
        x = self.model.embed_tokens(input_ids)
        for blk in self.model.layers:
            x = blk(x)
        x = self.model.norm(x)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        return types.SimpleNamespace(logits=self.lm_head(x), past_key_values=None)

    def save(self, out_dir, tok_files=()):
        os.makedirs(out_dir, exist_ok=True)
        save_safetensors(os.path.join(out_dir, "model.safetensors"),
                         {k: v.to(torch.bfloat16) for k, v in self.state_dict().items()})
        write_json(os.path.join(out_dir, "config.json"), dict(self.cfg, model_type="standin"))
        for src in tok_files:
            shutil.copy(src, os.path.join(out_dir, os.path.basename(src)))

    @staticmethod
    def load(out_dir, device, dtype=torch.float32):
        c = read_json(os.path.join(out_dir, "config.json"))
        m = StandInLM(c["vocab_size"], c["hidden_size"], c["num_hidden_layers"], c["nh"])
        sd = load_safetensors(os.path.join(out_dir, "model.safetensors"))
        m.load_state_dict({k: v.float() for k, v in sd.items()})
        return m.to(device=device, dtype=dtype).eval()


def is_standin_dir(model_dir):
    try:
        return read_json(os.path.join(model_dir, "config.json")).get("model_type") == "standin"
    except OSError:
        return False


def load_any(model_dir, device, dtype=torch.float32):
    if is_standin_dir(model_dir):
        return StandInLM.load(model_dir, device, dtype), False
    return load_hf_model(model_dir, device, dtype), True


# ----------------------------------------------------------------------------- runner

class Target:
    """Frozen target with layer-output taps. tap_ids are 0-based decoder-layer indices."""

    def __init__(self, model, tap_ids, is_hf):
        self.model = model
        self.tap_ids = list(tap_ids)
        self.is_hf = is_hf
        self.layers = model.model.layers
        self.n_layers = len(self.layers)
        if max(self.tap_ids) >= self.n_layers or min(self.tap_ids) < 0:
            raise ValueError(f"tap ids {self.tap_ids} outside 0..{self.n_layers - 1}")
        self.embed_w = model.model.embed_tokens.weight
        self.lm_head_w = model.lm_head.weight
        self.hidden = self.embed_w.shape[1]

    def _call(self, ids, **kw):
        try:
            return self.model(input_ids=ids, **kw)
        except TypeError:
            kw.pop("logits_to_keep", None)
            return self.model(input_ids=ids, **kw)

    @torch.no_grad()
    def forward_taps(self, ids, want_logits=True):
        """ids (B, T) -> (logits (B, T, V) or None, feats (B, T, n_taps*H) in the model dtype)."""
        store = {}
        hooks = []
        for i in self.tap_ids:
            def hook(mod, inp, out, i=i):
                store[i] = out[0] if isinstance(out, (tuple, list)) else out
            hooks.append(self.layers[i].register_forward_hook(hook))
        try:
            out = self._call(ids, use_cache=False, **({} if want_logits else {"logits_to_keep": 1}))
        finally:
            for h in hooks:
                h.remove()
        feats = torch.cat([store[i] for i in self.tap_ids], dim=-1)
        return (out.logits if want_logits else None), feats

    @torch.no_grad()
    def greedy(self, prompt, n_new):
        """prompt (B, P) long, no padding -> (B, n_new) greedy tokens."""
        if not self.is_hf:
            seq = prompt
            for _ in range(n_new):
                nxt = self._call(seq, logits_to_keep=1).logits[:, -1].argmax(-1)
                seq = torch.cat([seq, nxt[:, None]], 1)
            return seq[:, prompt.shape[1]:]
        out = self._call(prompt, use_cache=True, logits_to_keep=1)
        pkv = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1)
        toks = [nxt]
        for _ in range(n_new - 1):
            out = self._call(nxt[:, None], past_key_values=pkv, use_cache=True)
            pkv = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1)
            toks.append(nxt)
        return torch.stack(toks, 1)
