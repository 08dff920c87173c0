/* tok_util.c - small building blocks of the tokenizer: growable id/text buffers, UTF-8 decoding
 * with maximal-subpart error handling, base64, the GPT-2 byte-level alphabet, and file reading.
 */
#include "tok_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- growable buffers ------------------------------------------------------------------------ */

void kdt_tok_ids_free(kdt_tok_ids *v) {
    if (!v) return;
    free(v->ids);
    v->ids = NULL;
    v->n = v->cap = 0;
}

void kdt_tok_text_free(kdt_tok_text *t) {
    if (!t) return;
    free(t->data);
    t->data = NULL;
    t->len = t->cap = 0;
}

kdt_status kdt_tok_ids_push(kdt_tok_ids *v, int32_t id) {
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 64;
        int32_t *p = realloc(v->ids, cap * sizeof *p);
        if (!p) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "tokenizer: out of memory for %zu ids", cap);
        v->ids = p;
        v->cap = cap;
    }
    v->ids[v->n++] = id;
    return KDT_OK;
}

kdt_status kdt_tok_text_append(kdt_tok_text *t, const void *bytes, size_t len) {
    if (t->len + len + 1 > t->cap) {
        size_t cap = t->cap ? t->cap : 64;
        while (cap < t->len + len + 1) cap *= 2;
        char *p = realloc(t->data, cap);
        if (!p) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "tokenizer: out of memory for %zu bytes", cap);
        t->data = p;
        t->cap = cap;
    }
    if (len) memcpy(t->data + t->len, bytes, len);
    t->len += len;
    t->data[t->len] = '\0';
    return KDT_OK;
}

/* ---- UTF-8 ----------------------------------------------------------------------------------- */

/* Well-formed sequences (Unicode Table 3-7): the lead byte fixes the length and the allowed range
 * of the second byte; later bytes are 80..BF. A byte outside its range ends the maximal subpart. */
int32_t kdt_utf8_decode(const uint8_t *p, size_t n, size_t *len) {
    uint8_t b0 = p[0];
    if (b0 < 0x80) {
        *len = 1;
        return b0;
    }
    size_t need;
    uint8_t lo = 0x80, hi = 0xBF; /* range of the second byte */
    uint32_t cp;
    if (b0 >= 0xC2 && b0 <= 0xDF) {
        need = 2; cp = b0 & 0x1F;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
        need = 3; cp = b0 & 0x0F;
        if (b0 == 0xE0) lo = 0xA0;      /* no overlongs */
        if (b0 == 0xED) hi = 0x9F;      /* no surrogates */
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
        need = 4; cp = b0 & 0x07;
        if (b0 == 0xF0) lo = 0x90;      /* no overlongs */
        if (b0 == 0xF4) hi = 0x8F;      /* nothing above U+10FFFF */
    } else {
        *len = 1;                       /* 80..C1, F5..FF never start a sequence */
        return KDT_UTF8_INVALID;
    }
    for (size_t i = 1; i < need; i++) {
        if (i >= n) {
            *len = n;
            return KDT_UTF8_INCOMPLETE;
        }
        uint8_t b = p[i];
        uint8_t l = i == 1 ? lo : 0x80, h = i == 1 ? hi : 0xBF;
        if (b < l || b > h) {
            *len = i;
            return KDT_UTF8_INVALID;
        }
        cp = (cp << 6) | (b & 0x3F);
    }
    *len = need;
    return (int32_t)cp;
}

kdt_status kdt_utf8_append_cp(kdt_tok_text *t, uint32_t cp) {
    uint8_t b[4];
    size_t n;
    if (cp < 0x80) {
        b[0] = (uint8_t)cp; n = 1;
    } else if (cp < 0x800) {
        b[0] = (uint8_t)(0xC0 | (cp >> 6)); b[1] = (uint8_t)(0x80 | (cp & 0x3F)); n = 2;
    } else if (cp < 0x10000) {
        b[0] = (uint8_t)(0xE0 | (cp >> 12)); b[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
        b[2] = (uint8_t)(0x80 | (cp & 0x3F)); n = 3;
    } else {
        b[0] = (uint8_t)(0xF0 | (cp >> 18)); b[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
        b[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F)); b[3] = (uint8_t)(0x80 | (cp & 0x3F)); n = 4;
    }
    return kdt_tok_text_append(t, b, n);
}

kdt_status kdt_utf8_append_lossy(kdt_tok_text *t, const uint8_t *p, size_t n) {
    static const char replacement[] = "\xEF\xBF\xBD";
    size_t i = 0, run = 0; /* p[run..i) is well-formed and not yet copied */
    while (i < n) {
        size_t len;
        int32_t cp = kdt_utf8_decode(p + i, n - i, &len);
        if (cp >= 0) {
            i += len;
            continue;
        }
        kdt_status s = kdt_tok_text_append(t, p + run, i - run);
        if (s == KDT_OK) s = kdt_tok_text_append(t, replacement, 3);
        if (s != KDT_OK) return s;
        i += len;
        run = i;
    }
    return kdt_tok_text_append(t, p + run, n - run);
}

int kdt_py_isspace(uint32_t cp) {
    return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 ||
           cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
           cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

/* ---- byte-level alphabet and base64 ---------------------------------------------------------- */

/* GPT-2's bytes_to_unicode: printable Latin-1 bytes ('!'..'~', U+00A1..U+00AC, U+00AE..U+00FF)
 * stand for themselves; the other 68 bytes map, in byte order, to U+0100, U+0101, ... */
void kdt_bytelevel_tables(uint32_t byte_to_cp[256], int16_t cp_to_byte[0x144]) {
    for (int i = 0; i < 0x144; i++) cp_to_byte[i] = -1;
    uint32_t next = 256;
    for (int b = 0; b < 256; b++) {
        int printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        byte_to_cp[b] = printable ? (uint32_t)b : next++;
        cp_to_byte[byte_to_cp[b]] = (int16_t)b;
    }
}

static int b64_value(unsigned char c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

long kdt_base64_decode(const char *s, size_t n, uint8_t *out) {
    if (n == 0 || n % 4 != 0) return -1;
    long o = 0;
    for (size_t i = 0; i < n; i += 4) {
        int v[4], pad = 0;
        for (int k = 0; k < 4; k++) {
            unsigned char c = (unsigned char)s[i + k];
            if (c == '=' && i + 4 == n && k >= 2) {
                v[k] = 0;
                pad++;
            } else {
                if (pad) return -1; /* data after '=' */
                v[k] = b64_value(c);
                if (v[k] < 0) return -1;
            }
        }
        uint32_t x = (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
        out[o++] = (uint8_t)(x >> 16);
        if (pad < 2) out[o++] = (uint8_t)(x >> 8);
        if (pad < 1) out[o++] = (uint8_t)x;
    }
    return o;
}

/* ---- files ----------------------------------------------------------------------------------- */

kdt_status kdt_tok_read_file(const char *path, char **data, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return kdt_fail(KDT_ERR_IO, "tokenizer: cannot open %s: %s", path, strerror(errno));
    char *buf = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (cap - n < 65536) {
            cap = cap ? cap * 2 : 1 << 20;
            char *p = realloc(buf, cap + 1);
            if (!p) {
                free(buf);
                fclose(f);
                return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "tokenizer: out of memory reading %s", path);
            }
            buf = p;
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0) break;
    }
    int err = ferror(f);
    fclose(f);
    if (err) {
        free(buf);
        return kdt_fail(KDT_ERR_IO, "tokenizer: read error on %s", path);
    }
    buf[n] = '\0';
    *data = buf;
    *len = n;
    return KDT_OK;
}
