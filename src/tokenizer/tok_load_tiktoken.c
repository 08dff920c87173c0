/* tok_load_tiktoken.c - loads a tiktoken BPE file (Kimi K2's tiktoken.model: one line per token,
 * "base64(token bytes) rank", ranks 0..N-1) and the optional tokenizer_config.json beside it
 * (special tokens, bos/eos, and kdtree's options: pat_str, num_reserved_special_tokens,
 * split_long_runs). Every malformed line is reported with file and line number.
 */
#include "tok_internal.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Kimi K2's pre-tokenizer pattern (tokenization_kimi.py, TikTokenTokenizer.pat_str). */
static const char KIMI_PAT_STR[] =
    "[\\p{Han}]+"
    "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*"
    "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+"
    "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    "|\\p{N}{1,3}"
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+"
    "|\\s+(?!\\S)"
    "|\\s+";

#define KIMI_NUM_RESERVED 256

typedef struct rank_line {
    const char *b64; /* points into the file text */
    size_t b64_len;
    int32_t rank;
    int32_t line;
} rank_line;

static int is_blank(char c) { return c == ' ' || c == '\t' || c == '\r'; }

/* Parses every line into `lines` (malloc'd). */
static kdt_status parse_lines(const char *path, const char *text, size_t len, rank_line **out, size_t *n_out) {
    size_t cap = 1024, n = 0;
    rank_line *lines = malloc(cap * sizeof *lines);
    if (!lines) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    kdt_status s = KDT_OK;
    int32_t line_no = 0;
    for (size_t i = 0; i < len;) {
        const char *ln = text + i;
        const char *nl = memchr(ln, '\n', len - i);
        size_t ll = nl ? (size_t)(nl - ln) : len - i;
        i += ll + (nl != NULL);
        line_no++;
        /* fields separated by blanks (Python's line.split()); blank lines are skipped */
        const char *f[3];
        size_t fl[3];
        int nf = 0;
        for (size_t k = 0; k < ll;) {
            while (k < ll && is_blank(ln[k])) k++;
            if (k == ll) break;
            size_t start = k;
            while (k < ll && !is_blank(ln[k])) k++;
            if (nf < 3) {
                f[nf] = ln + start;
                fl[nf] = k - start;
            }
            nf++;
        }
        if (nf == 0) continue;
        if (nf != 2) {
            s = kdt_fail(KDT_ERR_FORMAT, "%s:%d: expected \"<base64 token> <rank>\", found %d field%s", path,
                         line_no, nf, nf == 1 ? "" : "s");
            break;
        }
        long long rank = 0;
        for (size_t k = 0; k < fl[1]; k++) {
            char c = f[1][k];
            if (c < '0' || c > '9' || rank > INT32_MAX / 2) {
                s = kdt_fail(KDT_ERR_FORMAT, "%s:%d: rank \"%.*s\" is not a non-negative integer below 2^30",
                             path, line_no, (int)(fl[1] < 40 ? fl[1] : 40), f[1]);
                goto done;
            }
            rank = rank * 10 + (c - '0');
        }
        if (n == cap) {
            cap *= 2;
            rank_line *p = realloc(lines, cap * sizeof *p);
            if (!p) {
                s = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
                break;
            }
            lines = p;
        }
        lines[n++] = (rank_line){f[0], fl[0], (int32_t)rank, line_no};
    }
done:
    if (s == KDT_OK && n == 0) s = kdt_fail(KDT_ERR_FORMAT, "%s: no tokens in the file", path);
    if (s != KDT_OK) {
        free(lines);
        return s;
    }
    *out = lines;
    *n_out = n;
    return KDT_OK;
}

/* Reads the tiktoken options and special tokens from tokenizer_config.json (cfg may be NULL). */
static kdt_status load_specials(kdt_tokenizer *t, json_t *cfg, const char *cfg_path, int32_t n_reserved) {
    char name[64];
    kdt_status s;
    json_t *added = cfg ? json_object_get(cfg, "added_tokens_decoder") : NULL;
    if (added && !json_is_object(added))
        return kdt_fail(KDT_ERR_FORMAT, "%s: added_tokens_decoder must be an object", cfg_path);
    /* the reserved block first: every id gets a name, a configured one wins below */
    for (int32_t k = 0; k < n_reserved; k++) {
        int32_t id = t->n_ranks + k;
        snprintf(name, sizeof name, "<|reserved_token_%d|>", id);
        if ((s = kdt_tok_set_bytes(t, id, name, strlen(name))) != KDT_OK) return s;
        t->tok_flags[id] = TOKF_ADDED | TOKF_SPECIAL;
    }
    const char *key;
    json_t *v;
    json_object_foreach(added, key, v) {
        char *end;
        long id = strtol(key, &end, 10);
        if (!key[0] || *end || id < 0 || id >= t->n_vocab)
            return kdt_fail(KDT_ERR_FORMAT, "%s: added_tokens_decoder key \"%s\" is not a token id in [0, 2^24)",
                            cfg_path, key);
        if (id < t->n_ranks)
            return kdt_fail(KDT_ERR_FORMAT, "%s: added_tokens_decoder[\"%s\"] collides with BPE rank %ld of "
                            "tiktoken.model", cfg_path, key, id);
        json_t *content = json_is_object(v) ? json_object_get(v, "content") : NULL;
        if (!json_is_string(content) || json_string_length(content) == 0)
            return kdt_fail(KDT_ERR_FORMAT, "%s: added_tokens_decoder[\"%s\"].content must be a non-empty string",
                            cfg_path, key);
        json_t *special = json_object_get(v, "special");
        if ((s = kdt_tok_set_bytes(t, (int32_t)id, json_string_value(content), json_string_length(content))) != KDT_OK)
            return s;
        t->tok_flags[id] = TOKF_ADDED | (special && json_is_false(special) ? 0 : TOKF_SPECIAL);
    }
    return KDT_OK;
}

kdt_status kdt_tok_load_tiktoken(kdt_tokenizer *t, const char *model_path, const char *config_path) {
    t->kind = KDT_TOK_TIKTOKEN;
    char *text = NULL;
    size_t len = 0;
    rank_line *lines = NULL;
    size_t n = 0;
    int32_t *line_of_rank = NULL;
    uint8_t *buf = NULL;
    json_t *cfg = NULL;
    kdt_status s = kdt_tok_read_file(model_path, &text, &len);
    if (s != KDT_OK) return s;
    if ((s = parse_lines(model_path, text, len, &lines, &n)) != KDT_OK) goto out;
    if (n + (size_t)KIMI_NUM_RESERVED > KDT_TOK_MAX_ID) {
        s = kdt_fail(KDT_ERR_FORMAT, "%s: too many tokens (%zu)", model_path, n);
        goto out;
    }

    /* options */
    int32_t n_reserved = KIMI_NUM_RESERVED;
    const char *pat = KIMI_PAT_STR;
    size_t pat_len = strlen(KIMI_PAT_STR);
    const char *pat_from = model_path; /* the file named by pattern errors */
    t->split_long_runs = 1;
    int32_t max_added = -1;
    if (config_path) {
        json_error_t err;
        cfg = json_load_file(config_path, 0, &err);
        if (!cfg) {
            s = kdt_fail(KDT_ERR_FORMAT, "%s:%d:%d: invalid JSON: %s", config_path, err.line, err.column, err.text);
            goto out;
        }
        if (!json_is_object(cfg)) {
            s = kdt_fail(KDT_ERR_FORMAT, "%s: top level must be an object", config_path);
            goto out;
        }
        json_t *v = json_object_get(cfg, "num_reserved_special_tokens");
        if (v) {
            if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > 1 << 20) {
                s = kdt_fail(KDT_ERR_FORMAT, "%s: num_reserved_special_tokens must be an integer in [0, 2^20]",
                             config_path);
                goto out;
            }
            n_reserved = (int32_t)json_integer_value(v);
        }
        if ((v = json_object_get(cfg, "pat_str"))) {
            if (!json_is_string(v) || json_string_length(v) == 0) {
                s = kdt_fail(KDT_ERR_FORMAT, "%s: pat_str must be a non-empty string", config_path);
                goto out;
            }
            pat = json_string_value(v);
            pat_len = json_string_length(v);
            pat_from = config_path; /* its errors name the file the pattern came from */
        }
        if ((v = json_object_get(cfg, "split_long_runs"))) {
            if (!json_is_boolean(v)) {
                s = kdt_fail(KDT_ERR_FORMAT, "%s: split_long_runs must be true or false", config_path);
                goto out;
            }
            t->split_long_runs = json_is_true(v);
        }
        const char *key;
        json_t *tokv;
        json_object_foreach(json_object_get(cfg, "added_tokens_decoder"), key, tokv) {
            long id = strtol(key, NULL, 10);
            if (id > max_added && id < KDT_TOK_MAX_ID) max_added = (int32_t)id;
        }
    }

    /* ranks: exactly 0..n-1, each once */
    t->n_ranks = (int32_t)n;
    int32_t n_vocab = t->n_ranks + n_reserved;
    if (max_added + 1 > n_vocab) n_vocab = max_added + 1;
    if ((s = kdt_tok_alloc_ids(t, n_vocab)) != KDT_OK) goto out;
    line_of_rank = calloc(n, sizeof *line_of_rank);
    buf = malloc(4096);
    if (!line_of_rank || !buf) {
        s = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "%s: out of memory", model_path);
        goto out;
    }
    if ((s = kdt_tok_bytes_map_init(t)) != KDT_OK) goto out;
    for (size_t i = 0; i < n; i++) {
        const rank_line *l = &lines[i];
        if (l->rank >= (int32_t)n) {
            s = kdt_fail(KDT_ERR_FORMAT, "%s:%d: rank %d, but the file has %zu tokens: ranks must be 0..%zu "
                         "without gaps", model_path, l->line, l->rank, n, n - 1);
            goto out;
        }
        if (line_of_rank[l->rank]) {
            s = kdt_fail(KDT_ERR_FORMAT, "%s:%d: rank %d is already used on line %d", model_path, l->line,
                         l->rank, line_of_rank[l->rank]);
            goto out;
        }
        line_of_rank[l->rank] = l->line;
        if (l->b64_len > 4096 / 3 * 4) {
            s = kdt_fail(KDT_ERR_FORMAT, "%s:%d: token longer than 3072 bytes", model_path, l->line);
            goto out;
        }
        long got = kdt_base64_decode(l->b64, l->b64_len, buf);
        if (got <= 0) {
            s = kdt_fail(KDT_ERR_FORMAT, "%s:%d: \"%.*s\" is not valid base64 of a non-empty token", model_path,
                         l->line, (int)(l->b64_len < 40 ? l->b64_len : 40), l->b64);
            goto out;
        }
        if ((s = kdt_tok_set_bytes(t, l->rank, buf, (size_t)got)) != KDT_OK) goto out;
        int32_t other = kdt_tok_bytes_map_insert(t, l->rank);
        if (other >= 0) {
            s = kdt_fail(KDT_ERR_FORMAT, "%s:%d: token bytes repeat those of rank %d (line %d)", model_path,
                         l->line, other, line_of_rank[other]);
            goto out;
        }
    }
    if ((s = load_specials(t, cfg, config_path ? config_path : "tokenizer_config.json", n_reserved)) != KDT_OK)
        goto out;
    if ((s = kdt_tok_pretok_add(&t->pretok, pat, pat_len, pat_from)) != KDT_OK) goto out;
    if ((s = kdt_tok_finish(t, model_path)) != KDT_OK) goto out;
    if (cfg) kdt_tok_config_bos_eos(t, cfg);
out:
    json_decref(cfg);
    free(buf);
    free(line_of_rank);
    free(lines);
    free(text);
    return s;
}
