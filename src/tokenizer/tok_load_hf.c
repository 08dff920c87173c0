/* tok_load_hf.c - loads an HF tokenizer.json with a byte-level BPE model (DeepSeek-V3): the
 * vocab (byte-level strings -> bytes), the merges (-> pair ranks), the added tokens, and the
 * pre-tokenizer (Sequence / Split(Isolated) / ByteLevel) as PCRE2 steps. Anything outside that
 * (other models, normalizers, split behaviours, lstrip/rstrip tokens) is refused by name rather
 * than silently tokenized differently.
 */
#include "tok_internal.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* GPT-2's byte-level split, used when ByteLevel has use_regex = true. */
static const char GPT2_PAT[] = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

typedef struct hf_ctx {
    kdt_tokenizer *t;
    const char *path;
    int saw_byte_level;
    int16_t cp_to_byte[0x144];
    uint32_t byte_to_cp[256];
} hf_ctx;

static const char *type_of(json_t *node) {
    json_t *ty = json_object_get(node, "type");
    return json_is_string(ty) ? json_string_value(ty) : NULL;
}

/* A regex matching the literal string s (Split with a "String" pattern). */
static kdt_status literal_regex(const char *s, size_t n, kdt_tok_text *out) {
    kdt_status st = kdt_tok_text_append(out, "", 0);
    for (size_t i = 0; i < n && st == KDT_OK; i++) {
        if (strchr("\\^$.|?*+()[]{}-&", s[i]) && s[i]) st = kdt_tok_text_append(out, "\\", 1);
        if (st == KDT_OK) st = kdt_tok_text_append(out, &s[i], 1);
    }
    return st;
}

static kdt_status add_pretokenizer(hf_ctx *c, json_t *node, const char *where, int depth) {
    const char *ty = type_of(node);
    if (!ty) return kdt_fail(KDT_ERR_FORMAT, "%s: %s has no \"type\"", c->path, where);
    if (depth > 4) return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: %s: pre-tokenizers nested too deeply", c->path, where);
    if (c->saw_byte_level)
        return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: %s (%s) comes after ByteLevel; only ByteLevel last is "
                        "supported", c->path, where, ty);
    char sub[96];
    kdt_status s;
    if (strcmp(ty, "Sequence") == 0) {
        json_t *list = json_object_get(node, "pretokenizers");
        if (!json_is_array(list)) return kdt_fail(KDT_ERR_FORMAT, "%s: %s.pretokenizers must be an array", c->path, where);
        size_t i;
        json_t *item;
        json_array_foreach(list, i, item) {
            snprintf(sub, sizeof sub, "%s.pretokenizers[%zu]", where, i);
            if ((s = add_pretokenizer(c, item, sub, depth + 1)) != KDT_OK) return s;
        }
        return KDT_OK;
    }
    if (strcmp(ty, "Split") == 0) {
        json_t *behavior = json_object_get(node, "behavior"), *invert = json_object_get(node, "invert");
        if (!json_is_string(behavior) || strcmp(json_string_value(behavior), "Isolated") != 0)
            return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: %s: Split behavior %s is not supported (only \"Isolated\")",
                            c->path, where, json_is_string(behavior) ? json_string_value(behavior) : "(missing)");
        if (json_is_true(invert))
            return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: %s: Split with invert = true is not supported", c->path, where);
        json_t *pattern = json_object_get(node, "pattern");
        json_t *re = json_object_get(pattern, "Regex"), *str = json_object_get(pattern, "String");
        snprintf(sub, sizeof sub, "%s: %s", c->path, where);
        if (json_is_string(re)) return kdt_tok_pretok_add(&c->t->pretok, json_string_value(re), json_string_length(re), sub);
        if (json_is_string(str)) {
            kdt_tok_text lit = {0};
            s = literal_regex(json_string_value(str), json_string_length(str), &lit);
            if (s == KDT_OK) s = kdt_tok_pretok_add(&c->t->pretok, lit.data, lit.len, sub);
            kdt_tok_text_free(&lit);
            return s;
        }
        return kdt_fail(KDT_ERR_FORMAT, "%s: %s.pattern must be {\"Regex\": ...} or {\"String\": ...}", c->path, where);
    }
    if (strcmp(ty, "ByteLevel") == 0) {
        if (json_is_true(json_object_get(node, "add_prefix_space")))
            return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: %s: ByteLevel add_prefix_space = true is not supported",
                            c->path, where);
        json_t *use_regex = json_object_get(node, "use_regex");
        if (!use_regex || json_is_true(use_regex)) { /* HF's default is true */
            snprintf(sub, sizeof sub, "%s: %s (GPT-2 regex)", c->path, where);
            if ((s = kdt_tok_pretok_add(&c->t->pretok, GPT2_PAT, strlen(GPT2_PAT), sub)) != KDT_OK) return s;
        }
        c->saw_byte_level = 1;
        return KDT_OK;
    }
    return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: %s: pre-tokenizer type \"%s\" is not supported", c->path, where, ty);
}

/* Byte-level vocab string -> bytes. Returns 0 if some character is outside the byte alphabet. */
static int bytelevel_decode(const hf_ctx *c, const char *s, size_t n, kdt_tok_text *out) {
    out->len = 0;
    for (size_t i = 0; i < n;) {
        size_t len;
        int32_t cp = kdt_utf8_decode((const uint8_t *)s + i, n - i, &len);
        if (cp < 0 || cp >= 0x144 || c->cp_to_byte[cp] < 0) return 0;
        uint8_t b = (uint8_t)c->cp_to_byte[cp];
        if (kdt_tok_text_append(out, &b, 1) != KDT_OK) return 0;
        i += len;
    }
    return 1;
}

static kdt_status check_model(hf_ctx *c, json_t *model) {
    const char *ty = type_of(model);
    if (ty && strcmp(ty, "BPE") != 0)
        return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: model.type \"%s\" is not supported (byte-level BPE only)", c->path, ty);
    json_t *v;
    if ((v = json_object_get(model, "dropout")) && !json_is_null(v) && json_number_value(v) != 0.0)
        return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: model.dropout is set; BPE dropout is not supported", c->path);
    if (json_is_true(json_object_get(model, "byte_fallback")))
        return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: model.byte_fallback = true is not supported", c->path);
    const char *affix[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int i = 0; i < 2; i++) {
        v = json_object_get(model, affix[i]);
        if (v && !json_is_null(v) && !(json_is_string(v) && json_string_length(v) == 0))
            return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: model.%s is set; not supported", c->path, affix[i]);
    }
    c->t->hf_ignore_merges = json_is_true(json_object_get(model, "ignore_merges"));
    return KDT_OK;
}

static kdt_status check_normalizer_decoder(hf_ctx *c, json_t *root) {
    json_t *norm = json_object_get(root, "normalizer");
    if (norm && !json_is_null(norm)) {
        const char *ty = type_of(norm);
        json_t *list = json_object_get(norm, "normalizers");
        if (!ty || strcmp(ty, "Sequence") != 0 || !json_is_array(list) || json_array_size(list) != 0)
            return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: normalizer \"%s\" is not supported (only none or an empty "
                            "Sequence)", c->path, ty ? ty : "?");
    }
    json_t *dec = json_object_get(root, "decoder");
    if (dec && !json_is_null(dec)) {
        const char *ty = type_of(dec);
        if (!ty || strcmp(ty, "ByteLevel") != 0)
            return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: decoder \"%s\" is not supported (only ByteLevel)", c->path,
                            ty ? ty : "?");
    }
    return KDT_OK;
}

/* HF numbers an added token itself: its vocab id if its text is a vocab entry, else one past the
 * largest id given so far (at least the vocab's entry count); the file's "id" only draws a
 * warning there. A file where the two disagree is refused, so we never pick silently. */
static kdt_status load_added(hf_ctx *c, json_t *vocab, json_t *added) {
    kdt_tokenizer *t = c->t;
    size_t i;
    json_t *a;
    kdt_status s;
    int64_t vocab_count = (int64_t)json_object_size(vocab), max_assigned = -1;
    json_array_foreach(added, i, a) {
        json_t *id = json_object_get(a, "id"), *content = json_object_get(a, "content");
        if (!json_is_integer(id) || json_integer_value(id) < 0 || json_integer_value(id) >= t->n_vocab)
            return kdt_fail(KDT_ERR_FORMAT, "%s: added_tokens[%zu].id is missing or not in [0, 2^24)", c->path, i);
        if (!json_is_string(content) || json_string_length(content) == 0)
            return kdt_fail(KDT_ERR_FORMAT, "%s: added_tokens[%zu].content must be a non-empty string", c->path, i);
        const char *flags[] = {"lstrip", "rstrip", "single_word"};
        for (int k = 0; k < 3; k++)
            if (json_is_true(json_object_get(a, flags[k])))
                return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: added_tokens[%zu] (\"%s\") has %s = true, which is not "
                                "supported", c->path, i, json_string_value(content), flags[k]);
        int32_t tid = (int32_t)json_integer_value(id);
        json_t *in_vocab = json_object_get(vocab, json_string_value(content));
        int64_t hf_id = json_is_integer(in_vocab) ? json_integer_value(in_vocab)
                        : max_assigned >= vocab_count ? max_assigned + 1 : vocab_count;
        if (hf_id > max_assigned) max_assigned = hf_id;
        if (hf_id != tid)
            return kdt_fail(KDT_ERR_FORMAT, "%s: added_tokens[%zu] (\"%s\") has id %d, but HF tokenizers numbers it "
                            "%lld (added tokens follow the vocab in order)", c->path, i, json_string_value(content),
                            tid, (long long)hf_id);
        if (t->tok_flags[tid] & TOKF_ADDED)
            return kdt_fail(KDT_ERR_FORMAT, "%s: added_tokens[%zu]: id %d is listed twice", c->path, i, tid);
        if ((s = kdt_tok_set_bytes(t, tid, json_string_value(content), json_string_length(content))) != KDT_OK)
            return s;
        t->tok_flags[tid] = TOKF_ADDED | (json_is_true(json_object_get(a, "special")) ? TOKF_SPECIAL : 0) |
                            (json_is_true(json_object_get(a, "normalized")) ? TOKF_NORMALIZED : 0);
    }
    return KDT_OK;
}

static kdt_status load_merges(hf_ctx *c, json_t *vocab, json_t *merges) {
    kdt_tokenizer *t = c->t;
    kdt_status s = kdt_tok_pair_init(&t->merges, json_array_size(merges));
    if (s != KDT_OK) return s;
    kdt_tok_text buf = {0};
    size_t i;
    json_t *m;
    json_array_foreach(merges, i, m) {
        const char *left, *right;
        size_t left_len, right_len;
        if (json_is_string(m)) { /* "a b" (tokens never contain a space: it is 'Ġ') */
            const char *str = json_string_value(m);
            const char *sp = strchr(str, ' ');
            if (!sp || strchr(sp + 1, ' ')) {
                s = kdt_fail(KDT_ERR_FORMAT, "%s: model.merges[%zu] (\"%s\") must be two tokens separated by "
                             "one space", c->path, i, str);
                break;
            }
            left = str;
            left_len = (size_t)(sp - str);
            right = sp + 1;
            right_len = strlen(right);
        } else if (json_is_array(m) && json_array_size(m) == 2 && json_is_string(json_array_get(m, 0)) &&
                   json_is_string(json_array_get(m, 1))) {
            left = json_string_value(json_array_get(m, 0));
            left_len = json_string_length(json_array_get(m, 0));
            right = json_string_value(json_array_get(m, 1));
            right_len = json_string_length(json_array_get(m, 1));
        } else {
            s = kdt_fail(KDT_ERR_FORMAT, "%s: model.merges[%zu] must be \"a b\" or [\"a\", \"b\"]", c->path, i);
            break;
        }
        /* left, right and left+right, each NUL-terminated in buf, for vocab lookups */
        buf.len = 0;
        s = kdt_tok_text_append(&buf, left, left_len);
        if (s == KDT_OK) s = kdt_tok_text_append(&buf, "", 1);
        if (s == KDT_OK) s = kdt_tok_text_append(&buf, right, right_len);
        if (s == KDT_OK) s = kdt_tok_text_append(&buf, "", 1);
        if (s == KDT_OK) s = kdt_tok_text_append(&buf, left, left_len);
        if (s == KDT_OK) s = kdt_tok_text_append(&buf, right, right_len);
        if (s != KDT_OK) break;
        const char *names[3] = {buf.data, buf.data + left_len + 1, buf.data + left_len + right_len + 2};
        int32_t ids[3];
        for (int k = 0; k < 3; k++) {
            json_t *id = json_object_get(vocab, names[k]);
            if (!json_is_integer(id)) {
                s = kdt_fail(KDT_ERR_FORMAT, "%s: model.merges[%zu] (\"%.*s\" + \"%.*s\"): \"%s\" is not in model.vocab",
                             c->path, i, (int)left_len, left, (int)right_len, right, names[k]);
                goto out;
            }
            ids[k] = (int32_t)json_integer_value(id);
        }
        if (kdt_tok_pair_insert(&t->merges, ids[0], ids[1], (int32_t)i, ids[2]) != KDT_OK) {
            s = kdt_fail(KDT_ERR_FORMAT, "%s: model.merges[%zu] (\"%.*s\" + \"%.*s\") appears twice", c->path, i,
                         (int)left_len, left, (int)right_len, right);
            break;
        }
    }
out:
    kdt_tok_text_free(&buf);
    return s;
}

kdt_status kdt_tok_load_hf(kdt_tokenizer *t, const char *json_path, const char *config_path) {
    t->kind = KDT_TOK_HF_BPE;
    hf_ctx c = {.t = t, .path = json_path};
    kdt_bytelevel_tables(c.byte_to_cp, c.cp_to_byte);
    char *text = NULL;
    size_t len = 0;
    json_t *root = NULL, *cfg = NULL;
    kdt_tok_text bytes = {0};
    kdt_status s = kdt_tok_read_file(json_path, &text, &len);
    if (s != KDT_OK) return s;
    json_error_t err;
    root = json_loadb(text, len, 0, &err);
    free(text);
    if (!root) return kdt_fail(KDT_ERR_FORMAT, "%s:%d:%d: invalid JSON: %s", json_path, err.line, err.column, err.text);

    json_t *model = json_object_get(root, "model");
    json_t *vocab = json_object_get(model, "vocab"), *merges = json_object_get(model, "merges");
    json_t *added = json_object_get(root, "added_tokens");
    if (!json_is_object(model)) {
        s = kdt_fail(KDT_ERR_FORMAT, "%s: no \"model\" object", json_path);
        goto out;
    }
    if ((s = check_model(&c, model)) != KDT_OK) goto out;
    if (!json_is_object(vocab) || !json_is_array(merges)) {
        s = kdt_fail(KDT_ERR_FORMAT, "%s: model.vocab must be an object and model.merges an array", json_path);
        goto out;
    }
    if (added && !json_is_array(added)) {
        s = kdt_fail(KDT_ERR_FORMAT, "%s: added_tokens must be an array", json_path);
        goto out;
    }
    if ((s = check_normalizer_decoder(&c, root)) != KDT_OK) goto out;
    json_t *pre = json_object_get(root, "pre_tokenizer");
    if (!pre || json_is_null(pre)) {
        s = kdt_fail(KDT_ERR_UNSUPPORTED, "%s: no pre_tokenizer; only byte-level BPE is supported", json_path);
        goto out;
    }
    if ((s = add_pretokenizer(&c, pre, "pre_tokenizer", 0)) != KDT_OK) goto out;
    if (!c.saw_byte_level) {
        s = kdt_fail(KDT_ERR_UNSUPPORTED, "%s: pre_tokenizer has no ByteLevel step; only byte-level BPE is "
                     "supported", json_path);
        goto out;
    }

    /* id space: vocab ids and added ids */
    int64_t max_id = -1;
    const char *key;
    json_t *v;
    json_object_foreach(vocab, key, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= KDT_TOK_MAX_ID) {
            s = kdt_fail(KDT_ERR_FORMAT, "%s: model.vocab[\"%s\"] is not a token id in [0, 2^24)", json_path, key);
            goto out;
        }
        if (json_integer_value(v) > max_id) max_id = json_integer_value(v);
    }
    size_t i;
    json_array_foreach(added, i, v) {
        json_t *id = json_object_get(v, "id");
        if (json_is_integer(id) && json_integer_value(id) > max_id && json_integer_value(id) < KDT_TOK_MAX_ID)
            max_id = json_integer_value(id);
    }
    if ((s = kdt_tok_alloc_ids(t, (int32_t)(max_id + 1))) != KDT_OK) goto out;
    json_object_foreach(vocab, key, v) {
        int32_t id = (int32_t)json_integer_value(v);
        if (t->tok_len[id] >= 0) {
            s = kdt_fail(KDT_ERR_FORMAT, "%s: model.vocab: id %d is given to two tokens (one is \"%s\")", json_path,
                         id, key);
            goto out;
        }
        size_t klen = strlen(key);
        /* a string outside the byte alphabet (e.g. an added token's text) is kept as its UTF-8 */
        if (bytelevel_decode(&c, key, klen, &bytes)) s = kdt_tok_set_bytes(t, id, bytes.data, bytes.len);
        else s = kdt_tok_set_bytes(t, id, key, klen);
        if (s != KDT_OK) goto out;
    }
    if ((s = load_added(&c, vocab, added)) != KDT_OK) goto out;
    if ((s = load_merges(&c, vocab, merges)) != KDT_OK) goto out;
    if ((s = kdt_tok_finish(t, json_path)) != KDT_OK) goto out;
    if (config_path) {
        cfg = json_load_file(config_path, 0, &err);
        if (!cfg || !json_is_object(cfg)) {
            s = kdt_fail(KDT_ERR_FORMAT, "%s:%d:%d: invalid JSON: %s", config_path, err.line, err.column,
                         cfg ? "top level must be an object" : err.text);
            goto out;
        }
        kdt_tok_config_bos_eos(t, cfg);
    }
out:
    kdt_tok_text_free(&bytes);
    json_decref(cfg);
    json_decref(root);
    return s;
}
