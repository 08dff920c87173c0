/* sched.c - the scheduler between HTTP threads and the one inference thread.
 *
 * HTTP threads build a srv_req (prompt ids, sampling params) and submit it to a bounded FIFO. The
 * inference thread is the only caller of the engine: each loop it
 *   1. drops queued requests whose client asked to cancel, and kdt_engine_cancel()s running ones
 *      (so a disconnect frees its KV pages within one round),
 *   2. admits queued requests in order while the engine accepts them (KDT_ERR_CAPACITY with
 *      streams running means "no room yet": they wait; with nothing running it can never fit and
 *      the request is refused with 400),
 *   3. runs one kdt_engine_step round over every active stream (continuous batching) and appends
 *      each stream's tokens to its request, waking the HTTP thread that waits on it,
 *   4. refreshes the snapshot /metrics reads.
 * A request is reference-counted: one reference for the HTTP side, one while the scheduler holds
 * it (queued or running). Lock order: sched.mu before req.mu, never the other way.
 *
 * Stream ids: a cancelled stream reports one final KDT_FINISH_CANCELLED event in the next step.
 * If the engine reuses ids, that event could carry the id of a newly admitted stream, so a
 * cancelled request stays in the active list (flagged `cancelling`) until the end of the next
 * step, and a CANCELLED event is matched to a cancelling request first.
 */
#include "server/server.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- requests ------------------------------------------------------------------------------- */

srv_req *srv_req_new(void) {
    srv_req *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    if (pthread_mutex_init(&r->mu, NULL) || pthread_cond_init(&r->cv, &ca)) {
        pthread_condattr_destroy(&ca);
        free(r);
        return NULL;
    }
    pthread_condattr_destroy(&ca);
    r->refs = 1;
    r->state = SRV_REQ_NEW;
    r->stream_id = -1;
    atomic_init(&r->cancel, 0);
    return r;
}

static void req_retain(srv_req *r) {
    pthread_mutex_lock(&r->mu);
    r->refs++;
    pthread_mutex_unlock(&r->mu);
}

void srv_req_release(srv_req *r) {
    if (!r) return;
    pthread_mutex_lock(&r->mu);
    int last = --r->refs == 0;
    pthread_mutex_unlock(&r->mu);
    if (!last) return;
    srv_ids_free(&r->prompt);
    srv_ids_free(&r->out);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r);
}

/* Marks r done (finished, cancelled or refused) and wakes its reader. */
static void req_finish(srv_req *r, kdt_finish_reason finish, int err_status, const char *msg) {
    pthread_mutex_lock(&r->mu);
    if (r->state != SRV_REQ_DONE) {
        r->state = SRV_REQ_DONE;
        r->finish = finish;
        r->err_status = err_status;
        if (msg) snprintf(r->err_msg, sizeof r->err_msg, "%s", msg);
    }
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

static void abs_deadline(struct timespec *ts, double wait_s) {
    clock_gettime(CLOCK_MONOTONIC, ts);
    long long ns = ts->tv_nsec + (long long)(wait_s * 1e9);
    ts->tv_sec += (time_t)(ns / 1000000000LL);
    ts->tv_nsec = (long)(ns % 1000000000LL);
}

void srv_req_wait(srv_req *r, size_t seen, srv_req_state state_seen, double wait_s,
                  srv_ids *fresh, srv_req_view *view) {
    struct timespec until;
    abs_deadline(&until, wait_s);
    pthread_mutex_lock(&r->mu);
    while (r->out.n <= seen && r->state == state_seen && r->state != SRV_REQ_DONE) {
        if (pthread_cond_timedwait(&r->cv, &r->mu, &until) == ETIMEDOUT) break;
    }
    if (fresh && r->out.n > seen && srv_ids_append(fresh, r->out.v + seen, r->out.n - seen))
        fresh->n = 0; /* out of memory: the caller sees no progress and retries */
    view->state = r->state;
    view->n_out = r->out.n;
    view->finish = r->finish;
    view->err_status = r->err_status;
    pthread_mutex_unlock(&r->mu);
}

/* ---- the queue ------------------------------------------------------------------------------ */

int srv_sched_submit(srv_sched *s, srv_req *r, srv_error *e) {
    pthread_mutex_lock(&s->mu);
    if (s->snap.fault[0]) {
        srv_error_set(e, 503, "server_error", NULL, "engine_failed",
                      "the engine failed and cannot serve (%s); restart the server", s->snap.fault);
        pthread_mutex_unlock(&s->mu);
        return -1;
    }
    if (s->draining || s->stop) {
        pthread_mutex_unlock(&s->mu);
        srv_error_set(e, 503, "server_error", NULL, "shutting_down",
                      "the server is shutting down");
        e->retry_after_s = 5;
        return -1;
    }
    if (s->n_pending >= s->max_queue) {
        int depth = s->n_pending;
        pthread_mutex_unlock(&s->mu);
        srv_error_set(e, 429, "rate_limit_error", NULL, "queue_full",
                      "the server is busy: %d requests are already waiting (--max-queue %d); "
                      "retry later", depth, s->max_queue);
        e->retry_after_s = 1;
        return -1;
    }
    req_retain(r); /* the scheduler's reference */
    pthread_mutex_lock(&r->mu);
    r->state = SRV_REQ_QUEUED;
    pthread_mutex_unlock(&r->mu);
    r->next = NULL;
    if (s->pending_tail) s->pending_tail->next = r;
    else s->pending_head = r;
    s->pending_tail = r;
    s->n_pending++;
    s->snap.queue_depth = s->n_pending;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return 0;
}

void srv_sched_cancel(srv_sched *s, srv_req *r) {
    if (atomic_exchange(&r->cancel, 1)) return;
    atomic_store(&s->cancel_hint, 1);
    pthread_mutex_lock(&s->mu);
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

void srv_sched_get_snapshot(srv_sched *s, srv_sched_snapshot *out) {
    pthread_mutex_lock(&s->mu);
    *out = s->snap;
    out->draining = s->draining;
    pthread_mutex_unlock(&s->mu);
}

/* ---- the inference thread ------------------------------------------------------------------- */

static void refresh_snapshot(srv_sched *s) {
    kdt_engine_stats st;
    memset(&st, 0, sizeof st);
    s->be->get_stats(s->be->self, &st);
    pthread_mutex_lock(&s->mu);
    s->snap.engine = st;
    s->snap.queue_depth = s->n_pending;
    s->snap.active = s->n_active;
    pthread_mutex_unlock(&s->mu);
}

static void count_stream_end(srv_sched *s, int cancelled, int failed) {
    pthread_mutex_lock(&s->metrics->mu);
    s->metrics->streams_cancelled += (uint64_t)cancelled;
    s->metrics->streams_failed += (uint64_t)failed;
    pthread_mutex_unlock(&s->metrics->mu);
}

/* Removes queued requests that were cancelled before admission. */
static void drop_cancelled_pending(srv_sched *s) {
    srv_req *dropped = NULL;
    pthread_mutex_lock(&s->mu);
    srv_req **pp = &s->pending_head, *prev = NULL;
    while (*pp) {
        srv_req *r = *pp;
        if (atomic_load(&r->cancel)) {
            *pp = r->next;
            if (s->pending_tail == r) s->pending_tail = prev;
            s->n_pending--;
            r->next = dropped;
            dropped = r;
        } else {
            prev = r;
            pp = &r->next;
        }
    }
    pthread_mutex_unlock(&s->mu);
    while (dropped) {
        srv_req *r = dropped;
        dropped = r->next;
        req_finish(r, KDT_FINISH_CANCELLED, 0, NULL);
        count_stream_end(s, 1, 0);
        srv_req_release(r);
    }
}

static void cancel_active(srv_sched *s, int all) {
    for (srv_req *r = s->active; r; r = r->next) {
        if (r->cancelling || !(all || atomic_load(&r->cancel))) continue;
        kdt_status st = s->be->cancel(s->be->self, r->stream_id);
        if (st != KDT_OK)
            fprintf(stderr, "kdtree serve: cancel of stream %d failed: %s\n", r->stream_id,
                    kdt_last_error());
        r->cancelling = 1;
        req_finish(r, KDT_FINISH_CANCELLED, 0, NULL);
        count_stream_end(s, 1, 0);
    }
}

/* Unlinks and releases active requests that are done (cancelled ones after their round). */
static void reap_active(srv_sched *s, int cancelling_too) {
    srv_req **pp = &s->active;
    while (*pp) {
        srv_req *r = *pp;
        pthread_mutex_lock(&r->mu);
        int done = r->state == SRV_REQ_DONE;
        pthread_mutex_unlock(&r->mu);
        if (done && (!r->cancelling || cancelling_too)) {
            *pp = r->next;
            pthread_mutex_lock(&s->mu);
            s->n_active--;
            pthread_mutex_unlock(&s->mu);
            srv_req_release(r);
        } else {
            pp = &r->next;
        }
    }
}

static void admit(srv_sched *s) {
    for (;;) {
        pthread_mutex_lock(&s->mu);
        srv_req *r = s->pending_head; /* only this thread removes from the queue */
        pthread_mutex_unlock(&s->mu);
        if (!r) return;
        int32_t id = -1;
        kdt_status st = s->be->add(s->be->self, r->prompt.v, (int32_t)r->prompt.n, &r->params, &id);
        int engine_has_streams = s->active != NULL || s->be->busy(s->be->self);
        if (st == KDT_ERR_CAPACITY && engine_has_streams) return; /* wait for room */

        pthread_mutex_lock(&s->mu);
        s->pending_head = r->next;
        if (!s->pending_head) s->pending_tail = NULL;
        s->n_pending--;
        pthread_mutex_unlock(&s->mu);
        r->next = NULL;

        if (st != KDT_OK) {
            char msg[256];
            int status = 400;
            const char *fault = s->be->fault ? s->be->fault(s->be->self) : NULL;
            if (st == KDT_ERR_CAPACITY)
                snprintf(msg, sizeof msg, "the request does not fit in the KV cache even when "
                         "the server is idle (%s)", kdt_last_error());
            else if (st == KDT_ERR_INVALID_ARG)
                snprintf(msg, sizeof msg, "%s", kdt_last_error());
            else if (fault) {
                status = 503;
                snprintf(msg, sizeof msg, "the engine failed and cannot serve (%s); restart the server", fault);
            } else {
                status = 500;
                snprintf(msg, sizeof msg, "the engine refused the request: %s (%s)",
                         kdt_status_name(st), kdt_last_error());
            }
            req_finish(r, KDT_FINISH_ERROR, status, msg);
            count_stream_end(s, 0, 1);
            srv_req_release(r);
            continue;
        }
        double now = srv_now();
        pthread_mutex_lock(&r->mu);
        r->stream_id = id;
        r->state = SRV_REQ_RUNNING;
        r->t_admit = now;
        pthread_cond_broadcast(&r->cv);
        pthread_mutex_unlock(&r->mu);
        r->next = s->active;
        s->active = r;
        pthread_mutex_lock(&s->mu);
        s->n_active++;
        pthread_mutex_unlock(&s->mu);
        pthread_mutex_lock(&s->metrics->mu);
        s->metrics->prompt_tokens += r->prompt.n;
        s->metrics->streams_started++;
        pthread_mutex_unlock(&s->metrics->mu);
    }
}

static srv_req *find_stream(srv_sched *s, int32_t id, int cancelled_event) {
    srv_req *fallback = NULL;
    for (srv_req *r = s->active; r; r = r->next) {
        if (r->stream_id != id) continue;
        if (r->cancelling == cancelled_event) return r;
        fallback = r;
    }
    return cancelled_event ? NULL : (fallback && !fallback->cancelling ? fallback : NULL);
}

static void dispatch(srv_sched *s, const kdt_stream_event *ev, int32_t n_ev) {
    double now = srv_now();
    uint64_t generated = 0;
    for (int32_t i = 0; i < n_ev; i++) {
        const kdt_stream_event *e = &ev[i];
        srv_req *r = find_stream(s, e->stream_id, e->finish == KDT_FINISH_CANCELLED);
        if (!r || r->cancelling) continue; /* a cancelled stream's last word: already done */
        generated += (uint64_t)(e->n_tokens > 0 ? e->n_tokens : 0);
        int first = 0;
        pthread_mutex_lock(&r->mu);
        if (e->n_tokens > 0) {
            if (r->out.n == 0) {
                r->t_first = now;
                first = 1;
            }
            if (srv_ids_append(&r->out, e->tokens, (size_t)e->n_tokens)) {
                pthread_mutex_unlock(&r->mu);
                s->be->cancel(s->be->self, r->stream_id);
                r->cancelling = 1;
                req_finish(r, KDT_FINISH_ERROR, 500, "out of memory");
                continue;
            }
        }
        if (e->tau > 0) {
            r->tau_sum += (uint64_t)e->tau;
            r->tau_rounds++;
        }
        if (e->finish != KDT_FINISH_NONE && r->state != SRV_REQ_DONE) {
            r->state = SRV_REQ_DONE;
            r->finish = e->finish;
            if (e->finish == KDT_FINISH_ERROR) {
                r->err_status = 500;
                snprintf(r->err_msg, sizeof r->err_msg, "the engine failed this stream");
            }
        }
        pthread_cond_broadcast(&r->cv);
        pthread_mutex_unlock(&r->mu);

        pthread_mutex_lock(&s->metrics->mu);
        if (e->tau > 0) s->metrics->tau_count[e->tau < SRV_TAU_BUCKETS ? e->tau : SRV_TAU_BUCKETS]++;
        if (e->finish == KDT_FINISH_ERROR) s->metrics->streams_failed++;
        pthread_mutex_unlock(&s->metrics->mu);
        if (first) srv_metrics_observe(s->metrics, &s->metrics->ttft, now - r->t_submit);
    }
    if (generated) srv_metrics_tokens(s->metrics, generated, now);
}

/* A failed step leaves the engine in an unknown state: fail every running stream. */
static void fail_all_active(srv_sched *s, kdt_status st) {
    char msg[256];
    snprintf(msg, sizeof msg, "engine step failed: %s (%s)", kdt_status_name(st),
             kdt_last_error());
    fprintf(stderr, "kdtree serve: %s\n", msg);
    /* a device that failed for good: /health says so and new requests get 503 from now on (set
     * before the running requests learn of the failure, so none of them sees a healthy server) */
    const char *fault = s->be->fault ? s->be->fault(s->be->self) : NULL;
    if (fault) fprintf(stderr, "kdtree serve: the engine cannot run again: %s\n", fault);
    pthread_mutex_lock(&s->mu);
    s->fatal = st;
    snprintf(s->fatal_msg, sizeof s->fatal_msg, "%s", msg);
    if (fault) snprintf(s->snap.fault, sizeof s->snap.fault, "%s", fault);
    pthread_mutex_unlock(&s->mu);
    for (srv_req *r = s->active; r; r = r->next) {
        if (!r->cancelling) {
            s->be->cancel(s->be->self, r->stream_id);
            count_stream_end(s, 0, 1);
        }
        r->cancelling = 1;
        req_finish(r, KDT_FINISH_ERROR, 500, msg);
    }
}

static void *inference_main(void *arg) {
    srv_sched *s = arg;
    for (;;) {
        int engine_work = s->active != NULL || s->be->busy(s->be->self);
        pthread_mutex_lock(&s->mu);
        while (!s->stop && !engine_work && s->n_pending == 0 && !atomic_load(&s->cancel_hint))
            pthread_cond_wait(&s->cv, &s->mu);
        int stop = s->stop;
        pthread_mutex_unlock(&s->mu);
        if (stop) break;

        atomic_store(&s->cancel_hint, 0);
        drop_cancelled_pending(s);
        cancel_active(s, 0);
        admit(s);

        if (s->active || s->be->busy(s->be->self)) {
            int32_t n_ev = 0;
            double t0 = srv_now();
            kdt_status st = s->be->step(s->be->self, s->events, s->max_events, &n_ev);
            srv_metrics_observe(s->metrics, &s->metrics->round_time, srv_now() - t0);
            if (st == KDT_OK) dispatch(s, s->events, n_ev);
            else fail_all_active(s, st);
            reap_active(s, 1);
        } else {
            reap_active(s, 1);
        }
        refresh_snapshot(s);
    }
    /* Shutdown: cancel what still runs, refuse what still waits. */
    cancel_active(s, 1);
    reap_active(s, 1);
    pthread_mutex_lock(&s->mu);
    srv_req *r = s->pending_head;
    s->pending_head = s->pending_tail = NULL;
    s->n_pending = 0;
    pthread_mutex_unlock(&s->mu);
    while (r) {
        srv_req *next = r->next;
        req_finish(r, KDT_FINISH_CANCELLED, 503, "the server is shutting down");
        srv_req_release(r);
        r = next;
    }
    refresh_snapshot(s);
    return NULL;
}

kdt_status srv_sched_start(srv_sched *s, srv_backend *be, srv_metrics *m, int32_t max_queue) {
    memset(s, 0, sizeof *s);
    s->be = be;
    s->metrics = m;
    s->max_queue = max_queue;
    s->max_events = 2 * be->max_streams + 16; /* max_streams suffices; room for late cancels */
    s->events = calloc((size_t)s->max_events, sizeof *s->events);
    if (!s->events) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "serve: scheduler events");
    atomic_init(&s->cancel_hint, 0);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->snap.max_queue = max_queue;
    s->snap.max_streams = be->max_streams;
    refresh_snapshot(s);
    if (pthread_create(&s->thread, NULL, inference_main, s) != 0) {
        free(s->events);
        s->events = NULL;
        pthread_mutex_destroy(&s->mu);
        pthread_cond_destroy(&s->cv);
        return kdt_fail(KDT_ERR_INTERNAL, "serve: cannot start the inference thread");
    }
    s->thread_started = 1;
    return KDT_OK;
}

void srv_sched_drain(srv_sched *s) {
    pthread_mutex_lock(&s->mu);
    s->draining = 1;
    pthread_mutex_unlock(&s->mu);
}

int srv_sched_idle(srv_sched *s) {
    pthread_mutex_lock(&s->mu);
    int idle = s->n_pending == 0 && s->n_active == 0;
    pthread_mutex_unlock(&s->mu);
    return idle;
}

void srv_sched_stop(srv_sched *s, double grace_s) {
    if (!s->thread_started) return;
    srv_sched_drain(s);
    double until = srv_now() + grace_s;
    while (!srv_sched_idle(s) && srv_now() < until)
        nanosleep(&(struct timespec){0, 20 * 1000 * 1000}, NULL);
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    s->thread_started = 0;
}

void srv_sched_destroy(srv_sched *s) {
    free(s->events);
    s->events = NULL;
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
}
