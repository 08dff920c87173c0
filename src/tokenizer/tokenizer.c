/* tokenizer.c - the tokenizer object: loading (format detection), the token table and its maps,
 * encoding (special-token split -> UTF-8 validity split -> regex pre-tokenization -> BPE),
 * decoding and special-token lookups.
 *
 * BPE is the rank-based merge loop both references use: repeatedly merge the adjacent pair with
 * the lowest rank, leftmost on ties. tiktoken ranks a pair by the rank of its concatenated bytes
 * (and takes a piece that is itself a token whole); HF ranks it by its position in the merges
 * list. Candidates sit in a binary heap keyed (rank, position) over a doubly linked list of
 * symbols, stale entries are skipped when popped: O(n log n) per piece, so a 25k-space run costs
 * no more than 25k ordinary bytes.
 */
#include "tok_internal.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* ---- token table ----------------------------------------------------------------------------- */

kdt_status kdt_tok_alloc_ids(kdt_tokenizer *t, int32_t n_vocab) {
    if (n_vocab <= 0) return kdt_fail(KDT_ERR_FORMAT, "tokenizer: empty vocabulary");
    t->n_vocab = n_vocab;
    t->tok_off = calloc((size_t)n_vocab, sizeof *t->tok_off);
    t->tok_len = malloc((size_t)n_vocab * sizeof *t->tok_len);
    t->tok_flags = calloc((size_t)n_vocab, 1);
    if (!t->tok_off || !t->tok_len || !t->tok_flags)
        return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "tokenizer: out of memory for %d tokens", n_vocab);
    for (int32_t i = 0; i < n_vocab; i++) t->tok_len[i] = -1;
    return KDT_OK;
}

kdt_status kdt_tok_set_bytes(kdt_tokenizer *t, int32_t id, const void *bytes, size_t len) {
    if (t->arena_len + len + 1 > t->arena_cap) {
        size_t cap = t->arena_cap ? t->arena_cap : 1 << 16;
        while (cap < t->arena_len + len + 1) cap *= 2;
        char *p = realloc(t->arena, cap);
        if (!p) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "tokenizer: out of memory for token bytes");
        t->arena = p;
        t->arena_cap = cap;
    }
    if (t->arena_len + len > UINT32_MAX)
        return kdt_fail(KDT_ERR_CAPACITY, "tokenizer: token bytes exceed 4 GiB");
    if (len) memcpy(t->arena + t->arena_len, bytes, len);
    t->tok_off[id] = (uint32_t)t->arena_len;
    t->tok_len[id] = (int32_t)len;
    t->arena[t->arena_len + len] = '\0'; /* so special names can be handed out as C strings */
    t->arena_len += len + 1;
    return KDT_OK;
}

static uint64_t hash_bytes(const uint8_t *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h ^ (h >> 29);
}

static size_t pow2_at_least(size_t n) {
    size_t c = 16;
    while (c < n) c *= 2;
    return c;
}

int32_t kdt_tok_lookup_bytes(const kdt_tokenizer *t, const void *bytes, size_t len) {
    const tok_bytes_map *m = &t->bpe_by_bytes;
    if (!m->slots) return -1;
    uint32_t i = (uint32_t)hash_bytes(bytes, len) & m->mask;
    for (;; i = (i + 1) & m->mask) {
        int32_t id = m->slots[i];
        if (id < 0) return -1;
        if ((size_t)t->tok_len[id] == len && memcmp(t->arena + t->tok_off[id], bytes, len) == 0) return id;
    }
}

kdt_status kdt_tok_bytes_map_init(kdt_tokenizer *t) {
    size_t cap = pow2_at_least((size_t)t->n_vocab * 2);
    t->bpe_by_bytes.slots = malloc(cap * sizeof(int32_t));
    if (!t->bpe_by_bytes.slots) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "tokenizer: out of memory for the vocabulary map");
    for (size_t i = 0; i < cap; i++) t->bpe_by_bytes.slots[i] = -1;
    t->bpe_by_bytes.mask = (uint32_t)(cap - 1);
    return KDT_OK;
}

int32_t kdt_tok_bytes_map_insert(kdt_tokenizer *t, int32_t id) {
    tok_bytes_map *m = &t->bpe_by_bytes;
    const char *b = t->arena + t->tok_off[id];
    size_t len = (size_t)t->tok_len[id];
    uint32_t i = (uint32_t)hash_bytes((const uint8_t *)b, len) & m->mask;
    for (;; i = (i + 1) & m->mask) {
        int32_t other = m->slots[i];
        if (other < 0) {
            m->slots[i] = id;
            return -1;
        }
        if ((size_t)t->tok_len[other] == len && memcmp(t->arena + t->tok_off[other], b, len) == 0)
            return other;
    }
}

kdt_status kdt_tok_pair_init(tok_pair_map *m, size_t n) {
    size_t cap = pow2_at_least(n * 2 + 1);
    m->keys = malloc(cap * sizeof *m->keys);
    m->rank = malloc(cap * sizeof *m->rank);
    m->merged = malloc(cap * sizeof *m->merged);
    if (!m->keys || !m->rank || !m->merged)
        return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "tokenizer: out of memory for %zu merges", n);
    for (size_t i = 0; i < cap; i++) m->keys[i] = UINT64_MAX;
    m->mask = (uint32_t)(cap - 1);
    return KDT_OK;
}

static uint32_t hash_pair(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return (uint32_t)k;
}

kdt_status kdt_tok_pair_insert(tok_pair_map *m, int32_t a, int32_t b, int32_t rank, int32_t merged) {
    uint64_t k = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    uint32_t i = hash_pair(k) & m->mask;
    while (m->keys[i] != UINT64_MAX) {
        if (m->keys[i] == k) return KDT_ERR_FORMAT; /* caller names the duplicate */
        i = (i + 1) & m->mask;
    }
    m->keys[i] = k;
    m->rank[i] = rank;
    m->merged[i] = merged;
    return KDT_OK;
}

int kdt_tok_pair_find(const tok_pair_map *m, int32_t a, int32_t b, int32_t *rank, int32_t *merged) {
    uint64_t k = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    uint32_t i = hash_pair(k) & m->mask;
    for (;; i = (i + 1) & m->mask) {
        if (m->keys[i] == UINT64_MAX) return 0;
        if (m->keys[i] == k) {
            *rank = m->rank[i];
            *merged = m->merged[i];
            return 1;
        }
    }
}

/* ---- special-token trie ---------------------------------------------------------------------- */

static int32_t trie_new_node(tok_trie *tr, uint8_t byte) {
    if (tr->n == tr->cap) {
        int32_t cap = tr->cap ? tr->cap * 2 : 256;
        tok_trie_node *p = realloc(tr->nodes, (size_t)cap * sizeof *p);
        if (!p) return -1;
        tr->nodes = p;
        tr->cap = cap;
    }
    tok_trie_node *nd = &tr->nodes[tr->n];
    nd->child = nd->sibling = nd->token = -1;
    nd->byte = byte;
    return tr->n++;
}

static kdt_status trie_insert(tok_trie *tr, const uint8_t *s, size_t len, int32_t token) {
    if (tr->n == 0 && trie_new_node(tr, 0) < 0) goto oom;
    int32_t node = 0;
    for (size_t i = 0; i < len; i++) {
        int32_t c = tr->nodes[node].child;
        while (c >= 0 && tr->nodes[c].byte != s[i]) c = tr->nodes[c].sibling;
        if (c < 0) {
            c = trie_new_node(tr, s[i]);
            if (c < 0) goto oom;
            tr->nodes[c].sibling = tr->nodes[node].child;
            tr->nodes[node].child = c;
        }
        node = c;
    }
    tr->nodes[node].token = token;
    tr->first[s[0] >> 3] |= (uint8_t)(1u << (s[0] & 7));
    return KDT_OK;
oom:
    return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "tokenizer: out of memory for the special-token trie");
}

/* The longest token that starts at s[0]: its id (and *len), or -1. */
static int32_t trie_longest(const tok_trie *tr, const uint8_t *s, size_t n, size_t *len) {
    if (tr->n == 0 || !(tr->first[s[0] >> 3] & (1u << (s[0] & 7)))) return -1;
    int32_t node = 0, best = -1;
    for (size_t i = 0; i < n; i++) {
        int32_t c = tr->nodes[node].child;
        while (c >= 0 && tr->nodes[c].byte != s[i]) c = tr->nodes[c].sibling;
        if (c < 0) break;
        node = c;
        if (tr->nodes[node].token >= 0) {
            best = tr->nodes[node].token;
            *len = i + 1;
        }
    }
    return best;
}

static int32_t trie_exact(const tok_trie *tr, const uint8_t *s, size_t n) {
    size_t len = 0;
    if (n == 0) return -1;
    int32_t id = trie_longest(tr, s, n, &len);
    return id >= 0 && len == n ? id : -1;
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

kdt_status kdt_tok_finish(kdt_tokenizer *t, const char *what) {
    kdt_status s;
    if (!t->bpe_by_bytes.slots) {
        if ((s = kdt_tok_bytes_map_init(t)) != KDT_OK) return s;
        for (int32_t id = 0; id < t->n_vocab; id++) {
            if (t->tok_len[id] <= 0 || (t->tok_flags[id] & TOKF_ADDED)) continue;
            int32_t other = kdt_tok_bytes_map_insert(t, id);
            if (other >= 0)
                return kdt_fail(KDT_ERR_FORMAT, "%s: tokens %d and %d have the same bytes", what, other, id);
        }
    }
    t->max_token_len = 1;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        if (t->tok_flags[id] & TOKF_ADDED) continue;
        if (t->tok_len[id] > 65535)
            return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: token %d is %d bytes long (the limit is 65535)", what, id,
                            t->tok_len[id]);
        if (t->tok_len[id] > (int32_t)t->max_token_len) t->max_token_len = (uint32_t)t->tok_len[id];
    }
    for (int b = 0; b < 256; b++) {
        uint8_t byte = (uint8_t)b;
        t->byte_id[b] = kdt_tok_lookup_bytes(t, &byte, 1);
        if (t->byte_id[b] < 0)
            return kdt_fail(KDT_ERR_FORMAT, "%s: no token for the single byte 0x%02X (byte-level BPE "
                            "needs all 256)", what, b);
    }
    size_t n_special = 0;
    for (int32_t id = 0; id < t->n_vocab; id++) n_special += (t->tok_flags[id] & TOKF_ADDED) != 0;
    t->special_ids = malloc((n_special ? n_special : 1) * sizeof *t->special_ids);
    if (!t->special_ids) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "%s: out of memory", what);
    t->n_special = 0;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        if (!(t->tok_flags[id] & TOKF_ADDED)) continue;
        if (t->tok_len[id] <= 0) return kdt_fail(KDT_ERR_FORMAT, "%s: special token %d is empty", what, id);
        t->special_ids[t->n_special++] = id;
        tok_trie *tr = (t->tok_flags[id] & TOKF_NORMALIZED) ? &t->specials_norm : &t->specials_raw;
        const uint8_t *b = (const uint8_t *)t->arena + t->tok_off[id];
        if (trie_exact(&t->specials_raw, b, (size_t)t->tok_len[id]) >= 0 ||
            trie_exact(&t->specials_norm, b, (size_t)t->tok_len[id]) >= 0)
            return kdt_fail(KDT_ERR_FORMAT, "%s: special token \"%.*s\" (id %d) is defined twice", what,
                            t->tok_len[id], (const char *)b, id);
        if ((s = trie_insert(tr, b, (size_t)t->tok_len[id], id)) != KDT_OK) return s;
    }
    qsort(t->special_ids, t->n_special, sizeof *t->special_ids, cmp_i32);
    return KDT_OK;
}

/* ---- loading --------------------------------------------------------------------------------- */

static int is_dir(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

static int is_file(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

/* dir + "/" + name, or NULL (out of memory). */
static char *path_join(const char *dir, size_t dir_len, const char *name) {
    size_t n = dir_len + 1 + strlen(name) + 1;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%.*s/%s", (int)dir_len, dir, name);
    return p;
}

static int32_t config_token_id(const kdt_tokenizer *t, json_t *v) {
    if (json_is_object(v)) v = json_object_get(v, "content");
    if (!json_is_string(v)) return -1;
    const uint8_t *name = (const uint8_t *)json_string_value(v);
    size_t n = json_string_length(v);
    int32_t id = trie_exact(&t->specials_raw, name, n);
    if (id < 0) id = trie_exact(&t->specials_norm, name, n);
    if (id < 0) id = kdt_tok_lookup_bytes(t, name, n);
    return id;
}

void kdt_tok_config_bos_eos(kdt_tokenizer *t, const void *config_json) {
    json_t *cfg = (json_t *)config_json;
    t->bos_id = config_token_id(t, json_object_get(cfg, "bos_token"));
    t->eos_id = config_token_id(t, json_object_get(cfg, "eos_token"));
}

kdt_status kdt_tokenizer_load(const char *path, kdt_tokenizer **out) {
    KDT_CHECK_ARG(out != NULL, "tokenizer_load: out is NULL");
    *out = NULL;
    KDT_CHECK_ARG(path != NULL && path[0], "tokenizer_load: path is NULL or empty");
    char *model = NULL, *config = NULL;
    int tiktoken = 0;
    kdt_status s = KDT_OK;
    if (is_dir(path)) {
        size_t n = strlen(path);
        model = path_join(path, n, "tiktoken.model");
        config = path_join(path, n, "tokenizer_config.json");
        if (!model || !config) {
            s = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "tokenizer_load: out of memory");
            goto done;
        }
        if (is_file(model)) {
            tiktoken = 1;
        } else {
            free(model);
            model = path_join(path, n, "tokenizer.json");
            if (!model) {
                s = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "tokenizer_load: out of memory");
                goto done;
            }
            if (!is_file(model)) {
                s = kdt_fail(KDT_ERR_IO, "tokenizer_load: %s has neither tiktoken.model nor tokenizer.json", path);
                goto done;
            }
        }
    } else {
        FILE *f = fopen(path, "rb");
        if (!f) {
            s = kdt_fail(KDT_ERR_IO, "tokenizer_load: cannot open %s", path);
            goto done;
        }
        int c;
        while ((c = fgetc(f)) == ' ' || c == '\n' || c == '\r' || c == '\t') {}
        fclose(f);
        tiktoken = c != '{';
        model = strdup(path);
        const char *slash = strrchr(path, '/');
        config = slash ? path_join(path, (size_t)(slash - path), "tokenizer_config.json")
                       : strdup("tokenizer_config.json");
        if (!model || !config) {
            s = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "tokenizer_load: out of memory");
            goto done;
        }
    }
    if (!is_file(config)) {
        free(config);
        config = NULL;
    }
    kdt_tokenizer *t = calloc(1, sizeof *t);
    if (!t) {
        s = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "tokenizer_load: out of memory");
        goto done;
    }
    t->bos_id = t->eos_id = -1;
    s = tiktoken ? kdt_tok_load_tiktoken(t, model, config) : kdt_tok_load_hf(t, model, config);
    if (s != KDT_OK) {
        kdt_tokenizer_free(t);
        goto done;
    }
    *out = t;
done:
    free(model);
    free(config);
    return s;
}

void kdt_tokenizer_free(kdt_tokenizer *t) {
    if (!t) return;
    free(t->tok_off);
    free(t->tok_len);
    free(t->tok_flags);
    free(t->arena);
    free(t->bpe_by_bytes.slots);
    free(t->merges.keys);
    free(t->merges.rank);
    free(t->merges.merged);
    free(t->specials_raw.nodes);
    free(t->specials_norm.nodes);
    free(t->special_ids);
    kdt_tok_pretok_free(&t->pretok);
    free(t);
}

/* ---- simple queries -------------------------------------------------------------------------- */

kdt_tok_kind kdt_tokenizer_kind(const kdt_tokenizer *t) { return t ? t->kind : (kdt_tok_kind)0; }
int32_t kdt_tokenizer_vocab_size(const kdt_tokenizer *t) { return t ? t->n_vocab : 0; }
int32_t kdt_tokenizer_bos(const kdt_tokenizer *t) { return t ? t->bos_id : -1; }
int32_t kdt_tokenizer_eos(const kdt_tokenizer *t) { return t ? t->eos_id : -1; }
size_t kdt_tokenizer_special_count(const kdt_tokenizer *t) { return t ? t->n_special : 0; }

int kdt_tokenizer_is_special(const kdt_tokenizer *t, int32_t id) {
    return t && id >= 0 && id < t->n_vocab && (t->tok_flags[id] & TOKF_SPECIAL) != 0;
}

/* index: the position in an id array for the message, or SIZE_MAX for a single id */
static kdt_status check_id(const kdt_tokenizer *t, int32_t id, const char *what, size_t index) {
    char where[48];
    if (index == SIZE_MAX) snprintf(where, sizeof where, "id %d", id);
    else snprintf(where, sizeof where, "ids[%zu] = %d", index, id);
    if (id < 0 || id >= t->n_vocab)
        return kdt_fail(KDT_ERR_INVALID_ARG, "%s: %s is outside [0, %d)", what, where, t->n_vocab);
    if (t->tok_len[id] < 0)
        return kdt_fail(KDT_ERR_INVALID_ARG, "%s: %s is not a token of this vocabulary", what, where);
    return KDT_OK;
}

kdt_status kdt_tok_check_id(const kdt_tokenizer *t, int32_t id, const char *what) {
    return check_id(t, id, what, SIZE_MAX);
}

kdt_status kdt_tokenizer_token_bytes(const kdt_tokenizer *t, int32_t id, const char **bytes, size_t *len) {
    KDT_CHECK_ARG(t && bytes && len, "tokenizer_token_bytes: NULL argument");
    kdt_status s = check_id(t, id, "tokenizer_token_bytes", SIZE_MAX);
    if (s != KDT_OK) return s;
    *bytes = t->arena + t->tok_off[id];
    *len = (size_t)t->tok_len[id];
    return KDT_OK;
}

kdt_status kdt_tokenizer_special_id(const kdt_tokenizer *t, const char *name, int32_t *id) {
    KDT_CHECK_ARG(t && name && id, "tokenizer_special_id: NULL argument");
    size_t n = strlen(name);
    int32_t found = trie_exact(&t->specials_raw, (const uint8_t *)name, n);
    if (found < 0) found = trie_exact(&t->specials_norm, (const uint8_t *)name, n);
    if (found < 0) return kdt_fail(KDT_ERR_INVALID_ARG, "tokenizer_special_id: no special token \"%s\"", name);
    *id = found;
    return KDT_OK;
}

kdt_status kdt_tokenizer_special_at(const kdt_tokenizer *t, size_t i, int32_t *id, const char **name) {
    KDT_CHECK_ARG(t && id && name, "tokenizer_special_at: NULL argument");
    KDT_CHECK_ARG(i < t->n_special, "tokenizer_special_at: i = %zu, count = %zu", i, t->n_special);
    *id = t->special_ids[i];
    *name = t->arena + t->tok_off[*id]; /* NUL-terminated: see kdt_tok_set_bytes */
    return KDT_OK;
}

/* ---- BPE ------------------------------------------------------------------------------------- */

/* A candidate merge. 16 bytes and a 4-ary heap: long pieces make the heap large, and its
 * sift-downs are bound by cache misses, so four children share one cache line. */
typedef struct merge_cand {
    uint64_t key;       /* rank << 32 | left position: the heap order */
    uint16_t left_len;  /* the two symbols' lengths when pushed (tokens are < 64 KiB) */
    uint16_t right_len;
    int32_t merged;     /* the merged symbol's id (tiktoken: the rank itself) */
} merge_cand;

typedef struct enc_ctx {
    const kdt_tokenizer *t;
    kdt_tok_ids *out;
    pcre2_match_data *md;
    size_t cap;       /* capacity of the per-piece arrays below */
    uint32_t *next;   /* [cap] start of the next symbol (n at the end) */
    uint32_t *prev;   /* [cap] start of the previous symbol (UINT32_MAX at the start) */
    int32_t *sym_id;  /* [cap] the symbol's token id */
    uint8_t *alive;   /* [cap] the position starts a live symbol */
    merge_cand *heap; /* [heap_cap] 4-ary min-heap of candidates, stale ones skipped when popped */
    size_t heap_n, heap_cap;
} enc_ctx;

static kdt_status ctx_reserve(enc_ctx *c, size_t n) {
    if (n <= c->cap) return KDT_OK;
    size_t cap = c->cap ? c->cap : 256;
    while (cap < n) cap *= 2;
    uint32_t *nx = realloc(c->next, cap * sizeof *nx);
    if (nx) c->next = nx;
    uint32_t *pv = realloc(c->prev, cap * sizeof *pv);
    if (pv) c->prev = pv;
    int32_t *id = realloc(c->sym_id, cap * sizeof *id);
    if (id) c->sym_id = id;
    uint8_t *al = realloc(c->alive, cap);
    if (al) c->alive = al;
    if (!nx || !pv || !id || !al) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "tokenizer: out of memory (piece of %zu bytes)", n);
    c->cap = cap;
    return KDT_OK;
}

static kdt_status heap_push(enc_ctx *c, merge_cand e) {
    if (c->heap_n == c->heap_cap) {
        size_t cap = c->heap_cap ? c->heap_cap * 2 : 256;
        merge_cand *h = realloc(c->heap, cap * sizeof *h);
        if (!h) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "tokenizer: out of memory for BPE candidates");
        c->heap = h;
        c->heap_cap = cap;
    }
    size_t i = c->heap_n++;
    while (i > 0) {
        size_t parent = (i - 1) / 4;
        if (c->heap[parent].key <= e.key) break;
        c->heap[i] = c->heap[parent];
        i = parent;
    }
    c->heap[i] = e;
    return KDT_OK;
}

static merge_cand heap_pop(enc_ctx *c) {
    merge_cand top = c->heap[0], last = c->heap[--c->heap_n];
    size_t i = 0, n = c->heap_n;
    for (;;) {
        size_t first = 4 * i + 1, m = i;
        uint64_t mk = last.key;
        for (size_t ch = first; ch < first + 4 && ch < n; ch++)
            if (c->heap[ch].key < mk) {
                m = ch;
                mk = c->heap[ch].key;
            }
        if (m == i) break;
        c->heap[i] = c->heap[m];
        i = m;
    }
    if (n) c->heap[i] = last;
    return top;
}

/* Pushes the candidate merge of the symbols starting at `left` and `mid` if it has a rank. */
static kdt_status push_pair(enc_ctx *c, const uint8_t *p, uint32_t left, uint32_t mid, uint32_t end) {
    const kdt_tokenizer *t = c->t;
    int32_t rank, merged = -1;
    if (end - left > t->max_token_len) return KDT_OK; /* no token is that long */
    if (t->kind == KDT_TOK_TIKTOKEN) {
        rank = merged = kdt_tok_lookup_bytes(t, p + left, end - left);
        if (rank < 0) return KDT_OK;
    } else if (!kdt_tok_pair_find(&t->merges, c->sym_id[left], c->sym_id[mid], &rank, &merged)) {
        return KDT_OK;
    }
    merge_cand e = {(uint64_t)(uint32_t)rank << 32 | left, (uint16_t)(mid - left), (uint16_t)(end - mid), merged};
    return heap_push(c, e);
}

static kdt_status bpe_piece(enc_ctx *c, const uint8_t *p, size_t n) {
    const kdt_tokenizer *t = c->t;
    kdt_status s;
    if (n == 0) return KDT_OK;
    if (n == 1) return kdt_tok_ids_push(c->out, t->byte_id[p[0]]);
    if (t->kind == KDT_TOK_TIKTOKEN || t->hf_ignore_merges) {
        int32_t whole = kdt_tok_lookup_bytes(t, p, n);
        if (whole >= 0) return kdt_tok_ids_push(c->out, whole);
    }
    if (n >= UINT32_MAX) return kdt_fail(KDT_ERR_CAPACITY, "tokenizer: a %zu-byte piece is too long", n);
    if ((s = ctx_reserve(c, n)) != KDT_OK) return s;
    for (uint32_t i = 0; i < n; i++) {
        c->next[i] = i + 1;
        c->prev[i] = i ? i - 1 : UINT32_MAX;
        c->sym_id[i] = t->byte_id[p[i]];
        c->alive[i] = 1;
    }
    c->heap_n = 0;
    for (uint32_t i = 0; i + 1 < n; i++)
        if ((s = push_pair(c, p, i, i + 1, i + 2)) != KDT_OK) return s;
    while (c->heap_n) {
        merge_cand e = heap_pop(c);
        uint32_t left = (uint32_t)e.key, mid = left + e.left_len, end = mid + e.right_len;
        /* stale: the left symbol was absorbed or grew, or the right one grew */
        if (!c->alive[left] || c->next[left] != mid || c->next[mid] != end) continue;
        c->alive[mid] = 0;
        c->next[left] = end;
        if (end < n) c->prev[end] = left;
        c->sym_id[left] = e.merged;
        if (c->prev[left] != UINT32_MAX && (s = push_pair(c, p, c->prev[left], left, end)) != KDT_OK) return s;
        if (end < n && (s = push_pair(c, p, left, end, c->next[end])) != KDT_OK) return s;
    }
    for (uint32_t i = 0; i < n; i = c->next[i])
        if ((s = kdt_tok_ids_push(c->out, c->sym_id[i])) != KDT_OK) return s;
    return KDT_OK;
}

static kdt_status piece_cb(void *ctx, const uint8_t *piece, size_t len) { return bpe_piece(ctx, piece, len); }

/* Ordinary text: valid UTF-8 runs go through the pre-tokenizer; each maximal run of ill-formed
 * bytes (including an incomplete sequence at the end) is one piece of its own. */
static kdt_status encode_ordinary(enc_ctx *c, const uint8_t *p, size_t n) {
    size_t i = 0;
    kdt_status s;
    while (i < n) {
        size_t start = i, len;
        while (i < n && kdt_utf8_decode(p + i, n - i, &len) >= 0) i += len;
        if (i > start && (s = kdt_tok_pretokenize(&c->t->pretok, p + start, i - start, c->md, piece_cb, c)) != KDT_OK)
            return s;
        start = i;
        while (i < n && kdt_utf8_decode(p + i, n - i, &len) < 0) i += len;
        if (i > start && (s = bpe_piece(c, p + start, i - start)) != KDT_OK) return s;
    }
    return KDT_OK;
}

/* Splits on the tokens of one trie (leftmost-longest); gaps go to the next stage. */
static kdt_status encode_specials(enc_ctx *c, const uint8_t *p, size_t n, int stage) {
    const kdt_tokenizer *t = c->t;
    if (stage == 2) return encode_ordinary(c, p, n);
    const tok_trie *tr = stage == 0 ? &t->specials_raw : &t->specials_norm;
    if (tr->n == 0) return encode_specials(c, p, n, stage + 1);
    size_t i = 0, gap = 0;
    kdt_status s;
    while (i < n) {
        size_t len = 0;
        int32_t id = trie_longest(tr, p + i, n - i, &len);
        if (id < 0) {
            i++;
            continue;
        }
        if (i > gap && (s = encode_specials(c, p + gap, i - gap, stage + 1)) != KDT_OK) return s;
        if ((s = kdt_tok_ids_push(c->out, id)) != KDT_OK) return s;
        i += len;
        gap = i;
    }
    return gap < n ? encode_specials(c, p + gap, n - gap, stage + 1) : KDT_OK;
}

static kdt_status encode_chunk(enc_ctx *c, const uint8_t *p, size_t n, unsigned flags) {
    return (flags & KDT_ENCODE_PARSE_SPECIAL) ? encode_specials(c, p, n, 0) : encode_ordinary(c, p, n);
}

/* tokenization_kimi.py: 400,000-character chunks, each cut before the character that makes a run
 * of (non-)whitespace longer than 25,000 characters (Python's isspace); pieces encode separately.
 * An ill-formed byte counts as one non-space character. */
#define KIMI_CHUNK_CHARS 400000
#define KIMI_MAX_RUN_CHARS 25000

static kdt_status encode_kimi_chunks(enc_ctx *c, const uint8_t *p, size_t n, unsigned flags) {
    size_t i = 0;
    kdt_status s;
    while (i < n) {
        size_t chunk_start = i, piece_start = i, chars = 0, run = 0;
        int run_space = 0;
        while (i < n && chars < KIMI_CHUNK_CHARS) {
            size_t len;
            int32_t cp = kdt_utf8_decode(p + i, n - i, &len);
            int space = cp >= 0 && kdt_py_isspace((uint32_t)cp);
            if (i == chunk_start) run_space = space;
            if (space != run_space) {
                run = 1;
                run_space = space;
            } else if (++run > KIMI_MAX_RUN_CHARS) {
                if ((s = encode_chunk(c, p + piece_start, i - piece_start, flags)) != KDT_OK) return s;
                piece_start = i;
                run = 1;
            }
            i += len;
            chars++;
        }
        if ((s = encode_chunk(c, p + piece_start, i - piece_start, flags)) != KDT_OK) return s;
    }
    return KDT_OK;
}

kdt_status kdt_tokenizer_encode(const kdt_tokenizer *t, const char *text, size_t len, unsigned flags,
                                kdt_tok_ids *out) {
    KDT_CHECK_ARG(t != NULL && out != NULL, "tokenizer_encode: tokenizer or out is NULL");
    KDT_CHECK_ARG(text != NULL || len == 0, "tokenizer_encode: text is NULL with len = %zu", len);
    KDT_CHECK_ARG((flags & ~KDT_ENCODE_PARSE_SPECIAL) == 0, "tokenizer_encode: unknown flags 0x%x", flags);
    if (len == 0) return KDT_OK;
    enc_ctx c;
    memset(&c, 0, sizeof c);
    c.t = t;
    c.out = out;
    c.md = pcre2_match_data_create(1, NULL);
    if (!c.md) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "tokenizer_encode: out of memory");
    size_t n0 = out->n;
    const uint8_t *p = (const uint8_t *)text;
    kdt_status s = t->split_long_runs ? encode_kimi_chunks(&c, p, len, flags) : encode_chunk(&c, p, len, flags);
    if (s != KDT_OK) out->n = n0; /* all or nothing */
    pcre2_match_data_free(c.md);
    free(c.next);
    free(c.prev);
    free(c.sym_id);
    free(c.alive);
    free(c.heap);
    return s;
}

/* ---- decoding -------------------------------------------------------------------------------- */

kdt_status kdt_tokenizer_decode(const kdt_tokenizer *t, const int32_t *ids, size_t n, unsigned flags,
                                kdt_tok_text *out) {
    KDT_CHECK_ARG(t != NULL && out != NULL, "tokenizer_decode: tokenizer or out is NULL");
    KDT_CHECK_ARG(ids != NULL || n == 0, "tokenizer_decode: ids is NULL with n = %zu", n);
    KDT_CHECK_ARG((flags & ~(KDT_DECODE_SKIP_SPECIAL | KDT_DECODE_LOSSY_UTF8)) == 0,
                  "tokenizer_decode: unknown flags 0x%x", flags);
    kdt_status s;
    for (size_t i = 0; i < n; i++)
        if ((s = check_id(t, ids[i], "tokenizer_decode", i)) != KDT_OK) return s;
    kdt_tok_text raw = {0};
    kdt_tok_text *dst = (flags & KDT_DECODE_LOSSY_UTF8) ? &raw : out;
    size_t len0 = out->len;
    s = kdt_tok_text_append(dst, "", 0);
    for (size_t i = 0; i < n && s == KDT_OK; i++) {
        int32_t id = ids[i];
        if ((flags & KDT_DECODE_SKIP_SPECIAL) && (t->tok_flags[id] & TOKF_SPECIAL)) continue;
        s = kdt_tok_text_append(dst, t->arena + t->tok_off[id], (size_t)t->tok_len[id]);
    }
    if (s == KDT_OK && dst == &raw) s = kdt_utf8_append_lossy(out, (const uint8_t *)raw.data, raw.len);
    kdt_tok_text_free(&raw);
    if (s != KDT_OK && out->data) {
        out->len = len0;
        out->data[len0] = '\0';
    }
    return s;
}
