/* serve.c - `kdtree serve`: options, start-up, and a graceful shutdown on SIGINT/SIGTERM.
 *
 * SIGINT/SIGTERM/SIGPIPE are blocked in every thread (they are blocked here before any thread
 * starts and threads inherit the mask); the main thread alone waits for them with sigwait. The
 * first signal starts the drain: new generation requests get 503, running ones may finish for
 * --shutdown-grace seconds; a second signal (or the end of the grace) cancels the rest.
 */
#include "server/server.h"
#include "cli/cli.h"
#include "kdtree/model.h"

#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct serve_options {
    const char *model, *draft, *tokenizer, *host, *name, *static_dir;
    int port;
    int32_t max_streams, max_queue, max_context, kv_pages, max_budget, budget, mock_round_ms, mock_fault_at;
    long long max_body;
    kdt_spec_mode spec;
    kdt_device device;
    int32_t prefill_attention, prefill_chunk, max_prefill_tokens;
    double grace;
    int idle_timeout;
    int verbose;
} serve_options;

static const char usage_text[] =
    "usage: kdtree serve --model DIR [options]\n"
    "\n"
    "An OpenAI-compatible HTTP server: POST /v1/completions, /v1/chat/completions (SSE with\n"
    "\"stream\": true), GET /v1/models, /health, /metrics (Prometheus), / (web chat page).\n"
    "\n"
    "  --model DIR              target checkpoint directory (HF layout), or `mock` for the\n"
    "                           built-in deterministic test model (no weights)\n"
    "  --draft DIR              DFlash drafter directory (without it only \"ar\" decoding)\n"
    "  --tokenizer PATH         tokenizer file or directory (default: the model directory);\n"
    "                           `bytes`: a byte-level tokenizer, for random test checkpoints\n"
    "  --served-model-name NAME the model id clients use (default: the model directory's name)\n"
    "  --host ADDR              address to listen on (default 127.0.0.1)\n"
    "  --port N                 port (default 8080; 0 picks a free one, printed at start)\n"
    "  --max-streams N          streams decoded together, 1..64 (default 8)\n"
    "  --max-queue N            requests that may wait for a stream slot (default 64); more\n"
    "                           get 429 with Retry-After\n"
    "  --max-body-bytes N       largest request body (default 1048576); larger get 413\n"
    "  --spec ar|chain|ddtree|auto  default decoding mode (default ddtree with a drafter)\n"
    "  --budget B               default tree budget (default 32)\n"
    "  --max-budget B           largest budget a request may ask for (default 64)\n"
    "  --ctx N                  context per stream, prompt + output (default: the model's)\n"
    "  --kv-pages N             KV pool size in 64-token pages (default: max-streams x ctx)\n"
    "  --device auto|cpu|cuda   (default auto)\n"
    "  --threads N              CPU threads of the CPU forward, 0 = every core or OMP_NUM_THREADS (default 0)\n"
    "  --prefill-attn FORM      attention form of a prefill chunk: absorbed (decode's bits),\n"
    "                           plain, or auto (per chunk, the one with fewer FLOPs; default)\n"
    "  --prefill-chunk N        prompt rows per prefill pass, 1..4096 (default 0: the device's,\n"
    "                           CPU 64 absorbed / 256 plain or auto, GPU 256..2048 by the\n"
    "                           model's experts and the device); larger reads each weight\n"
    "                           once for more rows\n"
    "  --max-prefill-tokens N   prompt tokens prefilled per engine step (default 0: no limit);\n"
    "                           a long prompt then no longer stalls the running streams\n"
    "  --static-dir DIR         serve the web page from DIR instead of the built-in copy\n"
    "  --shutdown-grace S       seconds running requests may finish after SIGINT/SIGTERM (10)\n"
    "  --idle-timeout S         close a connection idle this long (default 300; 0 = never)\n"
    "  --mock-round-ms N        with --model mock: simulated time per engine round (default 2)\n"
    "  --mock-fault-at-step N   with --model mock: engine step N fails as a lost GPU would (tests\n"
    "                           /health's 503 engine_failed; default never)\n"
    "  -v, --verbose            one log line per request on stderr\n"
    "  -h, --help\n";

static int parse_int(const char *opt, const char *s, long long lo, long long hi, long long *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) {
        fprintf(stderr, "kdtree serve: %s expects an integer in %lld..%lld, got '%s'\n", opt, lo,
                hi, s);
        return -1;
    }
    *out = v;
    return 0;
}

/* 0 ok, 1 help printed, -1 bad option. */
static int parse_options(int argc, char **argv, serve_options *o) {
    enum { O_DRAFT = 256, O_TOK, O_NAME, O_HOST, O_PORT, O_STREAMS, O_QUEUE, O_BODY, O_SPEC,
           O_BUDGET, O_MAXB, O_CTX, O_PAGES, O_DEVICE, O_THREADS, O_PREFILL_ATTN, O_PREFILL_CHUNK, O_MAX_PREFILL, O_STATIC, O_GRACE, O_MOCKMS, O_MOCKFAULT, O_IDLE };
    static const struct option longopts[] = {
        {"model", required_argument, NULL, 'm'},
        {"draft", required_argument, NULL, O_DRAFT},
        {"tokenizer", required_argument, NULL, O_TOK},
        {"served-model-name", required_argument, NULL, O_NAME},
        {"host", required_argument, NULL, O_HOST},
        {"port", required_argument, NULL, O_PORT},
        {"max-streams", required_argument, NULL, O_STREAMS},
        {"max-queue", required_argument, NULL, O_QUEUE},
        {"max-body-bytes", required_argument, NULL, O_BODY},
        {"spec", required_argument, NULL, O_SPEC},
        {"budget", required_argument, NULL, O_BUDGET},
        {"max-budget", required_argument, NULL, O_MAXB},
        {"ctx", required_argument, NULL, O_CTX},
        {"kv-pages", required_argument, NULL, O_PAGES},
        {"device", required_argument, NULL, O_DEVICE},
        {"threads", required_argument, NULL, O_THREADS},
        {"prefill-attn", required_argument, NULL, O_PREFILL_ATTN},
        {"prefill-chunk", required_argument, NULL, O_PREFILL_CHUNK},
        {"max-prefill-tokens", required_argument, NULL, O_MAX_PREFILL},
        {"static-dir", required_argument, NULL, O_STATIC},
        {"shutdown-grace", required_argument, NULL, O_GRACE},
        {"mock-round-ms", required_argument, NULL, O_MOCKMS},
        {"mock-fault-at-step", required_argument, NULL, O_MOCKFAULT},
        {"idle-timeout", required_argument, NULL, O_IDLE},
        {"verbose", no_argument, NULL, 'v'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0}};
    *o = (serve_options){.host = "127.0.0.1", .port = 8080, .max_streams = 8, .max_queue = 64,
                         .max_body = 1 << 20, .spec = KDT_SPEC_DDTREE, .budget = 32,
                         .max_budget = 64, .grace = 10.0, .mock_round_ms = 2,
                         .idle_timeout = 300, .prefill_attention = KDT_PREFILL_AUTO};
    int spec_given = 0;
    optind = 0; /* glibc's full reset, as cli_parse: 1 would resume an earlier scan */
    opterr = 1;
    int c;
    long long v;
    while ((c = getopt_long(argc, argv, "m:vh", longopts, NULL)) != -1) {
        switch (c) {
        case 'm': o->model = optarg; break;
        case O_DRAFT: o->draft = optarg; break;
        case O_TOK: o->tokenizer = optarg; break;
        case O_NAME: o->name = optarg; break;
        case O_HOST: o->host = optarg; break;
        case O_STATIC: o->static_dir = optarg; break;
        case 'v': o->verbose = 1; break;
        case 'h': fputs(usage_text, stdout); return 1;
        case O_PORT:
            if (parse_int("--port", optarg, 0, 65535, &v)) return -1;
            o->port = (int)v;
            break;
        case O_STREAMS:
            if (parse_int("--max-streams", optarg, 1, 64, &v)) return -1;
            o->max_streams = (int32_t)v;
            break;
        case O_QUEUE:
            if (parse_int("--max-queue", optarg, 0, 1 << 20, &v)) return -1;
            o->max_queue = (int32_t)v;
            break;
        case O_BODY:
            if (parse_int("--max-body-bytes", optarg, 64, 1LL << 32, &v)) return -1;
            o->max_body = v;
            break;
        case O_SPEC:
            if (srv_spec_parse(optarg, &o->spec)) {
                fprintf(stderr, "kdtree serve: --spec expects ar, chain, ddtree or auto, got '%s'\n",
                        optarg);
                return -1;
            }
            spec_given = 1;
            break;
        case O_BUDGET:
            if (parse_int("--budget", optarg, 1, 1024, &v)) return -1;
            o->budget = (int32_t)v;
            break;
        case O_MAXB:
            if (parse_int("--max-budget", optarg, 1, 1024, &v)) return -1;
            o->max_budget = (int32_t)v;
            break;
        case O_CTX:
            if (parse_int("--ctx", optarg, 2, INT32_MAX, &v)) return -1;
            o->max_context = (int32_t)v;
            break;
        case O_PAGES:
            if (parse_int("--kv-pages", optarg, 1, INT32_MAX, &v)) return -1;
            o->kv_pages = (int32_t)v;
            break;
        case O_MOCKMS:
            if (parse_int("--mock-round-ms", optarg, 0, 60000, &v)) return -1;
            o->mock_round_ms = (int32_t)v;
            break;
        case O_MOCKFAULT:
            if (parse_int("--mock-fault-at-step", optarg, 1, INT32_MAX, &v)) return -1;
            o->mock_fault_at = (int32_t)v;
            break;
        case O_IDLE:
            if (parse_int("--idle-timeout", optarg, 0, 86400, &v)) return -1;
            o->idle_timeout = (int)v;
            break;
        case O_GRACE:
            if (parse_int("--shutdown-grace", optarg, 0, 3600, &v)) return -1;
            o->grace = (double)v;
            break;
        case O_THREADS:
            if (parse_int("--threads", optarg, 0, 1024, &v)) return -1;
            kdt_set_cpu_threads((int)v);
            break;
        case O_PREFILL_ATTN:
            if (cli_parse_prefill_attn("serve", optarg, &o->prefill_attention)) return -1;
            break;
        case O_PREFILL_CHUNK:
            if (parse_int("--prefill-chunk", optarg, 0, KDT_MAX_PREFILL_CHUNK, &v)) return -1;
            o->prefill_chunk = (int32_t)v;
            break;
        case O_MAX_PREFILL:
            if (parse_int("--max-prefill-tokens", optarg, 0, 1 << 30, &v)) return -1;
            o->max_prefill_tokens = (int32_t)v;
            break;
        case O_DEVICE:
            if (!strcmp(optarg, "auto")) o->device = KDT_DEVICE_AUTO;
            else if (!strcmp(optarg, "cpu")) o->device = KDT_DEVICE_CPU;
            else if (!strcmp(optarg, "cuda")) o->device = KDT_DEVICE_CUDA;
            else {
                fprintf(stderr, "kdtree serve: --device expects auto, cpu or cuda, got '%s'\n",
                        optarg);
                return -1;
            }
            break;
        default: fputs(usage_text, stderr); return -1;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "kdtree serve: unexpected argument '%s'\n", argv[optind]);
        return -1;
    }
    if (!o->model) {
        fprintf(stderr, "kdtree serve: --model DIR is required (or --model mock)\n%s", usage_text);
        return -1;
    }
    if (o->budget > o->max_budget) {
        fprintf(stderr, "kdtree serve: --budget %d is over --max-budget %d\n", o->budget,
                o->max_budget);
        return -1;
    }
    int is_mock = !strcmp(o->model, "mock");
    if (!is_mock && !o->draft && spec_given && o->spec != KDT_SPEC_AR) {
        fprintf(stderr, "kdtree serve: --spec %s needs --draft\n", srv_spec_name(o->spec));
        return -1;
    }
    if (!is_mock && !o->draft) o->spec = KDT_SPEC_AR;
    return 0;
}

/* The served name: --served-model-name, else the model directory's last component. */
static void default_name(const char *model, char *out, size_t cap) {
    size_t n = strlen(model);
    while (n > 1 && model[n - 1] == '/') n--;
    size_t b = n;
    while (b > 0 && model[b - 1] != '/') b--;
    snprintf(out, cap, "%.*s", (int)(n - b), model + b);
    if (!out[0]) snprintf(out, cap, "kdtree");
}

int kdt_cli_serve(int argc, char **argv) {
    serve_options o;
    int prc = parse_options(argc, argv, &o);
    if (prc) return prc > 0 ? 0 : 2;

    /* Block the shutdown signals before any thread exists: every thread inherits the mask, and
     * only sigwait below sees them. SIGPIPE is blocked so a vanished client never kills us. */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    sigdelset(&set, SIGPIPE);

    srv_backend *be = NULL;
    kdt_status st;
    int is_mock = !strcmp(o.model, "mock");
    if (!is_mock && cli_check_model_dirs("serve", o.model, o.draft) != 0) return 1;
    if (is_mock) {
        srv_mock_options mo = {.max_streams = o.max_streams, .max_context = o.max_context,
                               .kv_pages = o.kv_pages, .round_ms = o.mock_round_ms,
                               .max_budget = o.max_budget, .fault_at_step = o.mock_fault_at};
        st = srv_backend_mock_create(&mo, &be);
    } else {
        srv_engine_options eo = {
            .engine = {.model_dir = o.model, .draft_dir = o.draft, .device = o.device,
                       .max_streams = o.max_streams, .max_context = o.max_context,
                       .kv_pages = o.kv_pages, .max_budget = o.max_budget, .verbose = 1,
                       .prefill_attention = o.prefill_attention, .prefill_chunk = o.prefill_chunk,
                       .max_prefill_tokens = o.max_prefill_tokens},
            .tokenizer_path = o.tokenizer};
        st = srv_backend_engine_create(&eo, &be);
    }
    if (st != KDT_OK) {
        fprintf(stderr, "kdtree serve: cannot load the model: %s: %s\n", kdt_status_name(st),
                kdt_last_error());
        return 1;
    }

    char name[SRV_MODEL_NAME_MAX];
    if (o.name && strlen(o.name) >= sizeof name) {
        fprintf(stderr, "kdtree serve: --served-model-name is over %d bytes\n", SRV_MODEL_NAME_MAX - 1);
        srv_backend_free(be);
        return 2;
    }
    if (o.name) snprintf(name, sizeof name, "%s", o.name);
    else default_name(o.model, name, sizeof name);
    srv_config cfg = {.host = o.host, .port = o.port, .max_queue = o.max_queue,
                      .max_body_bytes = (size_t)o.max_body, .model_name = name,
                      .default_spec = o.spec, .default_budget = o.budget,
                      .static_dir = o.static_dir, .idle_timeout_s = o.idle_timeout,
                      .verbose = o.verbose};
    srv_server *srv = NULL;
    int port = 0;
    st = srv_server_start(&cfg, be, &srv, &port);
    if (st != KDT_OK) {
        fprintf(stderr, "kdtree %s\n", kdt_last_error()); /* the message starts with "serve: " */
        srv_backend_free(be);
        return 1;
    }
    const char *h = o.host;
    int v6 = strchr(h, ':') != NULL;
    printf("kdtree serve: listening on http://%s%s%s:%d (model \"%s\", %s backend, %d streams, "
           "context %d, spec %s)\n",
           v6 ? "[" : "", h, v6 ? "]" : "", port, name, be->kind, be->max_streams,
           be->max_context, srv_spec_name(o.spec));
    fflush(stdout);

    int sig = 0;
    while (sigwait(&set, &sig) != 0) {}
    fprintf(stderr, "kdtree serve: %s: draining (up to %.0f s; signal again to stop now)\n",
            sig == SIGINT ? "SIGINT" : "SIGTERM", o.grace);
    srv_server_begin_drain(srv);
    struct timespec step = {0, 50 * 1000 * 1000};
    double until = srv_now() + o.grace;
    while (!srv_server_idle(srv) && srv_now() < until) {
        if (sigtimedwait(&set, NULL, &step) > 0) {
            fprintf(stderr, "kdtree serve: second signal: cancelling running requests\n");
            break;
        }
    }
    srv_server_stop(srv, 0);
    srv_backend_free(be);
    fprintf(stderr, "kdtree serve: stopped\n");
    return 0;
}
