/* test_server_sched.c - the server below HTTP: scheduler + generation (gen.c) over the mock
 * backend, with real threads. Checks that greedy answers under 32 concurrent clients equal the
 * same requests served alone, that no KV page leaks, that streamed deltas add up to the
 * non-streamed text, stop strings (truncation + the engine stream cancelled), cancellation freeing
 * pages within a round, 429 when the queue is full (also when the KV cache is what is full), 400
 * for context overflows and for requests that can never fit, and a graceful shutdown.
 *
 * Like test_server_api.c it #includes the server sources it needs (they are not in libkdtree).
 */
#include "t.h"

#ifdef KDT_WITH_MODEL
#include "../src/server/util.c"
#include "../src/server/api.c"
#include "../src/server/textout.c"
#include "../src/server/metrics.c"
#include "../src/server/bytes_tok.c"
#include "../src/server/backend_mock.c"
#include "../src/server/sched.c"
#include "../src/server/gen.c"

typedef struct harness {
    srv_backend *be;
    srv_sched sched;
    srv_metrics metrics;
    srv_api_limits lim;
} harness;

static int harness_start(harness *h, srv_mock_options mo, int32_t max_queue) {
    memset(h, 0, sizeof *h);
    if (srv_backend_mock_create(&mo, &h->be) != KDT_OK) return -1;
    srv_metrics_init(&h->metrics);
    h->lim = (srv_api_limits){.model_name = "mock", .max_budget = 64,
                              .default_spec = KDT_SPEC_DDTREE, .default_budget = 32,
                              .has_draft = 1};
    return srv_sched_start(&h->sched, h->be, &h->metrics, max_queue) == KDT_OK ? 0 : -1;
}

static void harness_stop(harness *h) {
    srv_sched_stop(&h->sched, 0);
    srv_sched_destroy(&h->sched);
    srv_metrics_destroy(&h->metrics);
    srv_backend_free(h->be);
}

/* The outcome of one request. */
typedef struct result {
    int status;                 /* 200 or the error status */
    srv_error err;
    srv_buf text;               /* non-stream: the answer; stream: the deltas concatenated */
    srv_buf sse;                /* stream: the raw bytes */
    int32_t prompt_tokens, completion_tokens;
    char finish[16];
} result;

static void result_free(result *r) {
    srv_buf_free(&r->text);
    srv_buf_free(&r->sse);
}

/* Collects the text of every SSE data event into r->text; checks the framing on the way. */
static void parse_sse(result *r) {
    const char *p = r->sse.data ? r->sse.data : "";
    int done = 0;
    while (*p) {
        const char *end = strstr(p, "\n\n");
        CHECK_MSG(end != NULL, "unterminated SSE event: %.80s", p);
        if (!end) break;
        CHECK_MSG(!done, "data after [DONE]");
        CHECK_MSG(!strncmp(p, "data: ", 6), "event without data: %.40s", p);
        const char *data = p + 6;
        size_t n = (size_t)(end - data);
        if (n == 6 && !memcmp(data, "[DONE]", 6)) {
            done = 1;
        } else {
            json_t *j = json_loadb(data, n, 0, NULL);
            CHECK_MSG(j != NULL, "bad JSON in SSE: %.*s", (int)n, data);
            json_t *c0 = json_array_get(json_object_get(j, "choices"), 0);
            json_t *t = json_object_get(c0, "text");
            if (!t) t = json_object_get(json_object_get(c0, "delta"), "content");
            if (json_is_string(t)) srv_buf_append(&r->text, json_string_value(t), json_string_length(t));
            json_t *f = json_object_get(c0, "finish_reason");
            if (json_is_string(f)) snprintf(r->finish, sizeof r->finish, "%s", json_string_value(f));
            json_t *u = json_object_get(j, "usage");
            if (u) {
                r->prompt_tokens = (int32_t)json_integer_value(json_object_get(u, "prompt_tokens"));
                r->completion_tokens =
                    (int32_t)json_integer_value(json_object_get(u, "completion_tokens"));
            }
            json_decref(j);
        }
        p = end + 2;
    }
    CHECK_MSG(done, "the stream did not end with data: [DONE]");
}

/* One request through parse -> start -> admission -> pump, as an HTTP thread would run it. */
static void run_request(harness *h, srv_endpoint ep, const char *body, result *r) {
    memset(r, 0, sizeof *r);
    srv_api_req api;
    if (srv_api_parse(ep, body, strlen(body), &h->lim, &api, &r->err)) {
        srv_api_req_free(&api);
        r->status = r->err.status;
        return;
    }
    srv_gen g;
    int stream = api.stream;
    if (srv_gen_start(&g, h->be, &h->sched, "mock", &api, srv_now(), &r->err)) {
        r->status = r->err.status;
        srv_gen_free(&g);
        return;
    }
    int a;
    double until = srv_now() + 20;
    while ((a = srv_gen_wait_admitted(&g, 0.05, &r->err)) == 0 && srv_now() < until) {}
    if (a <= 0) {
        r->status = a < 0 ? r->err.status : 504;
        srv_gen_free(&g);
        return;
    }
    if (stream) srv_gen_begin_stream(&g);
    int rc = 0;
    while ((rc = srv_gen_pump(&g, 0.05, &r->err)) == 0 && srv_now() < until) {
        if (stream && g.out.len) {
            srv_buf_append(&r->sse, g.out.data, g.out.len);
            srv_buf_consume(&g.out, g.out.len);
        }
    }
    if (stream) {
        srv_buf_append(&r->sse, g.out.data ? g.out.data : "", g.out.len);
        r->status = 200; /* the headers went out before any error */
        parse_sse(r);
    } else if (rc == 1) {
        r->status = 200;
        srv_buf_append(&r->text, g.text.data ? g.text.data : "", g.text.len);
        r->prompt_tokens = g.prompt_tokens;
        r->completion_tokens = g.completion_tokens;
        snprintf(r->finish, sizeof r->finish, "%s", g.finish_reason ? g.finish_reason : "");
        srv_buf body_json = {0};
        CHECK(srv_gen_response_json(&g, &body_json) == 0);
        srv_buf_free(&body_json);
    } else {
        r->status = rc < 0 ? r->err.status : 504;
    }
    srv_gen_free(&g);
}

/* Waits (bounded) until the engine holds no stream and no KV page. */
static int wait_engine_empty(harness *h, double seconds) {
    double until = srv_now() + seconds;
    srv_sched_snapshot s;
    do {
        srv_sched_get_snapshot(&h->sched, &s);
        if (s.engine.kv_pages_used == 0 && s.active == 0 && s.queue_depth == 0) return 1;
        nanosleep(&(struct timespec){0, 2 * 1000 * 1000}, NULL);
    } while (srv_now() < until);
    fprintf(stderr, "  engine not empty: kv used %d, active %d, queued %d\n",
            s.engine.kv_pages_used, s.active, s.queue_depth);
    return 0;
}

/* ---- 32 concurrent clients vs solo ---------------------------------------------------------- */

#define N_CLIENTS 32
static char bodies[N_CLIENTS][512];
static srv_endpoint eps[N_CLIENTS];

typedef struct worker {
    harness *h;
    int idx;
    result res;
} worker;

static void *worker_main(void *arg) {
    worker *w = arg;
    run_request(w->h, eps[w->idx], bodies[w->idx], &w->res);
    return NULL;
}

static void make_bodies(void) {
    for (int i = 0; i < N_CLIENTS; i++) {
        int chat = i % 2, stream = (i / 2) % 2;
        const char *spec = (const char *[]){"ar", "chain", "ddtree", "auto"}[i % 4];
        eps[i] = chat ? SRV_EP_CHAT : SRV_EP_COMPLETIONS;
        if (chat)
            snprintf(bodies[i], sizeof bodies[i],
                     "{\"model\":\"mock\",\"messages\":[{\"role\":\"user\",\"content\":\"question "
                     "%d\"}],\"temperature\":0,\"max_tokens\":%d,\"stream\":%s,\"stream_options\":"
                     "{\"include_usage\":true},\"kdtree\":{\"spec\":\"%s\",\"budget\":%d}}",
                     i, 20 + 7 * i, stream ? "true" : "false", spec, 1 + i);
        else
            snprintf(bodies[i], sizeof bodies[i],
                     "{\"prompt\":\"prompt number %d\",\"temperature\":0,\"max_tokens\":%d,"
                     "\"stream\":%s,\"stream_options\":{\"include_usage\":true},\"kdtree\":{\"spec\":"
                     "\"%s\"}}", i, 20 + 7 * i, stream ? "true" : "false", spec);
    }
}

static void test_concurrent_equals_solo(void) {
    harness h;
    CHECK(harness_start(&h, (srv_mock_options){.max_streams = 8, .round_ms = 1}, 64) == 0);
    make_bodies();
    static result solo[N_CLIENTS];
    for (int i = 0; i < N_CLIENTS; i++) {
        run_request(&h, eps[i], bodies[i], &solo[i]);
        CHECK_MSG(solo[i].status == 200, "solo %d: %d %s", i, solo[i].status, solo[i].err.message);
        CHECK_MSG(solo[i].text.len > 0, "solo %d: empty answer", i);
        CHECK(solo[i].completion_tokens > 0 && solo[i].prompt_tokens > 0);
    }
    CHECK(wait_engine_empty(&h, 2));
    for (int round = 0; round < 2; round++) {
        static worker w[N_CLIENTS];
        pthread_t th[N_CLIENTS];
        for (int i = 0; i < N_CLIENTS; i++) {
            w[i] = (worker){.h = &h, .idx = i};
            CHECK(pthread_create(&th[i], NULL, worker_main, &w[i]) == 0);
        }
        for (int i = 0; i < N_CLIENTS; i++) pthread_join(th[i], NULL);
        for (int i = 0; i < N_CLIENTS; i++) {
            result *r = &w[i].res;
            CHECK_MSG(r->status == 200, "client %d: %d %s", i, r->status, r->err.message);
            CHECK_MSG(r->text.len == solo[i].text.len &&
                          !memcmp(r->text.data, solo[i].text.data, r->text.len),
                      "client %d: concurrent answer differs from solo:\n    %s\n    %s", i,
                      r->text.data ? r->text.data : "", solo[i].text.data ? solo[i].text.data : "");
            CHECK_EQ_INT(r->completion_tokens, solo[i].completion_tokens);
            CHECK(!strcmp(r->finish, solo[i].finish));
            result_free(r);
        }
        CHECK(wait_engine_empty(&h, 2));
    }
    for (int i = 0; i < N_CLIENTS; i++) result_free(&solo[i]);
    srv_metrics *m = &h.metrics;
    CHECK_EQ_INT(m->streams_started, 3 * N_CLIENTS);
    CHECK_EQ_INT(m->streams_cancelled, 0);
    CHECK(m->ttft.n == 3 * N_CLIENTS);
    harness_stop(&h);
}

static void test_stream_matches_plain(void) {
    harness h;
    CHECK(harness_start(&h, (srv_mock_options){.round_ms = 0}, 8) == 0);
    const char *plain = "{\"messages\":[{\"role\":\"user\",\"content\":\"same\"}],\"temperature\":0}";
    const char *streamed = "{\"messages\":[{\"role\":\"user\",\"content\":\"same\"}],\"temperature\":0,"
                           "\"stream\":true,\"stream_options\":{\"include_usage\":true}}";
    result a, b;
    run_request(&h, SRV_EP_CHAT, plain, &a);
    run_request(&h, SRV_EP_CHAT, streamed, &b);
    CHECK(a.status == 200 && b.status == 200);
    CHECK(a.text.len > 0 && a.text.len == b.text.len && !memcmp(a.text.data, b.text.data, a.text.len));
    CHECK(!strcmp(a.finish, "stop") && !strcmp(b.finish, "stop"));
    CHECK_EQ_INT(a.completion_tokens, b.completion_tokens);
    CHECK_EQ_INT(a.prompt_tokens, b.prompt_tokens);
    /* the chat stream opens with the assistant role */
    CHECK(b.sse.data && strstr(b.sse.data, "\"delta\":{\"role\":\"assistant\",\"content\":\"\"}") ==
                            strstr(b.sse.data, "\"delta\""));
    /* without include_usage there is no usage chunk */
    result c;
    run_request(&h, SRV_EP_COMPLETIONS, "{\"prompt\":\"p\",\"stream\":true,\"max_tokens\":3}", &c);
    CHECK(c.status == 200 && c.sse.data && !strstr(c.sse.data, "\"usage\""));
    result_free(&a);
    result_free(&b);
    result_free(&c);
    harness_stop(&h);
}

static void test_stop_strings(void) {
    harness h;
    CHECK(harness_start(&h, (srv_mock_options){.round_ms = 0}, 8) == 0);
    result full;
    const char *b0 = "{\"prompt\":\"tell me\",\"temperature\":0,\"max_tokens\":200,"
                     "\"kdtree\":{\"ignore_eos\":true}}";
    run_request(&h, SRV_EP_COMPLETIONS, b0, &full);
    CHECK(full.status == 200 && full.text.len > 40);
    CHECK(!strcmp(full.finish, "length"));
    CHECK_EQ_INT(full.completion_tokens, 200);
    if (full.text.len > 40) {
        /* a stop string from the middle of the answer, as it first occurs */
        char stop[8];
        memcpy(stop, full.text.data + 20, 4);
        stop[4] = '\0';
        while (((unsigned char)stop[0] & 0xc0) == 0x80) memmove(stop, stop + 1, strlen(stop));
        size_t cut = (size_t)(strstr(full.text.data, stop) - full.text.data);
        for (int stream = 0; stream < 2; stream++) {
            char body[512];
            snprintf(body, sizeof body,
                     "{\"prompt\":\"tell me\",\"temperature\":0,\"max_tokens\":200,\"stream\":%s,"
                     "\"stop\":[\"zzzz\",\"%s\"],\"kdtree\":{\"ignore_eos\":true}}",
                     stream ? "true" : "false", stop);
            result r;
            run_request(&h, SRV_EP_COMPLETIONS, body, &r);
            CHECK_MSG(r.status == 200 && r.text.len == cut && !memcmp(r.text.data, full.text.data, cut),
                      "stop '%s' stream %d: got %zu bytes, want %zu", stop, stream, r.text.len, cut);
            CHECK(!strcmp(r.finish, "stop"));
            if (!stream) CHECK(r.completion_tokens < 200); /* counted up to the match only */
            CHECK(wait_engine_empty(&h, 1)); /* the engine stream was cancelled at the match */
            result_free(&r);
        }
    }
    /* a stop string that never occurs changes nothing */
    result r;
    run_request(&h, SRV_EP_COMPLETIONS,
                "{\"prompt\":\"tell me\",\"temperature\":0,\"max_tokens\":200,\"stop\":\"@@\","
                "\"kdtree\":{\"ignore_eos\":true}}", &r);
    CHECK(r.text.len == full.text.len && !memcmp(r.text.data, full.text.data, r.text.len));
    result_free(&r);
    result_free(&full);
    harness_stop(&h);
}

static void test_cancel_frees_pages(void) {
    harness h;
    CHECK(harness_start(&h, (srv_mock_options){.round_ms = 5}, 8) == 0);
    const char *body = "{\"prompt\":\"a long story\",\"max_tokens\":900,\"stream\":true,"
                       "\"kdtree\":{\"ignore_eos\":true}}";
    srv_api_req api;
    srv_error e;
    CHECK(srv_api_parse(SRV_EP_COMPLETIONS, body, strlen(body), &h.lim, &api, &e) == 0);
    srv_gen g;
    CHECK(srv_gen_start(&g, h.be, &h.sched, "mock", &api, srv_now(), &e) == 0);
    while (srv_gen_wait_admitted(&g, 0.05, &e) == 0) {}
    for (int i = 0; i < 5; i++) srv_gen_pump(&g, 0.05, &e);
    srv_sched_snapshot s;
    srv_sched_get_snapshot(&h.sched, &s);
    CHECK(s.engine.kv_pages_used > 0 && s.active == 1);
    uint64_t rounds_before = s.engine.rounds;
    srv_gen_cancel(&g); /* the client went away */
    CHECK(wait_engine_empty(&h, 1));
    srv_sched_get_snapshot(&h.sched, &s);
    CHECK_MSG(s.engine.rounds <= rounds_before + 2, "pages freed only after %llu rounds",
              (unsigned long long)(s.engine.rounds - rounds_before));
    srv_gen_free(&g);
    CHECK_EQ_INT(h.metrics.streams_cancelled, 1);

    /* cancelled while still queued: leaves the queue, never reaches the engine */
    harness_stop(&h);
    CHECK(harness_start(&h, (srv_mock_options){.max_streams = 1, .round_ms = 5}, 8) == 0);
    srv_gen g1, g2;
    CHECK(srv_api_parse(SRV_EP_COMPLETIONS, body, strlen(body), &h.lim, &api, &e) == 0);
    CHECK(srv_gen_start(&g1, h.be, &h.sched, "mock", &api, srv_now(), &e) == 0);
    while (srv_gen_wait_admitted(&g1, 0.05, &e) == 0) {}
    CHECK(srv_api_parse(SRV_EP_COMPLETIONS, body, strlen(body), &h.lim, &api, &e) == 0);
    CHECK(srv_gen_start(&g2, h.be, &h.sched, "mock", &api, srv_now(), &e) == 0);
    CHECK_EQ_INT(srv_gen_wait_admitted(&g2, 0.05, &e), 0);
    srv_gen_cancel(&g2);
    srv_gen_cancel(&g1);
    CHECK(wait_engine_empty(&h, 1));
    srv_gen_free(&g1);
    srv_gen_free(&g2);
    CHECK_EQ_INT(h.metrics.streams_started, 1);
    harness_stop(&h);
}

/* Starts a long request and waits until it runs. */
static void start_long(harness *h, srv_gen *g, int max_tokens) {
    char body[256];
    snprintf(body, sizeof body, "{\"prompt\":\"a long story\",\"max_tokens\":%d,"
                                "\"kdtree\":{\"ignore_eos\":true}}", max_tokens);
    srv_api_req api;
    srv_error e;
    CHECK(srv_api_parse(SRV_EP_COMPLETIONS, body, strlen(body), &h->lim, &api, &e) == 0);
    CHECK(srv_gen_start(g, h->be, &h->sched, "mock", &api, srv_now(), &e) == 0);
}

static void test_queue_full_429(void) {
    harness h;
    CHECK(harness_start(&h, (srv_mock_options){.max_streams = 1, .round_ms = 5}, 1) == 0);
    srv_gen a, b;
    srv_error e;
    start_long(&h, &a, 900);
    while (srv_gen_wait_admitted(&a, 0.05, &e) == 0) {}
    start_long(&h, &b, 900); /* waits: the only stream slot is taken */
    CHECK_EQ_INT(srv_gen_wait_admitted(&b, 0.05, &e), 0);
    result c;
    run_request(&h, SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"max_tokens\":3}", &c);
    CHECK_EQ_INT(c.status, 429);
    CHECK(c.err.retry_after_s > 0 && c.err.code && !strcmp(c.err.code, "queue_full"));
    srv_gen_cancel(&a);
    CHECK(srv_gen_wait_admitted(&b, 2.0, &e) == 1); /* b moves up */
    srv_gen_cancel(&b);
    CHECK(wait_engine_empty(&h, 1));
    srv_gen_free(&a);
    srv_gen_free(&b);
    result_free(&c);
    harness_stop(&h);

    /* the KV cache is what is full: 4 pages, one 256-token request takes them all */
    CHECK(harness_start(&h, (srv_mock_options){.max_streams = 4, .max_context = 256,
                                               .kv_pages = 4, .round_ms = 5}, 1) == 0);
    start_long(&h, &a, 240); /* 12 prompt + 240 tokens: 4 pages */
    while (srv_gen_wait_admitted(&a, 0.05, &e) == 0) {}
    start_long(&h, &b, 240);
    CHECK_EQ_INT(srv_gen_wait_admitted(&b, 0.05, &e), 0); /* slots free, pages not */
    run_request(&h, SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"max_tokens\":3}", &c);
    CHECK_EQ_INT(c.status, 429);
    srv_gen_cancel(&a);
    CHECK(srv_gen_wait_admitted(&b, 2.0, &e) == 1);
    srv_gen_cancel(&b);
    CHECK(wait_engine_empty(&h, 1));
    srv_gen_free(&a);
    srv_gen_free(&b);
    result_free(&c);
    harness_stop(&h);
}

static void test_length_errors(void) {
    harness h;
    CHECK(harness_start(&h, (srv_mock_options){.max_context = 64, .kv_pages = 8, .round_ms = 0},
                        8) == 0);
    result r;
    char body[512];
    /* prompt alone fills the context */
    snprintf(body, sizeof body, "{\"prompt\":\"%064d\"}", 0);
    run_request(&h, SRV_EP_COMPLETIONS, body, &r);
    CHECK_EQ_INT(r.status, 400);
    CHECK(r.err.code && !strcmp(r.err.code, "context_length_exceeded") && !strcmp(r.err.param, "prompt"));
    /* prompt + max_tokens over the context */
    run_request(&h, SRV_EP_COMPLETIONS, "{\"prompt\":\"0123456789\",\"max_tokens\":60}", &r);
    CHECK_EQ_INT(r.status, 400);
    CHECK(!strcmp(r.err.param, "max_tokens") && strstr(r.err.message, "70 tokens"));
    run_request(&h, SRV_EP_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],"
                                 "\"max_tokens\":1000}", &r);
    CHECK_EQ_INT(r.status, 400);
    /* exactly the context is fine; chat's default max_tokens is the rest of the context */
    run_request(&h, SRV_EP_COMPLETIONS, "{\"prompt\":\"0123456789\",\"max_tokens\":54,"
                                        "\"kdtree\":{\"ignore_eos\":true}}", &r);
    CHECK_EQ_INT(r.status, 200);
    CHECK(r.completion_tokens == 54 && !strcmp(r.finish, "length"));
    result_free(&r);
    run_request(&h, SRV_EP_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],"
                                 "\"kdtree\":{\"ignore_eos\":true}}", &r);
    CHECK(r.status == 200 && r.prompt_tokens + r.completion_tokens == 64);
    result_free(&r);
    /* completions default to 16 tokens (OpenAI) */
    run_request(&h, SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"kdtree\":{\"ignore_eos\":true}}", &r);
    CHECK_EQ_INT(r.completion_tokens, 16);
    result_free(&r);
    /* token ids outside the vocabulary, an empty prompt */
    run_request(&h, SRV_EP_COMPLETIONS, "{\"prompt\":[1,2,99999]}", &r);
    CHECK(r.status == 400 && !strcmp(r.err.param, "prompt"));
    run_request(&h, SRV_EP_COMPLETIONS, "{\"prompt\":\"\"}", &r);
    CHECK(r.status == 400 && !strcmp(r.err.param, "prompt"));
    harness_stop(&h);

    /* a request that cannot fit in the KV pool even when idle: 400, not an endless wait */
    CHECK(harness_start(&h, (srv_mock_options){.max_context = 1024, .kv_pages = 2, .round_ms = 0},
                        8) == 0);
    run_request(&h, SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"max_tokens\":500}", &r);
    CHECK_EQ_INT(r.status, 400);
    CHECK(strstr(r.err.message, "KV cache") != NULL);
    run_request(&h, SRV_EP_COMPLETIONS, "{\"prompt\":\"x\",\"max_tokens\":100}", &r); /* fits */
    CHECK_EQ_INT(r.status, 200);
    result_free(&r);
    CHECK_EQ_INT(h.metrics.streams_failed, 1);
    harness_stop(&h);
}

static void test_sampling_seed(void) {
    harness h;
    CHECK(harness_start(&h, (srv_mock_options){.round_ms = 0}, 8) == 0);
    const char *b7 = "{\"prompt\":\"s\",\"temperature\":0.8,\"seed\":7,\"max_tokens\":60}";
    const char *b8 = "{\"prompt\":\"s\",\"temperature\":0.8,\"seed\":8,\"max_tokens\":60}";
    result a, b, c;
    run_request(&h, SRV_EP_COMPLETIONS, b7, &a);
    run_request(&h, SRV_EP_COMPLETIONS, b7, &b);
    run_request(&h, SRV_EP_COMPLETIONS, b8, &c);
    CHECK(a.text.len == b.text.len && !memcmp(a.text.data, b.text.data, a.text.len));
    CHECK(a.text.len != c.text.len || memcmp(a.text.data, c.text.data, a.text.len) != 0);
    result_free(&a);
    result_free(&b);
    result_free(&c);
    harness_stop(&h);
}

typedef struct shutdown_worker {
    harness *h;
    int stream;
    result res;
} shutdown_worker;

static void *shutdown_main(void *arg) {
    shutdown_worker *w = arg;
    char body[256];
    snprintf(body, sizeof body, "{\"prompt\":\"a long story\",\"max_tokens\":900,\"stream\":%s,"
                                "\"kdtree\":{\"ignore_eos\":true}}", w->stream ? "true" : "false");
    run_request(w->h, SRV_EP_COMPLETIONS, body, &w->res);
    return NULL;
}

/* The engine fails for good mid-generation (the mock's injected device fault at its 4th step):
 * the running request ends with 500, /health's snapshot names the fault, every later request is
 * refused with 503 engine_failed, and /metrics says kdtree_engine_failed 1. */
static void test_engine_fault_503(void) {
    harness h;
    CHECK(harness_start(&h, (srv_mock_options){.max_streams = 2, .round_ms = 1, .fault_at_step = 4}, 8) == 0);
    srv_sched_snapshot snap;
    srv_sched_get_snapshot(&h.sched, &snap);
    CHECK_EQ_INT(snap.fault[0], 0);
    result r;
    run_request(&h, SRV_EP_COMPLETIONS,
                "{\"prompt\":\"a long story\",\"max_tokens\":200,\"kdtree\":{\"ignore_eos\":true}}", &r);
    CHECK_EQ_INT(r.status, 500);
    result_free(&r);
    srv_sched_get_snapshot(&h.sched, &snap);
    CHECK(strstr(snap.fault, "injected") != NULL);
    for (int i = 0; i < 2; i++) { /* refused at submission, however often asked */
        run_request(&h, SRV_EP_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":3}", &r);
        CHECK_EQ_INT(r.status, 503);
        CHECK(r.err.code && !strcmp(r.err.code, "engine_failed"));
        CHECK(strstr(r.err.message, "restart the server") != NULL);
        result_free(&r);
    }
    /* the health body: valid JSON whatever the fault's text holds */
    srv_buf b = {0};
    const srv_health hh = {.status = "engine_failed", .model = "mock", .backend = "mock",
                           .error = "quote \" backslash \\ newline \n", .max_streams = 2};
    CHECK(srv_api_health_json(&hh, &b) == 0);
    json_error_t je;
    json_t *j = json_loadb(b.data, b.len, 0, &je);
    CHECK(j && !strcmp(json_string_value(json_object_get(j, "status")), "engine_failed") &&
          !strcmp(json_string_value(json_object_get(j, "error")), hh.error));
    json_decref(j);
    srv_buf_free(&b);
    srv_buf m = {0};
    CHECK(srv_metrics_render(&h.metrics, &snap, srv_now(), &m) == 0);
    CHECK(m.data && strstr(m.data, "\nkdtree_engine_failed 1\n") != NULL);
    srv_buf_free(&m);
    harness_stop(&h);
}

static void test_shutdown(void) {
    harness h;
    CHECK(harness_start(&h, (srv_mock_options){.max_streams = 2, .round_ms = 5}, 8) == 0);
    shutdown_worker w[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) { /* 2 running, 2 queued */
        w[i] = (shutdown_worker){.h = &h, .stream = i % 2};
        pthread_create(&th[i], NULL, shutdown_main, &w[i]);
    }
    double until = srv_now() + 2;
    srv_sched_snapshot s;
    do srv_sched_get_snapshot(&h.sched, &s);
    while ((s.active < 2 || s.queue_depth < 2) && srv_now() < until);
    CHECK(s.active == 2 && s.queue_depth == 2);
    srv_sched_stop(&h.sched, 0.05); /* grace too short for 900 tokens */
    for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < 4; i++) {
        result *r = &w[i].res;
        if (w[i].stream && r->status == 200) /* started streaming: ends with an error event */
            CHECK(r->sse.data && strstr(r->sse.data, "data: {\"error\"") != NULL);
        else
            CHECK_MSG(r->status == 503, "worker %d: status %d", i, r->status);
        result_free(r);
    }
    srv_sched_get_snapshot(&h.sched, &s);
    CHECK(s.engine.kv_pages_used == 0);
    result r;
    run_request(&h, SRV_EP_COMPLETIONS, "{\"prompt\":\"x\"}", &r); /* refused once draining */
    CHECK_EQ_INT(r.status, 503);
    harness_stop(&h);
}

int main(void) {
    T_RUN(test_concurrent_equals_solo);
    T_RUN(test_stream_matches_plain);
    T_RUN(test_stop_strings);
    T_RUN(test_cancel_frees_pages);
    T_RUN(test_queue_full_429);
    T_RUN(test_length_errors);
    T_RUN(test_sampling_seed);
    T_RUN(test_engine_fault_503);
    T_RUN(test_shutdown);
    return t_summary();
}

#else
int main(void) {
    printf("test_server_sched: skipped (built without jansson)\n");
    return t_summary();
}
#endif
