/* main.c - the `kdtree` command: dispatches to generate, bench and serve (the latter lives in
 * src/server/ and is linked in only when built with libmicrohttpd: KDT_WITH_SERVER). Exit codes:
 * 0 success, 1 a runtime failure, 2 a usage error. */
#include "cli.h"

#include "kdtree/kdtree.h"

#include <string.h>

#ifdef KDT_WITH_SERVER
int kdt_cli_serve(int argc, char **argv); /* src/server/serve.c */
#endif

static void usage(FILE *f) {
    fprintf(f,
            "usage: kdtree <command> [options]\n"
            "\n"
            "commands:\n"
            "  generate   decode one prompt (ar, chain, ddtree or auto) and print stats\n"
            "  bench      compare ar / chain / ddtree budgets over a prompt file\n"
            "  serve      OpenAI-compatible HTTP server%s\n"
            "\n"
            "  kdtree <command> --help   options of a command\n"
            "  kdtree --version          version and build (cpu / cuda)\n",
#ifdef KDT_WITH_SERVER
            ""
#else
            " (not in this build: needs libmicrohttpd)"
#endif
    );
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *c = argv[1];
    if (!strcmp(c, "--help") || !strcmp(c, "-h") || !strcmp(c, "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(c, "--version") || !strcmp(c, "-V")) {
        printf("kdtree %s\n", kdt_version_string());
        return 0;
    }
    if (!strcmp(c, "generate")) return cli_generate(argc - 1, argv + 1);
    if (!strcmp(c, "bench")) return cli_bench(argc - 1, argv + 1);
    if (!strcmp(c, "serve")) {
#ifdef KDT_WITH_SERVER
        return kdt_cli_serve(argc - 1, argv + 1);
#else
        fprintf(stderr, "kdtree serve: not built (the server needs libmicrohttpd and src/server/)\n");
        return 1;
#endif
    }
    if (c[0] == '-') fprintf(stderr, "kdtree: unknown option \"%s\" (see kdtree --help)\n", c);
    else fprintf(stderr, "kdtree: unknown command \"%s\" (see kdtree --help)\n", c);
    return 2;
}
