/* tok_internal.h - the tokenizer's private data layout and the helpers its files share: the token
 * table, hash maps, the special-token trie, the PCRE2 pre-tokenizer and UTF-8 utilities.
 * Tests include it to reach the pieces (pattern translation, pre-tokenization) directly.
 */
#ifndef KDT_TOK_INTERNAL_H
#define KDT_TOK_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdint.h>

#include "common.h"
#include "kdtree/tokenizer.h"

#define KDT_TOK_MAX_STEPS 6  /* pre-tokenizer regex steps (HF Sequence of Splits) */
#define KDT_TOK_MAX_ID (1 << 24) /* token ids are below this: a file cannot make us allocate more */

/* ---- growable buffers (also the public kdt_tok_ids / kdt_tok_text) -------------------------- */
kdt_status kdt_tok_ids_push(kdt_tok_ids *v, int32_t id);
kdt_status kdt_tok_text_append(kdt_tok_text *t, const void *bytes, size_t len);

/* ---- UTF-8 ----------------------------------------------------------------------------------- */
/* Classifies the sequence starting at p[0] (n >= 1 bytes available):
 *   returns the code point (>= 0) of a well-formed sequence, *len = its length;
 *   KDT_UTF8_INVALID: ill-formed, *len = length of its maximal subpart (>= 1) (Unicode ch. 3);
 *   KDT_UTF8_INCOMPLETE: a well-formed prefix cut by the end of input, *len = n. */
#define KDT_UTF8_INVALID (-1)
#define KDT_UTF8_INCOMPLETE (-2)
int32_t kdt_utf8_decode(const uint8_t *p, size_t n, size_t *len);
/* Appends bytes with every ill-formed subpart (and an incomplete tail) replaced by U+FFFD. */
kdt_status kdt_utf8_append_lossy(kdt_tok_text *t, const uint8_t *p, size_t n);
/* Appends the UTF-8 encoding of code point cp (< 0x110000). */
kdt_status kdt_utf8_append_cp(kdt_tok_text *t, uint32_t cp);
/* Python's str.isspace(): the White_Space property plus U+001C..U+001F. */
int kdt_py_isspace(uint32_t cp);

/* GPT-2 byte-level alphabet: byte b <-> code point byte_to_cp[b] (all < 0x144). */
void kdt_bytelevel_tables(uint32_t byte_to_cp[256], int16_t cp_to_byte[0x144]);

/* base64 (standard alphabet, '=' padding required to a multiple of 4) -> bytes. Returns the
 * decoded length, or -1 if the text is not valid base64. out must hold 3 * (n / 4) bytes. */
long kdt_base64_decode(const char *s, size_t n, uint8_t *out);

/* ---- hash maps ------------------------------------------------------------------------------- */
/* bytes -> token id; the keys are the tokens' own bytes in the tokenizer's arena. */
typedef struct tok_bytes_map {
    int32_t *slots; /* [mask + 1], -1 = empty */
    uint32_t mask;
} tok_bytes_map;

/* (left id, right id) -> merge rank and the merged id (HF BPE merges). */
typedef struct tok_pair_map {
    uint64_t *keys;  /* [mask + 1], UINT64_MAX = empty */
    int32_t *rank;   /* [mask + 1] */
    int32_t *merged; /* [mask + 1] */
    uint32_t mask;
} tok_pair_map;

/* Byte trie over the special/added tokens, for leftmost-longest matching. */
typedef struct tok_trie_node {
    int32_t child;   /* first child node, -1 if none */
    int32_t sibling; /* next sibling node, -1 if none */
    int32_t token;   /* token id ending here, -1 if none */
    uint8_t byte;
} tok_trie_node;
typedef struct tok_trie {
    tok_trie_node *nodes; /* [n]; nodes[0] is the root */
    int32_t n, cap;
    uint8_t first[32]; /* bitmap of first bytes, to skip positions quickly */
} tok_trie;

/* ---- the pre-tokenizer ----------------------------------------------------------------------- */
typedef struct tok_pretok {
    int n_steps;                          /* pieces of step i are split again by step i + 1 */
    pcre2_code *re[KDT_TOK_MAX_STEPS];    /* compiled with PCRE2_UTF | PCRE2_UCP, JIT if possible */
    char *source[KDT_TOK_MAX_STEPS];      /* the pattern as given (for messages) */
} tok_pretok;

/* Rewrites a pattern written for Rust regex / fancy-regex (tiktoken) or Oniguruma (HF) into
 * PCRE2 syntax with the same meaning (docs/tokenizer.md lists the rules). *out is malloc'd,
 * NUL-terminated. what names the pattern in error messages. */
kdt_status kdt_tok_translate_pattern(const char *pat, size_t len, const char *what, char **out);
/* Translates, compiles and appends one step. */
kdt_status kdt_tok_pretok_add(tok_pretok *p, const char *pat, size_t len, const char *what);
void kdt_tok_pretok_free(tok_pretok *p);

/* Calls piece(ctx, start, len) for every piece of valid-UTF-8 text[0..n): each step splits every
 * piece of the step before into its regex matches and the gaps between them (both kept, in
 * order: HF's "Isolated" behaviour; for tiktoken patterns the gaps are empty in practice). */
typedef kdt_status (*tok_piece_fn)(void *ctx, const uint8_t *piece, size_t len);
kdt_status kdt_tok_pretokenize(const tok_pretok *p, const uint8_t *text, size_t n,
                               pcre2_match_data *md, tok_piece_fn piece, void *ctx);

/* ---- the tokenizer --------------------------------------------------------------------------- */
/* tok_flags bits. TOKF_ADDED: matched in text by the special-token tries, never produced by BPE.
 * TOKF_SPECIAL: HF "special": true (skipped by KDT_DECODE_SKIP_SPECIAL); all tiktoken specials.
 * TOKF_NORMALIZED: HF added token with "normalized": true (matched in the second pass). */
enum { TOKF_SPECIAL = 1, TOKF_ADDED = 2, TOKF_NORMALIZED = 4 };

struct kdt_tokenizer {
    kdt_tok_kind kind;
    int32_t n_vocab;       /* one past the largest id */
    int32_t n_ranks;       /* tiktoken: BPE ranks are ids 0 .. n_ranks-1 */
    uint32_t *tok_off;     /* [n_vocab] offset of the token's bytes in arena */
    int32_t *tok_len;      /* [n_vocab] byte length, -1 for an unused id */
    uint8_t *tok_flags;    /* [n_vocab] TOKF_* */
    char *arena;           /* [arena_len] all token bytes, each followed by a NUL */
    size_t arena_len, arena_cap;
    int32_t byte_id[256];  /* the id of each single-byte token */
    uint32_t max_token_len; /* longest BPE token in bytes (< 64 KiB) */

    tok_bytes_map bpe_by_bytes; /* BPE tokens (not added ones) by their bytes */
    tok_pair_map merges;        /* HF only */
    int hf_ignore_merges;       /* HF model.ignore_merges: whole-piece vocab hit first */

    tok_trie specials_raw;  /* tiktoken: all specials; HF: added tokens with normalized=false */
    tok_trie specials_norm; /* HF: added tokens with normalized=true (matched in a second pass) */
    int32_t *special_ids;   /* [n_special] ascending */
    size_t n_special;

    tok_pretok pretok;
    int split_long_runs;    /* tokenization_kimi.py's 400k / 25k chunking (tiktoken only) */
    int32_t bos_id, eos_id; /* -1 if unknown */
};

/* Construction helpers shared by the two loaders. */
kdt_status kdt_tok_alloc_ids(kdt_tokenizer *t, int32_t n_vocab);
kdt_status kdt_tok_set_bytes(kdt_tokenizer *t, int32_t id, const void *bytes, size_t len);
kdt_status kdt_tok_finish(kdt_tokenizer *t, const char *what); /* maps, tries, byte ids */
int32_t kdt_tok_lookup_bytes(const kdt_tokenizer *t, const void *bytes, size_t len);
/* The bytes map is built by kdt_tok_finish unless a loader built it first (to name duplicates by
 * line): init, then insert returns -1 or the id that already has the same bytes. */
kdt_status kdt_tok_bytes_map_init(kdt_tokenizer *t);
int32_t kdt_tok_bytes_map_insert(kdt_tokenizer *t, int32_t id);
kdt_status kdt_tok_pair_insert(tok_pair_map *m, int32_t a, int32_t b, int32_t rank, int32_t merged);
int kdt_tok_pair_find(const tok_pair_map *m, int32_t a, int32_t b, int32_t *rank, int32_t *merged);
kdt_status kdt_tok_pair_init(tok_pair_map *m, size_t n);

/* KDT_ERR_INVALID_ARG unless id is a token of t; the message starts with `what`. */
kdt_status kdt_tok_check_id(const kdt_tokenizer *t, int32_t id, const char *what);

kdt_status kdt_tok_load_tiktoken(kdt_tokenizer *t, const char *model_path, const char *config_path);
kdt_status kdt_tok_load_hf(kdt_tokenizer *t, const char *json_path, const char *config_path);
/* Reads bos_token / eos_token from a parsed tokenizer_config.json (jansson json_t *). */
void kdt_tok_config_bos_eos(kdt_tokenizer *t, const void *config_json);

/* Reads a whole file (NUL-terminated copy); messages name the path. */
kdt_status kdt_tok_read_file(const char *path, char **data, size_t *len);

#endif
