/* Times one build of our attention kernel (a shared library of dspark_trt/kernels/cpu_kernels.c)
 * over SmolLM2-135M's attention shapes, to A/B two builds of the C source without Python in the
 * way (the attention counterpart of kernel_ab.c).
 *
 *     gcc -O3 -mavx512f -mavx512bw -pthread -shared -fPIC dspark_trt/kernels/cpu_kernels.c -lm -o new.so
 *     git show REV:dspark_trt/kernels/cpu_kernels.c > /tmp/old.c && gcc ... /tmp/old.c -lm -o old.so
 *     gcc -O2 benchmarks/attention_ab.c -o attention_ab -ldl
 *     ./attention_ab ./old.so 2 300 1 2 4 8; ./attention_ab ./new.so 2 300 1 2 4 8   # alternate, repeat
 *
 * Arguments: the library, its thread count, the context length (keys already in the slot), then
 * token counts (queries of one slot at consecutive positions, a verification step's shape). For
 * each token count it prints the best of 7 passes (after one warm-up) over 30 layers, each
 * layer's keys and values in their own part of the pool as in a decode step (9 query heads, 3 KV
 * heads, head dim 64), in ms, and a checksum of the output: two builds that compute the same
 * bits print the same checksum. The AVX-512 build's attention is the AMX build's too. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
typedef int (*start_fn)(int);
typedef int (*attention_fn)(const float *, long, long, long, long, long, const float *, const float *, long, long,
                            const long *, const long *, float, float *, long);
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
    if (argc < 5) { printf("usage: %s LIBRARY THREADS CONTEXT TOKENS...\n", argv[0]); return 2; }
    void *library = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!library) { printf("%s\n", dlerror()); return 1; }
    ((start_fn)dlsym(library, "dspark_start_threads"))(atoi(argv[2]));
    attention_fn attention = (attention_fn)dlsym(library, "dspark_attention");
    long context = atol(argv[3]), heads = 9, kv_heads = 3, dim = 64, capacity = 512, layers = 30, slots = 4;
    long layer_size = slots * kv_heads * capacity * dim;
    float *keys = aligned_alloc(64, sizeof(float) * layers * layer_size);
    float *values = aligned_alloc(64, sizeof(float) * layers * layer_size);
    for (long i = 0; i < layers * layer_size; i++) {  /* arbitrary values in [-0.5, 0.5) */
        keys[i] = (float)((i * 7919) % 1000) / 1000.0f - 0.5f;
        values[i] = (float)((i * 104729) % 997) / 997.0f - 0.5f;
    }
    float *q = aligned_alloc(64, sizeof(float) * 16 * heads * dim), *out = aligned_alloc(64, sizeof(float) * 16 * heads * dim);
    for (long i = 0; i < 16 * heads * dim; i++) q[i] = (float)((i * 31) % 101) / 50.0f - 1.0f;
    long slot_of[16] = {0}, positions[16];
    for (int a = 4; a < argc; a++) {
        long tokens = atol(argv[a]);
        if (tokens < 1 || tokens > 16 || context + tokens > capacity) { printf("tokens 1-16, context + tokens <= 512\n"); return 2; }
        for (long t = 0; t < tokens; t++) positions[t] = context + t;
        double best = 1e9, checksum = 0;
        for (int pass = 0; pass < 8; pass++) {
            double start = now();
            for (long l = 0; l < layers; l++)
                attention(q, tokens, heads * dim, heads, kv_heads, dim, keys + l * layer_size, values + l * layer_size,
                          kv_heads * capacity * dim, capacity * dim, slot_of, positions, 0.125f, out, heads * dim);
            double seconds = now() - start;
            if (pass && seconds < best) best = seconds;
        }
        for (long i = 0; i < tokens * heads * dim; i++) checksum += out[i];
        printf("%ld:%.3f (checksum %.9g) ", tokens, best * 1e3, checksum);
    }
    printf("\n");
    return 0;
}
