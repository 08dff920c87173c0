/* fuzz_http.c - the whole HTTP layer (src/server/http.c on libmicrohttpd, with gen.c, sched.c and
 * api.c behind it) on any bytes from a client. One server with the deterministic mock backend
 * (small context, no simulated compute) listens on 127.0.0.1 at a free port for the whole run;
 * each input is one client connection. Input byte 0 picks what goes on the wire (bits 0-1):
 *   0  the rest, raw (request line, headers, body: the parser of libmicrohttpd and our routing);
 *   1  POST /v1/completions with an exact Content-Length, the rest as its body;
 *   2  POST /v1/chat/completions, likewise;
 *   3  a POST /v1/chat/completions request line, Host and Connection: close, the rest as more
 *      headers and a body
 *      (Content-Length, chunked bodies, Expect, oversized bodies);
 * bit 2 flips whether the client shuts its write side after the request. A shut side is a client
 * that went away (a generation is cancelled, no answer) and lets the server see the end of an
 * incomplete request at once; an open one waits for the answer. So 0 always shuts it (raw bytes
 * are rarely a complete request), 1 and 2 by default do not, 3 does unless bit 2 is set (then a
 * chunked or Expect: 100-continue generation gets its answer, at the cost of a wait for an
 * incomplete one).
 * The promises checked:
 *   - after every input, /health still answers 200 "ok" on a fresh connection (no input kills,
 *     wedges or exhausts the server);
 *   - a reply, when one comes, starts with "HTTP/1.x NNN" and NNN is a status the server or
 *     libmicrohttpd gives for a client's request: 200, 400, 404, 405, 413, 429, 503 (http.c,
 *     gen.c, sched.c), 100 before another, 414, 431 and 505 (libmicrohttpd: URI or headers too
 *     large, an unsupported HTTP version); never 500 or another 5xx;
 *   - a complete templated request whose client stays gets its reply before the timeout.
 * Sockets are closed with a reset (SO_LINGER 0), so a long campaign leaves no TIME_WAIT behind.
 * The server sources are not in libkdtree, so they are included; the harness links
 * libmicrohttpd. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include "fuzz.h"

#include "../../src/server/util.c"
#include "../../src/server/api.c"
#include "../../src/server/textout.c"
#include "../../src/server/metrics.c"
#include "../../src/server/bytes_tok.c"
#include "../../src/server/backend_mock.c"
#include "../../src/server/static_page.c"
#include "../../src/server/sched.c"
#include "../../src/server/gen.c"
#include "../../src/server/http.c"

#define REPLY_TIMEOUT_MS 5000  /* a templated request's whole answer (at most 256 tokens, no sleeps) */
#define RAW_TIMEOUT_MS 500     /* anything else: an answer, or the server waiting for more */
#define HEALTH_TIMEOUT_MS 10000
#define MAX_BODY_BYTES 2048    /* small, so inputs reach the 413 paths */

static srv_backend *backend;
static srv_server *server;
static int server_port;

static void stop_server(void) {
    srv_server_stop(server, 0);
    srv_backend_free(backend);
}

static void start_server(void) {
    signal(SIGPIPE, SIG_IGN); /* a write to a closed socket fails with EPIPE instead */
    const srv_mock_options mo = {.max_streams = 4, .max_context = 256, .round_ms = 0, .max_budget = 16};
    if (srv_backend_mock_create(&mo, &backend) != KDT_OK) FUZZ_FAIL("mock backend: %s", kdt_last_error());
    const srv_config cfg = {.host = "127.0.0.1", .port = 0, .max_queue = 8, .max_body_bytes = MAX_BODY_BYTES,
                            .model_name = "mock", .default_spec = KDT_SPEC_DDTREE, .default_budget = 8,
                            .idle_timeout_s = 30};
    if (srv_server_start(&cfg, backend, &server, &server_port) != KDT_OK)
        FUZZ_FAIL("server: %s", kdt_last_error());
    atexit(stop_server); /* the replay build's ASan then sees whatever a stop leaves behind */
}

static double now_ms(void) { return srv_now() * 1e3; }

/* Sends req[0..n) on a fresh connection (then shuts the write side if asked) and reads the reply
 * until the server closes or timeout_ms passes. The first cap - 1 bytes land in buf, NUL-terminated;
 * returns how many there are, and *timed_out says whether the server was still sending or silent. */
static size_t exchange(const char *req, size_t n, int half_close, int timeout_ms, char *buf, size_t cap,
                       int *timed_out) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) FUZZ_FAIL("socket: %s", strerror(errno));
    const struct linger reset_on_close = {1, 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset_on_close, sizeof reset_on_close);
    const struct timeval send_limit = {2, 0}; /* a server that stopped reading must not hang us */
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &send_limit, sizeof send_limit);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)server_port)};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) FUZZ_FAIL("connect: %s", strerror(errno));
    for (size_t sent = 0; sent < n;) { /* the server may answer and close before taking it all */
        const ssize_t k = send(fd, req + sent, n - sent, MSG_NOSIGNAL);
        if (k <= 0) break;
        sent += (size_t)k;
    }
    if (half_close) shutdown(fd, SHUT_WR);
    size_t got = 0;
    *timed_out = 1;
    const double until = now_ms() + timeout_ms;
    for (double left; (left = until - now_ms()) > 0;) {
        struct pollfd p = {fd, POLLIN, 0};
        if (poll(&p, 1, (int)left + 1) <= 0) continue;
        char chunk[4096];
        const ssize_t k = recv(fd, chunk, sizeof chunk, 0);
        if (k <= 0) { /* closed (or reset) by the server: the reply is complete */
            *timed_out = 0;
            break;
        }
        const size_t keep = got + (size_t)k < cap - 1 ? (size_t)k : cap - 1 - got;
        memcpy(buf + got, chunk, keep);
        got += keep;
    }
    buf[got] = 0;
    close(fd);
    return got;
}

/* The status of the status line at s, or -1 if s does not start with "HTTP/1.x NNN ". */
static int status_of(const char *s, size_t n) {
    if (n < 13 || memcmp(s, "HTTP/1.", 7) != 0 || (s[7] != '0' && s[7] != '1') || s[8] != ' ') return -1;
    for (int i = 9; i < 12; i++)
        if (s[i] < '0' || s[i] > '9') return -1;
    if (s[12] != ' ' && s[12] != '\r') return -1;
    return (s[9] - '0') * 100 + (s[10] - '0') * 10 + (s[11] - '0');
}

static int legitimate(int status) {
    static const int ok[] = {200, 400, 404, 405, 413, 429, 503, /* the server */
                             414, 431, 505 /* libmicrohttpd */};
    for (size_t i = 0; i < sizeof ok / sizeof *ok; i++)
        if (status == ok[i]) return 1;
    return 0;
}

static void check_reply(const char *r, size_t n, int timed_out) {
    if (n == 0) return; /* closed without an answer (an incomplete request, a vanished client) */
    if (timed_out && !memchr(r, '\n', n)) return; /* still coming */
    int status = status_of(r, n);
    FUZZ_CHECK(status >= 0, "the reply starts '%.40s'", r);
    if (status == 100) { /* "100 Continue" (Expect), then the real answer */
        const char *next = strstr(r, "\r\n\r\n");
        if (!next || (size_t)(next + 4 - r) == n) return;
        status = status_of(next + 4, n - (size_t)(next + 4 - r));
        FUZZ_CHECK(status >= 0, "after 100 Continue the reply goes on '%.40s'", next + 4);
    }
    FUZZ_CHECK(legitimate(status), "status %d: '%.300s'", status, r);
    fuzz_note("status %d", status);
}

static void check_health(void) {
    static const char req[] = "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    static char reply[8192];
    int timed_out;
    const size_t n = exchange(req, sizeof req - 1, 0, HEALTH_TIMEOUT_MS, reply, sizeof reply, &timed_out);
    FUZZ_CHECK(status_of(reply, n) == 200 && strstr(reply, "\"status\":\"ok\"") && !timed_out,
               "after this input /health answers '%.300s'%s", reply, timed_out ? " (timed out)" : "");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!server) start_server();
    if (size < 1) return 0;
    const int mode = data[0] & 3, flip = (data[0] >> 2) & 1;
    const char *rest = (const char *)data + 1;
    const size_t n_rest = size - 1;
    static const char *const heads[4] = {
        "", "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n",
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n",
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"};
    const int templated = mode == 1 || mode == 2;
    srv_buf req = {0};
    if (srv_buf_puts(&req, heads[mode]) ||
        (templated && srv_buf_printf(&req, "Content-Length: %zu\r\n\r\n", n_rest)) ||
        srv_buf_append(&req, rest, n_rest))
        FUZZ_FAIL("out of memory");
    const int half_close = mode == 0 || (templated ? flip : !flip);
    static char reply[65536];
    int timed_out;
    const size_t n = exchange(req.data, req.len, half_close,
                              templated && !half_close ? REPLY_TIMEOUT_MS : RAW_TIMEOUT_MS, reply, sizeof reply,
                              &timed_out);
    check_reply(reply, n, timed_out);
    if (templated && !half_close)
        FUZZ_CHECK(n > 0 && !timed_out, "a complete request got %s within %d ms: '%.300s'",
                   n ? "no end of its reply" : "no reply", REPLY_TIMEOUT_MS, reply);
    srv_buf_free(&req);
    check_health();
    return 0;
}
