/* sampler.h - the per-stream random generator and the token sampler (temperature, top-k, top-p)
 * the engine applies at prefill and at every verified tree node. Internal to src/engine/.
 *
 * The same function samples in every mode (ar, chain, ddtree), so the per-node draws of a tree
 * walk are exact draws from the target's (transformed) distribution: that is what makes tree
 * sampling lossless (research ddtree-dflash.md §2.3).
 */
#ifndef KDT_ENGINE_SAMPLER_H
#define KDT_ENGINE_SAMPLER_H

#include <stdint.h>

/* xoshiro256** seeded through splitmix64: small, fast, good enough for sampling. */
typedef struct kdt_rng {
    uint64_t s[4];
} kdt_rng;

void kdt_rng_seed(kdt_rng *r, uint64_t seed);
uint64_t kdt_rng_next(kdt_rng *r);
/* uniform in [0, 1) with 53 random bits */
double kdt_rng_uniform(kdt_rng *r);

typedef struct kdt_sampler_params {
    float temperature;   /* <= 0: greedy (argmax, ties to the lower id) */
    int32_t top_k;       /* 0 = off */
    float top_p;         /* >= 1 = off */
} kdt_sampler_params;

/* Scratch for kdt_sample_token / kdt_sampler_probs: room for `vocab` candidates. */
typedef struct kdt_sampler_cand {
    float logit;
    int32_t id;
} kdt_sampler_cand;

typedef struct kdt_sampler_scratch {
    kdt_sampler_cand *cand; /* [cap] */
    int32_t *ids;           /* [cap] kept ids */
    double *p;              /* [cap] their probabilities */
    int32_t cap;
} kdt_sampler_scratch;

int kdt_sampler_scratch_reserve(kdt_sampler_scratch *s, int32_t vocab); /* 0 ok, -1 no memory */
void kdt_sampler_scratch_free(kdt_sampler_scratch *s);

/* argmax with ties to the lower id (what the model's fused argmax does) */
int32_t kdt_argmax_f32(const float *x, int32_t n);

/* The kept candidates and their probabilities after temperature, then top-k, then top-p (the
 * smallest prefix of the descending order whose mass reaches top_p, at least one token),
 * renormalised. Candidates come out sorted by descending probability, ties by ascending id.
 * Returns the number kept (>= 1); s->ids / s->p hold them. Greedy params keep the argmax only. */
int32_t kdt_sampler_probs(const float *logits, int32_t vocab, const kdt_sampler_params *sp,
                          kdt_sampler_scratch *s);

/* One draw: u in [0, 1) picks from kdt_sampler_probs' list by inverse CDF. */
int32_t kdt_sample_token(const float *logits, int32_t vocab, const kdt_sampler_params *sp,
                         double u, kdt_sampler_scratch *s);

#endif
