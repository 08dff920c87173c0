/* cmd_bench.c - `kdtree bench`: runs every prompt of a file with ar, chain and ddtree at each
 * budget (and auto with --auto) on one engine, and prints one comparison table: tokens/s, tau,
 * speed-up vs ar, and whether greedy output matched ar token for token. */
#include "cli.h"

#include <stdlib.h>
#include <string.h>

#ifdef KDT_WITH_TOKENIZER
#include "kdtree/tokenizer.h"
#endif

#define MAX_BUDGETS 16

typedef struct bench_plan {
    const char *mode;
    kdt_spec_mode spec;
    int32_t budget;
} bench_plan;

typedef struct bench_row {
    const char *mode;
    int32_t budget;
    cli_run_result res;
} bench_row;

/* Splits the file into prompts: one per non-empty line; "ids: 1,2,3" lines are token ids. */
static int load_prompts(const char *cmd, char *text, void *tok_v, int chat, int32_t ***prompts,
                        int32_t **n_prompt, int32_t *n) {
    (void)tok_v;
    (void)chat;
    int32_t cap = 16, cnt = 0;
    int32_t **pp = malloc(sizeof *pp * (size_t)cap), *nn = malloc(sizeof *nn * (size_t)cap);
    char *save = NULL;
    int line_no = 0;
    for (char *line = strtok_r(text, "\n", &save); line && pp && nn; line = strtok_r(NULL, "\n", &save)) {
        line_no++;
        size_t len = strlen(line);
        while (len && (line[len - 1] == '\r' || line[len - 1] == ' ')) line[--len] = 0;
        if (!len) continue;
        int32_t *ids = NULL, n_ids = 0;
        if (!strncmp(line, "ids:", 4)) {
            if (cli_parse_ids(cmd, line + 4, &ids, &n_ids) != 0) {
                fprintf(stderr, "kdtree %s: prompt file line %d\n", cmd, line_no);
                return -1;
            }
        } else {
#ifdef KDT_WITH_TOKENIZER
            kdt_tokenizer *tok = tok_v;
            if (!tok) {
                fprintf(stderr, "kdtree %s: line %d is text but there is no tokenizer (write \"ids: 1,2,3\")\n",
                        cmd, line_no);
                return -1;
            }
            kdt_tok_ids v = {0};
            kdt_status st;
            if (chat) {
                kdt_chat_message msg = {KDT_CHAT_USER, line};
                st = kdt_chat_encode(tok, KDT_CHAT_AUTO, &msg, 1, KDT_CHAT_ADD_GENERATION_PROMPT, &v);
            } else {
                st = kdt_tokenizer_encode(tok, line, len, 0, &v);
            }
            if (st != KDT_OK || v.n == 0) {
                fprintf(stderr, "kdtree %s: line %d: %s\n", cmd, line_no,
                        st != KDT_OK ? kdt_last_error() : "encodes to no tokens");
                kdt_tok_ids_free(&v);
                return -1;
            }
            ids = v.ids;
            n_ids = (int32_t)v.n;
#else
            fprintf(stderr, "kdtree %s: line %d is text but this build has no tokenizer (write \"ids: 1,2,3\")\n",
                    cmd, line_no);
            return -1;
#endif
        }
        if (cnt == cap) {
            cap *= 2;
            int32_t **p2 = realloc(pp, sizeof *pp * (size_t)cap);
            int32_t *n2 = p2 ? realloc(nn, sizeof *nn * (size_t)cap) : NULL;
            if (p2) pp = p2;
            if (n2) nn = n2;
            if (!p2 || !n2) {
                free(ids);
                break;
            }
        }
        pp[cnt] = ids;
        nn[cnt++] = n_ids;
    }
    *prompts = pp;
    *n_prompt = nn;
    *n = cnt;
    if (!pp || !nn) {
        fprintf(stderr, "kdtree %s: out of memory\n", cmd);
        return -1;
    }
    if (cnt == 0) {
        fprintf(stderr, "kdtree %s: the prompt file has no prompts\n", cmd);
        return -1;
    }
    return 0;
}

static double decode_rate(const cli_run_result *r) {
    const double t = r->wall_s - r->stats.t_prefill;
    return t > 0 ? ((double)r->stats.tokens_emitted - r->n_prompts) / t : 0.0;
}

int cli_bench(int argc, char **argv) {
    const char *cmd = "bench";
    cli_engine_args ea = {0};
    const char *prompt_file = NULL, *budgets_s = "8,16,32";
    int32_t max_tokens = 128, batch = 1, warmup = 0;
    double temperature = 0.0;
    uint64_t seed = 0;
    int with_auto = 0, ignore_eos = 0, chat = 0;
    const cli_opt opts[] = {
        {"model", 'm', CLI_STRING, "DIR", "target checkpoint directory (required)", &ea.model, 0, 0},
        {"draft", 'd', CLI_STRING, "DIR", "DFlash drafter directory (required)", &ea.draft, 0, 0},
        {"prompt-file", 'f', CLI_STRING, "FILE", "one prompt per line; \"ids: 1,2,3\" lines are token ids (required)", &prompt_file, 0, 0},
        {"budgets", 0, CLI_STRING, "LIST", "ddtree budgets to compare [8,16,32]", &budgets_s, 0, 0},
        {"auto", 0, CLI_FLAG, NULL, "also run auto (upper bound: the largest budget)", &with_auto, 0, 0},
        {"max-tokens", 'n', CLI_INT, "N", "tokens per prompt [128]", &max_tokens, 1, 1 << 24},
        {"batch", 0, CLI_INT, "S", "prompts decoded together (1..64) [1]", &batch, 1, 64},
        {"warmup", 0, CLI_INT, "N", "before each mode, decode the first N prompts untimed: graph captures and auto's first measurements out of the timing [0]", &warmup, 0, 1 << 20},
        {"temperature", 't', CLI_FLOAT, "T", "sampling temperature [0]", &temperature, 0, 100},
        {"seed", 0, CLI_U64, "S", "random seed [0]", &seed, 0, 0},
        {"chat", 0, CLI_FLAG, NULL, "wrap text prompts in the chat template", &chat, 0, 0},
        {"ignore-eos", 0, CLI_FLAG, NULL, "do not stop at end-of-sequence tokens", &ignore_eos, 0, 0},
        {"device", 0, CLI_STRING, "DEV", "cpu | cuda | auto [auto]", &ea.device, 0, 0},
        {"threads", 0, CLI_INT, "N", "CPU threads of the CPU forward, 0 = every core or OMP_NUM_THREADS [0]", &ea.threads, 0, 1024},
        {"prefill-attn", 0, CLI_STRING, "FORM", CLI_PREFILL_ATTN_HELP, &ea.prefill_attn, 0, 0},
        {"prefill-chunk", 0, CLI_INT, "N", CLI_PREFILL_CHUNK_HELP, &ea.prefill_chunk, 0, KDT_MAX_PREFILL_CHUNK},
        {"max-prefill-tokens", 0, CLI_INT, "N", CLI_MAX_PREFILL_TOKENS_HELP, &ea.max_prefill_tokens, 0, 1 << 30},
        {"max-context", 0, CLI_INT, "N", "context per stream, 0 = the model's maximum [0]", &ea.max_context, 0, 1 << 24},
        {"tokenizer", 0, CLI_STRING, "PATH", "tokenizer file or directory [the model dir]", &ea.tokenizer, 0, 0},
        {"yarn-legacy", 0, CLI_FLAG, NULL, "drafter YaRN amplitude 0.1 ln(factor) + 1", &ea.yarn_legacy, 0, 0},
    };
    const int n_opts = (int)(sizeof opts / sizeof opts[0]);
    const char *usage = "--model DIR --draft DIR --prompt-file FILE [--budgets 8,16,32] [options]";
    int prc = cli_parse("kdtree bench", usage, opts, n_opts, argc, argv);
    if (prc == 1) return 0;
    if (prc) return 2;
    if (!ea.model || !ea.draft || !prompt_file) {
        fprintf(stderr, "kdtree bench: --model, --draft and --prompt-file are required (see --help)\n");
        return 2;
    }
    int32_t budgets[MAX_BUDGETS];
    int n_budgets = cli_parse_int_list(cmd, "--budgets", budgets_s, budgets, MAX_BUDGETS, 1, 1024);
    if (n_budgets < 0) return 2;

    if (cli_check_model_dirs(cmd, ea.model, ea.draft) != 0) return 1;

    int rc = 1;
    char *text = cli_read_file(cmd, prompt_file, NULL);
    int32_t **prompts = NULL, *n_prompt = NULL, n = 0;
    bench_row rows[MAX_BUDGETS + 3];
    int n_rows = 0;
    kdt_engine *e = NULL;
    void *tok = NULL;
    if (!text) return 1;
#ifdef KDT_WITH_TOKENIZER
    {
        kdt_tokenizer *t = NULL;
        if (kdt_tokenizer_load(ea.tokenizer ? ea.tokenizer : ea.model, &t) == KDT_OK) tok = t;
        else if (ea.tokenizer) {
            fprintf(stderr, "kdtree bench: tokenizer: %s\n", kdt_last_error());
            goto out;
        }
    }
#endif
    if (load_prompts(cmd, text, tok, chat, &prompts, &n_prompt, &n) != 0) goto out;
    ea.max_streams = batch;
    ea.max_budget = 1;
    for (int i = 0; i < n_budgets; i++)
        if (budgets[i] > ea.max_budget) ea.max_budget = budgets[i];
    e = cli_engine_create(cmd, &ea);
    if (!e) goto out;

    kdt_gen_params p;
    kdt_gen_params_default(&p);
    p.temperature = (float)temperature;
    p.seed = seed;
    p.max_new_tokens = max_tokens;
    const int32_t *eos = NULL;
    int32_t n_eos = 0;
    if (!ignore_eos) kdt_engine_eos_ids(e, &eos, &n_eos);
    p.stop_ids = eos;
    p.n_stop = n_eos;

    bench_plan plan[MAX_BUDGETS + 3];
    int n_plan = 0;
    plan[n_plan++] = (bench_plan){"ar", KDT_SPEC_AR, 0};
    plan[n_plan++] = (bench_plan){"chain", KDT_SPEC_CHAIN, 0};
    for (int i = 0; i < n_budgets; i++) plan[n_plan++] = (bench_plan){"ddtree", KDT_SPEC_DDTREE, budgets[i]};
    if (with_auto) plan[n_plan++] = (bench_plan){"auto", KDT_SPEC_AUTO, ea.max_budget};
    for (int i = 0; i < n_plan; i++) {
        kdt_gen_params q = p;
        q.spec = plan[i].spec;
        q.budget = plan[i].budget > 0 ? plan[i].budget : 1;
        fprintf(stderr, "kdtree bench: %s%s%.0d ...\n", plan[i].mode, plan[i].budget ? " " : "", plan[i].budget);
        rows[n_rows].mode = plan[i].mode;
        rows[n_rows].budget = plan[i].budget;
        if (warmup > 0) { /* the same mode on the first prompts, results dropped */
            cli_run_result w = {0};
            const int32_t nw = warmup < n ? warmup : n;
            const int wrc = cli_run(cmd, e, nw, prompts, n_prompt, &q, NULL, NULL, &w);
            cli_run_result_free(&w, nw);
            if (wrc != 0) goto out;
        }
        if (cli_run(cmd, e, n, prompts, n_prompt, &q, NULL, NULL, &rows[n_rows].res) != 0) {
            n_rows++;
            goto out;
        }
        n_rows++;
    }
    const double ar_rate = decode_rate(&rows[0].res);
    printf("%d prompts, %d max tokens, batch %d, temperature %g, drafter depth %d\n", n, max_tokens, batch,
           temperature, kdt_engine_draft_depth(e));
    printf("%-8s %7s %9s %9s %10s %7s %8s %9s %6s %7s %6s %s\n", "mode", "budget", "tokens", "time_s", "tok/s",
           "tau", "speedup", "us/round", "draft", "verify", "other", temperature == 0 ? "same_as_ar" : "");
    for (int i = 0; i < n_rows; i++) {
        const cli_run_result *r = &rows[i].res;
        char b[16] = "-";
        if (rows[i].budget) snprintf(b, sizeof b, "%d", rows[i].budget);
        int same = 1;
        for (int32_t k = 0; k < n; k++)
            if (r->n_out[k] != rows[0].res.n_out[k] ||
                memcmp(r->out[k], rows[0].res.out[k], sizeof(int32_t) * (size_t)r->n_out[k]))
                same = 0;
        const double rate = decode_rate(r);
        const kdt_engine_stats *st = &r->stats;
        const double round_s = st->t_draft + st->t_build + st->t_verify + st->t_accept;
        const double pct = round_s > 0 ? 100.0 / round_s : 0.0;
        printf("%-8s %7s %9llu %9.3f %10.2f %7.3f %7.2fx %9.1f %5.1f%% %6.1f%% %5.1f%% %s\n", rows[i].mode, b,
               (unsigned long long)st->tokens_emitted, r->wall_s, rate, cli_tau_mean(st),
               ar_rate > 0 ? rate / ar_rate : 0.0, st->rounds ? 1e6 * round_s / (double)st->rounds : 0.0,
               st->t_draft * pct, st->t_verify * pct, (st->t_build + st->t_accept) * pct,
               temperature == 0 ? (same ? "yes" : "NO") : "");
    }
    for (int i = 0; i < n_rows; i++)
        if (rows[i].res.stats.plain_rounds > 0)
            printf("%s: %llu of %llu rounds plain (the drafter skipped: plain decoding measured faster)\n",
                   rows[i].mode, (unsigned long long)rows[i].res.stats.plain_rounds,
                   (unsigned long long)rows[i].res.stats.rounds);
    printf("tok/s and speedup count decode tokens (after each prompt's first token) over decode time.\n"
           "us/round: mean round time; draft / verify: the drafter and target-verify passes; other: top-K,\n"
           "tree build, accept, KV commit, host bookkeeping and syncs (the per-round overhead).\n");
    rc = 0;
out:
    for (int i = 0; i < n_rows; i++) cli_run_result_free(&rows[i].res, n);
    for (int32_t i = 0; i < n && prompts; i++) free(prompts[i]);
    free(prompts);
    free(n_prompt);
    kdt_engine_free(e);
#ifdef KDT_WITH_TOKENIZER
    kdt_tokenizer_free(tok);
#endif
    free(text);
    return rc;
}
