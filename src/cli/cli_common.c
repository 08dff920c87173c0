/* cli_common.c - helpers every CLI command uses: engine creation from flags, id-list and file
 * parsing, the run loop over an engine (continuous batching of the prompts), stats tables. */
#include "cli.h"


#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cli_check_dir(const char *cmd, const char *flag, const char *path) {
    struct stat st;
    if (!path) return 0;
    if (stat(path, &st) != 0) {
        fprintf(stderr, "kdtree %s: %s %s: %s\n", cmd, flag, path, strerror(errno));
        return -1;
    }
    if (!S_ISDIR(st.st_mode)) {
        fprintf(stderr, "kdtree %s: %s %s: not a directory (a checkpoint directory is expected)\n", cmd, flag,
                path);
        return -1;
    }
    return 0;
}

int cli_check_model_dirs(const char *cmd, const char *model, const char *draft) {
    return cli_check_dir(cmd, "--model", model) != 0 || cli_check_dir(cmd, "--draft", draft) != 0 ? -1 : 0;
}

int cli_parse_prefill_attn(const char *cmd, const char *text, int32_t *form) {
    if (!text || !strcmp(text, "auto")) *form = KDT_PREFILL_AUTO;
    else if (!strcmp(text, "absorbed")) *form = KDT_PREFILL_ABSORBED;
    else if (!strcmp(text, "plain")) *form = KDT_PREFILL_PLAIN;
    else {
        fprintf(stderr, "kdtree %s: --prefill-attn \"%s\": expected absorbed, plain or auto\n", cmd, text);
        return -1;
    }
    return 0;
}

kdt_engine *cli_engine_create(const char *cmd, const cli_engine_args *a) {
    kdt_engine_options o;
    memset(&o, 0, sizeof o);
    o.model_dir = a->model;
    o.draft_dir = a->draft;
    o.max_streams = a->max_streams;
    o.max_context = a->max_context;
    o.max_budget = a->max_budget;
    o.kv_pages = a->kv_pages;
    o.verbose = a->verbose;
    o.yarn_legacy_amplitude = a->yarn_legacy;
    o.prefill_chunk = a->prefill_chunk;
    o.max_prefill_tokens = a->max_prefill_tokens;
    if (cli_parse_prefill_attn(cmd, a->prefill_attn, &o.prefill_attention) != 0) return NULL;
    o.device = KDT_DEVICE_AUTO;
    if (a->device) {
        if (!strcmp(a->device, "cpu")) o.device = KDT_DEVICE_CPU;
        else if (!strcmp(a->device, "cuda")) o.device = KDT_DEVICE_CUDA;
        else if (!strcmp(a->device, "auto")) o.device = KDT_DEVICE_AUTO;
        else {
            fprintf(stderr, "kdtree %s: --device \"%s\": expected cpu, cuda or auto\n", cmd, a->device);
            return NULL;
        }
    }
    kdt_status st = kdt_set_cpu_threads(a->threads);
    if (st != KDT_OK) {
        fprintf(stderr, "kdtree %s: --threads: %s\n", cmd, kdt_last_error());
        return NULL;
    }
    kdt_engine *e = NULL;
    st = kdt_engine_create(&o, &e);
    if (st != KDT_OK) {
        fprintf(stderr, "kdtree %s: %s (%s)\n", cmd, kdt_last_error(), kdt_status_name(st));
        return NULL;
    }
    fprintf(stderr, "kdtree %s: decoding on %s, prefill in chunks of %d rows\n", cmd, kdt_engine_device_name(e),
            kdt_engine_prefill_chunk(e));
    return e;
}

int cli_parse_ids(const char *cmd, const char *text, int32_t **ids, int32_t *n) {
    size_t cap = 16, cnt = 0;
    int32_t *v = malloc(cap * sizeof *v);
    const char *p = text;
    while (v) {
        while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') p++;
        if (!*p) break;
        char *end = NULL;
        errno = 0;
        long long x = strtoll(p, &end, 10);
        if (errno || end == p || x < 0 || x > INT32_MAX) {
            fprintf(stderr, "kdtree %s: token ids: \"%.20s\" is not a token id\n", cmd, p);
            free(v);
            return -1;
        }
        if (cnt == cap) {
            int32_t *nv = realloc(v, (cap *= 2) * sizeof *v);
            if (!nv) { /* refused below as out of memory, not returned as a shorter list */
                free(v);
                v = NULL;
                break;
            }
            v = nv;
        }
        v[cnt++] = (int32_t)x;
        p = end;
        while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') p++;
        if (*p == ',') p++;
        else if (*p) {
            fprintf(stderr, "kdtree %s: token ids: unexpected \"%c\" (expected \"1,2,3\")\n", cmd, *p);
            free(v);
            return -1;
        }
    }
    if (!v) {
        fprintf(stderr, "kdtree %s: out of memory\n", cmd);
        return -1;
    }
    if (cnt == 0) {
        fprintf(stderr, "kdtree %s: token ids: the list is empty\n", cmd);
        free(v);
        return -1;
    }
    *ids = v;
    *n = (int32_t)cnt;
    return 0;
}

int cli_parse_int_list(const char *cmd, const char *what, const char *text, int32_t *out, int max,
                       int32_t lo, int32_t hi) {
    int32_t *ids = NULL, n = 0;
    if (cli_parse_ids(cmd, text, &ids, &n) != 0) return -1;
    if (n > max) {
        fprintf(stderr, "kdtree %s: %s: at most %d values\n", cmd, what, max);
        free(ids);
        return -1;
    }
    for (int32_t i = 0; i < n; i++) {
        if (ids[i] < lo || ids[i] > hi) {
            fprintf(stderr, "kdtree %s: %s: %d is outside %d..%d\n", cmd, what, ids[i], lo, hi);
            free(ids);
            return -1;
        }
        out[i] = ids[i];
    }
    free(ids);
    return n;
}

char *cli_read_file(const char *cmd, const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "kdtree %s: cannot open %s: %s\n", cmd, path, strerror(errno));
        return NULL;
    }
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        if (n + 1 >= cap) {
            char *nb = realloc(buf, cap *= 2);
            if (!nb) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = nb;
        }
        size_t got = fread(buf + n, 1, cap - n - 1, f);
        n += got;
        if (got == 0) break;
    }
    int err = ferror(f);
    fclose(f);
    if (!buf || err) {
        fprintf(stderr, "kdtree %s: cannot read %s\n", cmd, path);
        free(buf);
        return NULL;
    }
    buf[n] = 0;
    if (len) *len = n;
    return buf;
}

/* engine counters accumulated between two snapshots */
static void stats_delta(const kdt_engine_stats *a, const kdt_engine_stats *b, kdt_engine_stats *d) {
    *d = *b;
    d->rounds = b->rounds - a->rounds;
    d->stream_rounds = b->stream_rounds - a->stream_rounds;
    d->tokens_emitted = b->tokens_emitted - a->tokens_emitted;
    d->prompt_tokens = b->prompt_tokens - a->prompt_tokens;
    for (int i = 0; i < 18; i++) d->tau_hist[i] = b->tau_hist[i] - a->tau_hist[i];
    d->t_prefill = b->t_prefill - a->t_prefill;
    d->t_draft = b->t_draft - a->t_draft;
    d->t_build = b->t_build - a->t_build;
    d->t_verify = b->t_verify - a->t_verify;
    d->t_accept = b->t_accept - a->t_accept;
    d->plain_rounds = b->plain_rounds - a->plain_rounds;
}

int cli_run(const char *cmd, kdt_engine *e, int32_t n_prompts, int32_t *const *prompts,
            const int32_t *n_prompt, const kdt_gen_params *params, cli_token_fn on_token, void *user,
            cli_run_result *res) {
    memset(res, 0, sizeof *res);
    res->out = calloc((size_t)n_prompts, sizeof *res->out);
    res->n_out = calloc((size_t)n_prompts, sizeof *res->n_out);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n_prompts);
    kdt_stream_event ev[64];
    if (!res->out || !res->n_out || !ids) {
        fprintf(stderr, "kdtree %s: out of memory\n", cmd);
        free(ids);
        return -1;
    }
    for (int32_t i = 0; i < n_prompts; i++) {
        res->out[i] = malloc(sizeof(int32_t) * (size_t)params->max_new_tokens);
        ids[i] = -1;
        if (!res->out[i]) {
            fprintf(stderr, "kdtree %s: out of memory\n", cmd);
            free(ids);
            return -1;
        }
    }
    kdt_engine_stats before, after;
    kdt_engine_get_stats(e, &before);
    const double t0 = now_s();
    int32_t next = 0, done = 0, rc = 0;
    while (done < n_prompts && rc == 0) {
        /* admit as many waiting prompts as the engine takes now */
        while (next < n_prompts) {
            kdt_status st = kdt_engine_add(e, prompts[next], n_prompt[next], params, &ids[next]);
            if (st == KDT_ERR_CAPACITY && kdt_engine_busy(e)) break; /* retry after a round */
            if (st != KDT_OK) {
                fprintf(stderr, "kdtree %s: prompt %d: %s\n", cmd, next + 1, kdt_last_error());
                rc = -1;
                break;
            }
            next++;
        }
        if (rc) break;
        int32_t n_ev = 0;
        kdt_status st = kdt_engine_step(e, ev, 64, &n_ev);
        for (int32_t k = 0; k < n_ev; k++) {
            int32_t i = 0;
            while (i < next && ids[i] != ev[k].stream_id) i++;
            if (i == next) continue;
            int32_t room = params->max_new_tokens - res->n_out[i];
            int32_t n = ev[k].n_tokens < room ? ev[k].n_tokens : room;
            memcpy(res->out[i] + res->n_out[i], ev[k].tokens, sizeof(int32_t) * (size_t)n);
            res->n_out[i] += n;
            if (on_token && n > 0) on_token(user, i, ev[k].tokens, n);
            if (ev[k].finish != KDT_FINISH_NONE) {
                done++;
                ids[i] = -1;
                if (ev[k].finish == KDT_FINISH_ERROR) rc = -1;
            }
        }
        if (st != KDT_OK) {
            fprintf(stderr, "kdtree %s: %s (%s)\n", cmd, kdt_last_error(), kdt_status_name(st));
            rc = -1;
        }
    }
    res->wall_s = now_s() - t0;
    res->n_prompts = n_prompts;
    kdt_engine_get_stats(e, &after);
    stats_delta(&before, &after, &res->stats);
    free(ids);
    return rc;
}

void cli_run_result_free(cli_run_result *r, int32_t n_prompts) {
    if (r->out)
        for (int32_t i = 0; i < n_prompts; i++) free(r->out[i]);
    free(r->out);
    free(r->n_out);
    memset(r, 0, sizeof *r);
}

double cli_tau_mean(const kdt_engine_stats *s) {
    double num = 0, den = 0;
    for (int i = 1; i < 18; i++) {
        num += (double)i * (double)s->tau_hist[i];
        den += (double)s->tau_hist[i];
    }
    return den > 0 ? num / den : 0.0;
}

void cli_print_stats(FILE *f, const char *title, const cli_run_result *r) {
    const kdt_engine_stats *s = &r->stats;
    const double decode_s = r->wall_s - s->t_prefill;
    /* each prompt's first token comes from its prefill, the rest from rounds */
    const double decode_tokens = (double)s->tokens_emitted - (double)r->n_prompts;
    fprintf(f, "\n== %s ==\n", title);
    fprintf(f, "  tokens          %llu generated, %llu prompt\n", (unsigned long long)s->tokens_emitted,
            (unsigned long long)s->prompt_tokens);
    fprintf(f, "  time            %.3f s (prefill %.3f s)\n", r->wall_s, s->t_prefill);
    fprintf(f, "  tokens/s        %.2f overall, %.2f decode\n", r->wall_s > 0 ? s->tokens_emitted / r->wall_s : 0.0,
            decode_s > 0 ? decode_tokens / decode_s : 0.0);
    fprintf(f, "  rounds          %llu (%llu stream-rounds)\n", (unsigned long long)s->rounds,
            (unsigned long long)s->stream_rounds);
    fprintf(f, "  tau mean        %.3f (tokens per stream-round)\n", cli_tau_mean(s));
    uint64_t mx = 0;
    for (int i = 1; i < 18; i++)
        if (s->tau_hist[i] > mx) mx = s->tau_hist[i];
    if (mx > 0) {
        fprintf(f, "  tau histogram\n");
        for (int i = 1; i < 18; i++) {
            if (!s->tau_hist[i]) continue;
            int bar = (int)(40.0 * (double)s->tau_hist[i] / (double)mx + 0.5);
            fprintf(f, "    %2d%s %8llu  ", i, i == 17 ? "+" : " ", (unsigned long long)s->tau_hist[i]);
            for (int b = 0; b < bar; b++) fputc('#', f);
            fputc('\n', f);
        }
    }
    const double stage = s->t_prefill + s->t_draft + s->t_build + s->t_verify + s->t_accept;
    fprintf(f, "  stage           seconds    share\n");
    const char *names[5] = {"prefill", "draft", "build", "verify", "accept/commit"};
    const double t[5] = {s->t_prefill, s->t_draft, s->t_build, s->t_verify, s->t_accept};
    for (int i = 0; i < 5; i++)
        fprintf(f, "    %-13s %9.4f  %6.1f%%\n", names[i], t[i], stage > 0 ? 100.0 * t[i] / stage : 0.0);
    if (s->last_budget > 0) fprintf(f, "  auto budget     %d (last round, largest stream)\n", s->last_budget);
    if (s->plain_rounds > 0)
        fprintf(f, "  auto plain      %llu of %llu rounds without the drafter (plain decoding measured faster)\n",
                (unsigned long long)s->plain_rounds, (unsigned long long)s->rounds);
}
