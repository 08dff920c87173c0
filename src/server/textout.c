/* textout.c - stop strings matched on the detokenized text as it streams.
 *
 * Text arrives in chunks (each well-formed UTF-8). A stop string may straddle chunks, so the
 * longest tail of the text that is a proper prefix of some stop string is held back until the
 * next chunk decides it. When a stop string occurs, everything before its first occurrence (the
 * earliest over all stop strings) is emitted and nothing after. Because stop strings and text are
 * both well-formed UTF-8, a match or a held-back tail always starts on a character boundary, so
 * every emitted piece stays well-formed.
 */
#include "server/server.h"

#include <string.h>

void srv_textout_init(srv_textout *t, char *const *stop, int n_stop) {
    memset(t, 0, sizeof *t);
    t->stop = stop;
    t->n_stop = n_stop;
}

/* First occurrence of needle in hay[0..n) or -1. */
static long find(const char *hay, size_t n, const char *needle, size_t m) {
    if (m == 0 || m > n) return -1;
    for (size_t i = 0; i + m <= n; i++)
        if (hay[i] == needle[0] && memcmp(hay + i, needle, m) == 0) return (long)i;
    return -1;
}

int srv_textout_push(srv_textout *t, const char *text, size_t len, srv_buf *out) {
    if (t->stopped) return 1;
    if (srv_buf_append(&t->held, text, len)) return -1;
    const char *h = t->held.data ? t->held.data : "";
    size_t n = t->held.len;

    long first = -1;
    for (int k = 0; k < t->n_stop; k++) {
        long at = find(h, n, t->stop[k], strlen(t->stop[k]));
        if (at >= 0 && (first < 0 || at < first)) first = at;
    }
    if (first >= 0) {
        if (srv_buf_append(out, h, (size_t)first)) return -1;
        t->stopped = 1;
        srv_buf_free(&t->held);
        return 1;
    }

    /* Hold back the longest tail that is a proper prefix of a stop string. */
    size_t hold = 0;
    for (int k = 0; k < t->n_stop; k++) {
        size_t m = strlen(t->stop[k]);
        for (size_t p = (m - 1 < n ? m - 1 : n); p > hold; p--)
            if (memcmp(h + n - p, t->stop[k], p) == 0) {
                hold = p;
                break;
            }
    }
    if (srv_buf_append(out, h, n - hold)) return -1;
    srv_buf_consume(&t->held, n - hold);
    return 0;
}

int srv_textout_flush(srv_textout *t, srv_buf *out) {
    if (t->stopped || t->held.len == 0) return 0;
    int rc = srv_buf_append(out, t->held.data, t->held.len);
    srv_buf_consume(&t->held, t->held.len);
    return rc;
}

void srv_textout_free(srv_textout *t) { srv_buf_free(&t->held); }
