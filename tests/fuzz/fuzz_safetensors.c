/* fuzz_safetensors.c - bytes -> tsr_safetensors_open_memory, then every accessor over
 * what it accepted.
 *
 * safetensors.h promises that a file which opens is fully validated: every tensor's
 * bytes lie inside the data section, have exactly the shape's size, and the tensors
 * tile the data section.  So after a successful open this checks those properties,
 * touches the first and last byte of every tensor, looks every name up, and walks the
 * metadata.  libFuzzer hands the input in a heap block of exactly `size` bytes, so ASan
 * reports any read past the file's end.
 *
 * The input is the file itself; the seeds (tests/fuzz/corpus/safetensors) are small
 * valid files. */
#include <string.h>

#include "worker/load/safetensors.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        tsr_safetensors *f = NULL;
        char err[256];
        volatile uint8_t sink = 0;
        uint64_t covered = 0;

        err[0] = 0;
        tsr_status st = tsr_safetensors_open_memory(data, size, &f, err, sizeof err);
        if (st != TSR_OK) {
                FUZZ_CHECK(f == NULL);
                FUZZ_CHECK(st == TSR_E_INVAL || st == TSR_E_LIMIT || st == TSR_E_NOMEM);
                FUZZ_CHECK(strncmp(err, "<memory>: ", 10) == 0);
                return 0;
        }
        FUZZ_CHECK(f != NULL);
        uint64_t doff = tsr_safetensors_data_offset(f);
        FUZZ_CHECK(doff >= 8 && doff <= size);
        for (size_t i = 0; i < tsr_safetensors_n_tensors(f); i++) {
                const tsr_safetensors_tensor *t = tsr_safetensors_tensor_at(f, i);
                uint32_t bits = tsr_safetensors_dtype_bits(t->dtype);
                uint64_t n = 1;
                FUZZ_CHECK(bits > 0 && t->n_dims <= TSR_SAFETENSORS_MAX_DIMS);
                for (uint32_t d = 0; d < t->n_dims; d++)
                        n = t->shape[d] == 0 ? 0 : n * t->shape[d];
                FUZZ_CHECK(n == t->n_elements && t->n_bytes * 8 == n * bits);
                FUZZ_CHECK(t->offset <= size - doff && t->n_bytes <= size - doff - t->offset);
                if (t->n_bytes) {
                        const uint8_t *p = t->data;
                        FUZZ_CHECK(p == data + doff + t->offset);
                        sink ^= p[0];
                        sink ^= p[t->n_bytes - 1];
                } else {
                        FUZZ_CHECK(t->data == NULL);
                }
                FUZZ_CHECK(tsr_safetensors_find(f, t->name) == t);
                covered += t->n_bytes;
        }
        FUZZ_CHECK(covered == size - doff);       /* the tensors tile the data section */
        FUZZ_CHECK(tsr_safetensors_tensor_at(f, tsr_safetensors_n_tensors(f)) == NULL);
        for (size_t i = 0; i < tsr_safetensors_n_metadata(f); i++) {
                const char *k = NULL, *v = NULL;
                FUZZ_CHECK(tsr_safetensors_metadata_at(f, i, &k, &v) == TSR_OK && k && v);
                FUZZ_CHECK(tsr_safetensors_metadata(f, k) != NULL);
        }
        tsr_safetensors_close(&f);
        FUZZ_CHECK(f == NULL);
        (void)sink;
        return 0;
}
