"""Shared helpers for the tiny-pair training scripts (tools/tiny/).

Owns: progress logging and wall-clock deadlines, the Kimi pre-tokenization pattern and the tiny
tokenizer's special-token layout, tiktoken.model reading/writing, a pure-Python BPE trainer and
encoder (fallbacks used only when HF `tokenizers` / `tiktoken` are missing or fail), a minimal
safetensors reader/writer (so the drafter checkpoint layout is under our control), and the tar
packing of stage outputs. Nothing here imports transformers.
"""
import base64
import hashlib
import heapq
import json
import os
import struct
import sys
import tarfile
import time

# ----------------------------------------------------------------------------- logging / time

_T0 = time.time()


def set_t0(t0):
    """Make log timestamps and deadlines relative to the start of the whole device command."""
    global _T0
    _T0 = float(t0)


def now():
    """Seconds since the command started."""
    return time.time() - _T0


def log(msg):
    print(f"[{now():7.1f}s] {msg}", flush=True)


class StageError(RuntimeError):
    pass


def write_json(path, obj):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, ensure_ascii=False)
        f.write("\n")


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def stable_hash(s):
    """64-bit hash of a string that is the same on every machine and Python run."""
    return int.from_bytes(hashlib.sha256(s.encode("utf-8")).digest()[:8], "little")


class NanGuard:
    """Keeps a copy of the weights from the last finite-loss check; on a non-finite loss it
    restores them, rebuilds the AdamW optimizer and halves the learning rate (training goes on
    instead of losing the run)."""

    def __init__(self, model, groups, args, device):
        self.model, self.groups, self.args, self.device = model, groups, args, device
        self.lr_scale = 1.0
        self.saved = None
        self.rollbacks = 0

    def make_opt(self):
        import torch
        groups = [dict(g) for g in self.groups]
        try:
            return torch.optim.AdamW(groups, lr=self.args.lr, betas=(0.9, 0.95), eps=1e-8,
                                     fused=self.device.type == "cuda")
        except (TypeError, RuntimeError):
            return torch.optim.AdamW(groups, lr=self.args.lr, betas=(0.9, 0.95), eps=1e-8)

    def snapshot(self):
        self.saved = {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def finish(self, loss):
        """After the loop: never leave non-finite weights behind."""
        import math
        if loss is not None and not math.isfinite(float(loss)) and self.saved is not None:
            self.model.load_state_dict(self.saved)
            log("WARNING: last loss non-finite; restored the last finite snapshot")

    def rollback(self, opt):
        self.rollbacks += 1
        if self.saved is None or self.rollbacks > 5:
            raise StageError("non-finite loss and no usable snapshot (or too many rollbacks)")
        self.model.load_state_dict(self.saved)
        self.lr_scale *= 0.5
        log(f"WARNING: non-finite loss; restored the last snapshot, lr scale now {self.lr_scale}")
        del opt
        return self.make_opt()


# ----------------------------------------------------------------------------- tokenizer layout

# Verbatim pat_str of Kimi K2's tokenization_kimi.py (8 alternatives; `&&` is class intersection).
KIMI_PAT = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

N_SPECIAL = 16            # special-token slots after the mergeable ranks (Kimi reserves 256)
VOCAB_SIZE = 8192         # mergeable + special
N_MERGEABLE = VOCAB_SIZE - N_SPECIAL

# Named specials by offset from the first special id; the rest are <|reserved_token_{id}|> as in
# tokenization_kimi.py. [UNK] doubles as the DFlash mask token (Kimi's drafters use [UNK] too),
# and [UNK]/[PAD] are the last two ids as in Kimi (163838/163839).
_NAMED_SPECIALS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
    5: "<|im_system|>", 6: "<|im_middle|>", N_SPECIAL - 2: "[UNK]", N_SPECIAL - 1: "[PAD]",
}

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|im_{{ message['role'] }}|>{{ message['role'] }}<|im_middle|>{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def special_tokens(n_mergeable):
    """Ordered dict name -> id for the specials that follow n_mergeable mergeable ranks."""
    out = {}
    for off in range(N_SPECIAL):
        tid = n_mergeable + off
        out[_NAMED_SPECIALS.get(off, f"<|reserved_token_{tid}|>")] = tid
    return out


class TokMeta:
    """Ids of the tiny tokenizer's specials, derived from the number of mergeable ranks."""

    def __init__(self, n_mergeable):
        self.n_mergeable = n_mergeable
        self.specials = special_tokens(n_mergeable)
        self.vocab_size = n_mergeable + N_SPECIAL
        self.bos = self.specials["[BOS]"]
        self.eos = self.specials["[EOS]"]
        self.im_end = self.specials["<|im_end|>"]
        self.mask = self.specials["[UNK]"]
        self.pad = self.specials["[PAD]"]


def tokenizer_config(meta, max_len):
    added = {}
    for name, tid in meta.specials.items():
        added[str(tid)] = {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": True}
    return {
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>",
                                      "<|im_system|>", "<|im_middle|>"],
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "tokenizer_class": "TikTokenTokenizer",
        # Extra fields (not read by HF): the pre-tokenizer and the mergeable-rank count.
        "pat_str": KIMI_PAT,
        "num_mergeable_tokens": meta.n_mergeable,
        "dflash_mask_token": "[UNK]",
    }


# ----------------------------------------------------------------------------- tiktoken.model IO

def write_tiktoken(path, ranked_tokens):
    """ranked_tokens: list of bytes, index = rank. One line per token: base64(bytes) SP rank."""
    seen = set()
    for t in ranked_tokens:
        if not isinstance(t, bytes) or not t or t in seen:
            raise StageError(f"tiktoken writer: bad or duplicate token {t!r}")
        seen.add(t)
    for b in range(256):
        if bytes([b]) not in seen:
            raise StageError(f"tiktoken writer: single byte {b} missing")
    with open(path, "w", encoding="ascii") as f:
        for rank, t in enumerate(ranked_tokens):
            f.write(f"{base64.b64encode(t).decode('ascii')} {rank}\n")


def read_tiktoken(path):
    """Returns dict bytes -> rank, checking ranks are 0..n-1 contiguous."""
    ranks = {}
    with open(path, encoding="ascii") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            b64, r = line.split()
            ranks[base64.b64decode(b64)] = int(r)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise StageError(f"{path}: ranks are not contiguous 0..{len(ranks) - 1}")
    return ranks


def bytes_to_unicode():
    """GPT-2 / HF ByteLevel byte <-> printable-char table (byte -> char)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def ranks_from_hf_merges(merges, n_mergeable):
    """HF ByteLevel BPE merges (in merge order) -> ranked byte tokens for tiktoken.

    Ranks 0..255 are the single bytes in byte order; each merge then appends its merged token
    unless an earlier merge already produced the same bytes. Truncated to n_mergeable.
    """
    dec = {c: b for b, c in bytes_to_unicode().items()}
    ranked = [bytes([b]) for b in range(256)]
    have = set(ranked)
    for m in merges:
        a, b = (m.split(" ", 1) if isinstance(m, str) else m)
        try:
            ta = bytes(dec[c] for c in a)
            tb = bytes(dec[c] for c in b)
        except KeyError as e:
            raise StageError(f"merge {m!r} has a char outside the ByteLevel alphabet: {e}")
        if ta not in have or tb not in have:
            raise StageError(f"merge {m!r} uses a part that no earlier rank produced")
        t = ta + tb
        if t in have:
            continue
        ranked.append(t)
        have.add(t)
        if len(ranked) == n_mergeable:
            break
    return ranked


def compile_kimi_regex():
    """Python `regex` compile of KIMI_PAT (V1 enables the && class intersection)."""
    import regex
    return regex.compile(KIMI_PAT, flags=regex.V1)


def train_bpe_python(texts, n_mergeable, deadline_s=None):
    """Pure-Python byte-level BPE trainer (fallback). Returns ranked byte tokens.

    Pre-tokenizes with KIMI_PAT, counts chunks, then merges the most frequent adjacent pair
    (ties: smallest (left rank, right rank)) until n_mergeable ranks exist or no pair occurs twice.
    """
    pat = compile_kimi_regex()
    counts = {}
    for t in texts:
        for m in pat.findall(t):
            b = m.encode("utf-8")
            counts[b] = counts.get(b, 0) + 1
    words = [list(w) for w in counts]
    freqs = list(counts.values())
    ranked = [bytes([b]) for b in range(256)]
    pair_count = {}
    pair_words = {}

    changed = set()

    def add_pairs(wi, sign):
        w = words[wi]
        f = freqs[wi] * sign
        for p in zip(w, w[1:]):
            pair_count[p] = pair_count.get(p, 0) + f
            changed.add(p)
            if sign > 0:
                pair_words.setdefault(p, set()).add(wi)

    for wi in range(len(words)):
        add_pairs(wi, +1)
    heap = [(-c, p) for p, c in pair_count.items()]
    heapq.heapify(heap)
    changed.clear()
    while len(ranked) < n_mergeable and heap:
        if deadline_s is not None and now() > deadline_s:
            log(f"python BPE: deadline hit at {len(ranked)} ranks")
            break
        negc, p = heapq.heappop(heap)
        c = pair_count.get(p, 0)
        if c != -negc:
            continue  # stale entry; the current count was pushed when it changed
        if c < 2:
            break
        new_id = len(ranked)
        ranked.append(ranked[p[0]] + ranked[p[1]])
        for wi in list(pair_words.get(p, ())):
            w = words[wi]
            if len(w) < 2:
                continue
            add_pairs(wi, -1)
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == p[0] and w[i + 1] == p[1]:
                    out.append(new_id)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            words[wi] = out
            add_pairs(wi, +1)
        pair_count.pop(p, None)
        pair_words.pop(p, None)
        changed.discard(p)
        for q in changed:
            if pair_count.get(q, 0) > 0:
                heapq.heappush(heap, (-pair_count[q], q))
        changed.clear()
    return ranked


class PyTiktoken:
    """Slow pure-Python stand-in for tiktoken.Encoding (local tests only; same BPE rule)."""

    def __init__(self, ranks, specials):
        self.ranks = ranks
        self.specials = specials
        self.decoder = {r: t for t, r in ranks.items()}
        for name, tid in specials.items():
            self.decoder[tid] = name.encode("utf-8")
        self.pat = compile_kimi_regex()
        self.n_vocab = len(ranks) + len(specials)
        self._cache = {}

    def _bpe(self, piece):
        r = self.ranks.get(piece)
        if r is not None:
            return [r]
        parts = [bytes([b]) for b in piece]
        while len(parts) > 1:
            best, bi = None, -1
            for i in range(len(parts) - 1):
                rk = self.ranks.get(parts[i] + parts[i + 1])
                if rk is not None and (best is None or rk < best):
                    best, bi = rk, i
            if best is None:
                break
            parts[bi:bi + 2] = [parts[bi] + parts[bi + 1]]
        return [self.ranks[p] for p in parts]

    def encode_ordinary(self, text):
        out = []
        for m in self.pat.findall(text):
            b = m.encode("utf-8")
            ids = self._cache.get(b)
            if ids is None:
                ids = self._bpe(b)
                if len(self._cache) < 200000:
                    self._cache[b] = ids
            out.extend(ids)
        return out

    def encode_ordinary_batch(self, texts, num_threads=1):
        return [self.encode_ordinary(t) for t in texts]

    def encode(self, text, allowed_special=()):
        if text in self.specials and (allowed_special == "all" or text in allowed_special):
            return [self.specials[text]]
        return self.encode_ordinary(text)

    def decode_bytes(self, ids):
        return b"".join(self.decoder[i] for i in ids)

    def decode(self, ids):
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


def make_encoding(ranks, meta, allow_python_fallback=False):
    """tiktoken.Encoding over our ranks + specials (the real package unless allowed to fall back)."""
    try:
        import tiktoken
    except ImportError:
        if not allow_python_fallback:
            raise
        log("WARNING: tiktoken not installed; using the slow pure-Python encoder (local test only)")
        return PyTiktoken(ranks, meta.specials)
    return tiktoken.Encoding(name="kdtree_tiny", pat_str=KIMI_PAT, mergeable_ranks=ranks,
                             special_tokens=dict(meta.specials))


# ----------------------------------------------------------------------------- safetensors IO

_ST_DTYPES = {"BF16": 2, "F32": 4, "F16": 2, "I64": 8, "I32": 4}


def save_safetensors(path, tensors, metadata=None):
    """Write a dict name -> torch tensor (bf16/f32/f16/i64/i32) as safetensors, names sorted."""
    import torch
    names = sorted(tensors)
    header, blobs, off = {}, [], 0
    tmap = {torch.bfloat16: ("BF16", torch.int16), torch.float32: ("F32", None),
            torch.float16: ("F16", None), torch.int64: ("I64", None), torch.int32: ("I32", None)}
    for n in names:
        t = tensors[n].detach().to("cpu").contiguous()
        if t.dtype not in tmap:
            raise StageError(f"safetensors: unsupported dtype {t.dtype} for {n}")
        code, view = tmap[t.dtype]
        raw = (t.view(view) if view is not None else t).numpy().tobytes()
        header[n] = {"dtype": code, "shape": list(t.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    header["__metadata__"] = dict(metadata or {"format": "pt"})
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hb += b" " * ((8 - len(hb) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for raw in blobs:
            f.write(raw)


def load_safetensors(path):
    """Read a safetensors file into a dict name -> torch tensor (CPU)."""
    import numpy as np
    import torch
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    npd = {"BF16": np.int16, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        a, b = h["data_offsets"]
        arr = np.frombuffer(data[a:b], dtype=npd[h["dtype"]]).reshape(h["shape"]).copy()
        t = torch.from_numpy(arr)
        if h["dtype"] == "BF16":
            t = t.view(torch.bfloat16)
        out[name] = t
    return out


# ----------------------------------------------------------------------------- packing

def pack_outputs(out_dir, tar_name, members, root, part_mib=15):
    """Tar `members` (paths relative to `root`) into out_dir/tar_name.partNN of <= part_mib MiB."""
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, tar_name + ".tmp")
    with tarfile.open(tmp, "w") as tf:
        for m in members:
            p = os.path.join(root, m)
            if os.path.exists(p):
                tf.add(p, arcname=m)
            else:
                log(f"pack: missing {m}, skipped")
    size = os.path.getsize(tmp)
    part = part_mib * 1024 * 1024
    names = []
    with open(tmp, "rb") as f:
        i = 0
        while True:
            chunk = f.read(part)
            if not chunk:
                break
            name = f"{tar_name}.part{i:02d}"
            with open(os.path.join(out_dir, name), "wb") as g:
                g.write(chunk)
            names.append(name)
            i += 1
    os.remove(tmp)
    log(f"packed {len(members)} paths, {size / 2**20:.1f} MiB into {len(names)} part(s): {names}")
    return names


def dir_size(path):
    total = 0
    for dp, _, fns in os.walk(path):
        for fn in fns:
            total += os.path.getsize(os.path.join(dp, fn))
    return total


def python_info():
    return f"python {sys.version.split()[0]} at {sys.executable}"
