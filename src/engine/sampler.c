/* sampler.c - xoshiro256** streams and the temperature / top-k / top-p sampler (sampler.h). */
#include "sampler.h"

#include <math.h>
#include <stdlib.h>

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void kdt_rng_seed(kdt_rng *r, uint64_t seed) {
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&x);
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t kdt_rng_next(kdt_rng *r) {
    uint64_t *s = r->s;
    const uint64_t result = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

double kdt_rng_uniform(kdt_rng *r) { return (double)(kdt_rng_next(r) >> 11) * (1.0 / 9007199254740992.0); }

int kdt_sampler_scratch_reserve(kdt_sampler_scratch *s, int32_t vocab) {
    if (s->cap >= vocab) return 0;
    kdt_sampler_cand *c = realloc(s->cand, sizeof *c * (size_t)vocab);
    if (!c) return -1;
    s->cand = c;
    int32_t *ids = realloc(s->ids, sizeof *ids * (size_t)vocab);
    if (!ids) return -1;
    s->ids = ids;
    double *p = realloc(s->p, sizeof *p * (size_t)vocab);
    if (!p) return -1;
    s->p = p;
    s->cap = vocab;
    return 0;
}

void kdt_sampler_scratch_free(kdt_sampler_scratch *s) {
    free(s->cand);
    free(s->ids);
    free(s->p);
    s->cand = NULL;
    s->ids = NULL;
    s->p = NULL;
    s->cap = 0;
}

int32_t kdt_argmax_f32(const float *x, int32_t n) {
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

/* a ranks before b: larger logit, then lower id */
static int before(kdt_sampler_cand a, kdt_sampler_cand b) {
    return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
}

static int cmp_cand(const void *pa, const void *pb) {
    kdt_sampler_cand a = *(const kdt_sampler_cand *)pa, b = *(const kdt_sampler_cand *)pb;
    return before(a, b) ? -1 : before(b, a) ? 1 : 0;
}

/* min-heap on rank order (heap[0] = the worst kept candidate) */
static void sift_down(kdt_sampler_cand *h, int32_t n, int32_t i) {
    for (;;) {
        int32_t w = i, l = 2 * i + 1, r = l + 1;
        if (l < n && before(h[w], h[l])) w = l;
        if (r < n && before(h[w], h[r])) w = r;
        if (w == i) return;
        kdt_sampler_cand t = h[i];
        h[i] = h[w];
        h[w] = t;
        i = w;
    }
}

int32_t kdt_sampler_probs(const float *logits, int32_t vocab, const kdt_sampler_params *sp,
                          kdt_sampler_scratch *s) {
    if (!(sp->temperature > 0.0f)) {
        s->ids[0] = kdt_argmax_f32(logits, vocab);
        s->p[0] = 1.0;
        return 1;
    }
    int32_t n;
    const int top_p_on = sp->top_p < 1.0f;
    if (sp->top_k > 0 && sp->top_k < vocab) {
        /* keep the top_k best in a min-heap, then sort them */
        n = sp->top_k;
        for (int32_t i = 0; i < n; i++) s->cand[i] = (kdt_sampler_cand){logits[i], i};
        for (int32_t i = n / 2 - 1; i >= 0; i--) sift_down(s->cand, n, i);
        for (int32_t i = n; i < vocab; i++) {
            kdt_sampler_cand c = {logits[i], i};
            if (before(c, s->cand[0])) {
                s->cand[0] = c;
                sift_down(s->cand, n, 0);
            }
        }
        qsort(s->cand, (size_t)n, sizeof *s->cand, cmp_cand);
    } else {
        n = vocab;
        for (int32_t i = 0; i < n; i++) s->cand[i] = (kdt_sampler_cand){logits[i], i};
        if (top_p_on) qsort(s->cand, (size_t)n, sizeof *s->cand, cmp_cand);
    }
    float mx = -INFINITY;
    for (int32_t i = 0; i < n; i++)
        if (s->cand[i].logit > mx) mx = s->cand[i].logit;
    double sum = 0.0;
    const double inv_t = 1.0 / (double)sp->temperature;
    for (int32_t i = 0; i < n; i++) {
        double e = exp(((double)s->cand[i].logit - (double)mx) * inv_t);
        s->p[i] = e;
        sum += e;
    }
    if (!(sum > 0.0) || !isfinite(sum)) { /* NaN/inf logits: fall back to the argmax */
        s->ids[0] = kdt_argmax_f32(logits, vocab);
        s->p[0] = 1.0;
        return 1;
    }
    int32_t kept = n;
    if (top_p_on) {
        double cum = 0.0;
        kept = 0;
        while (kept < n && (kept == 0 || cum < (double)sp->top_p * sum)) cum += s->p[kept++];
        sum = cum;
    }
    for (int32_t i = 0; i < kept; i++) {
        s->ids[i] = s->cand[i].id;
        s->p[i] /= sum;
    }
    return kept;
}

int32_t kdt_sample_token(const float *logits, int32_t vocab, const kdt_sampler_params *sp,
                         double u, kdt_sampler_scratch *s) {
    int32_t n = kdt_sampler_probs(logits, vocab, sp, s);
    double cum = 0.0;
    for (int32_t i = 0; i < n; i++) {
        cum += s->p[i];
        if (u < cum) return s->ids[i];
    }
    return s->ids[n - 1]; /* rounding: u just below 1 */
}
