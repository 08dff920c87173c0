/* fuzz_api_request.c - the server's request parser (srv_api_parse, src/server/api.c) on any
 * bytes. Input byte 0 picks the endpoint (bit 0: chat or completions) and the limits (bit 1: a
 * server without a drafter); the rest is the POST body. Promise: an accepted request satisfies
 * everything the handlers rely on (server_api_check.h); a refused one has status 400, 404 or 413,
 * an error type and a message. The server sources are not in libkdtree, so they are included. */
#include "fuzz.h"

#include "../../src/server/util.c"
#include "../../src/server/api.c"
#include "../server_api_check.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const srv_endpoint ep = (data[0] & 1) ? SRV_EP_CHAT : SRV_EP_COMPLETIONS;
    const srv_api_limits lim = {.model_name = "tiny", .max_budget = 64, .default_spec = KDT_SPEC_DDTREE,
                                .default_budget = 32, .has_draft = !(data[0] & 2)};
    srv_api_req r;
    srv_error e;
    memset(&e, 0, sizeof e);
    const char *body = (const char *)data + 1;
    const size_t n = size - 1;
    if (srv_api_parse(ep, body, n, &lim, &r, &e) == 0) {
        char why[128] = "";
        FUZZ_CHECK(srv_check_accepted_request(ep, &r, &lim, why, sizeof why), "accepted, but %s", why);
        fuzz_note("accepted");
    } else {
        FUZZ_CHECK((e.status == 400 || e.status == 404 || e.status == 413) && e.type && e.message[0],
                   "refused with status %d, message '%s'", e.status, e.message);
        fuzz_note("refused: %d %s", e.status, e.message);
    }
    srv_api_req_free(&r);
    return 0;
}
