/* fuzz_model_config.c - config.json and generation_config.json parsing (src/model/config.c) on
 * any bytes. Input byte 0 even: the rest is a config.json for kdt_config_parse; odd: a
 * generation_config.json merged into the bundled tiny target's config. Promise: a clean status
 * (KDT_OK, or an error with a message); a config that parses has the dimensions the forward
 * divides by and allocates with in range, and a RoPE table of finite, positive frequencies; a
 * merge keeps the eos list within its array. */
#include <math.h>
#include <string.h>

#include "fuzz.h"
#include "model/model_internal.h"

static kdt_model_config base;
static int have_base;

static void load_base(void) {
    size_t n;
    uint8_t *text = fuzz_read_file(KDT_SOURCE_DIR "/models/tiny-target/config.json", &n);
    if (!text) FUZZ_FAIL("cannot read the tiny target's config.json");
    if (kdt_config_parse((const char *)text, n, "tiny-target/config.json", &base) != KDT_OK)
        FUZZ_FAIL("the tiny target's config does not parse: %s", kdt_last_error());
    free(text);
    have_base = 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    if (!have_base) load_base();
    const char *text = (const char *)data + 1;
    const size_t n = size - 1;
    kdt_model_config cfg;
    if (!(data[0] & 1)) {
        memset(&cfg, 0, sizeof cfg);
        const kdt_status st = kdt_config_parse(text, n, "config.json", &cfg);
        if (st != KDT_OK) {
            FUZZ_CHECK(kdt_last_error()[0], "status %d without a message", (int)st);
            fuzz_note("refused: %s", kdt_last_error());
            return 0;
        }
        fuzz_note("parsed: %d layers, %d heads, vocab %d", cfg.n_layers, cfg.n_heads, cfg.vocab_size);
        FUZZ_CHECK(cfg.vocab_size > 0 && cfg.hidden_size > 0 && cfg.n_layers > 0 && cfg.n_heads > 0,
                   "V %d D %d layers %d heads %d", cfg.vocab_size, cfg.hidden_size, cfg.n_layers, cfg.n_heads);
        FUZZ_CHECK(cfg.kv_lora_rank > 0 && cfg.qk_rope_head_dim > 0 && cfg.qk_rope_head_dim % 2 == 0,
                   "d_c %d d_r %d", cfg.kv_lora_rank, cfg.qk_rope_head_dim);
        FUZZ_CHECK(cfg.n_eos >= 0 && cfg.n_eos <= (int32_t)(KDT_MODEL_MAX_EOS),
                   "n_eos %d", cfg.n_eos);
        FUZZ_CHECK(isfinite(cfg.softmax_scale) && cfg.softmax_scale > 0, "softmax scale %g", cfg.softmax_scale);
        const int32_t half = cfg.qk_rope_head_dim / 2;
        float *inv = malloc((size_t)half * sizeof *inv);
        if (!inv) return 0;
        kdt_rope_inv_freq(&cfg, inv);
        for (int32_t i = 0; i < half; i++)
            FUZZ_CHECK(isfinite(inv[i]) && inv[i] > 0, "inv_freq[%d] = %g", (int)i, inv[i]);
        free(inv);
    } else {
        cfg = base;
        const kdt_status st = kdt_config_merge_generation(text, n, "generation_config.json", &cfg);
        FUZZ_CHECK(st == KDT_OK || kdt_last_error()[0], "status %d without a message", (int)st);
        fuzz_note("merged: %s, %d eos ids", st == KDT_OK ? "ok" : kdt_last_error(), cfg.n_eos);
        FUZZ_CHECK(cfg.n_eos >= 0 && cfg.n_eos <= (int32_t)(KDT_MODEL_MAX_EOS),
                   "n_eos %d", cfg.n_eos);
        for (int32_t i = 0; i < cfg.n_eos; i++)
            FUZZ_CHECK(cfg.eos_token_ids[i] >= 0 && cfg.eos_token_ids[i] < cfg.vocab_size, "eos %d", (int)cfg.eos_token_ids[i]);
    }
    return 0;
}
