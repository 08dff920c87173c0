/* metrics.c - the server's counters and histograms and their Prometheus text exposition
 * (format 0.0.4): every family has # HELP and # TYPE lines, names carry no colons, counters end
 * in _total, histograms give cumulative _bucket{le=...} lines up to +Inf plus _sum and _count.
 * `promtool check metrics` accepts the page (tests/server/run_tests.sh checks it).
 *
 * Counters live in srv_metrics under one mutex (they change a few times per round, not per
 * token). Engine gauges (KV pages, stage times) come from the scheduler's snapshot, which the
 * inference thread refreshes after every round: the engine itself is never touched from here.
 */
#include "server/server.h"

#include <stdio.h>
#include <string.h>

/* Upper bounds (seconds) of the latency histograms; the last bucket is +Inf. */
static const double lat_bounds[SRV_LAT_BUCKETS] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                                   0.25,  0.5,    1,     2.5,  5,     10,   60};

static const int status_codes[SRV_STATUS_SLOTS - 1] = {200, 400, 404, 405, 413, 429, 499, 500, 503};

void srv_metrics_init(srv_metrics *m) {
    memset(m, 0, sizeof *m);
    pthread_mutex_init(&m->mu, NULL);
}

void srv_metrics_destroy(srv_metrics *m) { pthread_mutex_destroy(&m->mu); }

void srv_metrics_count_request(srv_metrics *m, srv_endpoint ep, int status) {
    int slot = SRV_STATUS_SLOTS - 1;
    for (int i = 0; i < SRV_STATUS_SLOTS - 1; i++)
        if (status_codes[i] == status) slot = i;
    if ((int)ep < 0 || ep >= SRV_EP_COUNT) ep = SRV_EP_OTHER;
    pthread_mutex_lock(&m->mu);
    m->requests[ep][slot]++;
    pthread_mutex_unlock(&m->mu);
}

void srv_metrics_observe(srv_metrics *m, srv_hist *h, double seconds) {
    int b = 0;
    while (b < SRV_LAT_BUCKETS && seconds > lat_bounds[b]) b++;
    pthread_mutex_lock(&m->mu);
    h->count[b]++;
    h->sum += seconds;
    h->n++;
    pthread_mutex_unlock(&m->mu);
}

/* Keeps (time, cumulative tokens) samples at least 0.5 s apart for the tokens/s gauge. */
void srv_metrics_tokens(srv_metrics *m, uint64_t generated, double now) {
    pthread_mutex_lock(&m->mu);
    m->generated_tokens += generated;
    int last = (m->rate_head + 15) % 16;
    if (m->rate_n == 0 || now - m->rate_t[last] >= 0.5) {
        m->rate_t[m->rate_head] = now;
        m->rate_tok[m->rate_head] = m->generated_tokens;
        m->rate_head = (m->rate_head + 1) % 16;
        if (m->rate_n < 16) m->rate_n++;
    }
    pthread_mutex_unlock(&m->mu);
}

/* Generated tokens per second over the last ~8 s (0 when idle that long). */
static double token_rate(const srv_metrics *m, double now) {
    for (int k = m->rate_n; k >= 1; k--) { /* oldest first */
        int i = (m->rate_head - k + 32) % 16;
        if (m->rate_t[i] >= now - 10.0 && now - m->rate_t[i] > 0.2)
            return (double)(m->generated_tokens - m->rate_tok[i]) / (now - m->rate_t[i]);
    }
    return 0.0;
}

static int family(srv_buf *o, const char *name, const char *type, const char *help) {
    return srv_buf_printf(o, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static int hist_out(srv_buf *o, const char *name, const char *help, const srv_hist *h) {
    int rc = family(o, name, "histogram", help);
    uint64_t cum = 0;
    for (int b = 0; b < SRV_LAT_BUCKETS; b++) {
        cum += h->count[b];
        rc |= srv_buf_printf(o, "%s_bucket{le=\"%g\"} %llu\n", name, lat_bounds[b],
                             (unsigned long long)cum);
    }
    cum += h->count[SRV_LAT_BUCKETS];
    rc |= srv_buf_printf(o, "%s_bucket{le=\"+Inf\"} %llu\n%s_sum %.9g\n%s_count %llu\n", name,
                         (unsigned long long)cum, name, h->sum, name, (unsigned long long)h->n);
    return rc;
}

static int scalar(srv_buf *o, const char *name, const char *type, const char *help, double v) {
    return family(o, name, type, help) | srv_buf_printf(o, "%s %.17g\n", name, v);
}

int srv_metrics_render(srv_metrics *m, const srv_sched_snapshot *snap, double now, srv_buf *o) {
    int rc = 0;
    pthread_mutex_lock(&m->mu);
    srv_metrics c = *m; /* a consistent copy; the mutex field is not used */
    pthread_mutex_unlock(&m->mu);
    const kdt_engine_stats *es = &snap->engine;

    rc |= family(o, "kdtree_http_requests_total", "counter",
                 "HTTP requests answered, by endpoint and status code.");
    for (int ep = 0; ep < SRV_EP_COUNT; ep++)
        for (int s = 0; s < SRV_STATUS_SLOTS; s++) {
            if (!c.requests[ep][s]) continue;
            char code[8] = "other";
            if (s < SRV_STATUS_SLOTS - 1) snprintf(code, sizeof code, "%d", status_codes[s]);
            rc |= srv_buf_printf(o, "kdtree_http_requests_total{endpoint=\"%s\",status=\"%s\"} %llu\n",
                                 srv_endpoint_path((srv_endpoint)ep), code,
                                 (unsigned long long)c.requests[ep][s]);
        }
    rc |= scalar(o, "kdtree_prompt_tokens_total", "counter",
                 "Prompt tokens of admitted requests.", (double)c.prompt_tokens);
    rc |= scalar(o, "kdtree_generation_tokens_total", "counter",
                 "Tokens generated by the engine.", (double)c.generated_tokens);
    rc |= scalar(o, "kdtree_streams_started_total", "counter",
                 "Requests admitted into the engine.", (double)c.streams_started);
    rc |= scalar(o, "kdtree_streams_cancelled_total", "counter",
                 "Requests cancelled before they finished (client gone, stop string, shutdown).",
                 (double)c.streams_cancelled);
    rc |= scalar(o, "kdtree_streams_failed_total", "counter",
                 "Requests refused at admission or failed by the engine.",
                 (double)c.streams_failed);

    /* Accepted length per verify round (tau): buckets le=1..17 */
    rc |= family(o, "kdtree_accepted_length", "histogram",
                 "Tokens accepted per stream per verify round (tau = 1 + accepted draft tokens).");
    uint64_t cum = 0, n = 0;
    double sum = 0;
    for (int t = 1; t <= SRV_TAU_BUCKETS; t++) {
        cum += c.tau_count[t];
        sum += (double)t * (double)c.tau_count[t];
        rc |= srv_buf_printf(o, "kdtree_accepted_length_bucket{le=\"%d\"} %llu\n", t,
                             (unsigned long long)cum);
    }
    n = cum;
    rc |= srv_buf_printf(o, "kdtree_accepted_length_bucket{le=\"+Inf\"} %llu\n"
                            "kdtree_accepted_length_sum %.17g\nkdtree_accepted_length_count %llu\n",
                         (unsigned long long)n, sum, (unsigned long long)n);

    rc |= hist_out(o, "kdtree_time_to_first_token_seconds",
                   "Time from a request's arrival to its first generated token.", &c.ttft);
    rc |= hist_out(o, "kdtree_request_duration_seconds",
                   "Time from a generation request's arrival to its last byte.", &c.request_time);
    rc |= hist_out(o, "kdtree_round_duration_seconds",
                   "Wall time of one engine round (kdt_engine_step over all active streams).",
                   &c.round_time);
    rc |= scalar(o, "kdtree_generation_tokens_per_second", "gauge",
                 "Generated tokens per second over the last few seconds.", token_rate(&c, now));

    rc |= scalar(o, "kdtree_queue_depth", "gauge", "Requests waiting for admission.",
                 snap->queue_depth);
    rc |= scalar(o, "kdtree_queue_capacity", "gauge", "Most requests that may wait (--max-queue).",
                 snap->max_queue);
    rc |= scalar(o, "kdtree_active_streams", "gauge", "Requests decoding in the engine.",
                 snap->active);
    rc |= scalar(o, "kdtree_max_streams", "gauge", "Streams the engine decodes together.",
                 snap->max_streams);
    rc |= scalar(o, "kdtree_kv_pages_used", "gauge", "KV cache pages (64 tokens) in use.",
                 es->kv_pages_used);
    rc |= scalar(o, "kdtree_kv_pages_free", "gauge", "KV cache pages (64 tokens) free.",
                 es->kv_pages_total - es->kv_pages_used);
    rc |= scalar(o, "kdtree_engine_rounds_total", "counter",
                 "Engine rounds run (one round covers every active stream).", (double)es->rounds);
    rc |= scalar(o, "kdtree_engine_stream_rounds_total", "counter",
                 "Sum over rounds of the streams active in the round.",
                 (double)es->stream_rounds);
    rc |= family(o, "kdtree_engine_stage_seconds_total", "counter",
                 "Engine time by stage of a round (divide by rounds for time per round).");
    const char *stages[5] = {"prefill", "draft", "build", "verify", "accept"};
    double times[5] = {es->t_prefill, es->t_draft, es->t_build, es->t_verify, es->t_accept};
    for (int i = 0; i < 5; i++)
        rc |= srv_buf_printf(o, "kdtree_engine_stage_seconds_total{stage=\"%s\"} %.9g\n",
                             stages[i], times[i]);
    rc |= scalar(o, "kdtree_engine_auto_budget", "gauge",
                 "Tree budget the auto mode chose in the last round.", es->last_budget);
    rc |= scalar(o, "kdtree_engine_auto_plain_rounds_total", "counter",
                 "Rounds the auto mode ran without the drafter (plain decoding measured faster).",
                 (double)es->plain_rounds);
    rc |= scalar(o, "kdtree_engine_prefill_passes_total", "counter",
                 "Prefill forward passes (one pass holds a chunk of each waiting prompt).",
                 (double)es->prefill_passes);
    rc |= scalar(o, "kdtree_draining", "gauge", "1 while the server shuts down.", snap->draining);
    rc |= scalar(o, "kdtree_engine_failed", "gauge",
                 "1 once the engine failed for good (its device; /health says why): restart the server.",
                 snap->fault[0] != 0);
    return rc ? -1 : 0;
}
