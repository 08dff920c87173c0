/* fuzz_tokenizer_load.c - the tokenizer loaders (kdt_tokenizer_load: tiktoken.model and HF
 * tokenizer.json, each with an optional tokenizer_config.json) on any bytes. Input byte 0 bit 0
 * picks the format; the rest is split at its first NUL into the tokenizer file and, if there is a
 * NUL, tokenizer_config.json. Promise: a clean status (KDT_OK, or an error with a message); a
 * tokenizer that loads encodes a mixed text (ASCII, CJK, an emoji, a stray byte) to ids that decode
 * to exactly that text, or refuses with a message. */
#include <string.h>

#include "fuzz.h"
#include "kdtree/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const char *file = (data[0] & 1) ? "tokenizer.json" : "tiktoken.model";
    const char *other = (data[0] & 1) ? "tiktoken.model" : "tokenizer.json";
    const uint8_t *body = data + 1, *nul = memchr(body, 0, size - 1);
    const size_t n_file = nul ? (size_t)(nul - body) : size - 1;
    fuzz_remove_file(other);
    fuzz_write_file(file, body, n_file);
    if (nul) fuzz_write_file("tokenizer_config.json", nul + 1, size - 1 - n_file - 1);
    else fuzz_remove_file("tokenizer_config.json");
    kdt_tokenizer *tok = NULL;
    const kdt_status st = kdt_tokenizer_load(fuzz_tmpdir(), &tok);
    if (st != KDT_OK) {
        FUZZ_CHECK(tok == NULL && kdt_last_error()[0], "status %d: tokenizer %p, message '%s'", (int)st, (void *)tok,
                   kdt_last_error());
        fuzz_note("refused: %s", kdt_last_error());
        return 0;
    }
    static const char text[] = "Hello, world!  \t\n 123 \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x98\x80 \xff<|im_end|>";
    kdt_tok_ids ids = {0};
    kdt_tok_text back = {0};
    const kdt_status es = kdt_tokenizer_encode(tok, text, sizeof text - 1, 0, &ids);
    fuzz_note("loaded: vocab %d; encode: %s", (int)kdt_tokenizer_vocab_size(tok), es == KDT_OK ? "ok" : kdt_last_error());
    if (es == KDT_OK) {
        FUZZ_CHECK(kdt_tokenizer_decode(tok, ids.ids, ids.n, 0, &back) == KDT_OK, "decode: %s", kdt_last_error());
        FUZZ_CHECK(back.len == sizeof text - 1 && memcmp(back.data, text, back.len) == 0,
                   "decode(encode(x)) != x (%zu bytes back)", back.len);
    } else {
        FUZZ_CHECK(kdt_last_error()[0], "encode: status %d without a message", (int)es);
    }
    kdt_tok_ids_free(&ids);
    kdt_tok_text_free(&back);
    kdt_tokenizer_free(tok);
    return 0;
}
