/* fuzz_util.c - the temporary directory of the file-reading harnesses (fuzz.h). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* mkdtemp */
#endif
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fuzz.h"

static char dir[256];
static char written[512]; /* fuzz_write_file's result */

static void remove_dir(void) {
    /* the harnesses write only files with fixed names (and fuzz_dflash_config a link to the
     * drafter's weights): unlink them, then the directory */
    static const char *const names[] = {"config.json", "model.safetensors",
                                        "model.safetensors.index.json", "shard-1.safetensors",
                                        "tokenizer.json", "tiktoken.model", "tokenizer_config.json"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) fuzz_remove_file(names[i]);
    rmdir(dir);
}

const char *fuzz_tmpdir(void) {
    if (!dir[0]) {
        const char *t = getenv("TMPDIR");
        snprintf(dir, sizeof dir, "%s/kdt-fuzz-XXXXXX", t && t[0] ? t : "/tmp");
        if (!mkdtemp(dir)) FUZZ_FAIL("cannot make a temporary directory under %s", t && t[0] ? t : "/tmp");
        atexit(remove_dir);
    }
    return dir;
}

uint8_t *fuzz_read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    uint8_t *buf = NULL;
    long n = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
    if (n >= 0 && fseek(f, 0, SEEK_SET) == 0 && (buf = malloc(n ? (size_t)n : 1)) &&
        fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    *len = (size_t)(n > 0 ? n : 0);
    return buf;
}

const char *fuzz_write_file(const char *name, const void *data, size_t n) {
    snprintf(written, sizeof written, "%s/%s", fuzz_tmpdir(), name);
    FILE *f = fopen(written, "wb");
    if (!f || (n && fwrite(data, 1, n, f) != n) || fclose(f) != 0) FUZZ_FAIL("cannot write %s", written);
    return written;
}

void fuzz_remove_file(const char *name) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s", fuzz_tmpdir(), name);
    unlink(p);
}

void fuzz_note(const char *fmt, ...) {
    static int verbose = -1;
    if (verbose < 0) verbose = getenv("FUZZ_VERBOSE") && getenv("FUZZ_VERBOSE")[0] == '1';
    if (!verbose) return;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "  ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
}
