/* bytes_tok.c - a byte-level tokenizer: ids 0..255 are the bytes themselves, 256 and up are
 * specials (SRV_MOCK_EOS, SRV_MOCK_IM_END, four chat role markers, and anything a model's larger
 * vocabulary holds past them). The mock backend uses it, and `--tokenizer bytes` puts it in front
 * of a real engine so a random test checkpoint without a tokenizer of its own can be served.
 *
 * Chat prompts are <role marker>content<im_end> per message, then the assistant's marker.
 * The streaming decoder emits only well-formed UTF-8: an incomplete character is held back, and
 * an ill-formed sequence becomes one U+FFFD per maximal subpart (Unicode 15, table 3-7), as the
 * real detokenizer does.
 */
#include "server/server.h"

#include <stdlib.h>
#include <string.h>

kdt_status srv_bytes_encode(void *self, const char *text, size_t len, srv_ids *out) {
    (void)self;
    for (size_t i = 0; i < len; i++)
        if (srv_ids_push(out, (unsigned char)text[i]))
            return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "byte tokenizer: encode");
    return KDT_OK;
}

kdt_status srv_bytes_chat_encode(void *self, const kdt_chat_message *msgs, size_t n,
                                 srv_ids *out) {
    for (size_t i = 0; i < n; i++) {
        if (srv_ids_push(out, SRV_MOCK_ROLE0 + (int32_t)msgs[i].role) ||
            srv_bytes_encode(self, msgs[i].content, strlen(msgs[i].content), out) ||
            srv_ids_push(out, SRV_MOCK_IM_END))
            return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "byte tokenizer: chat prompt");
    }
    if (srv_ids_push(out, SRV_MOCK_ROLE0 + KDT_CHAT_ASSISTANT))
        return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "byte tokenizer: chat prompt");
    return KDT_OK;
}

/* The handle behind srv_detok: the bytes of a character still incomplete. */
typedef struct bytes_detok {
    unsigned char held[4];
    int n_held, need;
} bytes_detok;

kdt_status srv_bytes_detok_new(void *self, srv_detok **out) {
    (void)self;
    bytes_detok *d = calloc(1, sizeof *d);
    *out = (srv_detok *)d;
    return d ? KDT_OK : kdt_fail(KDT_ERR_OUT_OF_MEMORY, "byte tokenizer: detokenizer");
}

/* Length of the sequence a lead byte starts (0: not a lead byte). */
static int lead_len(unsigned char c) {
    return c < 0x80 ? 1 : (c >= 0xc2 && c <= 0xdf) ? 2 : (c >= 0xe0 && c <= 0xef) ? 3
         : (c >= 0xf0 && c <= 0xf4) ? 4 : 0;
}

/* Whether c may follow held[0..k) (k >= 1): the second byte's range depends on the lead. */
static int continues(const unsigned char *held, int k, unsigned char c) {
    if (k == 1) {
        switch (held[0]) {
        case 0xe0: return c >= 0xa0 && c <= 0xbf; /* no overlongs */
        case 0xed: return c >= 0x80 && c <= 0x9f; /* no surrogates */
        case 0xf0: return c >= 0x90 && c <= 0xbf;
        case 0xf4: return c >= 0x80 && c <= 0x8f; /* <= U+10FFFF */
        default: break;
        }
    }
    return c >= 0x80 && c <= 0xbf;
}

kdt_status srv_bytes_detok_feed(srv_detok *h, int32_t id, srv_buf *out) {
    static const char fffd[] = "\xef\xbf\xbd";
    bytes_detok *d = (bytes_detok *)h;
    if (id < 0) return kdt_fail(KDT_ERR_INVALID_ARG, "byte tokenizer: token %d", id);
    if (id >= 256) return KDT_OK; /* specials are not text */
    unsigned char c = (unsigned char)id;
    int rc = 0;
    if (d->n_held) {
        if (continues(d->held, d->n_held, c)) {
            d->held[d->n_held++] = c;
            if (d->n_held == d->need) {
                rc |= srv_buf_append(out, d->held, (size_t)d->n_held);
                d->n_held = 0;
            }
            return rc ? kdt_fail(KDT_ERR_OUT_OF_MEMORY, "byte tokenizer: text") : KDT_OK;
        }
        rc |= srv_buf_append(out, fffd, 3); /* the held prefix is a maximal subpart */
        d->n_held = 0;
    }
    int len = lead_len(c);
    if (len == 1) rc |= srv_buf_append(out, &c, 1);
    else if (len == 0) rc |= srv_buf_append(out, fffd, 3);
    else {
        d->held[0] = c;
        d->n_held = 1;
        d->need = len;
    }
    return rc ? kdt_fail(KDT_ERR_OUT_OF_MEMORY, "byte tokenizer: text") : KDT_OK;
}

kdt_status srv_bytes_detok_finish(srv_detok *h, srv_buf *out) {
    bytes_detok *d = (bytes_detok *)h;
    int rc = d->n_held ? srv_buf_append(out, "\xef\xbf\xbd", 3) : 0;
    d->n_held = 0;
    return rc ? kdt_fail(KDT_ERR_OUT_OF_MEMORY, "byte tokenizer: text") : KDT_OK;
}

void srv_bytes_detok_free(srv_detok *d) { free(d); }
