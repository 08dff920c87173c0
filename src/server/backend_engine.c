/* backend_engine.c - the real backend: a kdt_engine (target + DFlash drafter) and the model's
 * kdt_tokenizer behind the srv_backend table.
 *
 * The chat format follows the tokenizer (tiktoken -> Kimi K2, HF BPE -> DeepSeek-V3); with
 * `--tokenizer bytes` the byte-level tokenizer of bytes_tok.c stands in (random test checkpoints
 * that ship no tokenizer, e.g. tests/fixtures/models/kimi_tiny). Every
 * request stops at the model's end-of-turn ids: the tokenizer's eos, <|im_end|> and
 * <｜end▁of▁sentence｜> when the vocabulary has them, and eos_token_id of config.json and
 * generation_config.json (an id or a list), kept only when inside the engine's vocabulary.
 */
#include "server/server.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(KDT_WITH_TOKENIZER) && defined(KDT_WITH_MODEL)
#include <jansson.h>

typedef struct engine_backend {
    kdt_engine *engine;
    kdt_tokenizer *tok;
    kdt_chat_format chat;
} engine_backend;

/* The detokenizer handle behind srv_detok. */
typedef struct engine_detok {
    kdt_detok_stream *stream;
    kdt_tok_text text;
} engine_detok;

static kdt_status eb_encode(void *self, const char *text, size_t len, srv_ids *out) {
    engine_backend *b = self;
    kdt_tok_ids ids = {0};
    kdt_status st = kdt_tokenizer_encode(b->tok, text, len, 0, &ids);
    if (st == KDT_OK && srv_ids_append(out, ids.ids, ids.n))
        st = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "serve: prompt ids");
    kdt_tok_ids_free(&ids);
    return st;
}

static kdt_status eb_chat_encode(void *self, const kdt_chat_message *msgs, size_t n,
                                 srv_ids *out) {
    engine_backend *b = self;
    kdt_tok_ids ids = {0};
    kdt_status st = kdt_chat_encode(b->tok, b->chat, msgs, n, KDT_CHAT_ADD_GENERATION_PROMPT, &ids);
    if (st == KDT_OK && srv_ids_append(out, ids.ids, ids.n))
        st = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "serve: prompt ids");
    kdt_tok_ids_free(&ids);
    return st;
}

static kdt_status eb_detok_new(void *self, srv_detok **out) {
    engine_backend *b = self;
    engine_detok *d = calloc(1, sizeof *d);
    if (!d) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "serve: detokenizer");
    kdt_status st = kdt_detok_stream_new(b->tok, KDT_DECODE_SKIP_SPECIAL, &d->stream);
    if (st != KDT_OK) {
        free(d);
        return st;
    }
    *out = (srv_detok *)d;
    return KDT_OK;
}

static kdt_status move_text(engine_detok *d, srv_buf *out) {
    int rc = d->text.len ? srv_buf_append(out, d->text.data, d->text.len) : 0;
    d->text.len = 0;
    return rc ? kdt_fail(KDT_ERR_OUT_OF_MEMORY, "serve: detokenized text") : KDT_OK;
}

static kdt_status eb_detok_feed(srv_detok *h, int32_t id, srv_buf *out) {
    engine_detok *d = (engine_detok *)h;
    kdt_status st = kdt_detok_stream_feed(d->stream, id, &d->text);
    return st != KDT_OK ? st : move_text(d, out);
}

static kdt_status eb_detok_finish(srv_detok *h, srv_buf *out) {
    engine_detok *d = (engine_detok *)h;
    kdt_status st = kdt_detok_stream_finish(d->stream, &d->text);
    return st != KDT_OK ? st : move_text(d, out);
}

static void eb_detok_free(srv_detok *h) {
    engine_detok *d = (engine_detok *)h;
    if (!d) return;
    kdt_detok_stream_free(d->stream);
    kdt_tok_text_free(&d->text);
    free(d);
}

static kdt_status eb_add(void *self, const int32_t *prompt, int32_t n, const kdt_gen_params *p,
                         int32_t *id) {
    return kdt_engine_add(((engine_backend *)self)->engine, prompt, n, p, id);
}
static kdt_status eb_step(void *self, kdt_stream_event *ev, int32_t max_ev, int32_t *n_ev) {
    return kdt_engine_step(((engine_backend *)self)->engine, ev, max_ev, n_ev);
}
static kdt_status eb_cancel(void *self, int32_t id) {
    return kdt_engine_cancel(((engine_backend *)self)->engine, id);
}
static int eb_busy(const void *self) {
    return kdt_engine_busy(((const engine_backend *)self)->engine);
}
static void eb_get_stats(const void *self, kdt_engine_stats *out) {
    kdt_engine_get_stats(((const engine_backend *)self)->engine, out);
}

static const char *eb_fault(const void *self) {
    return kdt_engine_fault(((const engine_backend *)self)->engine);
}

static void eb_destroy(void *self) {
    engine_backend *b = self;
    if (!b) return;
    kdt_engine_free(b->engine);
    kdt_tokenizer_free(b->tok);
    free(b);
}

static void add_stop_id(srv_backend *sb, int32_t id) {
    if (id < 0 || id >= sb->vocab_size || sb->n_stop_ids >= SRV_MAX_STOP_IDS) return;
    for (int32_t i = 0; i < sb->n_stop_ids; i++)
        if (sb->stop_ids[i] == id) return;
    sb->stop_ids[sb->n_stop_ids++] = id;
}

/* eos_token_id (an id or a list of ids) from DIR/NAME, when the file exists. */
static void add_config_eos(srv_backend *sb, const char *dir, const char *name) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    json_t *root = json_load_file(path, 0, NULL);
    if (!root) return;
    json_t *cfg = json_object_get(root, "text_config"); /* multimodal wrappers (Kimi K2.5+) */
    json_t *eos = json_object_get(json_is_object(cfg) ? cfg : root, "eos_token_id");
    if (!eos) eos = json_object_get(root, "eos_token_id");
    if (json_is_integer(eos)) add_stop_id(sb, (int32_t)json_integer_value(eos));
    for (size_t i = 0; json_is_array(eos) && i < json_array_size(eos); i++)
        if (json_is_integer(json_array_get(eos, i)))
            add_stop_id(sb, (int32_t)json_integer_value(json_array_get(eos, i)));
    json_decref(root);
}

kdt_status srv_backend_engine_create(const srv_engine_options *opt, srv_backend **out) {
    KDT_CHECK_ARG(opt && out && opt->engine.model_dir, "serve: --model is required");
    engine_backend *b = calloc(1, sizeof *b);
    srv_backend *sb = calloc(1, sizeof *sb);
    if (!b || !sb) {
        free(b);
        free(sb);
        return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "serve: backend");
    }
    const char *tok_path = opt->tokenizer_path ? opt->tokenizer_path : opt->engine.model_dir;
    int bytes = strcmp(tok_path, "bytes") == 0;
    kdt_status st = bytes ? KDT_OK : kdt_tokenizer_load(tok_path, &b->tok);
    if (st == KDT_OK) st = kdt_engine_create(&opt->engine, &b->engine);
    if (st == KDT_OK && bytes && kdt_engine_vocab_size(b->engine) < SRV_MOCK_VOCAB)
        st = kdt_fail(KDT_ERR_UNSUPPORTED, "serve: --tokenizer bytes needs a vocabulary of at "
                      "least %d ids, the model has %d", SRV_MOCK_VOCAB,
                      kdt_engine_vocab_size(b->engine));
    if (st != KDT_OK) {
        eb_destroy(b);
        free(sb);
        return st;
    }
    if (!bytes)
        b->chat = kdt_tokenizer_kind(b->tok) == KDT_TOK_TIKTOKEN ? KDT_CHAT_KIMI_K2
                                                                 : KDT_CHAT_DEEPSEEK_V3;
    *sb = (srv_backend){
        .self = b, .kind = "engine", .vocab_size = kdt_engine_vocab_size(b->engine),
        .max_context = kdt_engine_max_context(b->engine),
        .max_streams = opt->engine.max_streams > 0 ? opt->engine.max_streams : 8,
        .max_budget = opt->engine.max_budget > 0 ? opt->engine.max_budget : 64,
        .bos = bytes ? -1 : kdt_tokenizer_bos(b->tok), .has_draft = opt->engine.draft_dir != NULL,
        .encode = eb_encode, .chat_encode = eb_chat_encode, .detok_new = eb_detok_new,
        .detok_feed = eb_detok_feed, .detok_finish = eb_detok_finish,
        .detok_free = eb_detok_free, .add = eb_add, .step = eb_step, .cancel = eb_cancel,
        .busy = eb_busy, .get_stats = eb_get_stats, .fault = eb_fault, .destroy = eb_destroy};
    if (bytes) { /* a random test checkpoint: the byte tokenizer's ids and markers */
        sb->encode = srv_bytes_encode;
        sb->chat_encode = srv_bytes_chat_encode;
        sb->detok_new = srv_bytes_detok_new;
        sb->detok_feed = srv_bytes_detok_feed;
        sb->detok_finish = srv_bytes_detok_finish;
        sb->detok_free = srv_bytes_detok_free;
        sb->bos = -1;
        add_stop_id(sb, SRV_MOCK_EOS);
        add_stop_id(sb, SRV_MOCK_IM_END);
    } else {
        add_stop_id(sb, kdt_tokenizer_eos(b->tok));
        static const char *const end_markers[] = {"<|im_end|>", "<｜end▁of▁sentence｜>",
                                                  "<|endoftext|>"};
        for (size_t i = 0; i < sizeof end_markers / sizeof *end_markers; i++) {
            int32_t id;
            if (kdt_tokenizer_special_id(b->tok, end_markers[i], &id) == KDT_OK)
                add_stop_id(sb, id);
        }
        kdt_clear_error();
    }
    add_config_eos(sb, opt->engine.model_dir, "config.json");
    add_config_eos(sb, opt->engine.model_dir, "generation_config.json");
    *out = sb;
    return KDT_OK;
}

#else /* built without the tokenizer (PCRE2) or the model runtime (jansson) */

kdt_status srv_backend_engine_create(const srv_engine_options *opt, srv_backend **out) {
    (void)opt;
    (void)out;
    return kdt_fail(KDT_ERR_UNSUPPORTED,
                    "serve: this build has no tokenizer/model runtime (needs libpcre2-dev and "
                    "libjansson-dev); only --model mock works");
}

#endif
