/* cli.h - what the `kdtree` command's files share: the option-table parser (one table drives
 * getopt_long and the --help text), prompt loading, running prompts through an engine, and the
 * stats tables. Commands: generate (cmd_generate.c), bench (cmd_bench.c); serve lives in
 * src/server/ and is linked in when built (KDT_WITH_SERVER).
 */
#ifndef KDT_CLI_H
#define KDT_CLI_H

#include "kdtree/engine.h"
#include "kdtree/model.h" /* kdt_prefill_attention, KDT_MAX_PREFILL_CHUNK */

#include <stdint.h>
#include <stdio.h>

/* ---- options --------------------------------------------------------------------------------- */
typedef enum cli_opt_kind {
    CLI_FLAG = 0,   /* no value: *(int *)dest = 1 */
    CLI_STRING,     /* *(const char **)dest */
    CLI_INT,        /* *(int32_t *)dest, within [lo, hi] */
    CLI_FLOAT,      /* *(double *)dest, within [lo, hi] */
    CLI_U64,        /* *(uint64_t *)dest */
} cli_opt_kind;

typedef struct cli_opt {
    const char *name;       /* long name without "--" */
    char short_name;        /* 0 = none */
    cli_opt_kind kind;
    const char *metavar;    /* value placeholder in --help, NULL for flags */
    const char *help;       /* one line */
    void *dest;
    double lo, hi;          /* CLI_INT / CLI_FLOAT range (lo > hi: unchecked) */
} cli_opt;

/* Parses argv[1..) (argv[0] is the command name). Returns 0 on success, 1 if --help was asked
 * (help printed), 2 on a bad option (message on stderr). Positional arguments are refused. */
int cli_parse(const char *prog, const char *usage, const cli_opt *opts, int n_opts, int argc,
              char **argv);
void cli_print_help(FILE *f, const char *prog, const char *usage, const cli_opt *opts, int n_opts);

/* ---- engine + prompts ------------------------------------------------------------------------ */
typedef struct cli_engine_args {
    const char *model, *draft, *device, *tokenizer;
    int32_t max_streams, max_context, max_budget, kv_pages, yarn_legacy, verbose;
    int32_t threads; /* CPU threads for the CPU forward, 0 = every core (or OMP_NUM_THREADS) */
    const char *prefill_attn; /* --prefill-attn: absorbed | plain | auto; NULL = auto */
    int32_t prefill_chunk;    /* --prefill-chunk: rows per prefill pass, 0 = the device's default */
    int32_t max_prefill_tokens; /* --max-prefill-tokens: prompt tokens per engine step, 0 = no limit */
} cli_engine_args;

#define CLI_MAX_PREFILL_TOKENS_HELP \
    "prompt tokens prefilled per engine step, 0 = no limit; a long prompt then takes several steps while " \
    "running streams keep decoding [0]"
#define CLI_PREFILL_CHUNK_HELP \
    "prompt rows per prefill pass, 1..4096, 0 = the device's default (CPU 64 absorbed, 256 plain / auto; GPU " \
    "256..2048 by the model's experts and the device) [0]"

/* The --prefill-attn help line, and its parser: "absorbed", "plain" or "auto" into *form (a
 * kdt_prefill_attention); -1 with "kdtree <cmd>: --prefill-attn ..." on stderr otherwise. */
#define CLI_PREFILL_ATTN_HELP \
    "attention form of a prefill chunk: absorbed (decode's bits) | plain | auto (per chunk, the one with fewer " \
    "FLOPs) [auto]"
int cli_parse_prefill_attn(const char *cmd, const char *text, int32_t *form);

/* 0 if model and draft (NULL: nothing to check) name existing directories; else prints
 * "kdtree <cmd>: --model|--draft <path>: <why>" and returns -1. generate, bench and serve run it
 * before the tokenizer, which defaults to the model directory and would otherwise report a
 * mistyped --model as a tokenizer error. */
int cli_check_model_dirs(const char *cmd, const char *model, const char *draft);
/* Creates the engine; on failure prints "kdtree <cmd>: <message>" and returns NULL. */
kdt_engine *cli_engine_create(const char *cmd, const cli_engine_args *a);

/* Parses "1,2,3" (spaces allowed) into a malloc'ed array; -1 with a message on error. */
int cli_parse_ids(const char *cmd, const char *text, int32_t **ids, int32_t *n);
/* Parses "8,16,32" into up to max ints in [lo, hi]; returns the count or -1. */
int cli_parse_int_list(const char *cmd, const char *what, const char *text, int32_t *out, int max,
                       int32_t lo, int32_t hi);
/* Reads a whole file (NUL-terminated, malloc'ed); NULL with a message on error. */
char *cli_read_file(const char *cmd, const char *path, size_t *len);

/* ---- running ----------------------------------------------------------------------------------- */
typedef void (*cli_token_fn)(void *user, int32_t prompt_index, const int32_t *tokens, int32_t n);

typedef struct cli_run_result {
    int32_t **out;          /* [n_prompts][max_new] emitted tokens */
    int32_t *n_out;         /* [n_prompts] */
    int32_t n_prompts;
    double wall_s;          /* first add to last event */
    kdt_engine_stats stats; /* the engine's counters accumulated over this run only */
} cli_run_result;

/* Runs every prompt with `params` (all in flight together up to the engine's stream limit;
 * waiting ones join as others finish). on_token may be NULL. Returns 0 or -1 (message printed). */
int cli_run(const char *cmd, kdt_engine *e, int32_t n_prompts, int32_t *const *prompts,
            const int32_t *n_prompt, const kdt_gen_params *params, cli_token_fn on_token, void *user,
            cli_run_result *res);
void cli_run_result_free(cli_run_result *r, int32_t n_prompts);

/* Stats helpers */
double cli_tau_mean(const kdt_engine_stats *s);
void cli_print_stats(FILE *f, const char *title, const cli_run_result *r);

int cli_generate(int argc, char **argv);
int cli_bench(int argc, char **argv);

#endif
