/* cmd_generate.c - `kdtree generate`: one prompt through the engine, printing the output as it
 * is produced (text when a tokenizer is available, else token ids), then a stats table on
 * stderr; with --compare-ar the same prompt runs again with plain decoding for the speed-up. */
#include "cli.h"

#include <stdlib.h>
#include <string.h>

#ifdef KDT_WITH_TOKENIZER
#include "kdtree/tokenizer.h"
#endif

#define KDT_MODEL_MAX_EOS_CLI 16 /* stop ids: the model's eos ids plus the tokenizer's */

typedef struct gen_printer {
    int print_ids;
    int first;
#ifdef KDT_WITH_TOKENIZER
    kdt_detok_stream *detok;
#endif
} gen_printer;

static void print_tokens(void *user, int32_t prompt_index, const int32_t *tokens, int32_t n) {
    (void)prompt_index;
    gen_printer *p = user;
    for (int32_t i = 0; i < n; i++) {
#ifdef KDT_WITH_TOKENIZER
        if (p->detok && !p->print_ids) {
            kdt_tok_text t = {0};
            if (kdt_detok_stream_feed(p->detok, tokens[i], &t) == KDT_OK && t.len)
                fwrite(t.data, 1, t.len, stdout);
            kdt_tok_text_free(&t);
            continue;
        }
#endif
        printf(p->first ? "%d" : " %d", tokens[i]);
        p->first = 0;
    }
    fflush(stdout);
}

int cli_generate(int argc, char **argv) {
    const char *cmd = "generate";
    cli_engine_args ea = {0};
    const char *prompt = NULL, *prompt_file = NULL, *prompt_ids = NULL, *spec_s = NULL;
    int32_t budget = 32, top_k = 0, max_tokens = 256;
    double temperature = 0.0, top_p = 1.0;
    uint64_t seed = 0;
    int compare_ar = 0, ignore_eos = 0, print_ids = 0, chat = 0, quiet = 0;
    const cli_opt opts[] = {
        {"model", 'm', CLI_STRING, "DIR", "target checkpoint directory (required)", &ea.model, 0, 0},
        {"draft", 'd', CLI_STRING, "DIR", "DFlash drafter directory (needed by chain/ddtree/auto)", &ea.draft, 0, 0},
        {"prompt", 'p', CLI_STRING, "TEXT", "prompt text (needs a tokenizer in the model dir)", &prompt, 0, 0},
        {"prompt-file", 'f', CLI_STRING, "FILE", "read the prompt text from FILE", &prompt_file, 0, 0},
        {"prompt-ids", 0, CLI_STRING, "IDS", "prompt as token ids, e.g. \"1,2,3\"", &prompt_ids, 0, 0},
        {"chat", 0, CLI_FLAG, NULL, "wrap the prompt text in the model's chat template (user turn)", &chat, 0, 0},
        {"spec", 's', CLI_STRING, "MODE", "ar | chain | ddtree | auto (default ddtree with --draft, else ar)", &spec_s, 0, 0},
        {"budget", 'b', CLI_INT, "B", "tree budget (ddtree; auto: upper bound) [32]", &budget, 1, 1024},
        {"temperature", 't', CLI_FLOAT, "T", "sampling temperature, 0 = greedy [0]", &temperature, 0, 100},
        {"top-p", 0, CLI_FLOAT, "P", "nucleus sampling mass, 1 = off [1]", &top_p, 1e-9, 1},
        {"top-k", 0, CLI_INT, "K", "sample among the K best tokens, 0 = off [0]", &top_k, 0, 1 << 20},
        {"seed", 0, CLI_U64, "S", "random seed [0]", &seed, 0, 0},
        {"max-tokens", 'n', CLI_INT, "N", "tokens to generate (exact cap) [256]", &max_tokens, 1, 1 << 24},
        {"ignore-eos", 0, CLI_FLAG, NULL, "do not stop at the model's end-of-sequence tokens", &ignore_eos, 0, 0},
        {"device", 0, CLI_STRING, "DEV", "cpu | cuda | auto [auto]", &ea.device, 0, 0},
        {"threads", 0, CLI_INT, "N", "CPU threads of the CPU forward, 0 = every core or OMP_NUM_THREADS [0]", &ea.threads, 0, 1024},
        {"prefill-attn", 0, CLI_STRING, "FORM", CLI_PREFILL_ATTN_HELP, &ea.prefill_attn, 0, 0},
        {"prefill-chunk", 0, CLI_INT, "N", CLI_PREFILL_CHUNK_HELP, &ea.prefill_chunk, 0, KDT_MAX_PREFILL_CHUNK},
        {"max-prefill-tokens", 0, CLI_INT, "N", CLI_MAX_PREFILL_TOKENS_HELP, &ea.max_prefill_tokens, 0, 1 << 30},
        {"max-context", 0, CLI_INT, "N", "context per stream, 0 = the model's maximum [0]", &ea.max_context, 0, 1 << 24},
        {"tokenizer", 0, CLI_STRING, "PATH", "tokenizer file or directory [the model dir]", &ea.tokenizer, 0, 0},
        {"print-ids", 0, CLI_FLAG, NULL, "print token ids even when a tokenizer is available", &print_ids, 0, 0},
        {"compare-ar", 0, CLI_FLAG, NULL, "run the prompt again with ar and report the speed-up", &compare_ar, 0, 0},
        {"yarn-legacy", 0, CLI_FLAG, NULL, "drafter YaRN amplitude 0.1 ln(factor) + 1 (research notes §3.6)", &ea.yarn_legacy, 0, 0},
        {"quiet", 'q', CLI_FLAG, NULL, "do not print the generated tokens", &quiet, 0, 0},
    };
    const int n_opts = (int)(sizeof opts / sizeof opts[0]);
    const char *usage = "--model DIR [--draft DIR] (--prompt TEXT | --prompt-file F | --prompt-ids IDS) [options]";
    int prc = cli_parse("kdtree generate", usage, opts, n_opts, argc, argv);
    if (prc == 1) return 0;
    if (prc) return 2;
    if (!ea.model) {
        fprintf(stderr, "kdtree generate: --model DIR is required (see --help)\n");
        return 2;
    }
    if (!!prompt + !!prompt_file + !!prompt_ids != 1) {
        fprintf(stderr, "kdtree generate: give exactly one of --prompt, --prompt-file, --prompt-ids\n");
        return 2;
    }
    kdt_spec_mode spec = ea.draft ? KDT_SPEC_DDTREE : KDT_SPEC_AR;
    if (spec_s && kdt_spec_mode_parse(spec_s, &spec) != KDT_OK) {
        fprintf(stderr, "kdtree generate: --spec: %s\n", kdt_last_error());
        return 2;
    }
    if (spec != KDT_SPEC_AR && !ea.draft) {
        fprintf(stderr, "kdtree generate: --spec %s needs --draft DIR\n", kdt_spec_mode_name(spec));
        return 2;
    }

    if (cli_check_model_dirs(cmd, ea.model, ea.draft) != 0) return 1;

    int rc = 1;
    int32_t *ids = NULL, n_ids = 0;
    char *file_text = NULL;
    gen_printer pr = {print_ids, 1
#ifdef KDT_WITH_TOKENIZER
                      , NULL
#endif
    };
#ifdef KDT_WITH_TOKENIZER
    kdt_tokenizer *tok = NULL;
    {
        const char *tpath = ea.tokenizer ? ea.tokenizer : ea.model;
        kdt_status ts = kdt_tokenizer_load(tpath, &tok);
        if (ts != KDT_OK && (ea.tokenizer || !prompt_ids)) {
            fprintf(stderr, "kdtree generate: tokenizer: %s (use --prompt-ids for a model without one)\n",
                    kdt_last_error());
            return 1;
        }
    }
#else
    if (!prompt_ids || chat) {
        fprintf(stderr, "kdtree generate: this build has no tokenizer (PCRE2 missing): use --prompt-ids\n");
        return 1;
    }
#endif
    kdt_engine *e = NULL;
    cli_run_result res = {0}, ar = {0};
    if (prompt_ids) {
        if (cli_parse_ids(cmd, prompt_ids, &ids, &n_ids) != 0) goto out;
    } else {
        const char *text = prompt;
        if (prompt_file) {
            file_text = cli_read_file(cmd, prompt_file, NULL);
            if (!file_text) goto out;
            text = file_text;
        }
#ifdef KDT_WITH_TOKENIZER
        kdt_tok_ids v = {0};
        kdt_status ts;
        if (chat) {
            kdt_chat_message msg = {KDT_CHAT_USER, text};
            ts = kdt_chat_encode(tok, KDT_CHAT_AUTO, &msg, 1, KDT_CHAT_ADD_GENERATION_PROMPT, &v);
        } else {
            ts = kdt_tokenizer_encode(tok, text, strlen(text), 0, &v);
        }
        if (ts != KDT_OK || v.n == 0) {
            fprintf(stderr, "kdtree generate: encoding the prompt: %s\n",
                    ts != KDT_OK ? kdt_last_error() : "it encodes to no tokens");
            kdt_tok_ids_free(&v);
            goto out;
        }
        ids = v.ids;
        n_ids = (int32_t)v.n;
#endif
    }
    ea.max_streams = 1;
    ea.max_budget = budget;
    e = cli_engine_create(cmd, &ea);
    if (!e) goto out;

    kdt_gen_params p;
    kdt_gen_params_default(&p);
    p.spec = spec;
    p.budget = budget;
    p.temperature = (float)temperature;
    p.top_k = top_k;
    p.top_p = (float)top_p;
    p.seed = seed;
    p.max_new_tokens = max_tokens;
    int32_t stops[KDT_MODEL_MAX_EOS_CLI];
    int32_t n_stop = 0;
    if (!ignore_eos) {
        const int32_t *eos = NULL;
        int32_t n_eos = 0;
        kdt_engine_eos_ids(e, &eos, &n_eos);
        for (int32_t i = 0; i < n_eos && n_stop < KDT_MODEL_MAX_EOS_CLI; i++)
            if (eos[i] >= 0 && eos[i] < kdt_engine_vocab_size(e)) stops[n_stop++] = eos[i];
#ifdef KDT_WITH_TOKENIZER
        if (tok) {
            int32_t te = kdt_tokenizer_eos(tok);
            int dup = 0;
            for (int32_t i = 0; i < n_stop; i++) dup |= stops[i] == te;
            if (te >= 0 && te < kdt_engine_vocab_size(e) && !dup && n_stop < KDT_MODEL_MAX_EOS_CLI)
                stops[n_stop++] = te;
        }
#endif
    }
    p.stop_ids = stops;
    p.n_stop = n_stop;
#ifdef KDT_WITH_TOKENIZER
    if (tok && !print_ids && kdt_detok_stream_new(tok, 0, &pr.detok) != KDT_OK) pr.detok = NULL;
#endif
    if (cli_run(cmd, e, 1, &ids, &n_ids, &p, quiet ? NULL : print_tokens, &pr, &res) != 0) goto out;
#ifdef KDT_WITH_TOKENIZER
    if (pr.detok && !quiet) {
        kdt_tok_text t = {0};
        if (kdt_detok_stream_finish(pr.detok, &t) == KDT_OK && t.len) fwrite(t.data, 1, t.len, stdout);
        kdt_tok_text_free(&t);
    }
#endif
    if (!quiet) {
        printf("\n");
        fflush(stdout);
    }
    char title[96];
    snprintf(title, sizeof title, "%s%s", kdt_spec_mode_name(spec),
             spec == KDT_SPEC_DDTREE ? " (fixed budget)" : spec == KDT_SPEC_AUTO ? " (auto budget)" : "");
    cli_print_stats(stderr, title, &res);
    if (compare_ar) {
        kdt_gen_params q = p;
        q.spec = KDT_SPEC_AR;
        if (cli_run(cmd, e, 1, &ids, &n_ids, &q, NULL, NULL, &ar) != 0) goto out;
        cli_print_stats(stderr, "ar (reference)", &ar);
        const double a = ar.wall_s - ar.stats.t_prefill, b = res.wall_s - res.stats.t_prefill;
        const double rate_ar = a > 0 ? (ar.stats.tokens_emitted - 1) / a : 0;
        const double rate = b > 0 ? (res.stats.tokens_emitted - 1) / b : 0;
        fprintf(stderr, "\n  speed-up vs ar  %.2fx decode tokens/s (%.2f vs %.2f)\n",
                rate_ar > 0 ? rate / rate_ar : 0.0, rate, rate_ar);
        if (temperature == 0.0) {
            int same = res.n_out[0] == ar.n_out[0] &&
                       !memcmp(res.out[0], ar.out[0], sizeof(int32_t) * (size_t)res.n_out[0]);
            fprintf(stderr, "  greedy output   %s\n", same ? "identical to ar" : "DIFFERS from ar (bug)");
            if (!same) goto out;
        }
    }
    rc = 0;
out:
    cli_run_result_free(&res, 1);
    cli_run_result_free(&ar, 1);
    kdt_engine_free(e);
#ifdef KDT_WITH_TOKENIZER
    kdt_detok_stream_free(pr.detok);
    kdt_tokenizer_free(tok);
#endif
    free(ids);
    free(file_text);
    return rc;
}
