/* test_cli.c - the `kdtree` executable end to end: --version/--help, clear errors and exit code 2
 * for unknown flags, missing or malformed values, generate with ar and ddtree (--compare-ar must
 * report identical greedy output), bench's comparison table, and the serve dispatch slot.
 * Runs the binary that sits next to this test in the build directory; skipped if it is absent
 * (e.g. a build without jansson). Target: tests/fixtures/models/kimi_tiny; the drafter is a tiny
 * random DFlash checkpoint written here.
 */
#ifdef KDT_WITH_MODEL /* the engine is built with the model (jansson) */
#include "engine_test_util.h"

#include <stdarg.h>
#include <sys/wait.h>

static char g_bin[1100], g_tmp[256];

/* Runs `cmd` through the shell, stdout+stderr into g_out; returns the exit code. */
static char g_out[65536];
static int run(const char *fmt, ...) KDT_PRINTF(1, 2);
static int run(const char *fmt, ...) {
    char cmd[4096], full[4400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    snprintf(full, sizeof full, "%s > %s/out.txt 2>&1", cmd, g_tmp);
    int rc = system(full);
    char path[400];
    snprintf(path, sizeof path, "%s/out.txt", g_tmp);
    size_t n = 0;
    char *b = tm_read_bytes(path, &n);
    snprintf(g_out, sizeof g_out, "%s", b ? b : "");
    free(b);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

#define HAS(s) CHECK_MSG(strstr(g_out, (s)) != NULL, "output lacks \"%s\":\n%s", (s), g_out)
/* runs a command line, expects its exit code and a piece of its output */
#define RUN_HAS(rc, needle, ...) do { CHECK_EQ_INT(run(__VA_ARGS__), (rc)); HAS(needle); } while (0)

static void test_usage_errors(void) {
    RUN_HAS(0, "kdtree 0.1.0", "%s --version", g_bin);
    RUN_HAS(0, "generate", "%s --help", g_bin);
    CHECK_EQ_INT(run("%s", g_bin), 2);
    RUN_HAS(2, "unknown command", "%s frobnicate", g_bin);
    RUN_HAS(0, "--temperature", "%s generate --help", g_bin);
    HAS("--prompt-ids");
    RUN_HAS(2, "--bogus", "%s generate --bogus", g_bin);
    RUN_HAS(2, "needs a value", "%s generate --model %s --prompt-ids 1,2 --budget", g_bin,
            ET_FIXTURE);
    RUN_HAS(2, "not an integer", "%s generate --model %s --prompt-ids 1,2 --budget abc", g_bin,
            ET_FIXTURE);
    RUN_HAS(2, "--top-p", "%s generate --model %s --prompt-ids 1,2 --top-p 1.5", g_bin, ET_FIXTURE);
    RUN_HAS(2, "--model", "%s generate --prompt-ids 1,2", g_bin);
    RUN_HAS(2, "--draft", "%s generate --model %s --prompt-ids 1,2 --spec ddtree", g_bin, ET_FIXTURE);
    RUN_HAS(1, "token ids", "%s generate --model %s --prompt-ids 1,x", g_bin, ET_FIXTURE);
    RUN_HAS(1, "999", "%s generate --model %s --prompt-ids 1,999", g_bin, ET_FIXTURE);
    /* a mistyped directory is named by its flag, before the tokenizer (which defaults to the
     * model directory) or the engine loads anything */
    const char *no_model = "--model /nonexistent: No such file or directory";
    RUN_HAS(1, no_model, "%s generate --model /nonexistent --prompt-ids 1", g_bin);
    RUN_HAS(1, no_model, "%s generate --model /nonexistent --prompt hello", g_bin);
    RUN_HAS(1, "not a directory", "%s generate --model %s/config.json --prompt hello", g_bin, ET_FIXTURE);
    RUN_HAS(1, "--draft /nonexistent-draft: No such file or directory",
            "%s generate --model %s --draft /nonexistent-draft --prompt-ids 1", g_bin, ET_FIXTURE);
    RUN_HAS(1, "--device", "%s generate --model %s --prompt-ids 1 --device tpu", g_bin, ET_FIXTURE);
    RUN_HAS(1, "cuda", "%s generate --model %s --prompt-ids 1 --device cuda", g_bin, ET_FIXTURE);
    CHECK_EQ_INT(run("%s bench --model %s", g_bin, ET_FIXTURE), 2);
    int rc = run("%s serve --help", g_bin);
    CHECK(rc == 0 || (rc == 1 && strstr(g_out, "not built")));
    if (rc == 0) RUN_HAS(1, no_model, "%s serve --model /nonexistent --port 0", g_bin);
    if (rc == 0) RUN_HAS(2, "--prefill-chunk expects an integer in 0..4096", "%s serve --model %s --prefill-chunk -3",
                         g_bin, ET_FIXTURE);
}

static void test_generate_and_bench(void) {
    char draft[400];
    snprintf(draft, sizeof draft, "%s/draft", g_tmp);
    et_dflash_spec s = et_dflash_default(64, 320);
    s.block_size = 6;
    et_dflash_write(draft, &s, NULL);
    int32_t prompt[5] = {5, 6, 7, 100, 200}, ref[10];
    CHECK(et_greedy_reference(ET_FIXTURE, prompt, 5, 10, ref) == KDT_OK);
    char want[256];
    int o = 0;
    for (int i = 0; i < 10; i++) o += snprintf(want + o, sizeof want - (size_t)o, i ? " %d" : "%d", ref[i]);
    /* the reference decodes after an absorbed prefill: that form gives it bit for bit (the CLI's
     * default, auto, may take the plain form, the same function in another order) */
    CHECK_EQ_INT(run("%s generate -m %s --prompt-ids 5,6,7,100,200 -n 10 --ignore-eos --prefill-attn absorbed", g_bin,
                     ET_FIXTURE), 0);
    HAS(want);
    HAS("tau mean");
    CHECK_EQ_INT(run("%s generate -m %s --prompt-ids 5,6,7,100,200 -n 10 --ignore-eos --prefill-attn plain", g_bin,
                     ET_FIXTURE), 0);
    HAS("tau mean");
    /* the chunk the engine runs with, on stderr: the CPU's defaults (64 rows for the absorbed form,
     * 256 for plain or auto), or the one given */
    CHECK_EQ_INT(run("%s generate -m %s --prompt-ids 5 -n 1 --device cpu --prefill-attn absorbed", g_bin, ET_FIXTURE), 0);
    HAS("decoding on cpu, prefill in chunks of 64 rows");
    CHECK_EQ_INT(run("%s generate -m %s --prompt-ids 5 -n 1 --device cpu --prefill-attn plain", g_bin, ET_FIXTURE), 0);
    HAS("decoding on cpu, prefill in chunks of 256 rows");
    CHECK_EQ_INT(run("%s generate -m %s --prompt-ids 5 --prefill-attn fast", g_bin, ET_FIXTURE), 1);
    HAS("--prefill-attn \"fast\": expected absorbed, plain or auto");
    /* the absorbed form's bits do not depend on the prefill chunk; 0..4096 rows */
    CHECK_EQ_INT(run("%s generate -m %s --prompt-ids 5,6,7,100,200 -n 10 --ignore-eos --prefill-attn absorbed "
                     "--prefill-chunk 2", g_bin, ET_FIXTURE), 0);
    HAS(want);
    HAS("prefill in chunks of 2 rows");
    CHECK_EQ_INT(run("%s generate -m %s --prompt-ids 5 --prefill-chunk 4097", g_bin, ET_FIXTURE), 2);
    HAS("--prefill-chunk");
    CHECK_EQ_INT(run("%s generate -m %s --prompt-ids 5,6,7,100,200 -n 10 --ignore-eos --prefill-attn absorbed "
                     "--prefill-chunk 2 --max-prefill-tokens 2", g_bin, ET_FIXTURE), 0);
    HAS(want);
    CHECK_EQ_INT(run("%s generate -m %s --prompt-ids 5 --max-prefill-tokens -1", g_bin, ET_FIXTURE), 2);
    HAS("--max-prefill-tokens");
    /* any CPU thread count gives the same tokens; a count outside 0..1024 is refused */
    CHECK_EQ_INT(run("%s generate -m %s --prompt-ids 5,6,7,100,200 -n 10 --ignore-eos --threads 3", g_bin, ET_FIXTURE), 0);
    HAS(want);
    CHECK_EQ_INT(run("%s generate -m %s --prompt-ids 5 --threads 1025", g_bin, ET_FIXTURE), 2);
    HAS("--threads");
    CHECK_EQ_INT(run("%s generate -m %s -d %s --prompt-ids 5,6,7,100,200 -n 10 --ignore-eos --spec ddtree "
                     "--budget 8 --compare-ar", g_bin, ET_FIXTURE, draft), 0);
    HAS(want);
    HAS("identical to ar");
    HAS("speed-up vs ar");
    HAS("verify");
    CHECK_EQ_INT(run("%s generate -m %s -d %s --prompt-ids 5,6,7 -n 6 --spec auto --temperature 0.8 "
                     "--top-k 5 --seed 3", g_bin, ET_FIXTURE, draft), 0);
    char pf[400];
    snprintf(pf, sizeof pf, "%s/prompts.txt", g_tmp);
    const char *lines = "ids: 5,6,7,100,200\n\nids: 1, 2, 3\nids: 300\n";
    tm_write_bytes(pf, lines, strlen(lines));
    CHECK_EQ_INT(run("%s bench -m %s -d %s -f %s --budgets 2,8 --max-tokens 8 --batch 2 --auto", g_bin,
                     ET_FIXTURE, draft, pf), 0);
    HAS("same_as_ar");
    HAS("ddtree");
    HAS("chain");
    HAS("auto");
    CHECK_MSG(strstr(g_out, " NO") == NULL, "%s", g_out);
    tm_write_bytes(pf, "hello\n", 6);
    CHECK_EQ_INT(run("%s bench -m %s -d %s -f %s", g_bin, ET_FIXTURE, draft, pf), 1);
    HAS("line 1");
}

int main(void) {
    char self[1024];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) {
        printf("cannot locate the build directory: skipped\n");
        return 0;
    }
    self[n] = 0;
    char *slash = strrchr(self, '/');
    if (slash) *slash = 0;
    snprintf(g_bin, sizeof g_bin, "%s/kdtree", self);
    FILE *f = fopen(g_bin, "rb");
    FILE *g = fopen(ET_FIXTURE "/config.json", "rb");
    if (!f || !g) {
        printf("%s or the kimi_tiny fixture not present: skipped\n", g_bin);
        if (f) fclose(f);
        if (g) fclose(g);
        return 0;
    }
    fclose(f);
    fclose(g);
    snprintf(g_tmp, sizeof g_tmp, "/tmp/kdt_cli_test_XXXXXX");
    if (!mkdtemp(g_tmp)) return 1;
    T_RUN(test_usage_errors);
    T_RUN(test_generate_and_bench);
    tm_rmdir(g_tmp);
    return t_summary();
}
#else
#include <stdio.h>
int main(void) {
    printf("engine not built (no jansson): skipped\n");
    return 0;
}
#endif
