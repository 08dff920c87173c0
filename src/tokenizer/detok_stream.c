/* detok_stream.c - the streaming decoder: token ids in, UTF-8 text out, one chunk per token, and
 * no chunk ever holds a broken UTF-8 sequence.
 *
 * At most 3 bytes are held back: a well-formed but incomplete sequence at the end of what has
 * arrived. An ill-formed subpart becomes U+FFFD as soon as the byte that proves it ill-formed
 * arrives; finish() turns a still-incomplete tail into one U+FFFD. The decision for every byte
 * depends only on the bytes of its own sequence, so the chunks add up to exactly the lossy
 * decoding of all the ids at once.
 */
#include "tok_internal.h"

#include <stdlib.h>
#include <string.h>

struct kdt_detok_stream {
    const kdt_tokenizer *tok;
    unsigned flags;
    uint8_t held[4]; /* incomplete sequence from earlier tokens */
    size_t n_held;
    kdt_tok_text work; /* held bytes + the new token's bytes */
};

kdt_status kdt_detok_stream_new(const kdt_tokenizer *tok, unsigned flags, kdt_detok_stream **out) {
    KDT_CHECK_ARG(out != NULL, "detok_stream_new: out is NULL");
    *out = NULL;
    KDT_CHECK_ARG(tok != NULL, "detok_stream_new: tokenizer is NULL");
    KDT_CHECK_ARG((flags & ~KDT_DECODE_SKIP_SPECIAL) == 0, "detok_stream_new: unknown flags 0x%x", flags);
    kdt_detok_stream *s = calloc(1, sizeof *s);
    if (!s) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "detok_stream_new: out of memory");
    s->tok = tok;
    s->flags = flags;
    *out = s;
    return KDT_OK;
}

void kdt_detok_stream_free(kdt_detok_stream *s) {
    if (!s) return;
    kdt_tok_text_free(&s->work);
    free(s);
}

kdt_status kdt_detok_stream_feed(kdt_detok_stream *s, int32_t id, kdt_tok_text *out) {
    KDT_CHECK_ARG(s != NULL && out != NULL, "detok_stream_feed: stream or out is NULL");
    kdt_status st = kdt_tok_check_id(s->tok, id, "detok_stream_feed");
    if (st != KDT_OK) return st;
    const char *bytes = s->tok->arena + s->tok->tok_off[id];
    size_t len = (size_t)s->tok->tok_len[id];
    if ((s->flags & KDT_DECODE_SKIP_SPECIAL) && kdt_tokenizer_is_special(s->tok, id)) return kdt_tok_text_append(out, "", 0);
    s->work.len = 0;
    if ((st = kdt_tok_text_append(&s->work, s->held, s->n_held)) != KDT_OK) return st;
    if ((st = kdt_tok_text_append(&s->work, bytes, len)) != KDT_OK) return st;
    const uint8_t *p = (const uint8_t *)s->work.data;
    size_t n = s->work.len;
    /* find an incomplete well-formed tail: it can only start in the last 3 bytes */
    size_t keep = 0;
    for (size_t back = 1; back <= 3 && back <= n; back++) {
        size_t seq;
        if (p[n - back] < 0xC0) continue; /* not a lead byte */
        if (kdt_utf8_decode(p + n - back, back, &seq) == KDT_UTF8_INCOMPLETE) keep = back;
        break;
    }
    if ((st = kdt_utf8_append_lossy(out, p, n - keep)) != KDT_OK) return st;
    memcpy(s->held, p + n - keep, keep);
    s->n_held = keep;
    return KDT_OK;
}

kdt_status kdt_detok_stream_finish(kdt_detok_stream *s, kdt_tok_text *out) {
    KDT_CHECK_ARG(s != NULL && out != NULL, "detok_stream_finish: stream or out is NULL");
    kdt_status st = kdt_utf8_append_lossy(out, s->held, s->n_held);
    s->n_held = 0;
    return st;
}
