/* fuzz_tokenizer.c - encoding, decoding, the streaming decoder and chat prompts
 * (include/kdtree/tokenizer.h) of the three fixture tokenizers on any bytes. Input byte 0: bits
 * 0-1 pick the tokenizer (Kimi-style tiktoken, DeepSeek-style HF BPE, cl100k), bits 2-3 the
 * operation; the rest is its input. The promises checked:
 *   - text: any bytes encode, and decode gives exactly those bytes back (ordinary text; with
 *     special tokens parsed, encode and decode still succeed);
 *   - ids (the input as little-endian int32s folded into -2 .. vocab + 1): decode fails cleanly on
 *     an id out of range or a hole and succeeds otherwise; fed one by one to the streaming
 *     decoder, every chunk is well-formed UTF-8 and the chunks add up to the lossy decode;
 *   - chat (messages split at NUL bytes, the role from each one's first byte): render and encode
 *     succeed in both formats where the tokenizer has the format's markers, and for content free of
 *     marker strings the ids equal encoding the rendered text with special tokens parsed. */
#include <string.h>

#include "fuzz.h"
#include "kdtree/tokenizer.h"
#include "tokenizer/tok_internal.h"

static kdt_tokenizer *toks[3];

static void load(void) {
    static const char *const paths[3] = {KDT_SOURCE_DIR "/tests/fixtures/tokenizer/kimi_tiny",
                                         KDT_SOURCE_DIR "/tests/fixtures/tokenizer/deepseek_tiny/tokenizer.json",
                                         KDT_SOURCE_DIR "/tests/fixtures/tokenizer/cl100k/tiktoken.model"};
    for (int i = 0; i < 3; i++)
        if (kdt_tokenizer_load(paths[i], &toks[i]) != KDT_OK) FUZZ_FAIL("cannot load %s: %s", paths[i], kdt_last_error());
}

static void check_utf8(const char *p, size_t n, const char *what) {
    for (size_t i = 0, len = 0; i < n; i += len)
        FUZZ_CHECK(kdt_utf8_decode((const uint8_t *)p + i, n - i, &len) >= 0, "%s: ill-formed UTF-8 at byte %zu", what, i);
}

static void text_roundtrip(const kdt_tokenizer *tok, const char *text, size_t n) {
    kdt_tok_ids ids = {0};
    kdt_tok_text back = {0};
    FUZZ_CHECK(kdt_tokenizer_encode(tok, text, n, 0, &ids) == KDT_OK, "encode: %s", kdt_last_error());
    FUZZ_CHECK(kdt_tokenizer_decode(tok, ids.ids, ids.n, 0, &back) == KDT_OK, "decode: %s", kdt_last_error());
    FUZZ_CHECK(back.len == n && (n == 0 || memcmp(back.data, text, n) == 0), "decode(encode(x)) != x (%zu vs %zu bytes)",
               back.len, n);
    kdt_tok_ids_free(&ids);
    kdt_tok_text_free(&back);
    FUZZ_CHECK(kdt_tokenizer_encode(tok, text, n, KDT_ENCODE_PARSE_SPECIAL, &ids) == KDT_OK, "encode: %s", kdt_last_error());
    FUZZ_CHECK(kdt_tokenizer_decode(tok, ids.ids, ids.n, 0, &back) == KDT_OK, "decode: %s", kdt_last_error());
    kdt_tok_ids_free(&ids);
    kdt_tok_text_free(&back);
}

static void ids_decode(const kdt_tokenizer *tok, const uint8_t *p, size_t n) {
    const int32_t vocab = kdt_tokenizer_vocab_size(tok);
    const size_t count = n / 4;
    int32_t *ids = malloc((count ? count : 1) * sizeof *ids);
    if (!ids) return;
    int valid = 1;
    for (size_t i = 0; i < count; i++) {
        const uint32_t u = (uint32_t)p[4 * i] | (uint32_t)p[4 * i + 1] << 8 | (uint32_t)p[4 * i + 2] << 16 |
                           (uint32_t)p[4 * i + 3] << 24;
        ids[i] = (int32_t)(u % (uint32_t)(vocab + 4)) - 2;
        const char *b;
        size_t bl;
        valid &= kdt_tokenizer_token_bytes(tok, ids[i], &b, &bl) == KDT_OK;
    }
    kdt_tok_text all = {0}, lossy = {0}, streamed = {0};
    const kdt_status st = kdt_tokenizer_decode(tok, ids, count, 0, &all);
    FUZZ_CHECK((st == KDT_OK) == valid, "decode returned %d for ids that are %svalid", (int)st, valid ? "" : "not ");
    if (valid) {
        FUZZ_CHECK(kdt_tokenizer_decode(tok, ids, count, KDT_DECODE_LOSSY_UTF8, &lossy) == KDT_OK, "lossy decode");
        check_utf8(lossy.data, lossy.len, "lossy decode");
        kdt_detok_stream *s = NULL;
        FUZZ_CHECK(kdt_detok_stream_new(tok, 0, &s) == KDT_OK, "stream: %s", kdt_last_error());
        for (size_t i = 0; i <= count; i++) {
            kdt_tok_text chunk = {0};
            const kdt_status fs = i < count ? kdt_detok_stream_feed(s, ids[i], &chunk) : kdt_detok_stream_finish(s, &chunk);
            FUZZ_CHECK(fs == KDT_OK, "stream feed %zu: %s", i, kdt_last_error());
            check_utf8(chunk.data, chunk.len, "a streamed chunk");
            if (chunk.len) kdt_tok_text_append(&streamed, chunk.data, chunk.len);
            kdt_tok_text_free(&chunk);
        }
        FUZZ_CHECK(streamed.len == lossy.len && (lossy.len == 0 || memcmp(streamed.data, lossy.data, lossy.len) == 0),
                   "streamed text (%zu bytes) != lossy decode (%zu bytes)", streamed.len, lossy.len);
        kdt_detok_stream_free(s);
    } else if (count) {
        kdt_detok_stream *s = NULL;
        FUZZ_CHECK(kdt_detok_stream_new(tok, 0, &s) == KDT_OK, "stream: %s", kdt_last_error());
        for (size_t i = 0; i < count; i++) {
            kdt_tok_text chunk = {0};
            (void)kdt_detok_stream_feed(s, ids[i], &chunk); /* a bad id: an error, nothing else */
            kdt_tok_text_free(&chunk);
        }
        kdt_detok_stream_free(s);
    }
    kdt_tok_text_free(&all);
    kdt_tok_text_free(&lossy);
    kdt_tok_text_free(&streamed);
    free(ids);
}

static int has_marker(const kdt_tokenizer *tok, const char *s) {
    for (size_t i = 0, n = kdt_tokenizer_special_count(tok); i < n; i++) {
        int32_t id;
        const char *name;
        if (kdt_tokenizer_special_at(tok, i, &id, &name) == KDT_OK && name[0] && strstr(s, name)) return 1;
    }
    return 0;
}

static void chat(const kdt_tokenizer *tok, const char *p, size_t n, unsigned flags) {
    enum { MAX_MSGS = 8 };
    kdt_chat_message msgs[MAX_MSGS];
    char *copy = malloc(n + 1);
    if (!copy) return;
    memcpy(copy, p, n);
    copy[n] = 0;
    size_t n_msgs = 0;
    int markers = 0;
    for (char *q = copy; q <= copy + n && n_msgs < MAX_MSGS; q += strlen(q) + 1) {
        msgs[n_msgs].role = (kdt_chat_role)(q[0] ? (unsigned char)q[0] % 3 : KDT_CHAT_USER);
        msgs[n_msgs].content = q[0] ? q + 1 : q;
        markers |= has_marker(tok, msgs[n_msgs].content);
        n_msgs++;
    }
    for (int fmt = KDT_CHAT_KIMI_K2; fmt <= KDT_CHAT_DEEPSEEK_V3; fmt++) {
        kdt_tok_text text = {0};
        kdt_tok_ids ids = {0}, want = {0};
        FUZZ_CHECK(kdt_chat_render((kdt_chat_format)fmt, msgs, n_msgs, flags, &text) == KDT_OK, "render: %s",
                   kdt_last_error());
        const kdt_status st = kdt_chat_encode(tok, (kdt_chat_format)fmt, msgs, n_msgs, flags, &ids);
        if (st == KDT_OK && !markers) {
            FUZZ_CHECK(kdt_tokenizer_encode(tok, text.data, text.len, KDT_ENCODE_PARSE_SPECIAL, &want) == KDT_OK,
                       "encode of the rendered prompt: %s", kdt_last_error());
            FUZZ_CHECK(want.n == ids.n && (ids.n == 0 || memcmp(want.ids, ids.ids, ids.n * sizeof *ids.ids) == 0),
                       "chat encode (%zu ids) != encode of the rendered text (%zu ids), format %d", ids.n, want.n, fmt);
        } else if (st != KDT_OK) {
            FUZZ_CHECK(st == KDT_ERR_UNSUPPORTED && kdt_last_error()[0], "chat encode: status %d: %s", (int)st,
                       kdt_last_error());
        }
        kdt_tok_text_free(&text);
        kdt_tok_ids_free(&ids);
        kdt_tok_ids_free(&want);
    }
    free(copy);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    if (!toks[0]) load();
    const kdt_tokenizer *tok = toks[(data[0] & 3) % 3];
    const char *in = (const char *)data + 1;
    const size_t n = size - 1;
    fuzz_note("tokenizer %d, operation %d, %zu bytes", (data[0] & 3) % 3, (data[0] >> 2) & 3, n);
    switch ((data[0] >> 2) & 3) {
    case 0: text_roundtrip(tok, in, n); break;
    case 1: ids_decode(tok, (const uint8_t *)in, n); break;
    default: chat(tok, in, n, (data[0] >> 4) & 1 ? KDT_CHAT_ADD_GENERATION_PROMPT : 0); break;
    }
    return 0;
}
