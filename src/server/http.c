/* http.c - the HTTP layer: libmicrohttpd in thread-per-connection mode, routing, request bodies,
 * responses, SSE streaming and client disconnects. The generation logic itself is gen.c.
 *
 * Routes:
 *   POST /v1/completions, POST /v1/chat/completions   generation (JSON or SSE)
 *   GET  /v1/models, /v1/models/{id}, /health, /metrics, / (web chat page), /chat.js
 * Unknown route 404, wrong method 405 (with Allow), body over --max-body-bytes 413 (the body is
 * read and dropped first, so clients see the answer rather than a reset, up to a bound past which
 * the connection is closed: at once when Content-Length says so).
 *
 * Each connection's thread runs the access handler. For generation it parses, tokenizes and
 * submits (gen.c), then waits for admission so queue and capacity errors still get their status
 * code. Streaming answers use a callback response whose reader blocks (in 100 ms steps) on the
 * request's token queue; non-streaming answers wait in the handler. While waiting, the thread
 * peeks its socket: a client that closed the connection cancels its stream, which frees its KV
 * pages within one engine round. An idle stream sends an SSE comment every 10 s.
 */
#include "server/server.h"

#include <microhttpd.h>

#include <errno.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define WAIT_STEP_S 0.1      /* how often a waiting thread checks its client */
#define KEEPALIVE_S 10.0     /* SSE comment after this long without data */

struct srv_server {
    srv_config cfg;
    char model_name[SRV_MODEL_NAME_MAX];
    char static_dir[1024];
    srv_backend *be;
    srv_sched sched;
    srv_metrics metrics;
    srv_api_limits lim;
    struct MHD_Daemon *mhd;
    int listen_fd;
    long long created;       /* for /v1/models */
    atomic_int in_flight;    /* generation requests not yet completed (finishing their bytes) */
};

typedef struct conn_ctx {
    srv_server *srv;
    srv_endpoint ep;
    const srv_static_file *file; /* SRV_EP_PAGE */
    char model_id[SRV_MODEL_NAME_MAX + 1]; /* GET /v1/models/{id} */
    int method_ok;
    int fd;                  /* the client socket, for disconnect checks */
    int responded;
    int status;
    int too_big;
    size_t body_seen;        /* bytes of body received, kept or not */
    srv_buf body;
    int has_gen;
    srv_gen gen;
    double t_start, last_out;
    char method[8];
    char url[96];
} conn_ctx;

/* ---- small helpers ---------------------------------------------------------------------------- */

/* 1 when the peer has closed its end (or the socket failed); pipelined data counts as alive. */
static int client_gone(int fd) {
    if (fd < 0) return 0;
    char b;
    ssize_t n = recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n > 0) return 0;
    if (n == 0) return 1;
    return !(errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR);
}

/* Closes the connection without an answer, saying why (mhd_log drops libmicrohttpd's own line,
 * which gives no cause). A vanished client is closed with a bare MHD_NO instead: not news. */
static enum MHD_Result drop_connection(const char *why) {
    fprintf(stderr, "kdtree serve: http: connection closed: %s\n", why);
    return MHD_NO;
}

static enum MHD_Result respond(conn_ctx *ctx, struct MHD_Connection *c, int status,
                               const char *ctype, const void *data, size_t len, int retry_after,
                               const char *allow) {
    struct MHD_Response *r =
        MHD_create_response_from_buffer(len, (void *)data, MHD_RESPMEM_MUST_COPY);
    if (!r) return drop_connection("out of memory for a response");
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
    if (retry_after > 0) {
        char v[16];
        snprintf(v, sizeof v, "%d", retry_after);
        MHD_add_response_header(r, MHD_HTTP_HEADER_RETRY_AFTER, v);
    }
    if (allow) MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, allow);
    enum MHD_Result ret = MHD_queue_response(c, (unsigned)status, r);
    MHD_destroy_response(r);
    ctx->responded = 1;
    ctx->status = status;
    srv_metrics_count_request(&ctx->srv->metrics, ctx->ep, status);
    return ret;
}

static enum MHD_Result respond_json(conn_ctx *ctx, struct MHD_Connection *c, int status,
                                    const srv_buf *b) {
    return respond(ctx, c, status, "application/json", b->data ? b->data : "", b->len, 0, NULL);
}

static enum MHD_Result respond_error(conn_ctx *ctx, struct MHD_Connection *c, const srv_error *e,
                                     const char *allow) {
    srv_buf b = {0};
    if (srv_api_error_json(e, &b)) srv_buf_puts(&b, "{\"error\":{\"message\":\"error\"}}");
    enum MHD_Result r = respond(ctx, c, e->status, "application/json", b.data, b.len,
                                e->retry_after_s, allow);
    srv_buf_free(&b);
    return r;
}

/* ---- routing ---------------------------------------------------------------------------------- */

static void route(conn_ctx *ctx, const char *url, const char *method) {
    int is_get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
    int is_post = !strcmp(method, "POST");
    ctx->ep = SRV_EP_OTHER;
    if (!strcmp(url, "/v1/completions")) ctx->ep = SRV_EP_COMPLETIONS;
    else if (!strcmp(url, "/v1/chat/completions")) ctx->ep = SRV_EP_CHAT;
    else if (!strcmp(url, "/v1/models")) ctx->ep = SRV_EP_MODELS;
    else if (!strncmp(url, "/v1/models/", 11) && strlen(url + 11) <= SRV_MODEL_NAME_MAX) {
        ctx->ep = SRV_EP_MODELS;
        snprintf(ctx->model_id, sizeof ctx->model_id, "%s", url + 11);
    } else if (!strcmp(url, "/health")) ctx->ep = SRV_EP_HEALTH;
    else if (!strcmp(url, "/metrics")) ctx->ep = SRV_EP_METRICS;
    else {
        const char *u = !strcmp(url, "/index.html") ? "/" : url;
        for (size_t i = 0; i < srv_static_file_count; i++)
            if (!strcmp(u, srv_static_files[i].path)) {
                ctx->ep = SRV_EP_PAGE;
                ctx->file = &srv_static_files[i];
            }
    }
    if (ctx->ep == SRV_EP_COMPLETIONS || ctx->ep == SRV_EP_CHAT) ctx->method_ok = is_post;
    else ctx->method_ok = is_get;
}

/* ---- GET handlers ----------------------------------------------------------------------------- */

static enum MHD_Result handle_page(conn_ctx *ctx, struct MHD_Connection *c) {
    const srv_static_file *f = ctx->file;
    if (!ctx->srv->static_dir[0])
        return respond(ctx, c, 200, f->content_type, f->data, f->len, 0, NULL);
    /* --static-dir: the same file names, read from disk (for editing the page live) */
    char path[1200];
    snprintf(path, sizeof path, "%s/%s", ctx->srv->static_dir, f->file);
    FILE *fp = fopen(path, "rb");
    srv_buf b = {0};
    char chunk[8192];
    size_t n;
    while (fp && (n = fread(chunk, 1, sizeof chunk, fp)) > 0) srv_buf_append(&b, chunk, n);
    if (fp) fclose(fp);
    enum MHD_Result r;
    if (!fp) {
        srv_error e;
        srv_error_set(&e, 404, "invalid_request_error", NULL, NULL, "cannot read %s", path);
        r = respond_error(ctx, c, &e, NULL);
    } else {
        r = respond(ctx, c, 200, f->content_type, b.data ? b.data : "", b.len, 0, NULL);
    }
    srv_buf_free(&b);
    return r;
}

static enum MHD_Result handle_get(conn_ctx *ctx, struct MHD_Connection *c) {
    srv_server *srv = ctx->srv;
    srv_buf b = {0};
    enum MHD_Result r;
    srv_sched_snapshot snap;
    switch (ctx->ep) {
    case SRV_EP_MODELS:
        if (ctx->model_id[0] && strcmp(ctx->model_id, srv->model_name) != 0) {
            srv_error e;
            srv_error_set(&e, 404, "invalid_request_error", "model", "model_not_found",
                          "The model '%s' does not exist", ctx->model_id);
            return respond_error(ctx, c, &e, NULL);
        }
        if (ctx->model_id[0]) srv_api_model_json(srv->model_name, srv->created, &b);
        else srv_api_models_json(srv->model_name, srv->created, &b);
        r = respond_json(ctx, c, 200, &b);
        break;
    case SRV_EP_HEALTH:
        srv_sched_get_snapshot(&srv->sched, &snap);
        {   /* 503 while shutting down or once the engine failed for good: an orchestrator's
             * readiness / liveness probe takes the process out or restarts it */
            const int failed = snap.fault[0] != 0;
            const srv_health h = {.status = failed ? "engine_failed" : (snap.draining ? "shutting_down" : "ok"),
                                  .model = srv->model_name, .backend = srv->be->kind,
                                  .error = failed ? snap.fault : NULL, .draft = srv->be->has_draft,
                                  .max_context = srv->be->max_context, .max_streams = srv->be->max_streams,
                                  .active_streams = snap.active, .queue_depth = snap.queue_depth};
            srv_api_health_json(&h, &b);
            r = respond_json(ctx, c, snap.draining || failed ? 503 : 200, &b);
        }
        break;
    case SRV_EP_METRICS:
        srv_sched_get_snapshot(&srv->sched, &snap);
        /* count this scrape before rendering so the page includes it */
        srv_metrics_count_request(&srv->metrics, SRV_EP_METRICS, 200);
        srv_metrics_render(&srv->metrics, &snap, srv_now(), &b);
        r = respond(ctx, c, 200, "text/plain; version=0.0.4; charset=utf-8", b.data ? b.data : "",
                    b.len, 0, NULL);
        break;
    default:
        r = handle_page(ctx, c);
        break;
    }
    srv_buf_free(&b);
    return r;
}

/* ---- generation ------------------------------------------------------------------------------- */

static ssize_t sse_reader(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    conn_ctx *ctx = cls;
    srv_gen *g = &ctx->gen;
    for (;;) {
        if (g->out.len) {
            size_t n = g->out.len < max ? g->out.len : max;
            memcpy(buf, g->out.data, n);
            srv_buf_consume(&g->out, n);
            ctx->last_out = srv_now();
            return (ssize_t)n;
        }
        if (g->done) return MHD_CONTENT_READER_END_OF_STREAM;
        srv_error e;
        srv_gen_pump(g, WAIT_STEP_S, &e); /* errors become an SSE error event in g->out */
        if (g->out.len || g->done) continue;
        if (client_gone(ctx->fd)) {
            srv_gen_cancel(g);
            ctx->status = 499;
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        if (srv_now() - ctx->last_out > KEEPALIVE_S) srv_buf_puts(&g->out, ": keep-alive\n\n");
    }
}

static enum MHD_Result handle_generation(conn_ctx *ctx, struct MHD_Connection *c) {
    srv_server *srv = ctx->srv;
    srv_error e;
    if (ctx->too_big) {
        srv_error_set(&e, 413, "invalid_request_error", NULL, "request_too_large",
                      "the request body is larger than %zu bytes (--max-body-bytes)",
                      srv->cfg.max_body_bytes);
        return respond_error(ctx, c, &e, NULL);
    }
    srv_api_req api;
    if (srv_api_parse(ctx->ep, ctx->body.data ? ctx->body.data : "", ctx->body.len, &srv->lim,
                      &api, &e)) {
        srv_api_req_free(&api);
        return respond_error(ctx, c, &e, NULL);
    }
    srv_buf_free(&ctx->body);
    ctx->has_gen = 1;
    atomic_fetch_add(&srv->in_flight, 1);
    /* time to first token counts from the request's arrival */
    if (srv_gen_start(&ctx->gen, srv->be, &srv->sched, srv->model_name, &api, ctx->t_start, &e))
        return respond_error(ctx, c, &e, NULL);
    for (;;) { /* wait for admission so queue/capacity refusals keep their status code */
        int a = srv_gen_wait_admitted(&ctx->gen, WAIT_STEP_S, &e);
        if (a < 0) return respond_error(ctx, c, &e, NULL);
        if (a > 0) break;
        if (client_gone(ctx->fd)) {
            srv_gen_cancel(&ctx->gen);
            ctx->status = 499;
            srv_metrics_count_request(&srv->metrics, ctx->ep, 499);
            return MHD_NO;
        }
    }
    if (ctx->gen.api.stream) {
        if (srv_gen_begin_stream(&ctx->gen)) return drop_connection("out of memory starting a stream");
        struct MHD_Response *r =
            MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, sse_reader, ctx, NULL);
        if (!r) return drop_connection("out of memory starting a stream");
        MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream; charset=utf-8");
        MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
        MHD_add_response_header(r, "X-Accel-Buffering", "no");
        ctx->last_out = srv_now();
        enum MHD_Result ret = MHD_queue_response(c, MHD_HTTP_OK, r);
        MHD_destroy_response(r);
        ctx->responded = 1;
        ctx->status = 200;
        srv_metrics_count_request(&srv->metrics, ctx->ep, 200);
        return ret;
    }
    for (;;) {
        int rc = srv_gen_pump(&ctx->gen, WAIT_STEP_S, &e);
        if (rc < 0) return respond_error(ctx, c, &e, NULL);
        if (rc > 0) break;
        if (client_gone(ctx->fd)) {
            srv_gen_cancel(&ctx->gen);
            ctx->status = 499;
            srv_metrics_count_request(&srv->metrics, ctx->ep, 499);
            return MHD_NO;
        }
    }
    srv_buf b = {0};
    enum MHD_Result r;
    if (srv_gen_response_json(&ctx->gen, &b)) {
        srv_error_set(&e, 500, "server_error", NULL, NULL, "could not encode the response");
        r = respond_error(ctx, c, &e, NULL);
    } else {
        r = respond_json(ctx, c, 200, &b);
    }
    srv_buf_free(&b);
    return r;
}

/* How much of an oversized body is read (and dropped) before the 413 goes out. */
static size_t drain_limit(const srv_server *srv) {
    size_t four = 4 * srv->cfg.max_body_bytes;
    return four > ((size_t)64 << 20) ? four : ((size_t)64 << 20);
}

/* ---- libmicrohttpd callbacks ----------------------------------------------------------------- */

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version,
                                  const char *upload_data, size_t *upload_data_size,
                                  void **con_cls) {
    (void)version;
    srv_server *srv = cls;
    conn_ctx *ctx = *con_cls;
    if (!ctx) { /* headers are in: route, and refuse a too-large body before reading it */
        if (!(ctx = calloc(1, sizeof *ctx))) return drop_connection("out of memory for a connection");
        *con_cls = ctx;
        ctx->srv = srv;
        ctx->t_start = srv_now();
        ctx->fd = -1;
        const union MHD_ConnectionInfo *ci =
            MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        if (ci) ctx->fd = ci->connect_fd;
        snprintf(ctx->method, sizeof ctx->method, "%s", method);
        snprintf(ctx->url, sizeof ctx->url, "%s", url);
        route(ctx, url, method);
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND,
                                                     MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl && ctx->method_ok && (ctx->ep == SRV_EP_COMPLETIONS || ctx->ep == SRV_EP_CHAT)) {
            char *end;
            unsigned long long n = strtoull(cl, &end, 10);
            if (n > srv->cfg.max_body_bytes) {
                ctx->too_big = 1;
                /* a modest excess is read and dropped so the client sees the 413 instead of a
                 * reset mid-upload; a huge one is refused at once (MHD then closes) */
                if (n > drain_limit(srv)) return handle_generation(ctx, c);
            }
        }
        return MHD_YES;
    }
    if (ctx->responded) { /* answered early: drop the rest of the body */
        *upload_data_size = 0;
        return MHD_YES;
    }
    if (*upload_data_size) {
        /* libmicrohttpd cannot answer in the middle of a body: an oversized chunked body is
         * read and dropped (up to a bound, then the connection is closed) and 413 goes out at
         * its end */
        int wants_body = ctx->method_ok && (ctx->ep == SRV_EP_COMPLETIONS || ctx->ep == SRV_EP_CHAT);
        ctx->body_seen += *upload_data_size;
        if (wants_body && !ctx->too_big) {
            if (ctx->body.len + *upload_data_size > srv->cfg.max_body_bytes) {
                ctx->too_big = 1;
                srv_buf_free(&ctx->body);
            } else if (srv_buf_append(&ctx->body, upload_data, *upload_data_size)) {
                return drop_connection("out of memory reading a request body");
            }
        }
        *upload_data_size = 0;
        if (ctx->body_seen > drain_limit(srv))
            return drop_connection("a request body far over --max-body-bytes (read and dropped up to a bound)");
        return MHD_YES;
    }
    /* the whole request is in */
    if (ctx->ep == SRV_EP_OTHER) {
        srv_error e;
        srv_error_set(&e, 404, "invalid_request_error", NULL, "not_found",
                      "no route for %s %.64s", method, url);
        return respond_error(ctx, c, &e, NULL);
    }
    if (!ctx->method_ok) {
        int post = ctx->ep == SRV_EP_COMPLETIONS || ctx->ep == SRV_EP_CHAT;
        srv_error e;
        srv_error_set(&e, 405, "invalid_request_error", NULL, "method_not_allowed",
                      "%s is not allowed on %.64s (use %s)", method, url, post ? "POST" : "GET");
        return respond_error(ctx, c, &e, post ? "POST" : "GET, HEAD");
    }
    if (ctx->ep == SRV_EP_COMPLETIONS || ctx->ep == SRV_EP_CHAT) return handle_generation(ctx, c);
    return handle_get(ctx, c);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
    (void)c;
    srv_server *srv = cls;
    conn_ctx *ctx = *con_cls;
    if (!ctx) return;
    *con_cls = NULL;
    double dt = srv_now() - ctx->t_start;
    if (ctx->has_gen) {
        if (toe != MHD_REQUEST_TERMINATED_COMPLETED_OK) {
            srv_gen_cancel(&ctx->gen); /* client gone mid-stream */
            if (ctx->status == 200) ctx->status = 499;
        }
        srv_metrics_observe(&srv->metrics, &srv->metrics.request_time, dt);
    }
    if (srv->cfg.verbose) {
        if (ctx->has_gen)
            fprintf(stderr, "kdtree serve: %s %s %d prompt=%d completion=%d %.3fs%s\n",
                    ctx->method, ctx->url, ctx->status, ctx->gen.prompt_tokens,
                    ctx->gen.completion_tokens, dt, ctx->gen.api.stream ? " stream" : "");
        else
            fprintf(stderr, "kdtree serve: %s %s %d %.3fs\n", ctx->method, ctx->url, ctx->status,
                    dt);
    }
    if (ctx->has_gen) {
        srv_gen_free(&ctx->gen);
        atomic_fetch_sub(&srv->in_flight, 1);
    }
    srv_buf_free(&ctx->body);
    free(ctx);
}

static void mhd_log(void *cls, const char *fmt, va_list ap) {
    (void)cls;
    char line[512];
    vsnprintf(line, sizeof line, fmt, ap); /* libmicrohttpd passes most messages as "%s" */
    /* A client that went away (a timeout, a closed tab, a load balancer's bare TCP probe) is not
     * worth a log line: libmicrohttpd's own notes of it, and its lines for how we drop one (MHD_NO
     * from the handler, END_WITH_ERROR from the SSE reader; the other causes of those two are
     * logged by the code that returns them). */
    static const char *const vanished[] = {"Application reported internal error",
                                           "application error generating response",
                                           "Connection was closed by remote side",
                                           "Socket has been disconnected"};
    for (size_t i = 0; i < sizeof vanished / sizeof vanished[0]; i++)
        if (strstr(line, vanished[i])) return;
    fprintf(stderr, "kdtree serve: http: %s", line);
    if (!strchr(line, '\n')) fputc('\n', stderr);
}

/* ---- start / stop ----------------------------------------------------------------------------- */

static kdt_status open_listener(const char *host, int port, int *fd_out, int *port_out,
                                int *ipv6) {
    char portstr[16];
    snprintf(portstr, sizeof portstr, "%d", port);
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    int gai = getaddrinfo(host, portstr, &hints, &res);
    if (gai != 0)
        return kdt_fail(KDT_ERR_INVALID_ARG, "serve: --host %s: %s", host, gai_strerror(gai));
    int fd = -1, err = 0;
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) {
            err = errno;
            continue;
        }
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 256) == 0) {
            *ipv6 = a->ai_family == AF_INET6;
            break;
        }
        err = errno;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0)
        return kdt_fail(KDT_ERR_IO, "serve: cannot listen on %s:%d: %s", host, port,
                        strerror(err));
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    getsockname(fd, (struct sockaddr *)&ss, &sl);
    *port_out = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                         : ntohs(((struct sockaddr_in *)&ss)->sin_port);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    *fd_out = fd;
    return KDT_OK;
}

kdt_status srv_server_start(const srv_config *cfg, srv_backend *be, srv_server **out,
                            int *port_out) {
    KDT_CHECK_ARG(cfg && be && out, "serve: NULL argument");
    KDT_CHECK_ARG(cfg->max_queue >= 0, "serve: --max-queue = %d", cfg->max_queue);
    KDT_CHECK_ARG(cfg->max_body_bytes >= 64, "serve: --max-body-bytes = %zu (at least 64)",
                  cfg->max_body_bytes);
    KDT_CHECK_ARG(cfg->model_name && cfg->model_name[0] &&
                      strlen(cfg->model_name) < SRV_MODEL_NAME_MAX,
                  "serve: --served-model-name must be 1..%d bytes", SRV_MODEL_NAME_MAX - 1);
    for (const unsigned char *p = (const unsigned char *)cfg->model_name; *p; p++)
        KDT_CHECK_ARG(*p > ' ' && *p < 0x7f && *p != '"' && *p != '\\',
                      "serve: --served-model-name '%s' must be printable ASCII without spaces, "
                      "quotes or backslashes", cfg->model_name);
    srv_server *s = calloc(1, sizeof *s);
    if (!s) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "serve: server");
    s->cfg = *cfg;
    s->be = be;
    s->listen_fd = -1;
    atomic_init(&s->in_flight, 0);
    snprintf(s->model_name, sizeof s->model_name, "%s", cfg->model_name);
    if (cfg->static_dir) snprintf(s->static_dir, sizeof s->static_dir, "%s", cfg->static_dir);
    s->cfg.model_name = s->model_name;
    s->created = (long long)time(NULL);
    s->lim = (srv_api_limits){.model_name = s->model_name, .max_budget = be->max_budget,
                              .default_spec = cfg->default_spec,
                              .default_budget = cfg->default_budget, .has_draft = be->has_draft};
    srv_metrics_init(&s->metrics);
    kdt_status st = srv_sched_start(&s->sched, be, &s->metrics, cfg->max_queue);
    if (st != KDT_OK) {
        srv_metrics_destroy(&s->metrics);
        free(s);
        return st;
    }
    int port = 0, ipv6 = 0;
    st = open_listener(cfg->host ? cfg->host : "127.0.0.1", cfg->port, &s->listen_fd, &port, &ipv6);
    if (st == KDT_OK) {
        unsigned limit = (unsigned)(be->max_streams + cfg->max_queue + 64);
        unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD |
                         MHD_USE_POLL | MHD_USE_ITC | MHD_USE_ERROR_LOG |
                         (ipv6 ? MHD_USE_IPv6 : 0);
        s->mhd = MHD_start_daemon(flags, 0, NULL, NULL, on_request, s, MHD_OPTION_EXTERNAL_LOGGER,
                                  mhd_log, NULL, MHD_OPTION_LISTEN_SOCKET, s->listen_fd,
                                  MHD_OPTION_NOTIFY_COMPLETED, on_completed, s,
                                  MHD_OPTION_CONNECTION_LIMIT, limit,
                                  MHD_OPTION_CONNECTION_TIMEOUT,
                                  (unsigned)(cfg->idle_timeout_s > 0 ? cfg->idle_timeout_s : 0),
                                  MHD_OPTION_END);
        if (!s->mhd) st = kdt_fail(KDT_ERR_INTERNAL, "serve: libmicrohttpd failed to start");
    }
    if (st != KDT_OK) {
        if (s->listen_fd >= 0) close(s->listen_fd); /* MHD never took it */
        srv_sched_stop(&s->sched, 0);
        srv_sched_destroy(&s->sched);
        srv_metrics_destroy(&s->metrics);
        free(s);
        return st;
    }
    *port_out = port;
    *out = s;
    return KDT_OK;
}

void srv_server_begin_drain(srv_server *s) {
    srv_sched_drain(&s->sched);
}

int srv_server_idle(srv_server *s) { return srv_sched_idle(&s->sched); }

void srv_server_stop(srv_server *s, double grace_s) {
    if (!s) return;
    srv_sched_stop(&s->sched, grace_s); /* every request is done after this */
    /* stop accepting; the listen socket is ours again (MHD would close it otherwise) */
    MHD_socket fd = MHD_quiesce_daemon(s->mhd);
    /* let answers that just ended (final chunk, error event, [DONE]) reach their clients before
     * the connections are torn down; bounded, as a client may have stopped reading */
    double until = srv_now() + 5.0;
    while (atomic_load(&s->in_flight) > 0 && srv_now() < until)
        nanosleep(&(struct timespec){0, 10 * 1000 * 1000}, NULL);
    MHD_stop_daemon(s->mhd);            /* joins the connection threads */
    if (fd != MHD_INVALID_SOCKET) close(fd);
    srv_sched_destroy(&s->sched);
    srv_metrics_destroy(&s->metrics);
    free(s);
}
