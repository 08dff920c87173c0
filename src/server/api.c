/* api.c - the OpenAI wire format: POST bodies of /v1/completions and /v1/chat/completions parsed
 * and validated into srv_api_req (every refusal names the field), and the JSON the server sends
 * back: full responses, SSE chunks, the usage chunk, /v1/models and error bodies.
 *
 * Unknown fields are ignored (clients send many defaults), but fields that would change the
 * answer in a way we do not implement (n > 1, logprobs, echo, penalties, tools, logit_bias) are
 * refused with 400 rather than silently dropped. The `kdtree` object is our extension and is
 * strict: {"spec": "ar"|"chain"|"ddtree"|"auto", "budget": 1..max_budget, "ignore_eos": bool}.
 */
#include "server/server.h"

#include <jansson.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---- names ---------------------------------------------------------------------------------- */

const char *srv_endpoint_path(srv_endpoint ep) {
    switch (ep) {
    case SRV_EP_COMPLETIONS: return "/v1/completions";
    case SRV_EP_CHAT: return "/v1/chat/completions";
    case SRV_EP_MODELS: return "/v1/models";
    case SRV_EP_HEALTH: return "/health";
    case SRV_EP_METRICS: return "/metrics";
    case SRV_EP_PAGE: return "/";
    default: return "other";
    }
}

static const char *const spec_names[] = {"ar", "chain", "ddtree", "auto"};

int srv_spec_parse(const char *s, kdt_spec_mode *out) {
    for (int i = 0; i < 4; i++)
        if (strcmp(s, spec_names[i]) == 0) {
            *out = (kdt_spec_mode)i;
            return 0;
        }
    return -1;
}

const char *srv_spec_name(kdt_spec_mode m) {
    return (m >= KDT_SPEC_AR && m <= KDT_SPEC_AUTO) ? spec_names[m] : "?";
}

/* ---- request parsing ------------------------------------------------------------------------ */

static const char *json_type_name(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a number";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    default: return "null";
    }
}

static char *dup_n(const char *s, size_t n) {
    char *p = malloc(n + 1);
    if (!p) return NULL;
    memcpy(p, s, n);
    p[n] = '\0';
    return p;
}

/* Optional boolean: absent/null keeps *out. */
static int get_bool(json_t *root, const char *key, int *out, srv_error *e) {
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_boolean(v)) {
        srv_bad_field(e, key, "'%s' must be a boolean, got %s", key, json_type_name(v));
        return -1;
    }
    *out = json_is_true(v);
    return 0;
}

/* Optional number within [lo, hi]; absent/null keeps *out. */
static int get_number(json_t *root, const char *key, double lo, double hi, double *out,
                      srv_error *e) {
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_number(v)) {
        srv_bad_field(e, key, "'%s' must be a number, got %s", key, json_type_name(v));
        return -1;
    }
    double x = json_number_value(v);
    if (!(x >= lo && x <= hi)) {
        srv_bad_field(e, key, "'%s' = %g is out of range [%g, %g]", key, x, lo, hi);
        return -1;
    }
    *out = x;
    return 0;
}

/* Optional integer within [lo, hi]; absent/null keeps *out. */
static int get_int(json_t *root, const char *key, long long lo, long long hi, long long *out,
                   srv_error *e) {
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_integer(v)) {
        srv_bad_field(e, key, "'%s' must be an integer, got %s", key, json_type_name(v));
        return -1;
    }
    long long x = json_integer_value(v);
    if (x < lo || x > hi) {
        srv_bad_field(e, key, "'%s' = %lld is out of range [%lld, %lld]", key, x, lo, hi);
        return -1;
    }
    *out = x;
    return 0;
}

/* A field we do not implement: accepted only at its neutral value. */
static int refuse_unless_neutral(json_t *root, const char *key, srv_error *e) {
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v) || json_is_false(v)) return 0;
    if (json_is_integer(v) && (json_integer_value(v) == 0 ||
                               ((!strcmp(key, "n") || !strcmp(key, "best_of")) &&
                                json_integer_value(v) == 1)))
        return 0;
    if (json_is_real(v) && json_real_value(v) == 0.0) return 0;
    if (json_is_string(v) && json_string_length(v) == 0) return 0;
    if ((json_is_array(v) && json_array_size(v) == 0) ||
        (json_is_object(v) && json_object_size(v) == 0))
        return 0;
    if (!strcmp(key, "n") || !strcmp(key, "best_of")) {
        if (!json_is_integer(v))
            srv_bad_field(e, key, "'%s' must be an integer, got %s", key, json_type_name(v));
        else
            srv_bad_field(e, key, "'%s' = %lld is not supported: only 1 choice per request", key,
                          (long long)json_integer_value(v));
        return -1;
    }
    srv_bad_field(e, key, "'%s' is not supported by this server", key);
    return -1;
}

static int parse_stop(json_t *root, srv_api_req *r, srv_error *e) {
    json_t *v = json_object_get(root, "stop");
    if (!v || json_is_null(v)) return 0;
    json_t *one[1] = {v};
    json_t **items = one;
    size_t n = 1;
    if (json_is_array(v)) {
        n = json_array_size(v);
        if (n > SRV_MAX_STOP_STRINGS) {
            srv_bad_field(e, "stop", "'stop' has %zu strings, at most %d are allowed", n,
                          SRV_MAX_STOP_STRINGS);
            return -1;
        }
        items = NULL;
    } else if (!json_is_string(v)) {
        srv_bad_field(e, "stop", "'stop' must be a string or an array of strings, got %s",
                      json_type_name(v));
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *s = items ? items[i] : json_array_get(v, i);
        if (!json_is_string(s)) {
            srv_bad_field(e, "stop", "'stop[%zu]' must be a string, got %s", i, json_type_name(s));
            return -1;
        }
        size_t len = json_string_length(s);
        if (memchr(json_string_value(s), '\0', len)) {
            srv_bad_field(e, "stop", "'stop' strings may not contain NUL characters");
            return -1;
        }
        if (len == 0 || len > SRV_MAX_STOP_LEN) {
            srv_bad_field(e, "stop", "'stop' strings must be 1..%d bytes long (got %zu)",
                          SRV_MAX_STOP_LEN, len);
            return -1;
        }
        if (!(r->stop[r->n_stop] = dup_n(json_string_value(s), len))) goto oom;
        r->n_stop++;
    }
    return 0;
oom:
    srv_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    return -1;
}

static int parse_prompt(json_t *root, srv_api_req *r, srv_error *e) {
    json_t *v = json_object_get(root, "prompt");
    if (!v || json_is_null(v)) {
        srv_bad_field(e, "prompt", "'prompt' is required");
        return -1;
    }
    /* A one-element batch is the same as its element; more need n > 1 semantics. */
    if (json_is_array(v) && json_array_size(v) == 1 &&
        (json_is_string(json_array_get(v, 0)) || json_is_array(json_array_get(v, 0))))
        v = json_array_get(v, 0);
    if (json_is_string(v)) {
        r->prompt_len = json_string_length(v);
        if (!(r->prompt = dup_n(json_string_value(v), r->prompt_len))) goto oom;
        return 0;
    }
    if (!json_is_array(v)) {
        srv_bad_field(e, "prompt", "'prompt' must be a string or an array of token ids, got %s",
                      json_type_name(v));
        return -1;
    }
    size_t n = json_array_size(v);
    if (n == 0) {
        srv_bad_field(e, "prompt", "'prompt' is an empty array");
        return -1;
    }
    r->prompt_is_ids = 1;
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_array_get(v, i);
        if (!json_is_integer(t)) {
            srv_bad_field(e, "prompt",
                          "'prompt' must be a string, an array of token ids, or one of those in "
                          "a one-element array (batches of several prompts are not supported); "
                          "element %zu is %s", i, json_type_name(t));
            return -1;
        }
        long long id = json_integer_value(t);
        if (id < 0 || id > INT32_MAX) {
            srv_bad_field(e, "prompt", "'prompt[%zu]' = %lld is not a token id", i, id);
            return -1;
        }
        if (srv_ids_push(&r->prompt_ids, (int32_t)id)) goto oom;
    }
    return 0;
oom:
    srv_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    return -1;
}

/* content: a string, or an array of {"type": "text", "text": "..."} parts (concatenated). */
static int parse_content(json_t *c, size_t i, const char *role, char **out, srv_error *e) {
    char field[64];
    snprintf(field, sizeof field, "messages[%zu].content", i);
    if (!c || json_is_null(c)) {
        if (!strcmp(role, "assistant")) { /* an assistant turn may carry only tool calls */
            *out = dup_n("", 0);
            return *out ? 0 : -2;
        }
        srv_bad_field(e, field, "'%s' is required", field);
        return -1;
    }
    if (json_is_string(c)) {
        if (memchr(json_string_value(c), '\0', json_string_length(c))) goto nul;
        *out = dup_n(json_string_value(c), json_string_length(c));
        return *out ? 0 : -2;
    }
    if (!json_is_array(c)) {
        srv_bad_field(e, field, "'%s' must be a string or an array of text parts, got %s", field,
                      json_type_name(c));
        return -1;
    }
    srv_buf text = {0};
    for (size_t k = 0; k < json_array_size(c); k++) {
        json_t *part = json_array_get(c, k);
        json_t *type = json_object_get(part, "type");
        json_t *t = json_object_get(part, "text");
        if (!json_is_object(part) || !json_is_string(type) ||
            strcmp(json_string_value(type), "text") != 0 || !json_is_string(t)) {
            srv_buf_free(&text);
            srv_bad_field(e, field,
                          "'%s[%zu]' must be {\"type\": \"text\", \"text\": string} (only text "
                          "content is supported)", field, k);
            return -1;
        }
        if (memchr(json_string_value(t), '\0', json_string_length(t))) {
            srv_buf_free(&text);
            goto nul;
        }
        if (srv_buf_append(&text, json_string_value(t), json_string_length(t))) {
            srv_buf_free(&text);
            return -2;
        }
    }
    *out = text.data ? text.data : dup_n("", 0);
    return *out ? 0 : -2;
nul: /* the chat template takes NUL-terminated text: refuse rather than cut the message */
    srv_bad_field(e, field, "'%s' may not contain NUL characters", field);
    return -1;
}

static int parse_messages(json_t *root, srv_api_req *r, srv_error *e) {
    json_t *v = json_object_get(root, "messages");
    if (!v || json_is_null(v)) {
        srv_bad_field(e, "messages", "'messages' is required");
        return -1;
    }
    if (!json_is_array(v) || json_array_size(v) == 0) {
        srv_bad_field(e, "messages", "'messages' must be a non-empty array, got %s",
                      json_is_array(v) ? "an empty array" : json_type_name(v));
        return -1;
    }
    size_t n = json_array_size(v);
    if (n > SRV_MAX_MESSAGES) {
        srv_bad_field(e, "messages", "'messages' has %zu entries, at most %d are allowed", n,
                      SRV_MAX_MESSAGES);
        return -1;
    }
    if (!(r->msgs = calloc(n, sizeof *r->msgs))) goto oom;
    for (size_t i = 0; i < n; i++) {
        json_t *m = json_array_get(v, i);
        char field[64];
        snprintf(field, sizeof field, "messages[%zu]", i);
        if (!json_is_object(m)) {
            srv_bad_field(e, field, "'%s' must be an object, got %s", field, json_type_name(m));
            return -1;
        }
        json_t *role = json_object_get(m, "role");
        snprintf(field, sizeof field, "messages[%zu].role", i);
        if (!json_is_string(role)) {
            srv_bad_field(e, field, "'%s' must be a string, got %s", field,
                          role ? json_type_name(role) : "nothing");
            return -1;
        }
        const char *rs = json_string_value(role);
        kdt_chat_role cr;
        if (!strcmp(rs, "system") || !strcmp(rs, "developer")) cr = KDT_CHAT_SYSTEM;
        else if (!strcmp(rs, "user")) cr = KDT_CHAT_USER;
        else if (!strcmp(rs, "assistant")) cr = KDT_CHAT_ASSISTANT;
        else {
            srv_bad_field(e, field,
                          "'%s' = \"%.32s\" is not supported (system, developer, user, assistant)",
                          field, rs);
            return -1;
        }
        if (json_object_get(m, "tool_calls") && !json_is_null(json_object_get(m, "tool_calls"))) {
            snprintf(field, sizeof field, "messages[%zu].tool_calls", i);
            srv_bad_field(e, field, "tool calls are not supported by this server");
            return -1;
        }
        char *content = NULL;
        int rc = parse_content(json_object_get(m, "content"), i, rs, &content, e);
        if (rc == -2) goto oom;
        if (rc) return -1;
        r->msgs[i].role = cr;
        r->msgs[i].content = content;
        r->n_msgs = i + 1;
    }
    return 0;
oom:
    srv_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    return -1;
}

static int parse_kdtree_ext(json_t *root, const srv_api_limits *lim, srv_api_req *r,
                            srv_error *e) {
    json_t *k = json_object_get(root, "kdtree");
    if (!k || json_is_null(k)) return 0;
    if (!json_is_object(k)) {
        srv_bad_field(e, "kdtree", "'kdtree' must be an object, got %s", json_type_name(k));
        return -1;
    }
    const char *key;
    json_t *val;
    json_object_foreach(k, key, val) {
        if (strcmp(key, "spec") != 0 && strcmp(key, "budget") != 0 &&
            strcmp(key, "ignore_eos") != 0) {
            srv_bad_field(e, "kdtree",
                          "'kdtree.%.32s' is not a known field (spec, budget, ignore_eos)", key);
            return -1;
        }
    }
    json_t *spec = json_object_get(k, "spec");
    if (spec && !json_is_null(spec)) {
        if (!json_is_string(spec) || srv_spec_parse(json_string_value(spec), &r->spec)) {
            srv_bad_field(e, "kdtree.spec",
                          "'kdtree.spec' must be one of \"ar\", \"chain\", \"ddtree\", \"auto\"");
            return -1;
        }
    }
    long long budget = r->budget;
    if (get_int(k, "budget", 1, lim->max_budget, &budget, e)) {
        snprintf(e->param, sizeof e->param, "kdtree.budget");
        return -1;
    }
    r->budget = (int32_t)budget;
    if (get_bool(k, "ignore_eos", &r->ignore_eos, e)) {
        snprintf(e->param, sizeof e->param, "kdtree.ignore_eos");
        return -1;
    }
    if (r->spec != KDT_SPEC_AR && !lim->has_draft) {
        srv_bad_field(e, "kdtree.spec",
                      "'kdtree.spec' = \"%s\" needs a drafter; this server runs without one "
                      "(use \"ar\")", srv_spec_name(r->spec));
        return -1;
    }
    return 0;
}

int srv_api_parse(srv_endpoint ep, const char *body, size_t len, const srv_api_limits *lim,
                  srv_api_req *r, srv_error *e) {
    memset(r, 0, sizeof *r);
    r->ep = ep;
    r->max_tokens = -1;
    r->temperature = 1.0; /* OpenAI's default */
    r->top_p = 1.0;
    r->spec = lim->has_draft ? lim->default_spec : KDT_SPEC_AR;
    r->budget = lim->default_budget;

    json_error_t jerr;
    /* NUL is allowed in strings (a prompt may hold any text); fields that cannot carry it
     * say so themselves */
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL, &jerr);
    if (!root) {
        srv_error_set(e, 400, "invalid_request_error", NULL, "invalid_json",
                      "malformed JSON body at line %d, column %d: %s", jerr.line, jerr.column,
                      jerr.text);
        return -1;
    }
    int rc = -1;
    if (!json_is_object(root)) {
        srv_error_set(e, 400, "invalid_request_error", NULL, "invalid_json",
                      "the request body must be a JSON object, got %s", json_type_name(root));
        goto done;
    }

    json_t *model = json_object_get(root, "model");
    if (model && !json_is_null(model)) {
        if (!json_is_string(model)) {
            srv_bad_field(e, "model", "'model' must be a string, got %s", json_type_name(model));
            goto done;
        }
        if (strcmp(json_string_value(model), lim->model_name) != 0) {
            srv_error_set(e, 404, "invalid_request_error", "model", "model_not_found",
                          "The model '%.128s' does not exist; this server serves '%s'",
                          json_string_value(model), lim->model_name);
            goto done;
        }
    }

    static const char *const unsupported_common[] = {
        "n", "best_of", "presence_penalty", "frequency_penalty", "logit_bias", "tools",
        "functions", "top_logprobs", "logprobs"};
    for (size_t i = 0; i < sizeof unsupported_common / sizeof *unsupported_common; i++)
        if (refuse_unless_neutral(root, unsupported_common[i], e)) goto done;
    if (ep == SRV_EP_COMPLETIONS) {
        if (refuse_unless_neutral(root, "echo", e) || refuse_unless_neutral(root, "suffix", e))
            goto done;
    }
    json_t *rf = json_object_get(root, "response_format");
    if (rf && !json_is_null(rf)) {
        json_t *t = json_object_get(rf, "type");
        if (!json_is_object(rf) || !json_is_string(t) || strcmp(json_string_value(t), "text")) {
            srv_bad_field(e, "response_format",
                          "'response_format' other than {\"type\": \"text\"} is not supported");
            goto done;
        }
    }

    if (ep == SRV_EP_COMPLETIONS ? parse_prompt(root, r, e) : parse_messages(root, r, e))
        goto done;
    if (get_bool(root, "stream", &r->stream, e)) goto done;
    json_t *so = json_object_get(root, "stream_options");
    if (so && !json_is_null(so)) {
        if (!json_is_object(so)) {
            srv_bad_field(e, "stream_options", "'stream_options' must be an object, got %s",
                          json_type_name(so));
            goto done;
        }
        if (get_bool(so, "include_usage", &r->include_usage, e)) {
            snprintf(e->param, sizeof e->param, "stream_options.include_usage");
            goto done;
        }
    }
    long long max_tokens = -1;
    if (get_int(root, "max_tokens", 1, INT32_MAX, &max_tokens, e)) goto done;
    if (ep == SRV_EP_CHAT &&
        get_int(root, "max_completion_tokens", 1, INT32_MAX, &max_tokens, e))
        goto done;
    r->max_tokens = (int32_t)max_tokens;
    if (get_number(root, "temperature", 0.0, 2.0, &r->temperature, e)) goto done;
    if (get_number(root, "top_p", 0.0, 1.0, &r->top_p, e)) goto done;
    if (r->top_p <= 0.0) {
        srv_bad_field(e, "top_p", "'top_p' must be greater than 0");
        goto done;
    }
    long long top_k = 0;
    if (get_int(root, "top_k", 0, INT32_MAX, &top_k, e)) goto done;
    r->top_k = (int32_t)top_k;
    json_t *seed = json_object_get(root, "seed");
    if (seed && !json_is_null(seed)) {
        if (!json_is_integer(seed)) {
            srv_bad_field(e, "seed", "'seed' must be an integer, got %s", json_type_name(seed));
            goto done;
        }
        r->seed = (uint64_t)json_integer_value(seed);
        r->has_seed = 1;
    }
    if (parse_stop(root, r, e)) goto done;
    if (parse_kdtree_ext(root, lim, r, e)) goto done;
    rc = 0;
done:
    json_decref(root);
    return rc;
}

void srv_api_req_free(srv_api_req *r) {
    free(r->prompt);
    srv_ids_free(&r->prompt_ids);
    for (size_t i = 0; i < r->n_msgs; i++) free((char *)r->msgs[i].content);
    free(r->msgs);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    memset(r, 0, sizeof *r);
}

/* ---- responses ------------------------------------------------------------------------------ */

static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void srv_resp_id_init(srv_resp_id *rid, srv_endpoint ep, const char *model) {
    static atomic_ullong counter;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t n = atomic_fetch_add(&counter, 1) + 1;
    uint64_t a = mix64((uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 32) ^ n * 0x9e3779b97f4a7c15ull);
    uint64_t b = mix64(a ^ (uint64_t)ts.tv_sec ^ n);
    snprintf(rid->id, sizeof rid->id, "%s-%016llx%08llx", ep == SRV_EP_CHAT ? "chatcmpl" : "cmpl",
             (unsigned long long)a, (unsigned long long)(b & 0xffffffffu));
    rid->created = (long long)ts.tv_sec;
    rid->model = model;
}

/* Appends `root` as compact JSON and releases it. */
static int dump_into(json_t *root, srv_buf *out) {
    if (!root) return -1;
    char *s = json_dumps(root, JSON_COMPACT | JSON_REAL_PRECISION(6)); /* 6 digits: tau */
    json_decref(root);
    if (!s) return -1;
    int rc = srv_buf_puts(out, s);
    free(s);
    return rc;
}

int srv_api_health_json(const srv_health *h, srv_buf *out) {
    json_t *root = json_pack("{s:s, s:s, s:s, s:b, s:i, s:i, s:i, s:i}", "status", h->status, "model", h->model,
                             "backend", h->backend, "draft", h->draft, "max_context", (json_int_t)h->max_context,
                             "max_streams", (json_int_t)h->max_streams, "active_streams",
                             (json_int_t)h->active_streams, "queue_depth", (json_int_t)h->queue_depth);
    if (root && h->error && json_object_set_new(root, "error", json_string(h->error)) != 0) {
        json_decref(root);
        return -1;
    }
    return dump_into(root, out);
}

static json_t *usage_json(const srv_gen_summary *s) {
    return json_pack("{s:i, s:i, s:i}", "prompt_tokens", (json_int_t)s->prompt_tokens,
                     "completion_tokens", (json_int_t)s->completion_tokens, "total_tokens",
                     (json_int_t)s->prompt_tokens + s->completion_tokens);
}

static json_t *kdtree_json(const srv_gen_summary *s) {
    return json_pack("{s:f, s:i, s:s, s:i}", "tau", s->tau, "rounds", (json_int_t)s->rounds, "spec",
                     srv_spec_name(s->spec), "budget", (json_int_t)s->budget);
}

static json_t *base_json(const srv_resp_id *rid, const char *object) {
    return json_pack("{s:s, s:s, s:I, s:s}", "id", rid->id, "object", object, "created",
                     (json_int_t)rid->created, "model", rid->model);
}

int srv_api_response_json(srv_endpoint ep, const srv_resp_id *rid, const char *text, size_t len,
                          const srv_gen_summary *s, srv_buf *out) {
    json_t *str = json_stringn(text ? text : "", len);
    if (!str) return -1;
    json_t *choice;
    if (ep == SRV_EP_CHAT)
        choice = json_pack("{s:i, s:{s:s, s:o}, s:n, s:s}", "index", 0, "message", "role",
                           "assistant", "content", str, "logprobs", "finish_reason",
                           s->finish_reason ? s->finish_reason : "stop");
    else
        choice = json_pack("{s:i, s:o, s:n, s:s}", "index", 0, "text", str, "logprobs",
                           "finish_reason", s->finish_reason ? s->finish_reason : "stop");
    json_t *root = base_json(rid, ep == SRV_EP_CHAT ? "chat.completion" : "text_completion");
    if (!root || !choice) {
        json_decref(root);
        json_decref(choice);
        return -1;
    }
    json_object_set_new(root, "choices", json_pack("[o]", choice));
    json_object_set_new(root, "usage", usage_json(s));
    json_object_set_new(root, "kdtree", kdtree_json(s));
    return dump_into(root, out);
}

static int sse_wrap(json_t *root, srv_buf *out) {
    size_t mark = out->len;
    if (srv_buf_puts(out, "data: ") || dump_into(root, out) || srv_buf_puts(out, "\n\n")) {
        out->len = mark;
        if (out->data) out->data[mark] = '\0';
        return -1;
    }
    return 0;
}

int srv_api_chunk_sse(srv_endpoint ep, const srv_resp_id *rid, const char *text, size_t len,
                      int role_delta, const srv_gen_summary *s, srv_buf *out) {
    const char *finish = s ? s->finish_reason : NULL;
    json_t *choice;
    if (ep == SRV_EP_CHAT) {
        json_t *delta = json_object();
        if (!delta) return -1;
        if (role_delta) json_object_set_new(delta, "role", json_string("assistant"));
        if (len || role_delta) {
            json_t *str = json_stringn(text ? text : "", len);
            if (!str) {
                json_decref(delta);
                return -1;
            }
            json_object_set_new(delta, "content", str);
        }
        choice = json_pack("{s:i, s:o, s:n, s:o}", "index", 0, "delta", delta, "logprobs",
                           "finish_reason", finish ? json_string(finish) : json_null());
    } else {
        json_t *str = json_stringn(text ? text : "", len);
        if (!str) return -1;
        choice = json_pack("{s:i, s:o, s:n, s:o}", "index", 0, "text", str, "logprobs",
                           "finish_reason", finish ? json_string(finish) : json_null());
    }
    json_t *root = base_json(rid, ep == SRV_EP_CHAT ? "chat.completion.chunk" : "text_completion");
    if (!root || !choice) {
        json_decref(root);
        json_decref(choice);
        return -1;
    }
    json_object_set_new(root, "choices", json_pack("[o]", choice));
    if (finish) json_object_set_new(root, "kdtree", kdtree_json(s));
    return sse_wrap(root, out);
}

int srv_api_usage_chunk_sse(srv_endpoint ep, const srv_resp_id *rid, const srv_gen_summary *s,
                            srv_buf *out) {
    json_t *root = base_json(rid, ep == SRV_EP_CHAT ? "chat.completion.chunk" : "text_completion");
    if (!root) return -1;
    json_object_set_new(root, "choices", json_array());
    json_object_set_new(root, "usage", usage_json(s));
    return sse_wrap(root, out);
}

static json_t *model_json(const char *model, long long created) {
    return json_pack("{s:s, s:s, s:I, s:s}", "id", model, "object", "model", "created",
                     (json_int_t)created, "owned_by", "kdtree");
}

int srv_api_models_json(const char *model, long long created, srv_buf *out) {
    return dump_into(json_pack("{s:s, s:[o]}", "object", "list", "data", model_json(model, created)),
                     out);
}

int srv_api_model_json(const char *model, long long created, srv_buf *out) {
    return dump_into(model_json(model, created), out);
}

/* Copies s, replacing every byte that is not part of a well-formed UTF-8 sequence by '?'
 * (messages quote user input, possibly cut mid-character). */
static void utf8_scrub(const char *s, char *out, size_t cap) {
    size_t n = strlen(s), o = 0;
    for (size_t i = 0; i < n && o + 1 < cap;) {
        unsigned char c = (unsigned char)s[i];
        size_t len = c < 0x80 ? 1 : (c >= 0xc2 && c <= 0xdf) ? 2 : (c >= 0xe0 && c <= 0xef) ? 3
                   : (c >= 0xf0 && c <= 0xf4) ? 4 : 0;
        int ok = len > 0 && i + len <= n;
        for (size_t k = 1; ok && k < len; k++) ok = ((unsigned char)s[i + k] & 0xc0) == 0x80;
        if (ok && len == 3) { /* no overlongs, no surrogates */
            unsigned char d = (unsigned char)s[i + 1];
            ok = !(c == 0xe0 && d < 0xa0) && !(c == 0xed && d >= 0xa0);
        }
        if (ok && len == 4) {
            unsigned char d = (unsigned char)s[i + 1];
            ok = !(c == 0xf0 && d < 0x90) && !(c == 0xf4 && d >= 0x90);
        }
        if (!ok) { /* one '?' for the bad lead byte and the continuation bytes after it */
            out[o++] = '?';
            size_t k = 1;
            while (len > 1 && k < len && i + k < n && ((unsigned char)s[i + k] & 0xc0) == 0x80) k++;
            i += k;
            continue;
        }
        if (o + len >= cap) break;
        memcpy(out + o, s + i, len);
        o += len;
        i += len;
    }
    out[o] = '\0';
}

int srv_api_error_json(const srv_error *e, srv_buf *out) {
    char clean[sizeof e->message];
    utf8_scrub(e->message, clean, sizeof clean);
    json_t *msg = json_string(clean);
    return dump_into(json_pack("{s:{s:o, s:s, s:o, s:o}}", "error", "message", msg, "type",
                               e->type ? e->type : "server_error", "param",
                               e->param[0] ? json_string(e->param) : json_null(), "code",
                               e->code ? json_string(e->code) : json_null()),
                     out);
}
