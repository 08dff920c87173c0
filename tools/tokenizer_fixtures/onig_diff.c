/* onig_diff.c - differential fuzzing of kdtree's pre-tokenizer (PCRE2 + pattern translation)
 * against Oniguruma, HF tokenizers' own regex engine, which also reads tiktoken-style patterns
 * (class intersection "&&", bare script names as Script) the way fancy-regex does. A developer
 * tool, not a CI test (Oniguruma is not a dependency of the library):
 *
 *   cc -O2 -std=c11 -D_GNU_SOURCE -Iinclude -Isrc -Isrc/common tools/tokenizer_fixtures/onig_diff.c \
 *      src/tokenizer/*.c src/common/status.c -lpcre2-8 -ljansson -lonig -o /tmp/onig_diff
 *   /tmp/onig_diff [strings per pattern, default 20000] [seed]
 *
 * For each pattern (Kimi K2, cl100k, o200k, GPT-2, DeepSeek-V3's three splits) it splits random
 * strings (drawn from a pool of tricky code points plus random ones) both ways and prints the
 * first differences. Expected differences: characters assigned after Unicode 14 (PCRE2 10.42's
 * tables) - the pool avoids those, random code points may not.
 */
#include <oniguruma.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tok_internal.h"

static const char *const PATTERNS[][2] = {
    {"kimi_k2",
     "[\\p{Han}]+|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&"
     "[^\\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+"
     "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
     "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
    {"cl100k", "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
               "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
    {"o200k", "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?i:'s|'t|'re|'ve|"
              "'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|"
              "'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
    {"gpt2", "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"},
    {"dsv3_digits", "\\p{N}{1,3}"},
    {"dsv3_cjk", "[\xE4\xB8\x80-\xE9\xBE\xA5\xE3\x81\x80-\xE3\x82\x9F\xE3\x82\xA0-\xE3\x83\xBF]+"},
    {"dsv3_main", "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
                  " ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
};

/* Tricky code points: letters of every case class, marks, numbers, punctuation, symbols, all
 * White_Space characters and look-alikes, CJK with its punctuation and Han-script marks, kana,
 * Hangul, emoji pieces, apostrophes and case-folding traps. */
static const uint32_t POOL[] = {
    'a', 'b', 's', 't', 'S', 'T', 'K', 'L', 'D', 'M', 'R', 'V', 'E', 'z', 'A', '0', '1', '9', '\'', '"', ' ', ' ', ' ',
    '\t', '\n', '\r', 0x0B, 0x0C, 0x1C, 0x1F, '!', '.', ',', '-', '_', '/', '(', ')', '[', ']', '&', '`', '~', '$', '+',
    0x85, 0xA0, 0xAD, 0xB2, 0xBD, 0xC9, 0xDF, 0xE9, 0x17F, 0x130, 0x131, 0x1C5, 0x1C8, 0x2B0, 0x2BC, 0x2019, 0x300,
    0x301, 0x308, 0x345, 0x3A3, 0x3C2, 0x3C3, 0x410, 0x44F, 0x5D0, 0x5B4, 0x627, 0x64E, 0x660, 0x6F1, 0x915, 0x93F,
    0x94D, 0x966, 0xE01, 0xE31, 0xE48, 0x1100, 0x1680, 0x180E, 0x2000, 0x2003, 0x200A, 0x200B, 0x200D, 0x2028, 0x2029,
    0x202F, 0x205F, 0x2060, 0x2160, 0x2167, 0x2460, 0x212A, 0x2126, 0x3000, 0x3001, 0x3002, 0x3005, 0x3007, 0x3021,
    0x3031, 0x303B, 0x3041, 0x3093, 0x3099, 0x309B, 0x309D, 0x30A1, 0x30FB, 0x30FC, 0x30FD, 0x31F0, 0x3400, 0x4E00,
    0x4E2D, 0x9FA5, 0x9FA6, 0x9FFF, 0xAC00, 0xD7A3, 0xF900, 0xFE30, 0xFEFF, 0xFF01, 0xFF10, 0xFF21, 0xFF41, 0xFF5C,
    0xFF61, 0xFF70, 0xFF9E, 0xFFE5, 0x1D7D9, 0x1F1EF, 0x1F3FD, 0x1F44D, 0x1F468, 0xFE0F, 0x20000, 0x2A6D6, 0xE0001,
};

static uint64_t rng(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

typedef struct spans {
    size_t v[2048]; /* piece boundaries */
    size_t n;
} spans;

static kdt_status record(void *ctx, const uint8_t *p, size_t len) {
    spans *s = ctx;
    (void)p;
    if (s->n < 2048) s->v[s->n++] = len;
    return KDT_OK;
}

/* Oniguruma "find all" with HF's Isolated behaviour (gaps kept), as piece lengths. */
static void onig_split(regex_t *re, const uint8_t *s, size_t n, spans *out) {
    OnigRegion *rg = onig_region_new();
    size_t pos = 0, last = 0;
    out->n = 0;
    while (pos <= n) {
        int r = onig_search(re, s, s + n, s + pos, s + n, rg, ONIG_OPTION_NONE);
        if (r < 0) break;
        size_t ms = (size_t)rg->beg[0], me = (size_t)rg->end[0];
        if (me == ms) {
            pos = ms + 1;
            continue;
        }
        if (ms > last && out->n < 2048) out->v[out->n++] = ms - last;
        if (out->n < 2048) out->v[out->n++] = me - ms;
        last = pos = me;
    }
    if (last < n && out->n < 2048) out->v[out->n++] = n - last;
    onig_region_free(rg, 1);
}

int main(int argc, char **argv) {
    int iters = argc > 1 ? atoi(argv[1]) : 20000;
    uint64_t seed = argc > 2 ? strtoull(argv[2], NULL, 10) : 1;
    OnigEncoding enc = ONIG_ENCODING_UTF8;
    onig_initialize(&enc, 1);
    int total_bad = 0;
    for (size_t p = 0; p < sizeof PATTERNS / sizeof PATTERNS[0]; p++) {
        const char *pat = PATTERNS[p][1];
        regex_t *re;
        OnigErrorInfo einfo;
        if (onig_new(&re, (const OnigUChar *)pat, (const OnigUChar *)pat + strlen(pat), ONIG_OPTION_NONE,
                     ONIG_ENCODING_UTF8, ONIG_SYNTAX_DEFAULT, &einfo) != ONIG_NORMAL) {
            printf("%s: Oniguruma cannot compile the pattern\n", PATTERNS[p][0]);
            continue;
        }
        tok_pretok pt = {0};
        if (kdt_tok_pretok_add(&pt, pat, strlen(pat), PATTERNS[p][0]) != KDT_OK) {
            printf("%s: %s\n", PATTERNS[p][0], kdt_last_error());
            continue;
        }
        pcre2_match_data *md = pcre2_match_data_create(1, NULL);
        int bad = 0;
        for (int it = 0; it < iters; it++) {
            kdt_tok_text s = {0};
            int len = 1 + (int)(rng(&seed) % 24);
            for (int k = 0; k < len; k++) {
                uint32_t cp;
                if (rng(&seed) % 8) cp = POOL[rng(&seed) % (sizeof POOL / sizeof POOL[0])];
                else do cp = (uint32_t)(rng(&seed) % 0x30000); while (cp >= 0xD800 && cp < 0xE000);
                kdt_utf8_append_cp(&s, cp);
            }
            spans a, b;
            a.n = 0;
            kdt_tok_pretokenize(&pt, (const uint8_t *)s.data, s.len, md, record, &a);
            onig_split(re, (const uint8_t *)s.data, s.len, &b);
            if (a.n != b.n || memcmp(a.v, b.v, a.n * sizeof a.v[0]) != 0) {
                if (bad < 5) {
                    printf("%s differs on:", PATTERNS[p][0]);
                    for (size_t i = 0; i < s.len;) {
                        size_t l;
                        int32_t cp = kdt_utf8_decode((const uint8_t *)s.data + i, s.len - i, &l);
                        printf(" U+%04X", (unsigned)cp);
                        i += l;
                    }
                    printf("\n   pcre2:");
                    for (size_t i = 0; i < a.n; i++) printf(" %zu", a.v[i]);
                    printf("\n   onig: ");
                    for (size_t i = 0; i < b.n; i++) printf(" %zu", b.v[i]);
                    printf("\n");
                }
                bad++;
            }
            kdt_tok_text_free(&s);
        }
        printf("%-12s %d of %d strings differ\n", PATTERNS[p][0], bad, iters);
        total_bad += bad;
        pcre2_match_data_free(md);
        kdt_tok_pretok_free(&pt);
        onig_free(re);
    }
    onig_end();
    return total_bad != 0;
}
