/* fuzz_safetensors.c - the checkpoint reader (kdt_st_open_dir, src/model/safetensors.c) on any
 * bytes. Input byte 0 even: the rest is a directory's model.safetensors; odd: the rest is split at
 * its first NUL into model.safetensors.index.json and the one shard it may name,
 * shard-1.safetensors. Promise: a clean status (KDT_OK, or an error with a message); in a set that
 * opens, every tensor's bytes are its shape times its element size, lie inside its file after the
 * header (or in an aligned copy), are readable to the end, and kdt_st_find returns the tensor by
 * its name. */
#include <string.h>

#include "fuzz.h"
#include "model/model_internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const uint8_t *body = data + 1;
    const size_t n = size - 1;
    if (!(data[0] & 1)) {
        fuzz_remove_file("model.safetensors.index.json");
        fuzz_write_file("model.safetensors", body, n);
    } else {
        const uint8_t *nul = memchr(body, 0, n);
        const size_t n_index = nul ? (size_t)(nul - body) : n;
        fuzz_remove_file("model.safetensors");
        fuzz_write_file("model.safetensors.index.json", body, n_index);
        if (nul) fuzz_write_file("shard-1.safetensors", nul + 1, n - n_index - 1);
        else fuzz_remove_file("shard-1.safetensors");
    }
    kdt_st_set set;
    const kdt_status st = kdt_st_open_dir(fuzz_tmpdir(), 0, &set);
    if (st != KDT_OK) {
        FUZZ_CHECK(kdt_last_error()[0], "status %d without a message", (int)st);
        fuzz_note("refused: %s", kdt_last_error());
        return 0;
    }
    fuzz_note("opened: %lld tensors in %d files", (long long)set.n_tensors, (int)set.n_files);
    volatile unsigned char sink = 0;
    for (int64_t i = 0; i < set.n_tensors; i++) {
        const kdt_st_tensor *t = &set.tensors[i];
        FUZZ_CHECK(t->file >= 0 && t->file < set.n_files, "tensor %s: file %d", t->name, (int)t->file);
        FUZZ_CHECK(t->ndim >= 0 && t->ndim <= KDT_MAX_DIMS, "tensor %s: %d dims", t->name, (int)t->ndim);
        const size_t es = kdt_wtype_size(t->dtype);
        size_t elems = 1;
        for (int32_t d = 0; d < t->ndim; d++) {
            FUZZ_CHECK(t->shape[d] >= 0, "tensor %s: dim %d is %lld", t->name, (int)d, (long long)t->shape[d]);
            elems *= (size_t)t->shape[d];
        }
        if (es) FUZZ_CHECK(t->nbytes == elems * es, "tensor %s: %zu bytes for %zu elements of %zu", t->name,
                           t->nbytes, elems, es);
        const kdt_st_file *f = &set.files[t->file];
        const unsigned char *p = t->data, *map = f->map;
        if (t->nbytes && p >= map && p < map + f->map_size) {
            FUZZ_CHECK(p >= map + 8 && t->nbytes <= (size_t)(map + f->map_size - p),
                       "tensor %s: bytes outside its file", t->name);
        }
        if (t->nbytes) sink ^= p[0] ^ p[t->nbytes - 1];
        FUZZ_CHECK(kdt_st_find(&set, t->name) == t, "tensor %s: not found by its name", t->name);
    }
    (void)sink;
    kdt_st_close(&set);
    return 0;
}
