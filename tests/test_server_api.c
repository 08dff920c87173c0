/* test_server_api.c - the server's wire layer without a socket: request parsing and validation
 * (every bad field gets 400/404 naming it; mutation-fuzzed), response / SSE chunk / error
 * JSON, stop-string matching on streamed text (fuzzed against a reference over random
 * chunkings), the Prometheus page (checked by a small in-test linter with promtool's rules), the
 * mock tokenizer's UTF-8 hold-back, and that the embedded web page equals src/server/static/.
 *
 * The server sources are not part of libkdtree (they go into the kdtree executable), so this test
 * #includes the ones it needs; none of them touches libmicrohttpd.
 */
#include "t.h"
#include "t_mutate.h"

#ifdef KDT_WITH_MODEL /* jansson is there */
#include "../src/server/util.c"
#include "../src/server/api.c"
#include "../src/server/textout.c"
#include "../src/server/metrics.c"
#include "../src/server/bytes_tok.c"
#include "../src/server/backend_mock.c"
#include "../src/server/static_page.c"
#include "server_api_check.h"

#include <ctype.h>

static const srv_api_limits LIM = {.model_name = "tiny", .max_budget = 64,
                                   .default_spec = KDT_SPEC_DDTREE, .default_budget = 32,
                                   .has_draft = 1};

/* Parses body; returns the status (200 when accepted) and leaves the error in *e. */
static int parse_status(srv_endpoint ep, const char *body, const srv_api_limits *lim,
                        srv_error *e) {
    srv_api_req r;
    memset(e, 0, sizeof *e);
    int rc = srv_api_parse(ep, body, strlen(body), lim, &r, e);
    srv_api_req_free(&r);
    return rc ? e->status : 200;
}

static void test_parse_valid(void) {
    srv_api_req r;
    srv_error e;
    const char *b = "{\"model\":\"tiny\",\"prompt\":\"Hello\",\"max_tokens\":7,\"temperature\":0,"
                    "\"top_p\":0.9,\"top_k\":5,\"seed\":-3,\"stop\":[\"\\n\",\"END\"],\"stream\":true,"
                    "\"stream_options\":{\"include_usage\":true},\"n\":1,\"logprobs\":null,"
                    "\"presence_penalty\":0,\"user\":\"u\",\"kdtree\":{\"spec\":\"chain\","
                    "\"budget\":12,\"ignore_eos\":true}}";
    CHECK_EQ_INT(srv_api_parse(SRV_EP_COMPLETIONS, b, strlen(b), &LIM, &r, &e), 0);
    CHECK(r.prompt && strcmp(r.prompt, "Hello") == 0 && r.prompt_len == 5 && !r.prompt_is_ids);
    CHECK_EQ_INT(r.max_tokens, 7);
    CHECK_NEAR(r.temperature, 0.0, 0);
    CHECK_NEAR(r.top_p, 0.9, 1e-12);
    CHECK_EQ_INT(r.top_k, 5);
    CHECK(r.has_seed && r.seed == (uint64_t)-3);
    CHECK_EQ_INT(r.n_stop, 2);
    CHECK(r.n_stop == 2 && !strcmp(r.stop[0], "\n") && !strcmp(r.stop[1], "END"));
    CHECK(r.stream && r.include_usage && r.ignore_eos);
    CHECK_EQ_INT(r.spec, KDT_SPEC_CHAIN);
    CHECK_EQ_INT(r.budget, 12);
    srv_api_req_free(&r);

    /* defaults: no model field, OpenAI's temperature 1, server spec/budget */
    b = "{\"prompt\":[1,2,3]}";
    CHECK_EQ_INT(srv_api_parse(SRV_EP_COMPLETIONS, b, strlen(b), &LIM, &r, &e), 0);
    CHECK(r.prompt_is_ids && r.prompt_ids.n == 3 && r.prompt_ids.v[2] == 3);
    CHECK_EQ_INT(r.max_tokens, -1);
    CHECK_NEAR(r.temperature, 1.0, 0);
    CHECK_EQ_INT(r.spec, KDT_SPEC_DDTREE);
    CHECK_EQ_INT(r.budget, 32);
    CHECK(!r.stream && !r.has_seed && r.n_stop == 0);
    srv_api_req_free(&r);

    /* a prompt may contain NUL */
    b = "{\"prompt\":\"a\\u0000b\"}";
    CHECK_EQ_INT(srv_api_parse(SRV_EP_COMPLETIONS, b, strlen(b), &LIM, &r, &e), 0);
    CHECK(r.prompt_len == 3 && r.prompt && r.prompt[1] == '\0' && r.prompt[2] == 'b');
    srv_api_req_free(&r);

    /* a one-element batch, stop as a single string */
    b = "{\"prompt\":[\"x y\"],\"stop\":\"y\"}";
    CHECK_EQ_INT(srv_api_parse(SRV_EP_COMPLETIONS, b, strlen(b), &LIM, &r, &e), 0);
    CHECK(r.prompt && !strcmp(r.prompt, "x y") && r.n_stop == 1 && !strcmp(r.stop[0], "y"));
    srv_api_req_free(&r);
    b = "{\"prompt\":[[5,6]]}";
    CHECK_EQ_INT(srv_api_parse(SRV_EP_COMPLETIONS, b, strlen(b), &LIM, &r, &e), 0);
    CHECK(r.prompt_is_ids && r.prompt_ids.n == 2);
    srv_api_req_free(&r);

    /* chat: string content, text parts, developer -> system, max_completion_tokens */
    b = "{\"model\":\"tiny\",\"messages\":[{\"role\":\"developer\",\"content\":\"be brief\"},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},"
        "{\"type\":\"text\",\"text\":\"b\"}]},{\"role\":\"assistant\",\"content\":null},"
        "{\"role\":\"user\",\"content\":\"日本語\"}],\"max_completion_tokens\":9}";
    CHECK_EQ_INT(srv_api_parse(SRV_EP_CHAT, b, strlen(b), &LIM, &r, &e), 0);
    CHECK_EQ_INT(r.n_msgs, 4);
    if (r.n_msgs == 4) {
        CHECK(r.msgs[0].role == KDT_CHAT_SYSTEM && !strcmp(r.msgs[0].content, "be brief"));
        CHECK(r.msgs[1].role == KDT_CHAT_USER && !strcmp(r.msgs[1].content, "ab"));
        CHECK(r.msgs[2].role == KDT_CHAT_ASSISTANT && !strcmp(r.msgs[2].content, ""));
        CHECK(!strcmp(r.msgs[3].content, "日本語"));
    }
    CHECK_EQ_INT(r.max_tokens, 9);
    srv_api_req_free(&r);

    /* without a drafter the default is ar */
    srv_api_limits nodraft = LIM;
    nodraft.has_draft = 0;
    b = "{\"prompt\":\"x\"}";
    CHECK_EQ_INT(srv_api_parse(SRV_EP_COMPLETIONS, b, strlen(b), &nodraft, &r, &e), 0);
    CHECK_EQ_INT(r.spec, KDT_SPEC_AR);
    srv_api_req_free(&r);
}

typedef struct bad_case {
    srv_endpoint ep;
    const char *body;
    int status;
    const char *param; /* expected e.param ("" = none) */
} bad_case;

static void test_parse_errors(void) {
    static const bad_case cases[] = {
        {SRV_EP_COMPLETIONS, "{\"prompt\": \"x\"", 400, ""},                 /* malformed */
        {SRV_EP_COMPLETIONS, "", 400, ""},
        {SRV_EP_COMPLETIONS, "[1,2]", 400, ""},                              /* not an object */
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"prompt\":\"y\"}", 400, ""}, /* duplicate key */
        {SRV_EP_COMPLETIONS, "{\"model\":5,\"prompt\":\"x\"}", 400, "model"},
        {SRV_EP_COMPLETIONS, "{\"model\":\"gpt-4\",\"prompt\":\"x\"}", 404, "model"},
        {SRV_EP_COMPLETIONS, "{}", 400, "prompt"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":null}", 400, "prompt"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":5}", 400, "prompt"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":[]}", 400, "prompt"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":[\"a\",\"b\"]}", 400, "prompt"},   /* batch */
        {SRV_EP_COMPLETIONS, "{\"prompt\":[1,-2]}", 400, "prompt"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":[1,2.5]}", 400, "prompt"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"max_tokens\":0}", 400, "max_tokens"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"max_tokens\":\"5\"}", 400, "max_tokens"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"max_tokens\":1.5}", 400, "max_tokens"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"temperature\":2.5}", 400, "temperature"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"temperature\":\"hot\"}", 400, "temperature"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"top_p\":0}", 400, "top_p"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"top_p\":1.5}", 400, "top_p"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"top_k\":-1}", 400, "top_k"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"seed\":\"7\"}", 400, "seed"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"seed\":1.5}", 400, "seed"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"stop\":5}", 400, "stop"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"stop\":[\"a\",3]}", 400, "stop"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"stop\":\"\"}", 400, "stop"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"stop\":\"a\\u0000b\"}", 400, "stop"},
        {SRV_EP_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"a\\u0000\"}]}", 400,
         "messages[0].content"},
        {SRV_EP_CHAT,
         "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"\\u0000\"}]}]}",
         400, "messages[0].content"},
        {SRV_EP_COMPLETIONS,
         "{\"prompt\":\"x\",\"stop\":[\"1\",\"2\",\"3\",\"4\",\"5\",\"6\",\"7\",\"8\",\"9\"]}", 400,
         "stop"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"n\":2}", 400, "n"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"n\":\"1\"}", 400, "n"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"best_of\":3}", 400, "best_of"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"logprobs\":2}", 400, "logprobs"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"echo\":true}", 400, "echo"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"suffix\":\"s\"}", 400, "suffix"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"presence_penalty\":0.5}", 400, "presence_penalty"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"logit_bias\":{\"5\":1}}", 400, "logit_bias"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"stream\":\"yes\"}", 400, "stream"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"stream_options\":3}", 400, "stream_options"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"stream_options\":{\"include_usage\":1}}", 400,
         "stream_options.include_usage"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"kdtree\":[]}", 400, "kdtree"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"kdtree\":{\"spec\":\"beam\"}}", 400, "kdtree.spec"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"kdtree\":{\"spec\":3}}", 400, "kdtree.spec"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"kdtree\":{\"budget\":0}}", 400, "kdtree.budget"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"kdtree\":{\"budget\":65}}", 400, "kdtree.budget"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"kdtree\":{\"budget\":\"8\"}}", 400, "kdtree.budget"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"kdtree\":{\"beam\":1}}", 400, "kdtree"},
        {SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"kdtree\":{\"ignore_eos\":1}}", 400,
         "kdtree.ignore_eos"},
        {SRV_EP_CHAT, "{}", 400, "messages"},
        {SRV_EP_CHAT, "{\"messages\":[]}", 400, "messages"},
        {SRV_EP_CHAT, "{\"messages\":{\"role\":\"user\"}}", 400, "messages"},
        {SRV_EP_CHAT, "{\"messages\":[\"hi\"]}", 400, "messages[0]"},
        {SRV_EP_CHAT, "{\"messages\":[{\"content\":\"hi\"}]}", 400, "messages[0].role"},
        {SRV_EP_CHAT, "{\"messages\":[{\"role\":\"tool\",\"content\":\"hi\"}]}", 400,
         "messages[0].role"},
        {SRV_EP_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"user\"}]}",
         400, "messages[1].content"},
        {SRV_EP_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":7}]}", 400,
         "messages[0].content"},
        {SRV_EP_CHAT,
         "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\",\"image_url\":{}}]}]}",
         400, "messages[0].content"},
        {SRV_EP_CHAT,
         "{\"messages\":[{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{}]}]}", 400,
         "messages[0].tool_calls"},
        {SRV_EP_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"tools\":[{}]}", 400,
         "tools"},
        {SRV_EP_CHAT,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"response_format\":{\"type\":"
         "\"json_object\"}}", 400, "response_format"},
        {SRV_EP_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"max_completion_tokens\":0}",
         400, "max_completion_tokens"},
        {SRV_EP_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"logprobs\":true}", 400,
         "logprobs"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        srv_error e;
        int st = parse_status(cases[i].ep, cases[i].body, &LIM, &e);
        CHECK_MSG(st == cases[i].status, "case %zu %s: status %d, want %d (%s)", i, cases[i].body, st,
                  cases[i].status, e.message);
        CHECK_MSG(!strcmp(e.param, cases[i].param), "case %zu %s: param '%s', want '%s'", i,
                  cases[i].body, e.param, cases[i].param);
        CHECK_MSG(e.message[0] != '\0', "case %zu: empty message", i);
        CHECK_MSG(e.type && !strcmp(e.type, "invalid_request_error"), "case %zu: type", i);
    }
    /* a drafter-less server refuses speculative modes */
    srv_api_limits nodraft = LIM;
    nodraft.has_draft = 0;
    srv_error e;
    CHECK_EQ_INT(parse_status(SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"kdtree\":{\"spec\":\"ddtree\"}}",
                              &nodraft, &e), 400);
    CHECK(!strcmp(e.param, "kdtree.spec"));
    CHECK_EQ_INT(parse_status(SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"kdtree\":{\"spec\":\"ar\"}}",
                              &nodraft, &e), 200);
    /* the unknown model is 404 with code model_not_found */
    CHECK_EQ_INT(parse_status(SRV_EP_CHAT, "{\"model\":\"x\",\"messages\":[]}", &LIM, &e), 404);
    CHECK(e.code && !strcmp(e.code, "model_not_found"));
    /* bytes that are not UTF-8 are a JSON error, not a crash */
    CHECK_EQ_INT(parse_status(SRV_EP_COMPLETIONS, "{\"prompt\":\"\xff\xfe\"}", &LIM, &e), 400);
    /* deep nesting is refused by the parser, not by the stack */
    srv_buf deep = {0};
    for (int i = 0; i < 100000; i++) srv_buf_puts(&deep, "[");
    CHECK_EQ_INT(parse_status(SRV_EP_COMPLETIONS, deep.data, &LIM, &e), 400);
    srv_buf_free(&deep);
}

/* Mutation fuzz of the request parser: valid bodies with bytes replaced, deleted, duplicated or
 * JSON fragments inserted (edge numbers, surrogates, NUL escapes, brackets, known keys). Every
 * outcome is either an accepted request that satisfies every limit the handlers rely on, or a
 * 400 / 404 / 413 with a message (ASan / UBSan in CI see memory errors and leaks on both paths). */
static void test_parse_fuzz(void) {
    static const char *const seeds_c[] = {
        "{\"model\":\"tiny\",\"prompt\":\"Hello\",\"max_tokens\":7,\"temperature\":0,\"top_p\":0.9,"
        "\"top_k\":5,\"seed\":-3,\"stop\":[\"\\n\",\"END\"],\"stream\":true,\"stream_options\":"
        "{\"include_usage\":true},\"kdtree\":{\"spec\":\"chain\",\"budget\":12,\"ignore_eos\":true}}",
        "{\"prompt\":[1,2,3],\"max_tokens\":16,\"stop\":\"y\"}",
        "{\"prompt\":[[5,6]],\"kdtree\":{\"spec\":\"auto\",\"budget\":64}}",
    };
    static const char *const seeds_chat[] = {
        "{\"model\":\"tiny\",\"messages\":[{\"role\":\"developer\",\"content\":\"be brief\"},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"}]},{\"role\":\"assistant\","
        "\"content\":null},{\"role\":\"user\",\"content\":\"\\u65e5\"}],\"max_completion_tokens\":9,"
        "\"temperature\":1.5,\"top_p\":1}",
    };
    static const char *const frags[] = {
        "null", "-1", "0", "-0", "1e309", "-1e309", "2147483648", "9223372036854775808", "1.5", "true",
        "\"", "\\u0000", "\\ud800", "\\", "[", "]", "{", "}", ",", ":", "\"\"", "[]", "{}",
        "\"prompt\"", "\"messages\"", "\"stop\"", "\"kdtree\"", "\"budget\"", "\"spec\"",
        "\"max_tokens\"", "\"temperature\"", "\"role\"", "\"content\"", "\"text\"", "\xff", "\xc3",
    };
    const t_mutator mut = {frags, (int)(sizeof frags / sizeof *frags), "{}[]\",:0123456789-.eE\\u nultrfase", 0, 4};
    const int n_seed_c = (int)(sizeof seeds_c / sizeof *seeds_c);
    srv_api_limits nodraft = LIM;
    nodraft.has_draft = 0;
    uint64_t rng = t_fuzz_seed(0x5eed21);
    int accepted = 0, refused = 0, bad = 0;
    char buf[2048];
    for (int it = 0, iters = t_fuzz_iters(20000); it < iters && bad < 5; it++) {
        const int chat = t_rand_int(&rng, 4) == 0;
        const srv_endpoint ep = chat ? SRV_EP_CHAT : SRV_EP_COMPLETIONS;
        const char *seed = chat ? seeds_chat[0] : seeds_c[t_rand_int(&rng, n_seed_c)];
        size_t n = strlen(seed);
        memcpy(buf, seed, n);
        t_mutate(&mut, buf, &n, sizeof buf, &rng);
        const srv_api_limits *lim = t_rand_int(&rng, 8) ? &LIM : &nodraft;
        srv_api_req r;
        srv_error e;
        memset(&e, 0, sizeof e);
        const int rc = srv_api_parse(ep, buf, n, lim, &r, &e);
        char why[128] = "";
        if (rc == 0) {
            accepted++;
            if (!srv_check_accepted_request(ep, &r, lim, why, sizeof why)) {
                bad++;
                CHECK_MSG(0, "accepted but %s: %.*s", why, (int)n, buf);
            }
        } else {
            refused++;
            if (!(e.status == 400 || e.status == 404 || e.status == 413) || !e.message[0] || !e.type) {
                bad++;
                CHECK_MSG(0, "refused with status %d, message '%s': %.*s", e.status, e.message, (int)n, buf);
            }
        }
        srv_api_req_free(&r);
    }
    printf("  parser fuzz: %d bodies accepted, %d refused\n", accepted, refused);
    /* the mutations must reach both outcomes, or the test checks nothing */
    CHECK_MSG(accepted > 500 && refused > 5000, "accepted %d, refused %d", accepted, refused);
}

static json_t *load(const char *s, size_t n) {
    json_error_t je;
    json_t *j = json_loadb(s, n, 0, &je);
    if (!j) fprintf(stderr, "  bad JSON: %s: %.200s\n", je.text, s);
    return j;
}

static void test_responses(void) {
    srv_resp_id rid;
    srv_resp_id_init(&rid, SRV_EP_CHAT, "tiny");
    CHECK(!strncmp(rid.id, "chatcmpl-", 9) && strlen(rid.id) == 9 + 24);
    srv_resp_id rid2;
    srv_resp_id_init(&rid2, SRV_EP_CHAT, "tiny");
    CHECK(strcmp(rid.id, rid2.id) != 0);
    srv_gen_summary s = {.prompt_tokens = 5, .completion_tokens = 7, .finish_reason = "length",
                         .tau = 2.5, .rounds = 3, .spec = KDT_SPEC_DDTREE, .budget = 16};
    srv_buf b = {0};
    CHECK_EQ_INT(srv_api_response_json(SRV_EP_CHAT, &rid, "héllo\n\"q\"", strlen("héllo\n\"q\""), &s, &b),
                 0);
    json_t *j = load(b.data, b.len);
    CHECK(j != NULL);
    if (j) {
        CHECK(!strcmp(json_string_value(json_object_get(j, "object")), "chat.completion"));
        CHECK(!strcmp(json_string_value(json_object_get(j, "model")), "tiny"));
        json_t *c0 = json_array_get(json_object_get(j, "choices"), 0);
        CHECK(!strcmp(json_string_value(json_object_get(json_object_get(c0, "message"), "content")),
                      "héllo\n\"q\""));
        CHECK(!strcmp(json_string_value(json_object_get(c0, "finish_reason")), "length"));
        json_t *u = json_object_get(j, "usage");
        CHECK_EQ_INT(json_integer_value(json_object_get(u, "total_tokens")), 12);
        json_t *k = json_object_get(j, "kdtree");
        CHECK_NEAR(json_number_value(json_object_get(k, "tau")), 2.5, 1e-9);
        CHECK(!strcmp(json_string_value(json_object_get(k, "spec")), "ddtree"));
        json_decref(j);
    }
    /* text completion */
    b.len = 0;
    srv_resp_id_init(&rid, SRV_EP_COMPLETIONS, "tiny");
    CHECK(!strncmp(rid.id, "cmpl-", 5));
    CHECK_EQ_INT(srv_api_response_json(SRV_EP_COMPLETIONS, &rid, "ab", 2, &s, &b), 0);
    j = load(b.data, b.len);
    if (j) {
        CHECK(!strcmp(json_string_value(json_object_get(j, "object")), "text_completion"));
        json_t *c0 = json_array_get(json_object_get(j, "choices"), 0);
        CHECK(!strcmp(json_string_value(json_object_get(c0, "text")), "ab"));
        CHECK(json_is_null(json_object_get(c0, "logprobs")));
        json_decref(j);
    }
    /* invalid UTF-8 text is refused rather than sent as broken JSON */
    b.len = 0;
    CHECK_EQ_INT(srv_api_response_json(SRV_EP_COMPLETIONS, &rid, "\xc3", 1, &s, &b), -1);

    /* SSE chunks: framing, role delta, final chunk with the extension, usage chunk */
    b.len = 0;
    srv_resp_id_init(&rid, SRV_EP_CHAT, "tiny");
    CHECK_EQ_INT(srv_api_chunk_sse(SRV_EP_CHAT, &rid, "", 0, 1, NULL, &b), 0);
    CHECK(b.len > 8 && !strncmp(b.data, "data: ", 6) && !strcmp(b.data + b.len - 2, "\n\n"));
    CHECK(memchr(b.data, '\n', b.len - 2) == NULL); /* one line per event */
    j = load(b.data + 6, b.len - 8);
    if (j) {
        json_t *c0 = json_array_get(json_object_get(j, "choices"), 0);
        json_t *d = json_object_get(c0, "delta");
        CHECK(!strcmp(json_string_value(json_object_get(d, "role")), "assistant"));
        CHECK(!strcmp(json_string_value(json_object_get(d, "content")), ""));
        CHECK(json_is_null(json_object_get(c0, "finish_reason")));
        CHECK(json_object_get(j, "kdtree") == NULL);
        CHECK(!strcmp(json_string_value(json_object_get(j, "object")), "chat.completion.chunk"));
        json_decref(j);
    }
    b.len = 0;
    CHECK_EQ_INT(srv_api_chunk_sse(SRV_EP_CHAT, &rid, "a\nb", 3, 0, NULL, &b), 0);
    CHECK(memchr(b.data, '\n', b.len - 2) == NULL); /* the newline is escaped inside JSON */
    b.len = 0;
    CHECK_EQ_INT(srv_api_chunk_sse(SRV_EP_CHAT, &rid, "", 0, 0, &s, &b), 0);
    j = load(b.data + 6, b.len - 8);
    if (j) {
        json_t *c0 = json_array_get(json_object_get(j, "choices"), 0);
        CHECK(!strcmp(json_string_value(json_object_get(c0, "finish_reason")), "length"));
        CHECK(json_object_size(json_object_get(c0, "delta")) == 0);
        CHECK(json_object_get(j, "kdtree") != NULL);
        json_decref(j);
    }
    b.len = 0;
    CHECK_EQ_INT(srv_api_usage_chunk_sse(SRV_EP_COMPLETIONS, &rid, &s, &b), 0);
    j = load(b.data + 6, b.len - 8);
    if (j) {
        CHECK(json_array_size(json_object_get(j, "choices")) == 0);
        CHECK_EQ_INT(json_integer_value(json_object_get(json_object_get(j, "usage"), "prompt_tokens")), 5);
        json_decref(j);
    }

    /* errors: shape, nulls, invalid UTF-8 in the message is scrubbed */
    srv_error e;
    srv_error_set(&e, 429, "rate_limit_error", NULL, "queue_full", "busy \xe6\x97 (%d)", 3);
    b.len = 0;
    CHECK_EQ_INT(srv_api_error_json(&e, &b), 0);
    j = load(b.data, b.len);
    if (j) {
        json_t *er = json_object_get(j, "error");
        CHECK(!strcmp(json_string_value(json_object_get(er, "type")), "rate_limit_error"));
        CHECK(!strcmp(json_string_value(json_object_get(er, "code")), "queue_full"));
        CHECK(json_is_null(json_object_get(er, "param")));
        CHECK(!strcmp(json_string_value(json_object_get(er, "message")), "busy ? (3)"));
        json_decref(j);
    }
    srv_bad_field(&e, "max_tokens", "bad");
    b.len = 0;
    srv_api_error_json(&e, &b);
    j = load(b.data, b.len);
    if (j) {
        json_t *er = json_object_get(j, "error");
        CHECK(!strcmp(json_string_value(json_object_get(er, "param")), "max_tokens"));
        CHECK(json_is_null(json_object_get(er, "code")));
        json_decref(j);
    }
    b.len = 0;
    CHECK_EQ_INT(srv_api_models_json("tiny", 42, &b), 0);
    j = load(b.data, b.len);
    if (j) {
        json_t *m0 = json_array_get(json_object_get(j, "data"), 0);
        CHECK(!strcmp(json_string_value(json_object_get(m0, "id")), "tiny"));
        json_decref(j);
    }
    srv_buf_free(&b);
}

/* Reference for stop strings: the earliest occurrence over all stops in the whole text. */
static size_t ref_cut(const char *text, size_t n, char *const *stop, int n_stop, int *hit) {
    size_t best = n;
    *hit = 0;
    for (int k = 0; k < n_stop; k++) {
        size_t m = strlen(stop[k]);
        for (size_t i = 0; i + m <= n; i++)
            if (!memcmp(text + i, stop[k], m)) {
                if (i < best) best = i;
                *hit = 1;
                break;
            }
    }
    return best;
}

static void test_textout(void) {
    char *stops[] = {"END", "\n\n", "éé"};
    srv_textout t;
    srv_buf out = {0};
    srv_textout_init(&t, stops, 3);
    CHECK_EQ_INT(srv_textout_push(&t, "hello E", 7, &out), 0);
    CHECK(out.len == 6 && !memcmp(out.data, "hello ", 6)); /* "E" held back */
    CHECK_EQ_INT(srv_textout_push(&t, "N", 1, &out), 0);
    CHECK_EQ_INT(out.len, 6);
    CHECK_EQ_INT(srv_textout_push(&t, "D tail", 6, &out), 1);
    CHECK(out.len == 6 && !memcmp(out.data, "hello ", 6));
    CHECK_EQ_INT(srv_textout_push(&t, "more", 4, &out), 1); /* nothing after a stop */
    CHECK_EQ_INT(out.len, 6);
    srv_textout_free(&t);

    /* a false start is released, the flush gives the held tail */
    out.len = 0;
    srv_textout_init(&t, stops, 3);
    CHECK_EQ_INT(srv_textout_push(&t, "EN", 2, &out), 0);
    CHECK_EQ_INT(out.len, 0);
    CHECK_EQ_INT(srv_textout_push(&t, "x", 1, &out), 0);
    CHECK(out.len == 3 && !memcmp(out.data, "ENx", 3));
    CHECK_EQ_INT(srv_textout_push(&t, "E", 1, &out), 0);
    CHECK_EQ_INT(srv_textout_flush(&t, &out), 0);
    CHECK(out.len == 4 && !memcmp(out.data, "ENxE", 4));
    srv_textout_free(&t);

    /* no stop strings: everything passes at once */
    out.len = 0;
    srv_textout_init(&t, NULL, 0);
    CHECK_EQ_INT(srv_textout_push(&t, "abc", 3, &out), 0);
    CHECK_EQ_INT(out.len, 3);
    srv_textout_free(&t);

    /* fuzz: random texts over a small alphabet, random chunkings, vs the reference */
    static const char *const alphabet[] = {"a", "E", "N", "D", "\n", "é", "x"};
    uint64_t seed = t_fuzz_seed(12345);
    for (int iter = 0, iters = t_fuzz_iters(3000); iter < iters; iter++) {
        char text[256];
        size_t n = 0;
        int len = t_rand_int(&seed, 40);
        for (int i = 0; i < len; i++) {
            const char *p = alphabet[t_rand_int(&seed, 7)];
            memcpy(text + n, p, strlen(p));
            n += strlen(p);
        }
        int n_stop = t_rand_int(&seed, 4);
        int hit;
        size_t cut = ref_cut(text, n, stops, n_stop, &hit);
        srv_textout_init(&t, stops, n_stop);
        out.len = 0;
        size_t pos = 0;
        int stopped = 0;
        while (pos < n && !stopped) { /* chunks cut at character boundaries, like the detokenizer */
            size_t k = pos + 1 + (size_t)t_rand_int(&seed, 6);
            if (k > n) k = n;
            while (k < n && ((unsigned char)text[k] & 0xc0) == 0x80) k++;
            stopped = srv_textout_push(&t, text + pos, k - pos, &out) == 1;
            pos = k;
        }
        if (!stopped) srv_textout_flush(&t, &out);
        CHECK_MSG(stopped == hit && out.len == cut && (cut == 0 || !memcmp(out.data, text, cut)),
                  "iter %d: stopped %d hit %d out %zu cut %zu", iter, stopped, hit, out.len, cut);
        srv_textout_free(&t);
        if (t_cur_failed) break;
    }
    srv_buf_free(&out);
}

/* promtool's rules, checked here so a plain ctest run catches format slips: HELP and TYPE before
 * samples, valid names without colons, counters end in _total, histogram buckets cumulative with
 * le="+Inf" equal to _count. */
static void lint_prometheus(const char *page) {
    char family[128] = "", type[32] = "";
    int have_help = 0;
    double last_bucket = -1, inf_bucket = -1;
    const char *p = page;
    while (*p) {
        const char *nl = strchr(p, '\n');
        CHECK_MSG(nl != NULL, "the page must end with a newline");
        if (!nl) break;
        char line[512];
        size_t n = (size_t)(nl - p) < sizeof line - 1 ? (size_t)(nl - p) : sizeof line - 1;
        memcpy(line, p, n);
        line[n] = '\0';
        p = nl + 1;
        if (!strncmp(line, "# HELP ", 7)) {
            sscanf(line + 7, "%127s", family);
            have_help = 1;
            type[0] = '\0';
            last_bucket = -1;
            continue;
        }
        if (!strncmp(line, "# TYPE ", 7)) {
            char name[128];
            CHECK(sscanf(line + 7, "%127s %31s", name, type) == 2);
            CHECK_MSG(!strcmp(name, family) && have_help, "TYPE %s without its HELP", name);
            CHECK_MSG(strcmp(type, "counter") || strstr(name, "_total") == name + strlen(name) - 6,
                      "counter %s must end in _total", name);
            for (const char *c = name; *c; c++)
                CHECK_MSG(isalnum((unsigned char)*c) || *c == '_', "bad metric name %s", name);
            continue;
        }
        CHECK_MSG(line[0] != '#', "unknown comment: %s", line);
        char name[160];
        size_t k = strcspn(line, "{ ");
        CHECK(k < sizeof name);
        memcpy(name, line, k);
        name[k] = '\0';
        CHECK_MSG(!strncmp(name, family, strlen(family)), "sample %s outside family %s", name,
                  family);
        const char *val = strrchr(line, ' ');
        CHECK_MSG(val != NULL, "no value: %s", line);
        if (!val) continue;
        char *end;
        double v = strtod(val + 1, &end);
        CHECK_MSG(*end == '\0', "bad value in: %s", line);
        if (!strcmp(type, "histogram")) {
            if (strstr(name, "_bucket")) {
                CHECK_MSG(v >= last_bucket, "buckets not cumulative: %s", line);
                last_bucket = v;
                if (strstr(line, "le=\"+Inf\"")) inf_bucket = v;
            } else if (strstr(name, "_count")) {
                CHECK_MSG(v == inf_bucket, "%s != +Inf bucket", line);
            }
        }
    }
}

static void test_metrics(void) {
    srv_metrics m;
    srv_metrics_init(&m);
    srv_metrics_count_request(&m, SRV_EP_CHAT, 200);
    srv_metrics_count_request(&m, SRV_EP_CHAT, 200);
    srv_metrics_count_request(&m, SRV_EP_COMPLETIONS, 429);
    srv_metrics_count_request(&m, SRV_EP_OTHER, 404);
    srv_metrics_count_request(&m, SRV_EP_HEALTH, 418); /* an odd code lands in "other" */
    srv_metrics_observe(&m, &m.ttft, 0.003);
    srv_metrics_observe(&m, &m.ttft, 0.2);
    srv_metrics_observe(&m, &m.ttft, 1000.0); /* past the last bound: +Inf */
    srv_metrics_observe(&m, &m.round_time, 0.0001);
    m.tau_count[1] = 3;
    m.tau_count[4] = 2;
    m.tau_count[17] = 1;
    srv_metrics_tokens(&m, 100, 10.0);
    srv_metrics_tokens(&m, 100, 11.0);
    srv_sched_snapshot snap = {0};
    snap.engine.kv_pages_total = 40;
    snap.engine.kv_pages_used = 15;
    snap.engine.rounds = 7;
    snap.engine.t_verify = 0.25;
    snap.queue_depth = 2;
    snap.active = 3;
    srv_buf b = {0};
    CHECK_EQ_INT(srv_metrics_render(&m, &snap, 12.0, &b), 0);
    lint_prometheus(b.data);
    CHECK(strstr(b.data, "kdtree_http_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 2\n"));
    CHECK(strstr(b.data, "kdtree_http_requests_total{endpoint=\"/v1/completions\",status=\"429\"} 1\n"));
    CHECK(strstr(b.data, "kdtree_http_requests_total{endpoint=\"/health\",status=\"other\"} 1\n"));
    CHECK(strstr(b.data, "kdtree_kv_pages_used 15\n"));
    CHECK(strstr(b.data, "kdtree_kv_pages_free 25\n"));
    CHECK(strstr(b.data, "kdtree_queue_depth 2\n"));
    CHECK(strstr(b.data, "kdtree_accepted_length_bucket{le=\"1\"} 3\n"));
    CHECK(strstr(b.data, "kdtree_accepted_length_bucket{le=\"4\"} 5\n"));
    CHECK(strstr(b.data, "kdtree_accepted_length_count 6\n"));
    CHECK(strstr(b.data, "kdtree_accepted_length_sum 28\n")); /* 3 + 8 + 17 */
    CHECK(strstr(b.data, "kdtree_time_to_first_token_seconds_bucket{le=\"0.005\"} 1\n"));
    CHECK(strstr(b.data, "kdtree_time_to_first_token_seconds_bucket{le=\"60\"} 2\n"));
    CHECK(strstr(b.data, "kdtree_time_to_first_token_seconds_bucket{le=\"+Inf\"} 3\n"));
    CHECK(strstr(b.data, "kdtree_generation_tokens_total 200\n"));
    CHECK(strstr(b.data, "kdtree_engine_stage_seconds_total{stage=\"verify\"} 0.25\n"));
    /* 200 tokens in the window from t=10 to now=12 */
    CHECK(strstr(b.data, "kdtree_generation_tokens_per_second 50\n") ||
          strstr(b.data, "kdtree_generation_tokens_per_second 100\n"));
    /* idle long enough: the rate falls to 0 */
    b.len = 0;
    srv_metrics_render(&m, &snap, 100.0, &b);
    CHECK(strstr(b.data, "kdtree_generation_tokens_per_second 0\n"));
    srv_buf_free(&b);
    srv_metrics_destroy(&m);
}

static void test_mock_detok(void) {
    srv_backend *be = NULL;
    CHECK_EQ_INT(srv_backend_mock_create(NULL, &be), KDT_OK);
    if (!be) return;
    srv_detok *d = NULL;
    CHECK_EQ_INT(be->detok_new(be->self, &d), KDT_OK);
    srv_buf out = {0};
    const char *s = "a日🙂";
    for (const char *c = s; *c; c++) {
        size_t before = out.len;
        be->detok_feed(d, (unsigned char)*c, &out);
        /* every chunk is whole characters */
        CHECK(out.len == before || ((unsigned char)out.data[before] & 0xc0) != 0x80);
    }
    be->detok_feed(d, SRV_MOCK_EOS, &out); /* specials are not text */
    CHECK(out.len == strlen(s) && !memcmp(out.data, s, out.len));
    out.len = 0;
    be->detok_feed(d, 0xe6, &out); /* a cut character: U+FFFD at finish */
    CHECK_EQ_INT(out.len, 0);
    be->detok_finish(d, &out);
    CHECK(out.len == 3 && !memcmp(out.data, "\xef\xbf\xbd", 3));
    out.len = 0;
    be->detok_feed(d, 0xff, &out); /* never valid */
    CHECK(out.len == 3 && !memcmp(out.data, "\xef\xbf\xbd", 3));
    out.len = 0;
    be->detok_feed(d, 400, &out); /* any id past the bytes is special: no text */
    CHECK_EQ_INT(out.len, 0);
    CHECK(be->detok_feed(d, -1, &out) == KDT_ERR_INVALID_ARG);
    /* ill-formed sequences: one U+FFFD per maximal subpart, never invalid output */
    static const struct { const char *in, *want; } cases[] = {
        {"\xe0\x80\x80", "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"}, /* overlong: E0 needs A0..BF */
        {"\xed\xa0\x80", "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"}, /* surrogate */
        {"\xf4\x90\x80\x80", "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"}, /* > U+10FFFF */
        {"\xe6\x97" "x", "\xef\xbf\xbd" "x"}, /* cut short: one U+FFFD for the prefix */
        {"\xc0\xaf", "\xef\xbf\xbd\xef\xbf\xbd"},
        {"\xf0\x9f\x99\x82", "\xf0\x9f\x99\x82"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        out.len = 0;
        for (const char *c = cases[k].in; *c; c++) be->detok_feed(d, (unsigned char)*c, &out);
        be->detok_finish(d, &out);
        CHECK_MSG(out.len == strlen(cases[k].want) && !memcmp(out.data, cases[k].want, out.len),
                  "case %zu", k);
    }
    /* random bytes never give ill-formed output */
    uint64_t seed = t_fuzz_seed(99);
    for (int iter = 0, iters = t_fuzz_iters(200); iter < iters; iter++) {
        out.len = 0;
        for (int k = 0; k < 64; k++) be->detok_feed(d, t_rand_int(&seed, 256), &out);
        be->detok_finish(d, &out);
        json_t *j = json_stringn(out.data ? out.data : "", out.len); /* jansson validates UTF-8 */
        CHECK_MSG(j != NULL, "iter %d: ill-formed UTF-8 out of the detokenizer", iter);
        json_decref(j);
        if (t_cur_failed) break;
    }
    be->detok_free(d);
    srv_buf_free(&out);
    srv_ids ids = {0};
    kdt_chat_message msgs[2] = {{KDT_CHAT_SYSTEM, "s"}, {KDT_CHAT_USER, "hi"}};
    CHECK_EQ_INT(be->chat_encode(be->self, msgs, 2, &ids), KDT_OK);
    int32_t want[] = {SRV_MOCK_ROLE0, 's', SRV_MOCK_IM_END, SRV_MOCK_ROLE0 + 1, 'h', 'i',
                      SRV_MOCK_IM_END, SRV_MOCK_ROLE0 + 2};
    CHECK(ids.n == 8 && !memcmp(ids.v, want, sizeof want));
    srv_ids_free(&ids);
    srv_backend_free(be);
}

/* The embedded copies must equal src/server/static/ (run tools/embed_static.py after editing). */
static void test_static_embedded(void) {
    CHECK(srv_static_file_count >= 2);
    for (size_t i = 0; i < srv_static_file_count; i++) {
        const srv_static_file *f = &srv_static_files[i];
        char path[1024];
        snprintf(path, sizeof path, "%s/src/server/static/%s", KDT_SOURCE_DIR, f->file);
        FILE *fp = fopen(path, "rb");
        CHECK_MSG(fp != NULL, "cannot open %s", path);
        if (!fp) continue;
        srv_buf disk = {0};
        char chunk[4096];
        size_t n;
        while ((n = fread(chunk, 1, sizeof chunk, fp)) > 0) srv_buf_append(&disk, chunk, n);
        fclose(fp);
        CHECK_MSG(disk.len == f->len && !memcmp(disk.data, f->data, f->len),
                  "%s differs from the embedded copy: run python3 tools/embed_static.py", path);
        srv_buf_free(&disk);
    }
    CHECK(!strcmp(srv_static_files[0].path, "/"));
}

int main(void) {
    T_RUN(test_parse_valid);
    T_RUN(test_parse_errors);
    T_RUN(test_parse_fuzz);
    T_RUN(test_responses);
    T_RUN(test_textout);
    T_RUN(test_metrics);
    T_RUN(test_mock_detok);
    T_RUN(test_static_embedded);
    return t_summary();
}

#else
int main(void) {
    printf("test_server_api: skipped (built without jansson)\n");
    return t_summary();
}
#endif
