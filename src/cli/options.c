/* options.c - the CLI's option table: one cli_opt[] per command drives getopt_long, value
 * parsing with range checks, and the --help text, so the three never disagree. */
#include "cli.h"

#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

void cli_print_help(FILE *f, const char *prog, const char *usage, const cli_opt *opts, int n_opts) {
    fprintf(f, "usage: %s %s\n\noptions:\n", prog, usage);
    for (int i = 0; i < n_opts; i++) {
        char left[96];
        int o = 0;
        if (opts[i].short_name) o += snprintf(left + o, sizeof left - (size_t)o, "-%c, ", opts[i].short_name);
        else o += snprintf(left + o, sizeof left - (size_t)o, "    ");
        o += snprintf(left + o, sizeof left - (size_t)o, "--%s", opts[i].name);
        if (opts[i].metavar) snprintf(left + o, sizeof left - (size_t)o, " %s", opts[i].metavar);
        fprintf(f, "  %-30s %s\n", left, opts[i].help);
    }
    fprintf(f, "  %-30s %s\n", "-h, --help", "show this help and exit");
}

static int set_value(const char *prog, const cli_opt *o, const char *v) {
    char *end = NULL;
    errno = 0;
    switch (o->kind) {
    case CLI_FLAG:
        *(int *)o->dest = 1;
        return 0;
    case CLI_STRING:
        if (!v[0]) {
            fprintf(stderr, "%s: --%s: empty value\n", prog, o->name);
            return -1;
        }
        *(const char **)o->dest = v;
        return 0;
    case CLI_INT: {
        long long x = strtoll(v, &end, 10);
        if (errno || end == v || *end) {
            fprintf(stderr, "%s: --%s: \"%s\" is not an integer\n", prog, o->name, v);
            return -1;
        }
        if (o->lo <= o->hi && (x < o->lo || x > o->hi)) {
            fprintf(stderr, "%s: --%s: %lld is outside %.0f..%.0f\n", prog, o->name, x, o->lo, o->hi);
            return -1;
        }
        if (x < INT32_MIN || x > INT32_MAX) {
            fprintf(stderr, "%s: --%s: %lld does not fit\n", prog, o->name, x);
            return -1;
        }
        *(int32_t *)o->dest = (int32_t)x;
        return 0;
    }
    case CLI_FLOAT: {
        double x = strtod(v, &end);
        if (errno || end == v || *end || !isfinite(x)) {
            fprintf(stderr, "%s: --%s: \"%s\" is not a number\n", prog, o->name, v);
            return -1;
        }
        if (o->lo <= o->hi && (x < o->lo || x > o->hi)) {
            fprintf(stderr, "%s: --%s: %g is outside %g..%g\n", prog, o->name, x, o->lo, o->hi);
            return -1;
        }
        *(double *)o->dest = x;
        return 0;
    }
    case CLI_U64: {
        const char *sign = v;
        while (isspace((unsigned char)*sign)) sign++; /* strtoull skips these, then negates "-1" */
        if (sign[0] == '-') {
            fprintf(stderr, "%s: --%s: \"%s\" is negative\n", prog, o->name, v);
            return -1;
        }
        unsigned long long x = strtoull(v, &end, 10);
        if (errno || end == v || *end) {
            fprintf(stderr, "%s: --%s: \"%s\" is not an unsigned integer\n", prog, o->name, v);
            return -1;
        }
        *(uint64_t *)o->dest = (uint64_t)x;
        return 0;
    }
    }
    return -1;
}

int cli_parse(const char *prog, const char *usage, const cli_opt *opts, int n_opts, int argc,
              char **argv) {
    struct option *lo = calloc((size_t)n_opts + 2, sizeof *lo);
    char *shorts = calloc((size_t)n_opts * 2 + 4, 1);
    if (!lo || !shorts) {
        free(lo);
        free(shorts);
        fprintf(stderr, "%s: out of memory\n", prog);
        return 2;
    }
    size_t sp = 0;
    shorts[sp++] = ':'; /* report a missing value as ':' */
    shorts[sp++] = 'h';
    for (int i = 0; i < n_opts; i++) {
        lo[i].name = opts[i].name;
        lo[i].has_arg = opts[i].kind == CLI_FLAG ? no_argument : required_argument;
        lo[i].flag = NULL;
        lo[i].val = 256 + i;
        if (opts[i].short_name) {
            shorts[sp++] = opts[i].short_name;
            if (opts[i].kind != CLI_FLAG) shorts[sp++] = ':';
        }
    }
    lo[n_opts] = (struct option){"help", no_argument, NULL, 'h'};
    int rc = 0;
    optind = 0; /* glibc's full reset: with 1, a second call would resume the last one's scan */
    opterr = 0;
    for (;;) {
        int c = getopt_long(argc, argv, shorts, lo, NULL);
        if (c == -1) break;
        if (c == 'h') {
            cli_print_help(stdout, prog, usage, opts, n_opts);
            rc = 1;
            break;
        }
        if (c == '?' || c == ':') {
            /* a bad short option is named by its letter: its word may be a cluster, and inside
             * one optind still points at that word or, before its last letter, at the word
             * before it. A bad long option (optopt 0, or its val: 256 + i, or 'h' for --help=x)
             * is named by its word, which optind has passed. */
            const char short_form[3] = {'-', (char)optopt, 0};
            const int is_short = optopt != 0 && optopt < 256 && optopt != 'h';
            const char *bad = is_short ? short_form : argv[optind - 1];
            if (c == '?') fprintf(stderr, "%s: unknown option \"%s\" (see --help)\n", prog, bad);
            else fprintf(stderr, "%s: option \"%s\" needs a value\n", prog, bad);
            rc = 2;
            break;
        }
        int idx = -1;
        if (c >= 256) idx = c - 256;
        else
            for (int i = 0; i < n_opts; i++)
                if (opts[i].short_name == c) idx = i;
        if (idx < 0 || set_value(prog, &opts[idx], optarg) != 0) {
            rc = 2;
            break;
        }
    }
    if (rc == 0 && optind < argc) {
        fprintf(stderr, "%s: unexpected argument \"%s\" (see --help)\n", prog, argv[optind]);
        rc = 2;
    }
    free(lo);
    free(shorts);
    return rc;
}
