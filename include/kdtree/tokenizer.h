/* tokenizer.h - the native tokenizer and chat templates: text <-> token ids for the models kdtree
 * serves, with no Python, Rust or Jinja at run time.
 *
 * This subsystem owns:
 *   - loading a vocabulary: Kimi K2's tiktoken.model (+ tokenizer_config.json) or an HF
 *     tokenizer.json with byte-level BPE (DeepSeek-V3), detected from the path;
 *   - encoding: special/added-token splitting, regex pre-tokenization (PCRE2 + JIT, with the
 *     model's own pattern translated to PCRE2 syntax) and rank-based BPE merging;
 *   - decoding, token -> bytes, special-token lookups, and a streaming decoder that never emits a
 *     broken UTF-8 sequence;
 *   - the Kimi K2 and DeepSeek-V3 chat templates, written in C.
 * docs/tokenizer.md describes the formats, the pattern translation and the invalid-UTF-8 rules.
 *
 * A loaded kdt_tokenizer is read-only: any number of threads may encode/decode with it at once.
 * Available when the library was built with PCRE2 and jansson (KDT_WITH_TOKENIZER is defined).
 */
#ifndef KDTREE_TOKENIZER_H
#define KDTREE_TOKENIZER_H

#include "kdtree/kdtree.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kdt_tokenizer kdt_tokenizer;

typedef enum kdt_tok_kind {
    KDT_TOK_TIKTOKEN = 1, /* tiktoken.model ranks: token id = rank; specials after the ranks */
    KDT_TOK_HF_BPE = 2,   /* tokenizer.json, model.type "BPE" with a ByteLevel pre-tokenizer */
} kdt_tok_kind;

/* A growable array of token ids. Zero-initialise it; functions that take one append to it. */
typedef struct kdt_tok_ids {
    int32_t *ids; /* [cap], the first n valid */
    size_t n, cap;
} kdt_tok_ids;
void kdt_tok_ids_free(kdt_tok_ids *v); /* frees ids and zeroes *v */

/* A growable byte string, always NUL-terminated after data[len] once non-empty. Zero-initialise
 * it; functions that take one append to it. May hold NUL bytes (len is the length). */
typedef struct kdt_tok_text {
    char *data; /* [cap] */
    size_t len, cap;
} kdt_tok_text;
void kdt_tok_text_free(kdt_tok_text *t); /* frees data and zeroes *t */

/* ---- loading ------------------------------------------------------------------------------- */

/* Loads a tokenizer from `path`, which is one of:
 *   - a model directory: tiktoken.model is used if present, else tokenizer.json; a
 *     tokenizer_config.json next to it supplies special tokens, bos/eos and options;
 *   - a tiktoken.model file (format sniffed from the contents: lines "base64(bytes) rank");
 *   - a tokenizer.json file (contents start with '{').
 * tiktoken options read from tokenizer_config.json (all optional): "added_tokens_decoder"
 * (id -> {"content", "special"}), "bos_token"/"eos_token" (string or {"content": ...}),
 * "pat_str" (pre-tokenizer regex, default Kimi K2's), "num_reserved_special_tokens" (default
 * 256: ids n_ranks .. n_ranks+255 are special, unnamed ones "<|reserved_token_{id}|>"),
 * "split_long_runs" (default true: tokenization_kimi.py's 400k-char chunks / 25k-char runs).
 * Errors: KDT_ERR_IO (unreadable), KDT_ERR_FORMAT (malformed: the message names file and line or
 * JSON path), KDT_ERR_UNSUPPORTED (valid but outside what we implement, e.g. a Unigram model). */
kdt_status kdt_tokenizer_load(const char *path, kdt_tokenizer **out);
void kdt_tokenizer_free(kdt_tokenizer *tok); /* NULL is fine */

kdt_tok_kind kdt_tokenizer_kind(const kdt_tokenizer *tok);

/* One past the largest token id (BPE tokens and specials). Some ids below it may be unused
 * ("holes", e.g. a trimmed vocabulary); kdt_tokenizer_token_bytes reports those. */
int32_t kdt_tokenizer_vocab_size(const kdt_tokenizer *tok);

/* ---- encoding / decoding ------------------------------------------------------------------- */

/* Recognise special and added tokens (e.g. "<|im_end|>") written in the text. Without this flag
 * the whole text is ordinary text: a marker string is encoded like any other characters, which
 * is what user-supplied content needs. */
#define KDT_ENCODE_PARSE_SPECIAL 1u

/* Appends the ids of text[0..len) to out. Any bytes are accepted: valid UTF-8 runs are
 * pre-tokenized with the model's pattern; each maximal run of invalid UTF-8 bytes is one piece
 * of its own, byte-level BPE'd like any other (so decode gives the exact bytes back). */
kdt_status kdt_tokenizer_encode(const kdt_tokenizer *tok, const char *text, size_t len,
                                unsigned flags, kdt_tok_ids *out);

#define KDT_DECODE_SKIP_SPECIAL 1u /* drop tokens marked special (HF "special": true) */
#define KDT_DECODE_LOSSY_UTF8 2u   /* replace ill-formed UTF-8 by U+FFFD, one per maximal subpart */

/* Appends the bytes of ids[0..n) to out (exact bytes; may be invalid UTF-8 unless
 * KDT_DECODE_LOSSY_UTF8). An id out of range or a hole fails with KDT_ERR_INVALID_ARG. */
kdt_status kdt_tokenizer_decode(const kdt_tokenizer *tok, const int32_t *ids, size_t n,
                                unsigned flags, kdt_tok_text *out);

/* The bytes of one token: *bytes points into the tokenizer (valid until it is freed). */
kdt_status kdt_tokenizer_token_bytes(const kdt_tokenizer *tok, int32_t id, const char **bytes,
                                     size_t *len);

/* ---- special tokens ------------------------------------------------------------------------ */

/* The id of a special or added token by its text, e.g. "<|im_end|>" or "<｜User｜>".
 * KDT_ERR_INVALID_ARG if the tokenizer has no such token. */
kdt_status kdt_tokenizer_special_id(const kdt_tokenizer *tok, const char *name, int32_t *id);

/* bos/eos ids from tokenizer_config.json ("bos_token"/"eos_token"); -1 when not configured. */
int32_t kdt_tokenizer_bos(const kdt_tokenizer *tok);
int32_t kdt_tokenizer_eos(const kdt_tokenizer *tok);

/* 1 if id is a special token (tiktoken specials, HF added tokens marked "special"), else 0. */
int kdt_tokenizer_is_special(const kdt_tokenizer *tok, int32_t id);

/* Number of special/added tokens, and the i-th one (0 <= i < count) in id order. */
size_t kdt_tokenizer_special_count(const kdt_tokenizer *tok);
kdt_status kdt_tokenizer_special_at(const kdt_tokenizer *tok, size_t i, int32_t *id,
                                    const char **name);

/* ---- streaming decoder --------------------------------------------------------------------- */

/* Turns generated ids into UTF-8 text as they arrive. Every chunk it appends is well-formed
 * UTF-8 on its own:
 *   - the bytes of a character split across tokens are held back until it is complete;
 *   - an ill-formed sequence is emitted as U+FFFD (one per maximal subpart, as Python's
 *     errors="replace" and HF's decode do) as soon as the byte that proves it ill-formed
 *     arrives;
 *   - kdt_detok_stream_finish() emits still-held bytes of an incomplete sequence as one U+FFFD.
 * So the concatenation of all chunks equals kdt_tokenizer_decode(..., KDT_DECODE_LOSSY_UTF8) of
 * the same ids. flags: KDT_DECODE_SKIP_SPECIAL or 0. */
typedef struct kdt_detok_stream kdt_detok_stream;
kdt_status kdt_detok_stream_new(const kdt_tokenizer *tok, unsigned flags, kdt_detok_stream **out);
kdt_status kdt_detok_stream_feed(kdt_detok_stream *s, int32_t id, kdt_tok_text *out);
kdt_status kdt_detok_stream_finish(kdt_detok_stream *s, kdt_tok_text *out); /* also resets */
void kdt_detok_stream_free(kdt_detok_stream *s); /* NULL is fine */

/* ---- chat templates ------------------------------------------------------------------------ */

typedef enum kdt_chat_format {
    KDT_CHAT_AUTO = 0,        /* from the tokenizer: tiktoken -> Kimi K2, HF BPE -> DeepSeek-V3 */
    KDT_CHAT_KIMI_K2 = 1,     /* <|im_user|>user<|im_middle|>...<|im_end|>, default system prompt */
    KDT_CHAT_DEEPSEEK_V3 = 2, /* <｜begin▁of▁sentence｜>{system}<｜User｜>...<｜Assistant｜>... */
} kdt_chat_format;

typedef enum kdt_chat_role {
    KDT_CHAT_SYSTEM = 0,
    KDT_CHAT_USER = 1,
    KDT_CHAT_ASSISTANT = 2,
} kdt_chat_role;

typedef struct kdt_chat_message {
    kdt_chat_role role;
    const char *content; /* UTF-8, NUL-terminated, not NULL ("" is an empty turn) */
} kdt_chat_message;

#define KDT_CHAT_ADD_GENERATION_PROMPT 1u /* end with the assistant header the model continues */

/* Appends the prompt text the model's Jinja chat template renders for msgs[0..n), markers
 * included as text (KDT_CHAT_AUTO is not accepted here: name the format). */
kdt_status kdt_chat_render(kdt_chat_format fmt, const kdt_chat_message *msgs, size_t n,
                           unsigned flags, kdt_tok_text *out);

/* Appends the prompt's token ids: template markers become their special ids and every text
 * part is encoded as ordinary text, so a marker string inside a message stays text. For content
 * without marker strings this equals encoding kdt_chat_render's text with
 * KDT_ENCODE_PARSE_SPECIAL (what HF apply_chat_template does). */
kdt_status kdt_chat_encode(const kdt_tokenizer *tok, kdt_chat_format fmt,
                           const kdt_chat_message *msgs, size_t n, unsigned flags,
                           kdt_tok_ids *out);

#ifdef __cplusplus
}
#endif
#endif /* KDTREE_TOKENIZER_H */
