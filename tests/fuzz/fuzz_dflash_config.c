/* fuzz_dflash_config.c - the DFlash drafter's config.json (kdt_dflash_load, src/engine/dflash.h)
 * on any bytes, next to the bundled drafter's weights and against the bundled tiny target.
 * Promise: a clean status (KDT_OK, or an error with a message and no drafter); a drafter that
 * loads has a block of 2 .. KDT_MAX_DEPTH + 1 and taps of the target's layers, and drafts a block
 * over a short context with finite logits. */
#include <math.h>
#include <string.h>
#include <unistd.h>

#include "engine/dflash.h"
#include "fuzz.h"
#include "kdtree/model.h"

static kdt_model *target;

static void setup(void) {
    const kdt_model_options opt = {0};
    if (kdt_model_load(KDT_SOURCE_DIR "/models/tiny-target", &opt, &target) != KDT_OK)
        FUZZ_FAIL("cannot load the tiny target: %s", kdt_last_error());
    char link[512];
    snprintf(link, sizeof link, "%s/model.safetensors", fuzz_tmpdir());
    unlink(link);
    if (symlink(KDT_SOURCE_DIR "/models/tiny-dflash/model.safetensors", link) != 0)
        FUZZ_FAIL("cannot link the drafter's weights into %s", fuzz_tmpdir());
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!target) setup();
    fuzz_write_file("config.json", data, size);
    kdt_dflash *d = NULL;
    const kdt_status st = kdt_dflash_load(fuzz_tmpdir(), target, NULL, &d);
    if (st != KDT_OK) {
        FUZZ_CHECK(d == NULL && kdt_last_error()[0], "status %d: drafter %p, message '%s'", (int)st, (void *)d,
                   kdt_last_error());
        fuzz_note("refused: %s", kdt_last_error());
        return 0;
    }
    const kdt_dflash_config *c = kdt_dflash_get_config(d);
    const kdt_model_config *tc = kdt_model_get_config(target);
    FUZZ_CHECK(c->block_size >= 2 && c->block_size <= KDT_MAX_DEPTH + 1, "block %d", (int)c->block_size);
    FUZZ_CHECK(c->n_taps >= 1 && c->n_taps <= KDT_MODEL_MAX_TAPS, "%d taps", (int)c->n_taps);
    for (int32_t i = 0; i < c->n_taps; i++)
        FUZZ_CHECK(c->tap_layers[i] >= 0 && c->tap_layers[i] < tc->n_layers, "tap %d", (int)c->tap_layers[i]);
    fuzz_note("loaded: block %d, %d taps, theta %g", (int)c->block_size, (int)c->n_taps, c->rope_theta);
    enum { CTX = 9 };
    const size_t width = (size_t)c->hidden_size * (size_t)c->n_taps;
    float *feat = malloc(CTX * width * sizeof *feat);
    float *logits = malloc((size_t)(c->block_size - 1) * (size_t)tc->vocab_size * sizeof *logits);
    if (!feat || !logits) FUZZ_FAIL("out of memory");
    uint32_t x = 12345u; /* a fixed, non-trivial context: hidden states of unit scale */
    for (size_t i = 0; i < CTX * width; i++) {
        x = x * 1664525u + 1013904223u;
        feat[i] = (float)((int32_t)(x >> 8) - (1 << 23)) / (float)(1 << 23);
    }
    kdt_dflash_ctx *ctx = NULL;
    kdt_status ds = kdt_dflash_ctx_create(d, 32, &ctx);
    if (ds == KDT_OK) ds = kdt_dflash_ctx_append(d, ctx, feat, CTX);
    if (ds == KDT_OK) ds = kdt_dflash_draft(d, &ctx, 1, (const int32_t[]){7}, logits);
    FUZZ_CHECK(ds == KDT_OK, "loaded, but drafting failed: %s", kdt_last_error());
    for (size_t i = 0; i < (size_t)(c->block_size - 1) * (size_t)tc->vocab_size; i++)
        FUZZ_CHECK(isfinite(logits[i]), "logit %zu is %g (theta %g, factor %g)", i, logits[i], c->rope_theta,
                   c->rope_factor);
    kdt_dflash_ctx_free(ctx);
    kdt_dflash_free(d);
    free(feat);
    free(logits);
    return 0;
}
