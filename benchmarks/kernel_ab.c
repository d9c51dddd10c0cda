/* Times one build of our kernels (a shared library of dspark_trt/kernels/cpu_kernels.c) over
 * SmolLM2-135M's matrices, to A/B two builds of the C source without Python in the way.
 *
 *     gcc -O3 -mavx2 -mfma -pthread -shared -fPIC dspark_trt/kernels/cpu_kernels.c -lm -o new.so
 *     (the AMX build: -mavx512f -mavx512bw -mavx512bf16 -mamx-tile -mamx-bf16 -mamx-int8 instead)
 *     git show REV:dspark_trt/kernels/cpu_kernels.c > /tmp/old.c && gcc ... /tmp/old.c -lm -o old.so
 *     gcc -O2 benchmarks/kernel_ab.c -o kernel_ab -ldl
 *     ./kernel_ab ./old.so 2 1 2 4 6 8 16; ./kernel_ab ./new.so 2 1 2 4 6 8 16   # alternate, repeat
 *
 * Arguments: the library, its thread count, then row counts. For each row count it prints the
 * best of 5 passes (after one warm-up) over the 120 layer matrices (q/k/v fused, o, gate/up fused,
 * down; 30 layers) and the LM head, each in its own buffer so that every pass streams the weights
 * from memory as a decode step does, in ms. The weights hold arbitrary bf16 values: the timing
 * does not depend on them. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
typedef int (*start_fn)(int);
typedef void (*gemm_fn)(const float *, long, long, const uint16_t *, long, long, float *, long, const float *);
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc, char **argv){
  void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL); if(!h){printf("%s\n", dlerror()); return 1;}
  int (*init)(void) = (int (*)(void))dlsym(h, "dspark_kernel_init");  /* the AMX build asks Linux for the tile state */
  if (init && init() != 0) { printf("this build cannot start here (no AMX tile state)\n"); return 1; }
  start_fn start=(start_fn)dlsym(h,"dspark_start_threads"); gemm_fn gemm=(gemm_fn)dlsym(h,"dspark_bf16_gemm");
  start(atoi(argv[2]));
  long shapes[121][2]; int n=0;
  for(int l=0;l<30;l++){ long s[4][2]={{576,960},{576,576},{576,3072},{1536,576}}; for(int j=0;j<4;j++){shapes[n][0]=s[j][0];shapes[n][1]=s[j][1];n++;} }
  shapes[n][0]=576; shapes[n][1]=49152; n++;
  uint16_t *w[121]; for(int i=0;i<n;i++){ long sz=shapes[i][0]*((shapes[i][1]+63)/64*64); w[i]=aligned_alloc(64,sz*2+64); for(long j=0;j<sz;j++) w[i][j]=0x3c00+(j%97); }
  float *x=aligned_alloc(64,16*1536*4), *y=aligned_alloc(64,16*49152*4); for(long i=0;i<16*1536;i++) x[i]=1e-3f*(i%13);
  for(int a=3;a<argc;a++){ long M=atol(argv[a]); double best=1e9;
    for(int rep=0;rep<6;rep++){ double t=now(); for(int i=0;i<n;i++) gemm(x,M,shapes[i][0],w[i],shapes[i][0],shapes[i][1],y,shapes[i][1],0); t=now()-t; if(rep && t<best) best=t; }
    printf("%ld:%.1f ", M, best*1e3); }
  printf("\n");
}
