#!/usr/bin/env python3
"""make_model_fixtures.py - golden fixtures for the kdtree model runtime (src/model/).

Builds tiny random DeepSeek-V3-family models with transformers' own DeepseekV3ForCausalLM
(float32, eval, eager attention), saves them with save_pretrained and records what the reference
computes, so the C forward can be checked without torch:

  OUTDIR/<name>/config.json, model.safetensors (or model.safetensors.index.json + 2 shards)
  OUTDIR/<name>/expected.json       prompts, logits slice, argmax per position, greedy
                                    continuations, decoder-layer outputs, RoPE / softmax scale
  OUTDIR/kimi_tiny_published/       the kimi_tiny weights in the *published* K2.5 form: config
                                    wrapped under "text_config" (model_type kimi_k25) with the old
                                    rope_theta + rope_scaling form, tensors renamed with the
                                    "language_model." prefix and stored as bf16 (kimi_tiny's
                                    weights are bf16-representable, so kimi_tiny/expected.json
                                    holds for it too)

Models:
  dsv3_tiny   DeepSeek-V3-like: n_group 4 / topk_group 2, 2 dense layers then MoE, q_lora,
              2 shared experts, default RoPE; saved as index.json + 2 shards
  kimi_tiny   Kimi-like: n_group 1, one shared expert, first layer dense, q_lora,
              YaRN (beta_fast = beta_slow = 1, mscale = mscale_all_dim = 1)
  nolora_tiny q_lora_rank null, YaRN with DeepSeek betas 32/1 and mscale_all_dim != mscale,
              norm_topk_prob false

Usage: python3 tools/make_model_fixtures.py OUTDIR   (CPU is fine; needs torch, transformers >= 5,
safetensors; deterministic for a given torch/transformers version). Output stays well under 2 MB.
"""
import json
import math
import os
import shutil
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

VOCAB = 320
LOGIT_SLICE = 64          # logits recorded for vocab ids 0..63 at every position
N_NEW = 24                # greedy continuation length
PROMPT_LENGTHS = [1, 5, 17, 40]


def base_config(**kw):
    cfg = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=16, num_experts_per_tok=4, routed_scaling_factor=2.5,
        kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=16,
        n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
        hidden_act="silu", max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_interleave=True, attention_bias=False, tie_word_embeddings=False,
        bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1, pad_token_id=None,
        initializer_range=0.02,
    )
    cfg.update(kw)
    return cfg


MODELS = [
    ("dsv3_tiny", 1001, base_config(
        num_hidden_layers=3, first_k_dense_replace=2, n_routed_experts=16, n_group=4, topk_group=2,
        num_experts_per_tok=4, n_shared_experts=2, q_lora_rank=48, rms_norm_eps=1e-6,
        num_attention_heads=2, num_key_value_heads=2, moe_intermediate_size=8, intermediate_size=48,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=256), {"shards": 2}),
    ("kimi_tiny", 2002, base_config(
        num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=8, n_group=1, topk_group=1,
        num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.827, q_lora_rank=32,
        kv_lora_rank=48, qk_nope_head_dim=16, v_head_dim=32, rms_norm_eps=1e-5,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
                         "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 256}), {"bf16_weights": True}),
    ("nolora_tiny", 3003, base_config(
        num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=12, n_group=2, topk_group=1,
        num_experts_per_tok=3, n_shared_experts=1, q_lora_rank=None, hidden_size=64,
        num_attention_heads=2, num_key_value_heads=2, moe_intermediate_size=8,
        kv_lora_rank=64, qk_nope_head_dim=24, v_head_dim=24, norm_topk_prob=False,
        routed_scaling_factor=1.5, max_position_embeddings=8192,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8,
                         "original_max_position_embeddings": 1024}), {}),
]


def fl(x):
    """float32 -> shortest text that round-trips through float32 (9 significant digits)."""
    return float("%.9g" % float(x))


def randomize(model, seed, bf16_weights):
    """Replace transformers' init (std 0.02, norms = 1, bias = 0) by weights that give O(1)
    activations and well separated logits, non-trivial norms and router biases."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                # Positive biases keep every biased score > 0, so the group filter does not depend
                # on whether excluded experts are filled with 0 (transformers) or -inf (DeepSeek).
                p.copy_(0.3 * torch.rand(p.shape, generator=g))
            elif not p.is_floating_point() or name.endswith("inv_freq"):
                continue
            elif name.endswith("norm.weight"):                 # all RMSNorm weights
                p.copy_(1.0 + 0.25 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1 and isinstance(p, torch.nn.Parameter):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                fan_in = p.shape[-1]
                gain = 3.0 if name.startswith("lm_head") else 1.0
                if "embed_tokens" in name:
                    gain, fan_in = 1.0, 1
                p.copy_(gain * torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
        if bf16_weights:
            for _, p in model.named_parameters():
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(b.to(torch.bfloat16).to(torch.float32))


def make_prompts(seed):
    g = torch.Generator().manual_seed(seed + 17)
    prompts = []
    for n in PROMPT_LENGTHS:
        prompts.append(torch.randint(0, VOCAB, (n,), generator=g).tolist())
    prompts.append([7, 7, 7, 7, 7, 7, 7, 7])          # a repetitive prompt
    return prompts


def top2_gap(row):
    v, _ = torch.topk(row, 2)
    return float(v[0] - v[1])


@torch.no_grad()
def record(model, prompts):
    out = {"prompts": []}
    for ids in prompts:
        x = torch.tensor([ids])
        taps = []
        hooks = [layer.register_forward_hook(
            lambda _m, _i, o: taps.append((o[0] if isinstance(o, tuple) else o)[0].clone()))
            for layer in model.model.layers]
        logits = model(input_ids=x, use_cache=False).logits[0].float()      # [n][V]
        for h in hooks:
            h.remove()
        entry = {
            "tokens": ids,
            "logits_first": [[fl(v) for v in row[:LOGIT_SLICE]] for row in logits],
            "argmax": [int(row.argmax()) for row in logits],
            "top2_gap": [fl(top2_gap(row)) for row in logits],
            "logit_absmax": fl(logits.abs().max()),
        }
        if len(ids) == 17:
            # decoder-layer outputs (residual included) = HF hidden_states[i+1], all positions
            entry["layer_out"] = [[[fl(v) for v in row] for row in t] for t in taps]
        # greedy continuation through the KV cache, as plain greedy decoding does it
        res = model(input_ids=x, use_cache=True)
        past, last = res.past_key_values, res.logits[0, -1].float()
        greedy, gaps = [], []
        for _ in range(N_NEW):
            tok = int(last.argmax())
            greedy.append(tok)
            gaps.append(top2_gap(last))
            res = model(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            past, last = res.past_key_values, res.logits[0, -1].float()
        entry["greedy"] = greedy
        entry["greedy_min_gap"] = fl(min(gaps))
        out["prompts"].append(entry)
    return out


def save_model(model, outdir, shards):
    if not shards:
        model.save_pretrained(outdir)
        return
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for frac in (0.6, 0.55, 0.65, 0.5, 0.7, 0.75):
        tmp = tempfile.mkdtemp()
        model.save_pretrained(tmp, max_shard_size=int(total * frac))
        files = [f for f in os.listdir(tmp) if f.endswith(".safetensors")]
        if len(files) == shards and os.path.exists(os.path.join(tmp, "model.safetensors.index.json")):
            shutil.copytree(tmp, outdir, dirs_exist_ok=True)
            shutil.rmtree(tmp)
            return
        shutil.rmtree(tmp)
    raise SystemExit("could not produce exactly %d shards" % shards)


def published_copy(src_dir, dst_dir, hf_cfg):
    """kimi_tiny as Kimi K2.5 publishes it: wrapper config, old RoPE form, prefixed bf16 tensors."""
    os.makedirs(dst_dir, exist_ok=True)
    text = {k: v for k, v in hf_cfg.items() if k not in ("rope_parameters", "architectures",
                                                         "transformers_version", "dtype",
                                                         "torch_dtype", "model_type")}
    rp = dict(hf_cfg["rope_parameters"])
    text["model_type"] = "kimi_k2"
    text["rope_theta"] = rp.pop("rope_theta")
    rp.pop("rope_type", None)
    rp["type"] = "yarn"                               # the old key name
    text["rope_scaling"] = rp
    text["torch_dtype"] = "bfloat16"
    text["num_nextn_predict_layers"] = 0
    text["an_unknown_field"] = {"ignored": True}
    wrapper = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": {"model_type": "moonvit", "hidden_size": 8},
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(dst_dir, "config.json"), "w") as f:
        json.dump(wrapper, f, indent=2)
    tensors = {}
    for fn in sorted(os.listdir(src_dir)):
        if fn.endswith(".safetensors"):
            for k, v in load_file(os.path.join(src_dir, fn)).items():
                b = v.to(torch.bfloat16)
                assert torch.equal(b.float(), v), "kimi_tiny weights must be bf16-representable"
                tensors["language_model." + k] = b.contiguous()
    tensors["vision_tower.patch_embed.weight"] = torch.zeros(2, 8, dtype=torch.bfloat16)
    save_file(tensors, os.path.join(dst_dir, "model.safetensors"), metadata={"format": "pt"})
    # no expected.json here: the tests use ../kimi_tiny/expected.json (same function)


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    outroot = sys.argv[1]
    os.makedirs(outroot, exist_ok=True)
    torch.set_num_threads(1)            # deterministic CPU reductions
    import transformers
    for name, seed, cfg_kw, opts in MODELS:
        torch.manual_seed(seed)
        cfg = DeepseekV3Config(attn_implementation="eager", **cfg_kw)
        try:
            cfg._attn_implementation = "eager"
        except Exception:           # older/newer config classes: the kwarg above already did it
            pass
        model = DeepseekV3ForCausalLM(cfg).float().eval()
        randomize(model, seed, opts.get("bf16_weights", False))
        outdir = os.path.join(outroot, name)
        if os.path.exists(outdir):
            shutil.rmtree(outdir)
        save_model(model, outdir, opts.get("shards", 0))

        # the saved checkpoint must reload to the same function (checks the per-expert mapping)
        reloaded = DeepseekV3ForCausalLM.from_pretrained(outdir, attn_implementation="eager").float().eval()
        probe = torch.tensor([[1, 2, 3, 4, 5]])
        with torch.no_grad():
            a = model(input_ids=probe).logits
            b = reloaded(input_ids=probe).logits
        assert torch.allclose(a, b, rtol=0, atol=0), "reloaded model differs from the saved one"

        prompts = make_prompts(seed)
        exp = record(model, prompts)
        rot = model.model.rotary_emb
        attn0 = model.model.layers[0].self_attn
        exp["meta"] = {
            "name": name, "seed": seed, "torch": torch.__version__,
            "transformers": transformers.__version__, "logit_slice": LOGIT_SLICE,
            "rope_inv_freq": [fl(v) for v in rot.inv_freq.tolist()],
            "rope_attention_scaling": fl(getattr(rot, "attention_scaling", 1.0)),
            "softmax_scale": fl(attn0.scaling),
            "dense_layers": [i for i, l in enumerate(model.model.layers)
                             if not hasattr(l.mlp, "gate")],
        }
        with open(os.path.join(outdir, "expected.json"), "w") as f:
            json.dump(exp, f, separators=(",", ":"))
        with open(os.path.join(outdir, "config.json")) as f:
            saved_cfg = json.load(f)
        if name == "kimi_tiny":
            published_copy(outdir, os.path.join(outroot, name + "_published"), saved_cfg)

        files = sorted(os.listdir(outdir))
        size = sum(os.path.getsize(os.path.join(outdir, f)) for f in files)
        gaps = [p["greedy_min_gap"] for p in exp["prompts"]]
        print("%-14s %7d bytes  files %s" % (name, size, files))
        print("    softmax_scale %.9g  rope_attention_scaling %.9g  greedy min top-2 gaps %s"
              % (exp["meta"]["softmax_scale"], exp["meta"]["rope_attention_scaling"], gaps))
    total = 0
    for dp, _, fns in os.walk(outroot):
        total += sum(os.path.getsize(os.path.join(dp, f)) for f in fns)
    print("total %d bytes under %s" % (total, outroot))
    if total > 2 * 1024 * 1024:
        print("WARNING: fixtures exceed 2 MB")


if __name__ == "__main__":
    main()
