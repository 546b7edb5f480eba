// fa_decode.c - benchmark of ggml CPU ggml_flash_attn_ext for single-token decode
// with F16 / Q8_0 / Q4_0 K/V caches.
//
// usage: fa_decode [-t N] [-T TYPE] [-c]
//   -t N     only run configurations with N threads (default: 1 and 2)
//   -T TYPE  only run K/V type TYPE (F16, Q8_0, Q4_0)
//   -c       "cold": evict caches (write a 512 MiB buffer, as bench_decode's evict_caches
//            reads one: more than a 480 MiB L3) before every timed call (eviction time is
//            not included). Default is hot/steady-state repetition.
//   -m MS    minimum total timed time per configuration in ms (default 1000)
//   -n N     minimum number of timed repetitions (default 20)

#include "ggml-cpu.h"
#include "ggml.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#define D 128

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

// xorshift64* + Box-Muller
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static inline uint64_t rng_u64(void) {
  uint64_t x = rng_state;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  rng_state = x;
  return x * 0x2545F4914F6CDD1Dull;
}
static inline double rng_uniform(void) {  // (0,1)
  return ((rng_u64() >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}
static void fill_normal(float* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 2) {
    double u1 = rng_uniform(), u2 = rng_uniform();
    double r = sqrt(-2.0 * log(u1));
    x[i] = (float)(r * cos(2.0 * M_PI * u2));
    if (i + 1 < n)
      x[i + 1] = (float)(r * sin(2.0 * M_PI * u2));
  }
}

static int cmp_double(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

// plain reference: out[h][d] = sum_j softmax_j(scale * q_h . k_{j,h/r}) v_{j,h/r}[d], in double
// on the dequantized (F16-rounded / quantized) k and v.
static void reference(const float* q, const float* kf, const float* vf, int64_t Lk, int Hq, int Hkv,
                      float scale, double* out) {
  const int r = Hq / Hkv;
  double* s = malloc(sizeof(double) * Lk);
  for (int h = 0; h < Hq; h++) {
    const int hk = h / r;
    const float* qh = q + (int64_t)h * D;
    double mx = -INFINITY;
    for (int64_t j = 0; j < Lk; j++) {
      const float* kj = kf + ((int64_t)hk * Lk + j) * D;
      double acc = 0.0;
      for (int d = 0; d < D; d++)
        acc += (double)qh[d] * (double)kj[d];
      s[j] = acc * scale;
      if (s[j] > mx)
        mx = s[j];
    }
    double sum = 0.0;
    for (int64_t j = 0; j < Lk; j++) {
      s[j] = exp(s[j] - mx);
      sum += s[j];
    }
    for (int d = 0; d < D; d++)
      out[(int64_t)h * D + d] = 0.0;
    for (int64_t j = 0; j < Lk; j++) {
      const float* vj = vf + ((int64_t)hk * Lk + j) * D;
      const double p = s[j] / sum;
      for (int d = 0; d < D; d++)
        out[(int64_t)h * D + d] += p * (double)vj[d];
    }
  }
  free(s);
}

static const char* tname(enum ggml_type t) {
  switch (t) {
    case GGML_TYPE_F16:
      return "F16";
    case GGML_TYPE_Q8_0:
      return "Q8_0";
    case GGML_TYPE_Q4_0:
      return "Q4_0";
    default:
      return ggml_type_name(t);
  }
}

// diagnostic: emulates ggml's CPU F16-V path (q rounded to F16, online softmax in float,
// V*softmax accumulator VKQ stored in F16 and rounded after every update), single KV chunk.
static void emulate_f16_accum(const float* q, const float* kf, const float* vf, int64_t Lk, int Hq,
                              int Hkv, float scale, double* out) {
  const int r = Hq / Hkv;
  float qh16[D], acc[D];
  for (int h = 0; h < Hq; h++) {
    const int hk = h / r;
    for (int d = 0; d < D; d++)
      qh16[d] = ggml_fp16_to_fp32(ggml_fp32_to_fp16(q[(int64_t)h * D + d]));
    for (int d = 0; d < D; d++)
      acc[d] = 0.0f;
    float M = -INFINITY, S = 0.0f;
    for (int64_t j = 0; j < Lk; j++) {
      const float* kj = kf + ((int64_t)hk * Lk + j) * D;
      const float* vj = vf + ((int64_t)hk * Lk + j) * D;
      double dot = 0.0;
      for (int d = 0; d < D; d++)
        dot += (double)qh16[d] * (double)kj[d];
      const float s = (float)dot * scale;
      float ms = 1.0f, vs = 1.0f;
      if (s > M) {
        const float Mold = M;
        M = s;
        ms = expf(Mold - M);
        for (int d = 0; d < D; d++)
          acc[d] = ggml_fp16_to_fp32(ggml_fp32_to_fp16(acc[d] * ms));
      } else {
        vs = expf(s - M);
      }
      for (int d = 0; d < D; d++)
        acc[d] = ggml_fp16_to_fp32(ggml_fp32_to_fp16(fmaf(vj[d], vs, acc[d])));
      S = S * ms + vs;
    }
    for (int d = 0; d < D; d++)
      out[(int64_t)h * D + d] = acc[d] / S;
  }
}

static volatile uint8_t sink;
static void evict_caches(uint8_t* buf, size_t n) {
  for (size_t i = 0; i < n; i += 64)
    buf[i] += 1;
  sink = buf[n / 2];
}

int main(int argc, char** argv) {
  int thread_filter = 0;
  const char* type_filter = NULL;
  int cold = 0;
  double min_total_us = 1e6;
  int min_reps = 20;

  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "-t") && i + 1 < argc)
      thread_filter = atoi(argv[++i]);
    else if (!strcmp(argv[i], "-T") && i + 1 < argc)
      type_filter = argv[++i];
    else if (!strcmp(argv[i], "-c"))
      cold = 1;
    else if (!strcmp(argv[i], "-m") && i + 1 < argc)
      min_total_us = atof(argv[++i]) * 1e3;
    else if (!strcmp(argv[i], "-n") && i + 1 < argc)
      min_reps = atoi(argv[++i]);
    else {
      fprintf(stderr, "usage: %s [-t threads] [-T F16|Q8_0|Q4_0] [-c] [-m min_ms] [-n min_reps]\n",
              argv[0]);
      return 1;
    }
  }

  ggml_cpu_init();

  const enum ggml_type types[] = {GGML_TYPE_F16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0};
  const int64_t Lks[] = {4096, 32768};
  const int heads[][2] = {{8, 8}, {32, 8}};
  const int threads[] = {1, 2};
  const float scale = 1.0f / sqrtf((float)D);

  const size_t evict_n = (size_t)512 << 20;
  uint8_t* evict_buf = NULL;
  if (cold) {
    evict_buf = calloc(evict_n, 1);
  }

  const int max_reps = 1000000;
  double* times = malloc(sizeof(double) * max_reps);
  int printed_sanity = 0;
  int check_failed = 0;

  printf(
      "# ggml %s flash_attn_ext decode bench: D=%d Lq=1 batch=1 mask=NULL scale=1/sqrt(%d) "
      "prec=default mode=%s\n",
      ggml_commit(), D, D, cold ? "cold" : "hot");

  for (size_t it = 0; it < sizeof(types) / sizeof(types[0]); it++) {
    const enum ggml_type type = types[it];
    if (type_filter && strcasecmp(type_filter, tname(type)) != 0)
      continue;
    for (size_t il = 0; il < 2; il++) {
      const int64_t Lk = Lks[il];
      for (size_t ih = 0; ih < 2; ih++) {
        const int Hq = heads[ih][0], Hkv = heads[ih][1];

        const int64_t nkv = (int64_t)D * Lk * Hkv;
        const size_t kv_row = ggml_row_size(type, D);
        const size_t kv_bytes_each = kv_row * Lk * Hkv;

        struct ggml_init_params ip = {
            .mem_size = 2 * kv_bytes_each + 2 * sizeof(float) * D * Hq +
                        16 * ggml_tensor_overhead() + ggml_graph_overhead() + (1 << 20),
            .mem_buffer = NULL,
            .no_alloc = false,
        };
        struct ggml_context* ctx = ggml_init(ip);
        if (!ctx) {
          fprintf(stderr, "ggml_init failed\n");
          return 1;
        }

        struct ggml_tensor* q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, D, 1, Hq, 1);
        struct ggml_tensor* k = ggml_new_tensor_4d(ctx, type, D, Lk, Hkv, 1);
        struct ggml_tensor* v = ggml_new_tensor_4d(ctx, type, D, Lk, Hkv, 1);

        // fill: deterministic seed per (type, Lk, heads) so K/V are the same across thread counts
        rng_state = 0x9E3779B97F4A7C15ull ^ ((uint64_t)Lk * 1315423911u) ^ ((uint64_t)Hq << 40);
        fill_normal((float*)q->data, (int64_t)D * Hq);
        float* tmp = malloc(sizeof(float) * nkv);
        fill_normal(tmp, nkv);
        ggml_quantize_chunk(type, tmp, k->data, 0, Lk * Hkv, D, NULL);
        fill_normal(tmp, nkv);
        ggml_quantize_chunk(type, tmp, v->data, 0, Lk * Hkv, D, NULL);
        free(tmp);

        struct ggml_tensor* out = ggml_flash_attn_ext(ctx, q, k, v, NULL, scale, 0.0f, 0.0f);
        struct ggml_cgraph* gf = ggml_new_graph(ctx);
        ggml_build_forward_expand(gf, out);

        const size_t kv_bytes = ggml_nbytes(k) + ggml_nbytes(v);

        for (size_t itt = 0; itt < 2; itt++) {
          const int nth = threads[itt];
          if (thread_filter && nth != thread_filter)
            continue;

          struct ggml_cplan plan = ggml_graph_plan(gf, nth, NULL);
          uint8_t* work = plan.work_size ? malloc(plan.work_size) : NULL;
          plan.work_data = work;

          for (int w = 0; w < 3; w++) {
            if (ggml_graph_compute(gf, &plan) != GGML_STATUS_SUCCESS) {
              fprintf(stderr, "compute failed\n");
              return 1;
            }
          }

          int nrep = 0;
          double total = 0.0;
          while ((nrep < min_reps || total < min_total_us) && nrep < max_reps) {
            if (cold)
              evict_caches(evict_buf, evict_n);
            const double t0 = now_us();
            ggml_graph_compute(gf, &plan);
            const double t1 = now_us();
            times[nrep++] = t1 - t0;
            total += t1 - t0;
          }
          qsort(times, nrep, sizeof(double), cmp_double);
          const double med =
              (nrep % 2) ? times[nrep / 2] : 0.5 * (times[nrep / 2 - 1] + times[nrep / 2]);

          printf("type=%s Lk=%lld Hq=%d Hkv=%d threads=%d median_us=%.1f kv_GBps=%.2f\n",
                 tname(type), (long long)Lk, Hq, Hkv, nth, med, kv_bytes / (med * 1e3));
          fflush(stdout);
          fprintf(stderr, "#   reps=%d min_us=%.1f max_us=%.1f kv_bytes=%zu work_size=%zu\n", nrep,
                  times[0], times[nrep - 1], kv_bytes, plan.work_size);

          if (!printed_sanity && type == GGML_TYPE_F16 && Lk == 4096 && Hq == 8 && nth == 1) {
            const float* o = (const float*)out->data;
            printf(
                "# sanity: type=F16 Lk=4096 Hq=8 Hkv=8 out[0..3] = %.6f %.6f %.6f %.6f (out "
                "ne=[%lld,%lld,%lld,%lld])\n",
                o[0], o[1], o[2], o[3], (long long)out->ne[0], (long long)out->ne[1],
                (long long)out->ne[2], (long long)out->ne[3]);
            printed_sanity = 1;
          }

          // reference check: required for F16/Lk=4096/8-8; also informational for Q8_0/Q4_0
          if (Lk == 4096 && Hq == 8 && Hkv == 8) {
            float* kf = malloc(sizeof(float) * nkv);
            float* vf = malloc(sizeof(float) * nkv);
            const struct ggml_type_traits* tt = ggml_get_type_traits(type);
            tt->to_float(k->data, kf, nkv);
            tt->to_float(v->data, vf, nkv);
            double* ref = malloc(sizeof(double) * D * Hq);
            reference((const float*)q->data, kf, vf, Lk, Hq, Hkv, scale, ref);
            // out is [D, Hq, Lq=1, 1] -> out[h*D + d]
            const float* o = (const float*)out->data;
            double max_abs = 0.0, max_ref = 0.0, max_rel_elem = 0.0;
            for (int i = 0; i < D * Hq; i++) {
              const double e = fabs((double)o[i] - ref[i]);
              if (e > max_abs)
                max_abs = e;
              if (fabs(ref[i]) > max_ref)
                max_ref = fabs(ref[i]);
            }
            for (int i = 0; i < D * Hq; i++) {
              // element-wise relative error, floor on |ref| at 10% of max|ref| to avoid /~0
              const double den = fmax(fabs(ref[i]), 0.1 * max_ref);
              const double e = fabs((double)o[i] - ref[i]) / den;
              if (e > max_rel_elem)
                max_rel_elem = e;
            }
            double se = 0.0, sr = 0.0;
            for (int i = 0; i < D * Hq; i++) {
              const double e = (double)o[i] - ref[i];
              se += e * e;
              sr += ref[i] * ref[i];
            }
            const double rel_l2 = sqrt(se / sr);
            const double rel = max_abs / max_ref;
            const int pass = rel <= 1e-2;
            printf(
                "# check vs double reference: type=%s Lk=4096 Hq=8 Hkv=8 threads=%d "
                "max_abs_err=%.3e max|ref|=%.3e "
                "max_err/max|ref|=%.3e rel_l2_err=%.3e max_elem_rel_err=%.3e -> %s%s\n",
                tname(type), nth, max_abs, max_ref, rel, rel_l2, max_rel_elem,
                pass ? "PASS" : "FAIL",
                type == GGML_TYPE_F16 ? " (max_err/max|ref| <= 1e-2)"
                                      : " (max_err/max|ref| <= 1e-2, informational)");
            if (!pass && type == GGML_TYPE_F16)
              check_failed = 1;
            if (type == GGML_TYPE_F16 && nth == 1) {
              // diagnostic: how much of the error is ggml's F16 VKQ accumulator?
              double* emu = malloc(sizeof(double) * D * Hq);
              emulate_f16_accum((const float*)q->data, kf, vf, Lk, Hq, Hkv, scale, emu);
              double e_emu_ref = 0.0, e_out_emu = 0.0;
              for (int i = 0; i < D * Hq; i++) {
                e_emu_ref = fmax(e_emu_ref, fabs(emu[i] - ref[i]));
                e_out_emu = fmax(e_out_emu, fabs((double)o[i] - emu[i]));
              }
              printf(
                  "# diag: emulated F16-accumulator reference: max|emu-ref|/max|ref|=%.3e  "
                  "max|ggml-emu|/max|ref|=%.3e\n",
                  e_emu_ref / max_ref, e_out_emu / max_ref);
              free(emu);
            }
            free(ref);
            free(kf);
            free(vf);
          }

          free(work);
        }
        ggml_free(ctx);
      }
    }
  }

  free(times);
  free(evict_buf);
  return check_failed ? 2 : 0;
}
