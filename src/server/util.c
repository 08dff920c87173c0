/* util.c - small helpers of the server: growable byte and token-id buffers, OpenAI-style error
 * records, the monotonic clock. */
#include "server/server.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int buf_reserve(srv_buf *b, size_t extra) {
    if (extra > SIZE_MAX / 2 - b->len) return -1;
    size_t need = b->len + extra + 1; /* + NUL */
    if (need <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < need) cap *= 2;
    char *p = realloc(b->data, cap);
    if (!p) return -1;
    b->data = p;
    b->cap = cap;
    return 0;
}

int srv_buf_append(srv_buf *b, const void *data, size_t n) {
    if (buf_reserve(b, n)) return -1;
    if (n) memcpy(b->data + b->len, data, n);
    b->len += n;
    b->data[b->len] = '\0';
    return 0;
}

int srv_buf_puts(srv_buf *b, const char *s) { return srv_buf_append(b, s, strlen(s)); }

int srv_buf_printf(srv_buf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0 || buf_reserve(b, (size_t)n)) return -1;
    va_start(ap, fmt);
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
    return 0;
}

void srv_buf_consume(srv_buf *b, size_t n) {
    if (n >= b->len) {
        b->len = 0;
    } else {
        memmove(b->data, b->data + n, b->len - n);
        b->len -= n;
    }
    if (b->data) b->data[b->len] = '\0';
}

void srv_buf_free(srv_buf *b) {
    free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
}

int srv_ids_append(srv_ids *v, const int32_t *ids, size_t n) {
    if (n > SIZE_MAX / 8 - v->n) return -1;
    if (v->n + n > v->cap) {
        size_t cap = v->cap ? v->cap : 64;
        while (cap < v->n + n) cap *= 2;
        int32_t *p = realloc(v->v, cap * sizeof *p);
        if (!p) return -1;
        v->v = p;
        v->cap = cap;
    }
    if (n) memcpy(v->v + v->n, ids, n * sizeof *ids);
    v->n += n;
    return 0;
}

int srv_ids_push(srv_ids *v, int32_t id) { return srv_ids_append(v, &id, 1); }

void srv_ids_free(srv_ids *v) {
    free(v->v);
    v->v = NULL;
    v->n = v->cap = 0;
}

void srv_error_set(srv_error *e, int status, const char *type, const char *param, const char *code,
                   const char *fmt, ...) {
    e->status = status;
    e->type = type;
    e->code = code;
    e->retry_after_s = 0;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
}

double srv_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}
