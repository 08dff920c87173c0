/* gen.c - one generation request, from a parsed srv_api_req to the bytes the client receives,
 * independent of the HTTP library (http.c drives it; tests drive it directly).
 *
 *   srv_gen_start         prompt ids (chat template or plain encode, or ids given by the client),
 *                         context and max_tokens checks, sampling params, submit to the scheduler
 *   srv_gen_wait_admitted blocks (bounded) until the engine admitted or refused the request
 *   srv_gen_pump          reads new tokens, detokenizes them, matches stop strings (a match
 *                         cancels the engine stream at once), and appends SSE events (stream) or
 *                         accumulates the text (non-stream); the last call appends the final
 *                         chunk, the usage chunk when asked for, and "data: [DONE]"
 *   srv_gen_response_json the non-streaming body
 * usage.completion_tokens counts the tokens the engine emitted up to the end of the answer: up to
 * and including the end-of-turn token, or the token that completed a stop string.
 */
#include "server/server.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static uint64_t fresh_seed(void) {
    static atomic_ullong counter;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t z = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^
                 (atomic_fetch_add(&counter, 1) + 1) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int build_prompt(srv_gen *g, srv_error *e) {
    srv_api_req *a = &g->api;
    srv_ids *ids = &g->req->prompt;
    kdt_status st = KDT_OK;
    const char *field = a->ep == SRV_EP_CHAT ? "messages" : "prompt";
    if (a->ep == SRV_EP_CHAT) {
        st = g->be->chat_encode(g->be->self, a->msgs, a->n_msgs, ids);
    } else if (a->prompt_is_ids) {
        for (size_t i = 0; i < a->prompt_ids.n; i++)
            if (a->prompt_ids.v[i] >= g->be->vocab_size) {
                srv_bad_field(e, "prompt", "'prompt[%zu]' = %d is outside the vocabulary (0..%d)",
                              i, a->prompt_ids.v[i], g->be->vocab_size - 1);
                return -1;
            }
        if (srv_ids_append(ids, a->prompt_ids.v, a->prompt_ids.n)) st = KDT_ERR_OUT_OF_MEMORY;
    } else {
        st = g->be->encode(g->be->self, a->prompt, a->prompt_len, ids);
        if (st == KDT_OK && ids->n == 0 && g->be->bos >= 0 && srv_ids_push(ids, g->be->bos))
            st = KDT_ERR_OUT_OF_MEMORY;
    }
    if (st == KDT_ERR_OUT_OF_MEMORY) {
        srv_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        return -1;
    }
    if (st != KDT_OK) {
        srv_bad_field(e, field, "could not tokenize '%s': %s", field, kdt_last_error());
        return -1;
    }
    if (ids->n == 0) {
        srv_bad_field(e, field, "'%s' is empty (and the model has no BOS token to start from)",
                      field);
        return -1;
    }
    return 0;
}

static int check_lengths(srv_gen *g, srv_error *e) {
    const srv_api_req *a = &g->api;
    int64_t n_prompt = (int64_t)g->req->prompt.n, ctx = g->be->max_context;
    const char *field = a->ep == SRV_EP_CHAT ? "messages" : "prompt";
    if (n_prompt >= ctx) {
        srv_error_set(e, 400, "invalid_request_error", field, "context_length_exceeded",
                      "This model's maximum context length is %lld tokens, but the prompt has "
                      "%lld tokens (no room for a completion). Please shorten the prompt.",
                      (long long)ctx, (long long)n_prompt);
        return -1;
    }
    int64_t max_new = a->max_tokens;
    if (max_new < 0) /* OpenAI defaults: 16 for completions, the rest of the context for chat */
        max_new = a->ep == SRV_EP_CHAT ? ctx - n_prompt : (ctx - n_prompt < 16 ? ctx - n_prompt : 16);
    if (n_prompt + max_new > ctx) {
        srv_error_set(e, 400, "invalid_request_error", "max_tokens", "context_length_exceeded",
                      "This model's maximum context length is %lld tokens. However, you "
                      "requested %lld tokens (%lld in the %s, %lld for the completion). Please "
                      "reduce the length of the %s or max_tokens.",
                      (long long)ctx, (long long)(n_prompt + max_new), (long long)n_prompt,
                      a->ep == SRV_EP_CHAT ? "messages" : "prompt", (long long)max_new,
                      a->ep == SRV_EP_CHAT ? "messages" : "prompt");
        return -1;
    }
    g->req->params.max_new_tokens = (int32_t)max_new;
    return 0;
}

int srv_gen_start(srv_gen *g, srv_backend *be, srv_sched *s, const char *model,
                  srv_api_req *api, double t_arrival, srv_error *e) {
    memset(g, 0, sizeof *g);
    g->be = be;
    g->sched = s;
    g->api = *api; /* take ownership */
    memset(api, 0, sizeof *api);
    g->t_start = t_arrival;
    srv_resp_id_init(&g->rid, g->api.ep, model);
    srv_textout_init(&g->tout, g->api.stop, g->api.n_stop);
    g->state_seen = SRV_REQ_QUEUED;
    if (!(g->req = srv_req_new()) || be->detok_new(be->self, &g->detok) != KDT_OK) {
        srv_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        return -1;
    }
    if (build_prompt(g, e) || check_lengths(g, e)) return -1;

    srv_req *r = g->req;
    r->params.spec = g->api.spec;
    r->params.budget = g->api.budget;
    r->params.temperature = (float)g->api.temperature;
    r->params.top_k = g->api.top_k;
    r->params.top_p = (float)g->api.top_p;
    r->params.seed = g->api.has_seed ? g->api.seed : fresh_seed();
    if (!g->api.ignore_eos) {
        memcpy(r->stop_ids, be->stop_ids, (size_t)be->n_stop_ids * sizeof *be->stop_ids);
        r->params.stop_ids = r->stop_ids;
        r->params.n_stop = be->n_stop_ids;
    }
    r->t_submit = g->t_start;
    g->prompt_tokens = (int32_t)r->prompt.n;
    if (srv_sched_submit(s, r, e)) return -1;
    g->submitted = 1;
    return 0;
}

static void summary(const srv_gen *g, const char *finish, srv_gen_summary *s) {
    memset(s, 0, sizeof *s);
    s->prompt_tokens = g->prompt_tokens;
    s->completion_tokens = g->completion_tokens;
    s->finish_reason = finish;
    pthread_mutex_lock(&g->req->mu);
    s->rounds = g->req->tau_rounds;
    s->tau = g->req->tau_rounds ? (double)g->req->tau_sum / g->req->tau_rounds : 0.0;
    pthread_mutex_unlock(&g->req->mu);
    s->spec = g->api.spec;
    s->budget = g->api.budget;
}

/* Maps a refused/failed request to an error record. */
static void request_error(srv_gen *g, int status, srv_error *e) {
    pthread_mutex_lock(&g->req->mu);
    char msg[256];
    snprintf(msg, sizeof msg, "%s", g->req->err_msg[0] ? g->req->err_msg : "request failed");
    pthread_mutex_unlock(&g->req->mu);
    if (status == 400)
        srv_error_set(e, 400, "invalid_request_error", NULL, NULL, "%s", msg);
    else if (status == 503) {
        srv_error_set(e, 503, "server_error", NULL, "shutting_down", "%s", msg);
        e->retry_after_s = 5;
    } else
        srv_error_set(e, status ? status : 500, "server_error", NULL, NULL, "%s", msg);
}

int srv_gen_wait_admitted(srv_gen *g, double wait_s, srv_error *e) {
    srv_req_view v;
    srv_req_wait(g->req, 0, SRV_REQ_QUEUED, wait_s, NULL, &v);
    if (v.state == SRV_REQ_QUEUED) return 0;
    if (v.state == SRV_REQ_DONE && v.n_out == 0 && (v.err_status || v.finish == KDT_FINISH_CANCELLED)) {
        request_error(g, v.err_status ? v.err_status : 503, e);
        if (!v.err_status) snprintf(e->message, sizeof e->message, "the request was cancelled");
        return -1;
    }
    return 1;
}

static int is_stop_id(const srv_req *r, int32_t t) {
    for (int32_t i = 0; i < r->params.n_stop; i++)
        if (r->stop_ids[i] == t) return 1;
    return 0;
}

/* Appends new answer text: an SSE chunk (stream) or the accumulated text. */
static int emit_text(srv_gen *g, const char *text, size_t len) {
    if (!g->api.stream) return srv_buf_append(&g->text, text, len);
    if (len == 0) return 0;
    return srv_api_chunk_sse(g->api.ep, &g->rid, text, len, 0, NULL, &g->out);
}

int srv_gen_begin_stream(srv_gen *g) {
    if (g->api.ep != SRV_EP_CHAT) return 0;
    return srv_api_chunk_sse(g->api.ep, &g->rid, "", 0, 1, NULL, &g->out);
}

/* The end of the answer: final chunk (+ usage) and [DONE], or nothing more for non-stream. */
static int finish(srv_gen *g, const char *reason) {
    g->finish_reason = reason;
    g->done = 1;
    if (!g->api.stream) return 0;
    srv_gen_summary s;
    summary(g, reason, &s);
    int rc = srv_api_chunk_sse(g->api.ep, &g->rid, "", 0, 0, &s, &g->out);
    if (!rc && g->api.include_usage) rc = srv_api_usage_chunk_sse(g->api.ep, &g->rid, &s, &g->out);
    if (!rc) rc = srv_buf_puts(&g->out, "data: [DONE]\n\n");
    return rc;
}

/* A failure: remembered in g->error; a stream (its 200 already sent) gets an error event, then
 * [DONE] (out of memory here just ends the stream). Always -1. */
static int fail_stream(srv_gen *g, const srv_error *e) {
    g->done = 1;
    g->failed = 1;
    g->error = *e;
    if (g->api.stream && !srv_buf_puts(&g->out, "data: ") && !srv_api_error_json(e, &g->out))
        srv_buf_puts(&g->out, "\n\ndata: [DONE]\n\n");
    return -1;
}

int srv_gen_pump(srv_gen *g, double wait_s, srv_error *e) {
    if (g->done) return g->failed ? -1 : 1;
    srv_ids fresh = {0};
    srv_req_view v;
    srv_req_wait(g->req, g->seen, g->state_seen, wait_s, &fresh, &v);
    g->state_seen = v.state;
    srv_buf piece = {0}, text = {0};
    int stopped = 0, rc = 0;
    for (size_t i = 0; i < fresh.n && !stopped && !rc; i++) {
        int32_t t = fresh.v[i];
        g->seen++;
        g->completion_tokens++;
        if (is_stop_id(g->req, t)) continue; /* end of turn: not text; the stream ends here */
        piece.len = 0;
        if (g->be->detok_feed(g->detok, t, &piece) != KDT_OK) {
            srv_error_set(e, 500, "server_error", NULL, NULL, "detokenizer: %s", kdt_last_error());
            rc = -1;
            break;
        }
        int m = srv_textout_push(&g->tout, piece.data ? piece.data : "", piece.len, &text);
        if (m < 0) rc = -2;
        stopped = m == 1;
    }
    if (!rc && !stopped && v.state == SRV_REQ_DONE && g->seen >= v.n_out) {
        /* the engine is done and every token has been read */
        if (v.err_status) {
            request_error(g, v.err_status, e);
            rc = -1;
        } else {
            piece.len = 0;
            if (g->be->detok_finish(g->detok, &piece) != KDT_OK) rc = -2;
            else {
                int m = srv_textout_push(&g->tout, piece.data ? piece.data : "", piece.len, &text);
                stopped = m == 1;
                if (m < 0 || (!stopped && srv_textout_flush(&g->tout, &text))) rc = -2;
            }
            if (!rc && !stopped) {
                if (v.finish == KDT_FINISH_CANCELLED) {
                    srv_error_set(e, 503, "server_error", NULL, "shutting_down",
                                  "the request was cancelled (the server is shutting down)");
                    e->retry_after_s = 5;
                    rc = -1;
                } else if (v.finish == KDT_FINISH_ERROR) {
                    request_error(g, 500, e);
                    rc = -1;
                }
            }
        }
    }
    if (rc == -2) srv_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    if (rc == 0 && emit_text(g, text.data ? text.data : "", text.len)) {
        srv_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        rc = -1;
    }
    srv_buf_free(&piece);
    srv_buf_free(&text);
    srv_ids_free(&fresh);
    if (rc) return fail_stream(g, e);

    if (stopped) {
        srv_sched_cancel(g->sched, g->req); /* frees the stream's KV pages within a round */
        return finish(g, "stop") ? -1 : 1;
    }
    if (v.state == SRV_REQ_DONE && g->seen >= v.n_out)
        return finish(g, v.finish == KDT_FINISH_LENGTH ? "length" : "stop") ? -1 : 1;
    return 0;
}

int srv_gen_response_json(srv_gen *g, srv_buf *out) {
    srv_gen_summary s;
    summary(g, g->finish_reason, &s);
    return srv_api_response_json(g->api.ep, &g->rid, g->text.data, g->text.len, &s, out);
}

void srv_gen_cancel(srv_gen *g) {
    if (g->submitted && !g->done) srv_sched_cancel(g->sched, g->req);
}

void srv_gen_free(srv_gen *g) {
    srv_gen_cancel(g);
    if (g->detok) g->be->detok_free(g->detok);
    srv_req_release(g->req);
    srv_textout_free(&g->tout);
    srv_api_req_free(&g->api);
    srv_buf_free(&g->text);
    srv_buf_free(&g->out);
    memset(g, 0, sizeof *g);
}
