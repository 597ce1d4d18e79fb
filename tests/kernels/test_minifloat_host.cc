// test_minifloat_host.cc - kernels/cuda/minifloat.cuh (the device's fp8 e4m3 and e2m1
// encoders and decoders) compiled for the host, against kernels/quant/fp8.c, the CPU
// reference they port: the code of every 61st float32 bit pattern (70 million, all
// signs, NaN payloads, infinities, subnormals) and of every 2^-12 step in [0, 8] and
// [440, 460] (the saturation edge), and the value of every code.  Bitwise, NaN for NaN.
// The device builds the same double arithmetic (frexp, ldexp, rint are exact there too),
// so a logic slip in the port shows here without a GPU; suite 'unit'.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define __device__      // the header's functions as plain host inline functions
#include "kernels/cuda/minifloat.cuh"
#include "kernels/quant/quant.h"
extern "C" {
#include "kernels/quant/fpmm.h"         // tsr_fpmm_e2m1_x2
}

static int failures;

static void check_code(float x, const char *what, uint8_t got, uint8_t want) {
        if (got != want && failures++ < 8) {
                uint32_t b;
                memcpy(&b, &x, 4);
                printf("FAIL %s of %a (0x%08x): 0x%02x, fp8.c 0x%02x\n", what, (double)x, b, got, want);
        }
}

static void check_value(unsigned c, const char *what, float got, float want) {
        uint32_t a, b;
        memcpy(&a, &got, 4), memcpy(&b, &want, 4);
        if (a != b && !(isnan(got) && isnan(want)) && failures++ < 8)
                printf("FAIL %s of code 0x%02x: %a, fp8.c %a\n", what, c, (double)got, (double)want);
}

static void both(float x) {
        check_code(x, "e4m3", tsr_cuda_f32_to_e4m3(x), tsr_f32_to_fp8_e4m3(x));
        check_code(x, "e2m1", tsr_cuda_f32_to_e2m1(x), tsr_f32_to_e2m1(x));
}

int main(void) {
        uint64_t n = 0;
        for (uint64_t b = 0; b <= 0xffffffffull; b += 61, n++) {
                uint32_t u = (uint32_t)b;
                float x;
                memcpy(&x, &u, 4);
                both(x);
        }
        for (double v = 0; v <= 8.0; v += 0x1p-12, n += 2)
                both((float)v), both((float)-v);
        for (double v = 440; v <= 460.0; v += 0x1p-12, n += 2)
                both((float)v), both((float)-v);
        for (unsigned c = 0; c < 256; c++)
                check_value(c, "e4m3 value", tsr_cuda_e4m3_to_f32(c), tsr_fp8_e4m3_to_f32((uint8_t)c));
        for (unsigned c = 0; c < 16; c++) {
                check_value(c, "e2m1 value", tsr_cuda_e2m1_to_f32(c), tsr_e2m1_to_f32((uint8_t)c));
                if (tsr_cuda_e2m1_x2(c) != tsr_fpmm_e2m1_x2((uint8_t)c) && failures++ < 8)
                        printf("FAIL e2m1 x2 of code 0x%x: %d, fpmm.c %d\n", c, tsr_cuda_e2m1_x2(c),
                               tsr_fpmm_e2m1_x2((uint8_t)c));
        }
        printf("minifloat.cuh on the host: %llu encodings x 2 formats, 256 + 16 codes' values: %s (%d mismatches)\n",
               (unsigned long long)n, failures ? "FAIL" : "all equal to quant/fp8.c", failures);
        return failures ? 1 : 0;
}
