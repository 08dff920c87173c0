/* server_api_check.h - what the server's handlers rely on in a request srv_api_parse accepted
 * (src/server/server.h): a prompt or messages present, sampling values in range, stop strings
 * non-empty, a spec mode the server can run and a budget within its limit. Shared by the
 * mutation fuzz in test_server_api.c and the coverage-guided harness tests/fuzz/fuzz_api_request.c.
 * Returns 1, or 0 with the first broken property written to why. Include after server.h's sources. */
#ifndef KDT_SERVER_API_CHECK_H
#define KDT_SERVER_API_CHECK_H

#include <stdio.h>

static inline int srv_check_accepted_request(srv_endpoint ep, const srv_api_req *r, const srv_api_limits *lim,
                                             char *why, size_t why_n) {
#define BAD(...) return snprintf(why, why_n, __VA_ARGS__), 0
    if (ep == SRV_EP_COMPLETIONS) {
        if (r->prompt_is_ids) {
            if (r->prompt_ids.n < 1) BAD("empty id prompt");
            for (size_t i = 0; i < r->prompt_ids.n; i++)
                if (r->prompt_ids.v[i] < 0) BAD("negative id %d", (int)r->prompt_ids.v[i]);
        } else if (!r->prompt) {
            BAD("no prompt");
        }
    } else {
        if (r->n_msgs < 1 || !r->msgs) BAD("no messages");
        for (size_t i = 0; i < r->n_msgs; i++)
            if (!r->msgs[i].content) BAD("message %zu without content", i);
    }
    if (r->max_tokens != -1 && r->max_tokens < 1) BAD("max_tokens %d", (int)r->max_tokens);
    if (!(r->temperature >= 0 && r->temperature <= 2)) BAD("temperature %g", r->temperature);
    if (!(r->top_p > 0 && r->top_p <= 1)) BAD("top_p %g", r->top_p);
    if (r->top_k < 0) BAD("top_k %d", (int)r->top_k);
    if (r->n_stop < 0 || r->n_stop > SRV_MAX_STOP_STRINGS) BAD("n_stop %d", r->n_stop);
    for (int i = 0; i < r->n_stop; i++)
        if (!r->stop[i] || !r->stop[i][0]) BAD("stop %d empty", i);
    if (r->spec < KDT_SPEC_AR || r->spec > KDT_SPEC_AUTO) BAD("spec %d", (int)r->spec);
    if (r->spec != KDT_SPEC_AR && !lim->has_draft) BAD("speculative without a drafter");
    if (r->budget < 1 || r->budget > lim->max_budget) BAD("budget %d", (int)r->budget);
    return 1;
#undef BAD
}

#endif
