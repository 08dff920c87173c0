"""A1: the training corpus — Python sources of the running interpreter's installed packages.

Selection is deterministic for a given set of installed files: files are listed in sorted order,
each file's relative path (below its site-packages root) is hashed, the hash orders the files
(a fixed pseudo-random shuffle, so a byte cap does not favour packages early in the alphabet) and
splits them: about 2 % go to held-out evaluation, the rest to training. Exact duplicate contents
are kept once. Skipped: non-UTF-8, NUL bytes, huge files, and generated-looking files (very long
lines, long whitespace runs). Texts are used verbatim (no dedent, no normalisation).
"""
import hashlib
import os
import re
import site
import sys
import sysconfig

from common import log, stable_hash

HELDOUT_PER_MILLE = 20
_WS_RUN = re.compile(r"\s{2000}")


def package_roots(include_stdlib=False):
    """Existing site-packages (and optionally stdlib) dirs of this interpreter, deduplicated."""
    cands = []
    try:
        cands += site.getsitepackages()
    except Exception:
        pass
    try:
        cands.append(site.getusersitepackages())
    except Exception:
        pass
    paths = sysconfig.get_paths()
    cands += [paths.get("purelib"), paths.get("platlib")]
    cands += [p for p in sys.path if p and ("site-packages" in p or "dist-packages" in p)]
    if include_stdlib:
        cands.append(paths.get("stdlib"))
    roots = []
    for c in cands:
        if c and os.path.isdir(c):
            r = os.path.realpath(c)
            if r not in roots:
                roots.append(r)
    roots.sort()
    # Drop roots nested inside another root (they would be walked twice).
    return [r for r in roots if not any(r != o and r.startswith(o + os.sep) for o in roots)]


def list_py_files(roots):
    """Sorted (relative path, absolute path) of every .py file below the roots."""
    out, seen = [], set()
    for root in roots:
        for dp, dns, fns in os.walk(root):
            dns.sort()
            for fn in sorted(fns):
                if not fn.endswith(".py"):
                    continue
                ap = os.path.join(dp, fn)
                rel = os.path.relpath(ap, root)
                if rel in seen:
                    continue
                seen.add(rel)
                out.append((rel, ap))
    out.sort()
    return out


def _acceptable(data, max_line):
    if b"\0" in data:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    lines = text.split("\n")
    if max(len(l) for l in lines) > max_line:
        return None
    if _WS_RUN.search(text):
        return None
    return text


def collect(max_train_bytes, max_heldout_bytes, max_file_bytes=200_000, min_file_bytes=200,
            max_line=1000):
    """Returns (train_texts, heldout_texts, stats). Texts are lists of str, one per file."""
    roots = package_roots()
    files = list_py_files(roots)
    if len(files) < 200:
        log("corpus: few site-packages files; adding the standard library")
        roots = package_roots(include_stdlib=True)
        files = list_py_files(roots)
    log(f"corpus: {len(files)} .py files under {len(roots)} root(s): {roots}")
    keyed = sorted((stable_hash(rel), rel, ap) for rel, ap in files)
    train, held = [], []
    tb = hb = 0
    seen = set()
    skipped = {"size": 0, "content": 0, "dup": 0}
    for h, rel, ap in keyed:
        is_held = (h >> 20) % 1000 < HELDOUT_PER_MILLE
        if is_held and hb >= max_heldout_bytes:
            continue
        if not is_held and tb >= max_train_bytes:
            if hb >= max_heldout_bytes:
                break
            continue
        try:
            size = os.path.getsize(ap)
            if size > max_file_bytes or size < min_file_bytes:
                skipped["size"] += 1
                continue
            with open(ap, "rb") as f:
                data = f.read()
        except OSError:
            skipped["size"] += 1
            continue
        dh = hashlib.sha256(data).digest()
        if dh in seen:
            skipped["dup"] += 1
            continue
        seen.add(dh)
        text = _acceptable(data, max_line)
        if text is None:
            skipped["content"] += 1
            continue
        if is_held:
            held.append(text)
            hb += len(data)
        else:
            train.append(text)
            tb += len(data)
    stats = {"files_listed": len(files), "train_files": len(train), "heldout_files": len(held),
             "train_bytes": tb, "heldout_bytes": hb, "skipped": skipped, "roots": roots}
    log(f"corpus: train {len(train)} files {tb / 2**20:.1f} MiB, held-out {len(held)} files "
        f"{hb / 2**20:.2f} MiB, skipped {skipped}")
    return train, held, stats
