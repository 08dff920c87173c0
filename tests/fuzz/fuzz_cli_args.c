/* fuzz_cli_args.c - the command line's option parser (cli_parse, src/cli/options.c) and its list
 * parsers (cli_parse_ids, cli_parse_int_list, src/cli/cli_common.c) on any argv. Input byte 0
 * picks cli_parse_int_list's limits (bits 0-2: at most 1..8 values, bits 3-4: the range); the
 * rest, split at NUL bytes, is argv[1..] (at most MAX_ARGS words) for cli_parse on a table with
 * every option kind (flags, strings, ints and floats with ranges of either sign and unchecked,
 * u64; long and short names, names that are prefixes of others), and each word is also a list
 * for the two list parsers. The promises checked, from cli.h:
 *   - cli_parse returns 0, 1 or 2, and the same for the same argv parsed again (getopt's state
 *     must not leak from one call into the next);
 *   - 0: every value set is its kind's: a flag is 1, a string a non-empty tail of one of the
 *     words, an int within its range (and int32), a float finite and within its range, a u64 the
 *     value of a digit string in the words (a negative number is refused); nothing is printed;
 *   - 1: the help went to stdout (the usage line and every option);
 *   - 2: a line on stderr, "prog: ..." naming the problem: an option of the table, or a word
 *     (or the short option "-c") of the input, quoted;
 *   - cli_parse_ids: 0 with n >= 1 ids in 0..INT32_MAX, one per comma-separated item (a trailing
 *     comma allowed), each the item's number; else -1, a "kdtree <cmd>: " message and the outputs
 *     untouched;
 *   - cli_parse_int_list: the count (1..max, every value in [lo, hi], the values cli_parse_ids
 *     gives, nothing written past the count) exactly when cli_parse_ids accepts the text and its
 *     values fit; else -1 with a message, naming the list when the ids themselves were fine.
 * stdout and stderr are swapped for memory streams around each call, so the messages can be
 * checked and the fuzzer's output stays readable. */
#include <ctype.h>
#include <math.h>
#include <string.h>

#include "fuzz.h"

#include "../../src/cli/options.c"
#include "../../src/cli/cli_common.c"

enum { MAX_ARGS = 24, LIST_MAX = 8 };
#define PROG "prog"
#define CMD "fz"
#define UNSET_INT ((int32_t)0x7eadbeef) /* outside every checked range of the table */
#define UNSET_U64 0xfeedfacecafef00dull

/* The destinations of the table's options. */
typedef struct values {
    int verbose, chat;
    const char *model, *model_file;
    int32_t budget, max_tokens, offset, any_int;
    double temperature, top_p, scale;
    uint64_t seed;
} values;

static values v;

/* Every kind options.c supports, with the ranges `kdtree generate` uses and a few more shapes. */
static const cli_opt opts[] = {
    {"verbose", 'v', CLI_FLAG, NULL, "a flag with a short name", &v.verbose, 0, 0},
    {"chat", 0, CLI_FLAG, NULL, "a flag without one", &v.chat, 0, 0},
    {"model", 'm', CLI_STRING, "DIR", "a string", &v.model, 0, 0},
    {"model-file", 0, CLI_STRING, "FILE", "a string whose name extends another's", &v.model_file, 0, 0},
    {"budget", 'b', CLI_INT, "B", "an int in 1..1024", &v.budget, 1, 1024},
    {"max-tokens", 'n', CLI_INT, "N", "an int in 1..2^24", &v.max_tokens, 1, 1 << 24},
    {"offset", 0, CLI_INT, "K", "an int in -100..100", &v.offset, -100, 100},
    {"any-int", 0, CLI_INT, "K", "an unchecked int", &v.any_int, 1, 0},
    {"temperature", 't', CLI_FLOAT, "T", "a float in 0..100", &v.temperature, 0, 100},
    {"top-p", 0, CLI_FLOAT, "P", "a float in 1e-9..1", &v.top_p, 1e-9, 1},
    {"scale", 0, CLI_FLOAT, "S", "an unchecked float", &v.scale, 1, 0},
    {"seed", 's', CLI_U64, "S", "a u64", &v.seed, 0, 0},
};
enum { N_OPTS = (int)(sizeof opts / sizeof opts[0]) };

/* ---- stdout / stderr into memory ---------------------------------------------------------- */

typedef struct capture {
    FILE *saved_out, *saved_err, *out_f, *err_f;
    char *out, *err;
    size_t out_len, err_len;
} capture;

static void capture_begin(capture *c) {
    memset(c, 0, sizeof *c);
    c->out_f = open_memstream(&c->out, &c->out_len);
    c->err_f = open_memstream(&c->err, &c->err_len);
    if (!c->out_f || !c->err_f) FUZZ_FAIL("open_memstream failed");
    c->saved_out = stdout;
    c->saved_err = stderr;
    stdout = c->out_f;
    stderr = c->err_f;
}

/* After this, out and err are NUL-terminated strings. */
static void capture_end(capture *c) {
    stdout = c->saved_out;
    stderr = c->saved_err;
    fclose(c->out_f);
    fclose(c->err_f);
}

static void capture_free(capture *c) {
    free(c->out);
    free(c->err);
}

/* ---- cli_parse ------------------------------------------------------------------------------ */

typedef struct parse_run {
    int rc;
    values v;
    capture cap;
} parse_run;

/* Parses fresh copies of the words (exact-size allocations, so ASan sees any read past one), with
 * every destination at an "unset" value first. copies[] receives the words' copies; the caller
 * frees them once the values (which may point into them) are checked. */
static void run_parse(int argc, char *const *words, char **copies, parse_run *r) {
    char *argv[MAX_ARGS + 2];
    for (int i = 0; i < argc; i++) {
        const size_t n = strlen(words[i]) + 1;
        if (!(copies[i] = malloc(n))) FUZZ_FAIL("out of memory");
        memcpy(copies[i], words[i], n);
        argv[i] = copies[i]; /* getopt_long may permute argv: copies[] keeps the originals */
    }
    argv[argc] = NULL;
    v = (values){.verbose = -1, .chat = -1, .budget = UNSET_INT, .max_tokens = UNSET_INT, .offset = UNSET_INT,
                 .any_int = UNSET_INT, .temperature = NAN, .top_p = NAN, .scale = NAN, .seed = UNSET_U64};
    capture_begin(&r->cap);
    r->rc = cli_parse(PROG, "[options]", opts, N_OPTS, argc, argv);
    capture_end(&r->cap);
    r->v = v;
}

static int in_words(const char *s, int argc, char *const *words) {
    for (int i = 1; i < argc; i++)
        if (s >= words[i] && s < words[i] + strlen(words[i])) return 1;
    return 0;
}

/* The value of a digit string somewhere in the words ([spaces][+]digits, as strtoull reads one)? */
static int u64_in_words(uint64_t x, int argc, char *const *words) {
    for (int i = 1; i < argc; i++)
        for (const char *p = words[i]; *p; p++) {
            const char *q = p;
            while (isspace((unsigned char)*q)) q++;
            if (*q == '+') q++;
            if (!isdigit((unsigned char)*q)) continue;
            errno = 0;
            const unsigned long long y = strtoull(q, NULL, 10);
            if (!errno && y == x) return 1;
        }
    return 0;
}

static void check_int(const char *name, int32_t x, double lo, double hi) {
    FUZZ_CHECK(x == UNSET_INT || lo > hi || (x >= lo && x <= hi), "--%s = %d, outside %g..%g", name, (int)x, lo, hi);
}

static void check_float(const char *name, double x, double lo, double hi) {
    FUZZ_CHECK(isnan(x) || (isfinite(x) && (lo > hi || (x >= lo && x <= hi))), "--%s = %g, outside %g..%g", name, x,
               lo, hi);
}

static void check_accepted(const parse_run *r, int argc, char *const *words) {
    const values *x = &r->v;
    FUZZ_CHECK(r->cap.out_len == 0 && r->cap.err_len == 0, "accepted, but printed '%s%s'", r->cap.out, r->cap.err);
    FUZZ_CHECK(x->verbose == -1 || x->verbose == 1, "--verbose = %d", x->verbose);
    FUZZ_CHECK(x->chat == -1 || x->chat == 1, "--chat = %d", x->chat);
    FUZZ_CHECK(!x->model || (x->model[0] && in_words(x->model, argc, words)), "--model is not a non-empty word tail");
    FUZZ_CHECK(!x->model_file || (x->model_file[0] && in_words(x->model_file, argc, words)),
               "--model-file is not a non-empty word tail");
    check_int("budget", x->budget, 1, 1024);
    check_int("max-tokens", x->max_tokens, 1, 1 << 24);
    check_int("offset", x->offset, -100, 100);
    check_float("temperature", x->temperature, 0, 100);
    check_float("top-p", x->top_p, 1e-9, 1);
    check_float("scale", x->scale, 1, 0);
    FUZZ_CHECK(x->seed == UNSET_U64 || u64_in_words(x->seed, argc, words),
               "--seed = %llu, which no digit string of the input reads as (a negative number wrapped?)",
               (unsigned long long)x->seed);
}

static void check_help(const parse_run *r) {
    FUZZ_CHECK(r->cap.err_len == 0, "help, but stderr has '%s'", r->cap.err);
    FUZZ_CHECK(strstr(r->cap.out, "usage: " PROG " [options]\n") == r->cap.out, "help starts '%.40s'", r->cap.out);
    for (int i = 0; i < N_OPTS; i++) {
        char name[64];
        snprintf(name, sizeof name, "--%s", opts[i].name);
        FUZZ_CHECK(strstr(r->cap.out, name), "the help lacks %s", name);
    }
}

/* The word quoted in m = head + word + tail (the word may hold quotes itself), or NULL. */
static const char *quoted_word(const char *m, const char *head, const char *tail, size_t *len) {
    const size_t n = strlen(m), nh = strlen(head), nt = strlen(tail);
    if (n < nh + nt || strncmp(m, head, nh) != 0 || strcmp(m + n - nt, tail) != 0) return NULL;
    *len = n - nh - nt;
    return m + nh;
}

/* "prog: <why>\n" (a quoted word may hold newlines of its own), naming a table option, a quoted
 * word of the input, or a quoted "-c" whose letter one of the words holds. */
static void check_refused(const parse_run *r, int argc, char *const *words) {
    const char *m = r->cap.err;
    FUZZ_CHECK(r->cap.out_len == 0, "refused, but stdout has '%s'", r->cap.out);
    FUZZ_CHECK(strncmp(m, PROG ": ", strlen(PROG ": ")) == 0, "the message '%s' does not start with '" PROG ": '", m);
    FUZZ_CHECK(r->cap.err_len > 0 && m[r->cap.err_len - 1] == '\n', "the message '%s' does not end its line", m);
    int named = 0;
    for (int i = 0; i < N_OPTS && !named; i++) {
        char name[64];
        snprintf(name, sizeof name, "--%s:", opts[i].name);
        named = strstr(m, name) != NULL;
    }
    for (int i = 1; i < argc && !named; i++) {
        const size_t n = strlen(words[i]);
        for (const char *q = strchr(m, '"'); q && !named; q = strchr(q + 1, '"'))
            named = strncmp(q + 1, words[i], n) == 0 && q[1 + n] == '"';
        for (size_t k = 1; k < n && !named && words[i][0] == '-'; k++) {
            const char short_form[5] = {'"', '-', words[i][k], '"', 0};
            named = strstr(m, short_form) != NULL;
        }
    }
    FUZZ_CHECK(named, "the message '%.*s' names no option and no word of the input", (int)r->cap.err_len - 1, m);
    /* the word a getopt error quotes is the culprit: not a valid option, or one that takes a value */
    size_t len;
    const char *unknown = quoted_word(m, PROG ": unknown option \"", "\" (see --help)\n", &len);
    const char *no_value = unknown ? NULL : quoted_word(m, PROG ": option \"", "\" needs a value\n", &len);
    const char *q = unknown ? unknown : no_value;
    for (int i = -1; q && i < N_OPTS; i++) {
        const char *name = i < 0 ? "help" : opts[i].name;
        const char short_name = i < 0 ? 'h' : opts[i].short_name;
        const int is_long = len == strlen(name) + 2 && strncmp(q, "--", 2) == 0 && strncmp(q + 2, name, len - 2) == 0;
        const int is_short = len == 2 && q[0] == '-' && short_name && q[1] == short_name;
        FUZZ_CHECK(!unknown || !(is_long || is_short), "'%s' calls a valid option unknown", m);
        FUZZ_CHECK(!no_value || !(is_long || is_short) || (i >= 0 && opts[i].kind != CLI_FLAG),
                   "'%s': that option takes no value", m);
    }
}

static void fuzz_cli_parse(int argc, char *const *words) {
    char *copies_a[MAX_ARGS + 1], *copies_b[MAX_ARGS + 1];
    parse_run a, b;
    run_parse(argc, words, copies_a, &a);
    run_parse(argc, words, copies_b, &b);
    FUZZ_CHECK(a.rc == 0 || a.rc == 1 || a.rc == 2, "cli_parse returned %d", a.rc);
    FUZZ_CHECK(a.rc == b.rc && strcmp(a.cap.err, b.cap.err) == 0 && strcmp(a.cap.out, b.cap.out) == 0,
               "the same argv parsed twice: %d '%s', then %d '%s'", a.rc, a.cap.err, b.rc, b.cap.err);
    if (a.rc == 0) {
        check_accepted(&a, argc, copies_a);
        check_accepted(&b, argc, copies_b);
    } else if (a.rc == 1) {
        check_help(&a);
    } else {
        check_refused(&a, argc, copies_a);
    }
    fuzz_note("cli_parse: %d %s", a.rc, a.cap.err);
    capture_free(&a.cap);
    capture_free(&b.cap);
    for (int i = 0; i < argc; i++) free(copies_a[i]), free(copies_b[i]);
}

/* ---- the list parsers ------------------------------------------------------------------------- */

static int starts_with_cmd(const char *m) { return strncmp(m, "kdtree " CMD ": ", strlen("kdtree " CMD ": ")) == 0; }

static void fuzz_lists(const char *text, int max, int32_t lo, int32_t hi) {
    int32_t untouched = 0, *ids = &untouched, n = -7;
    capture cap;
    capture_begin(&cap);
    const int rc = cli_parse_ids(CMD, text, &ids, &n);
    capture_end(&cap);
    if (rc == 0) {
        int commas = 0;
        for (const char *p = text; *p; p++) commas += *p == ',';
        FUZZ_CHECK(ids != &untouched && n >= 1 && (n == commas || n == commas + 1),
                   "'%s': %d ids from %d commas", text, (int)n, commas);
        FUZZ_CHECK(cap.err_len == 0, "accepted, but printed '%s'", cap.err);
        const char *item = text;
        for (int32_t i = 0; i < n; i++) {
            FUZZ_CHECK(ids[i] >= 0, "'%s': id %d is negative", text, (int)ids[i]);
            const long long want = strtoll(item, NULL, 10);
            FUZZ_CHECK(ids[i] == want, "'%s': id %d is %d, its item reads %lld", text, (int)i, (int)ids[i], want);
            const char *comma = strchr(item, ',');
            item = comma ? comma + 1 : item + strlen(item);
        }
    } else {
        FUZZ_CHECK(rc == -1 && ids == &untouched && n == -7, "'%s' refused with %d, outputs changed", text, rc);
        FUZZ_CHECK(starts_with_cmd(cap.err) && strchr(cap.err, '\n'), "'%s' refused with the message '%s'", text,
                   cap.err);
    }
    capture_free(&cap);

    int32_t out[LIST_MAX + 1];
    for (int i = 0; i <= LIST_MAX; i++) out[i] = UNSET_INT;
    capture_begin(&cap);
    const int count = cli_parse_int_list(CMD, "--list", text, out, max, lo, hi);
    capture_end(&cap);
    int fits = rc == 0 && n <= max;
    for (int32_t i = 0; fits && i < n; i++) fits = ids[i] >= lo && ids[i] <= hi;
    FUZZ_CHECK((count >= 0) == fits, "'%s' (at most %d in %d..%d): cli_parse_int_list returned %d", text, max,
               (int)lo, (int)hi, count);
    if (fits) {
        FUZZ_CHECK(count == n && cap.err_len == 0, "'%s': %d values, %d ids", text, count, (int)n);
        for (int i = 0; i < count; i++) FUZZ_CHECK(out[i] == ids[i], "'%s': value %d is %d", text, i, (int)out[i]);
        for (int i = count; i <= LIST_MAX; i++) FUZZ_CHECK(out[i] == UNSET_INT, "'%s': out[%d] written", text, i);
    } else {
        FUZZ_CHECK(count == -1 && starts_with_cmd(cap.err), "'%s': %d with the message '%s'", text, count, cap.err);
        FUZZ_CHECK(rc != 0 || strstr(cap.err, "--list"), "'%s': the message '%s' does not name the list", text,
                   cap.err);
    }
    capture_free(&cap);
    if (rc == 0) free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    static const int32_t ranges[4][2] = {{1, 1024}, {0, INT32_MAX}, {8, 8}, {100, 50} /* empty: refuses all */};
    const int max = 1 + (data[0] & 7);
    const int32_t lo = ranges[(data[0] >> 3) & 3][0], hi = ranges[(data[0] >> 3) & 3][1];
    /* the words: argv[0] is the program, then the input's NUL-separated pieces */
    char *text = malloc(size); /* data[1..) NUL-terminated */
    if (!text) return 0;
    memcpy(text, data + 1, size - 1);
    text[size - 1] = 0;
    char *words[MAX_ARGS + 2] = {PROG};
    int argc = 1;
    for (char *p = text; p < text + size && argc <= MAX_ARGS; p += strlen(p) + 1) words[argc++] = p;
    words[argc] = NULL;
    fuzz_cli_parse(argc, words);
    for (int i = 1; i < argc; i++) fuzz_lists(words[i], max, lo, hi);
    free(text);
    return 0;
}
