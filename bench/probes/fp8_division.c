// The FP8 stores' division (musekern/kernels/qkv_front/fp8.py): for every bf16 x and scale s > 0 (normal or
// subnormal), is e4m3 of the fast quotient the e4m3 of RN(x / s)?  Per thread: p = 2^-64 if s > 2^64, 2^100 if
// s < 2^-64, else 1; s' = s p; r = RN(1/s'); b = 512 s'. Per value: x' = RN(x p); xc = clamp(x', +-b) (NaN kept);
// q = RN(xc r); e = RN(fma(-q, s', xc)); q' = RN(fma(e, r, q)); q' gets xc's sign. A power-of-two s': q' = RN(x' r).
// Compared: fp32 bit equality where |x/s| in [2^-11, 512 s'/s'] unclamped; below 2^-11 both |.| < 2^-10 with
// the same sign (e4m3 +-0 both); clamped: |q'| = 512 and |x/s| >= 448 (both saturate); NaN x skipped (NaN both).
#include <math.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
static float f(uint32_t u){float x; memcpy(&x,&u,4); return x;}
static uint32_t u(float x){uint32_t v; memcpy(&v,&x,4); return v;}
static uint64_t rng=88172645463325252ULL; static uint64_t nx(){rng^=rng<<13;rng^=rng>>7;rng^=rng<<17;return rng;}
int main(int argc,char**argv){
  long n=atol(argv[1]); long bad=0, checked=0, clamped=0, tiny=0;
  for(long i=0;i<n;i++){
    float s; int e;
    if(i<4*277){ e=(int)(i%277)-149; int kind=(int)(i/277);
      uint32_t mant = kind==0?0:kind==1?0x7fffff:kind==2?0x400000:(uint32_t)(nx()&0x7fffff);
      s=ldexpf(f(0x3f800000u|mant),e);}                 // every exponent -149..127 (subnormals included)
    else { e=(int)(nx()%277)-149; s=ldexpf(f(0x3f800000u|(uint32_t)(nx()&0x7fffff)),e);}
    if(!(s>0) || isinf(s)) continue;
    float p = s > 0x1p64f ? 0x1p-64f : (s < 0x1p-64f ? 0x1p100f : 1.0f);
    float sp=s*p, r=1.0f/sp, B=512.0f*sp;
    int pow2 = (u(sp) & 0x7fffff) == 0;
    for(uint32_t h=0;h<65536;h++){
      float x=f(h<<16);
      if(isnan(x)) continue;
      float xp=x*p;
      float xc = xp> B? B : (xp< -B? -B : xp);
      float q=xc*r; float er=fmaf(-q,sp,xc); float q2=fmaf(er,r,q); q2=copysignf(q2,xc);
      if(pow2) q2 = xp*r;  // a power-of-two scale: the products alone (no clamp: a huge one saturates as inf)
      float t=x/s;
      if(fabsf(xp)>B){ clamped++; if(!((pow2 ? fabsf(q2)>=448.0f : fabsf(q2)==512.0f) && fabsf(t)>=448.0f)){ if(bad<10) printf("clamp s=%a x=%a t=%a q2=%a\n",s,x,t,q2); bad++;} }
      else if(fabsf(t)<0x1p-11f){ tiny++; if(!(fabsf(q2)<0x1p-10f && signbit(q2)==signbit(t))){ if(bad<10) printf("tiny s=%a x=%a t=%a q2=%a\n",s,x,t,q2); bad++;} }
      else { checked++; if(u(q2)!=u(t)){ if(bad<10) printf("s=%a x=%a true=%a fast=%a\n",s,x,t,q2); bad++;} }
    }
  }
  printf("scales %ld: bit-compared %ld, below 2^-11 %ld, clamped %ld, mismatches %ld\n",n,checked,tiny,clamped,bad);
  return bad!=0;
}
