/* t_mutate.h - byte-level mutations for the tests' fuzz loops over parsers and loaders (request
 * bodies, tokenizer files, configs): bytes replaced, digits changed (values that still parse, so
 * range checks are reached), spans deleted or duplicated, fragments inserted, truncation. Header
 * only, seeded by t.h's generator, so every fuzz run is reproducible. */
#ifndef KDT_T_MUTATE_H
#define KDT_T_MUTATE_H

#include <string.h>

#include "t.h"

typedef struct t_mutator {
    const char *const *frags; /* inserted at random places (edge numbers, escapes, brackets, keys) */
    int n_frags;
    const char *alphabet;     /* most replacement bytes come from here; the rest are any byte */
    size_t tail;              /* > 0: half of the mutations fall in the last `tail` bytes */
    int max_mutations;        /* 1..max_mutations per call */
} t_mutator;

static inline void t_mutate(const t_mutator *m, char *buf, size_t *n, size_t cap, uint64_t *rng) {
    const int muts = 1 + t_rand_int(rng, m->max_mutations > 0 ? m->max_mutations : 1);
    for (int k = 0; k < muts && *n > 0; k++) {
        const size_t lo = m->tail && *n > m->tail && t_rand_int(rng, 2) ? *n - m->tail : 0;
        const size_t at = lo + (size_t)t_rand_int(rng, (int)(*n - lo));
        const size_t span = 1 + (size_t)t_rand_int(rng, 24), end = at + span < *n ? at + span : *n;
        switch (t_rand_int(rng, 11)) {
        case 0: case 1: /* replace a byte */
            buf[at] = m->alphabet && t_rand_int(rng, 4) ? m->alphabet[t_rand_int(rng, (int)strlen(m->alphabet))]
                                                        : (char)t_rand_int(rng, 256);
            break;
        case 2: case 3: /* change a digit, or the first one after at: a number that still parses */
            for (size_t i = at; i < *n; i++)
                if (buf[i] >= '0' && buf[i] <= '9') {
                    buf[i] = (char)('0' + t_rand_int(rng, 10));
                    break;
                }
            break;
        case 4: case 5: /* delete a span */
            memmove(buf + at, buf + end, *n - end);
            *n -= end - at;
            break;
        case 6: case 7: { /* insert a fragment */
            if (m->n_frags < 1) break;
            const char *f = m->frags[t_rand_int(rng, m->n_frags)];
            const size_t fl = strlen(f);
            if (*n + fl >= cap) break;
            memmove(buf + at + fl, buf + at, *n - at);
            memcpy(buf + at, f, fl);
            *n += fl;
            break;
        }
        case 8: case 9: /* duplicate a span right after itself */
            if (*n + (end - at) >= cap) break;
            memmove(buf + end + (end - at), buf + end, *n - end);
            memcpy(buf + end, buf + at, end - at);
            *n += end - at;
            break;
        default: /* truncate */
            *n = at;
            break;
        }
    }
}

#endif
