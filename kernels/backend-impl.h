/* backend-impl.h — private to kernels/: the function table every backend fills, and the
 * SIMD primitive table the CPU backend dispatches on at run time. */
#ifndef KVL_BACKEND_IMPL_H
#define KVL_BACKEND_IMPL_H

#include "kvl_kernels.h"

struct kvl_backend_ops {
  bool (*supports)(const kvl_backend_t *be, enum kvl_op op, uint32_t wtype);
  void (*matmul)(kvl_backend_t *be, const struct kvl_weight *w, const float *x, float *y, int n_tokens);
  void (*rmsnorm)(kvl_backend_t *be, const float *x, const float *w, float *y, int n_tokens, int n, float eps);
  void (*rope)(kvl_backend_t *be, const struct kvl_rope *r, float *x, const int32_t *pos, int n_tokens,
               int n_heads, bool inverse);
  void (*swiglu)(kvl_backend_t *be, const float *g, const float *u, float *y, int64_t n);
  void (*embed)(kvl_backend_t *be, const struct kvl_weight *t, const int32_t *ids, float *y, int n_tokens);
  void (*attention)(kvl_backend_t *be, const struct kvl_attn_args *a);
  /* optional (NULL: translator/apply.c translates on the host) */
  int (*translate)(kvl_backend_t *be, const struct kvl_tr_args *a, char *err, size_t errlen);
  /* optional (NULL: h += x on the host) */
  void (*add)(kvl_backend_t *be, float *h, const float *x, int64_t n);
  /* optional, all three or none (NULL: the backend keeps no activations; kvl_kernels.h) */
  void (*begin)(kvl_backend_t *be);
  void (*fetch)(kvl_backend_t *be, const void *p, size_t bytes);
  void (*end)(kvl_backend_t *be, const void *keep, size_t bytes);
  /* optional (NULL: no device) */
  bool (*traffic)(const kvl_backend_t *be, struct kvl_backend_traffic *t);
  /* optional (NULL: kvl_kv_store into the host pool) */
  void (*kv_put)(kvl_backend_t *be, const struct kvl_attn_args *a, const float *k, const float *v);
  /* optional (NULL, or false returned: kvl_logits_top answers false) */
  bool (*logits_top)(kvl_backend_t *be, const float *logits, int n_rows, int n_vocab, const int8_t *full,
                     const float *temperature, const double *u, struct kvl_logit_top *top, float *rows);
  /* optional, both or none (NULL: kvl_backend_host_register answers false) */
  bool (*host_register)(kvl_backend_t *be, void *p, size_t bytes);
  void (*host_unregister)(kvl_backend_t *be, void *p);
  /* optional (NULL: no copies left running into registered memory) */
  void (*host_sync)(kvl_backend_t *be, const void *p, size_t bytes);
  /* optional (NULL: every op has run when it returns) */
  void (*sync)(kvl_backend_t *be);
};

/* A backend that keeps copies of pools asks to hear of kvl_kv_pool_gone (at most 4). */
void kvl__kv_pool_gone_hook(void (*fn)(const void *base));

/* Vector primitives of one SIMD level (cpu/simd_*.c). All lengths in elements. */
struct kvl__simd {
  const char *name;
  float (*dot)(const float *a, const float *b, int64_t n);
  /* y[t*ldy + r] = sum_k w[r*K + k] * x[t*ldx + k], r < nr, t < nt (the portable level's
   * products; NULL where gemm_xt takes every size) */
  void (*gemm_tile)(const float *w, int nr, const float *x, int64_t ldx, int nt, float *y, int64_t ldy, int64_t K);
  void (*axpy)(float a, const float *x, float *y, int64_t n); /* y += a x */
  void (*scale)(float a, float *y, int64_t n);                /* y *= a */
  /* dequantise n elements of a row (bit-identical to kvl_dequant_row_ref) */
  int (*dequant)(uint32_t type, const void *src, float *dst, int64_t n);
  void (*swiglu)(const float *g, const float *u, float *y, int64_t n); /* y = silu(g) * u */
  /* Optional: y[t*ldy + r] (+)= sum_k w[r*ldw + k] * x_t[k] for r < nr, t < nt <= 16, k < K,
   * with the tokens interleaved (xg[k*16 + t]), in outer-product form: a (row, token) gets
   * the same bits in every batch. `more`: continue the sums already in y (a product split
   * over ranges of k gives the bits of the whole). Where a level has it, the matmul takes
   * it for every size. */
  void (*gemm_xt)(const float *w, int64_t ldw, int nr, const float *xg, int nt, float *y, int64_t ldy, int64_t K,
                  bool more);
  /* Optional: *out = the dot product of one quantised row of K elements with x, the weights
   * dequantised in registers (fp32, another order than dequant + dot); xs: the sums of x
   * per 16 elements (K/16). KVL_ENOTSUP for a format it does not cover. */
  int (*dequant_dot)(uint32_t type, const void *row, const float *x, const float *xs, int64_t K, float *out);
};

int kvl__dequant_avx512(uint32_t type, const void *src, float *dst, int64_t n);
int kvl__dequant_avx2(uint32_t type, const void *src, float *dst, int64_t n);
int kvl__dequant_dot_avx512(uint32_t type, const void *row, const float *x, const float *xs, int64_t K, float *out);
void kvl__swiglu_scalar(const float *g, const float *u, float *y, int64_t n);

/* Decode path with int8 activations (cpu/qdot_avx512.c, AVX-512 VNNI): quantise one row
 * of K activations per 32 (q, scales d[K/32], sums of 16 s16[K/16]); dot one weight row
 * with n_tokens such rows (token t at xq + t*K, xd + t*K/32, xs + t*K/16), unpacking each
 * weight unit once for all of them. KVL_ENOTSUP for formats it does not cover. */
#define KVL__QDOT_MAX_T 16
#define KVL__QDOT_USE_T 16 /* the matmul takes the int8 path up to this many tokens (cpu.c) */
#define KVL__QDOT1_MAX_T 6 /* up to this many tokens, the single-token kernel once per token (cpu.c) */
/* Rows rearranged for the one-token kernels (cpu.c makes these copies at load, through
 * kvl_backend_prepare, or at a weight's first decode product; KVL_DECODE_REPACK, a list
 * of q5_0, q4_k, q8_0, or all, or 0, says for which formats, default q5_0). qdot1,
 * qdot1n and qdot1_rows of the VNNI levels take them as these types, with the bits they
 * give the GGUF rows.
 *
 * KVL__TYPE_Q5_0_QUADS (K a multiple of 128): per row, the nb fp16 block scales first,
 * then per four blocks their 64 code bytes (block k's 16 at 16k) and two 64-bit masks of
 * their fifth bits (element i of block k at bit 16k + i: elements 0-15, then 16-31).
 * The GGUF row's bytes in another order, the same size.
 * KVL__TYPE_Q4_K_SB: per 256-element block, d and dmin (fp16), the eight 6-bit scales
 * and the eight mins as bytes, then the 128 code bytes: 148 bytes instead of 144.
 * KVL__TYPE_Q8_0_SC (K a multiple of 64): per row, the nb fp16 scales, then the codes
 * q + 128 as unsigned bytes, 32 per block: the same size. */
#define KVL__TYPE_Q5_0_QUADS 0x106u /* 0x100 + the GGUF type */
#define KVL__TYPE_Q8_0_SC 0x108u
#define KVL__TYPE_Q4_K_SB 0x10cu
#define KVL__Q4_K_SB_BYTES 148
void kvl__q5_0_quads_pack(const void *src, void *dst, int64_t rows, int64_t K);
void kvl__q4_k_sb_pack(const void *src, void *dst, int64_t rows, int64_t K);
void kvl__q8_0_sc_pack(const void *src, void *dst, int64_t rows, int64_t K);
/* w's copy for the one-token kernels, made now if it is not there (cpu.c), with its type
 * and row size; NULL where none is kept: a format or K without a copy, no slot, another
 * backend's copy in it, memory short, or turned off (KVL_DECODE_REPACK, KVL_DECODE=exact) */
const void *kvl__decode_copy(const struct kvl_weight *w, uint32_t *type, size_t *row_bytes);
/* the bytes of every repacked copy in the process (kvl_wpack_total_bytes), +/- delta */
void kvl__wpack_count(long long delta);
void kvl__q8_act(const float *x, int64_t K, int8_t *q, float *d, int32_t *s16);
int kvl__qdot_avx512vnni(uint32_t type, const void *w, int64_t K, const int8_t *xq, const float *xd,
                         const int32_t *xs, int n_tokens, float *out);
/* One token, with its codes also in the order the format's kernel reads them
 * (kvl__q8_order: 16-byte chunks of every 128 codes permuted; false, xp untouched, for a
 * format that reads xq): Q4_K unpacks two 64-element units and Q5_0 four blocks with one
 * 512-bit load each; the other formats read xq. */
bool kvl__q8_order(uint32_t type, const int8_t *xq, int64_t K, int8_t *xp);
/* Q4_K's activation side of one token prepared once per product (K % 256 == 0; cpu.c, any
 * processor): per 256-element block, its eight scales d, then the eight d x (code sum of
 * each 32): K/16 floats. The single-token Q4_K kernel takes them as xf (NULL: the natural-order kernel). */
void kvl__q4_k_act_factors(const float *xd, const int32_t *xs, int64_t K, float *xf);
int kvl__qdot1_avx512vnni(uint32_t type, const void *w, int64_t K, const int8_t *xq, const int8_t *xp,
                          const float *xd, const int32_t *xs, const float *xf, float *out);
/* The single-token kernel for 2..6 tokens at once (token t's arrays at t x their per-token
 * length, as qdot1 takes them one at a time): each weight block unpacked once, each
 * token's result bit-identical to qdot1's for it alone. The four int8 formats (Q4_K with
 * xf; K a multiple of 64); KVL_ENOTSUP otherwise (run qdot1 per token). */
int kvl__qdot1n_avx512vnni(uint32_t type, const void *w, int64_t K, int n_tokens, const int8_t *xq, const int8_t *xp,
                           const float *xd, const int32_t *xs, const float *xf, float *out);
/* One token against a run of rows (the qdot1_rows contract of struct kvl_backend): each
 * row the bits qdot1 gives it; Q4_K needs xf. */
int kvl__qdot1_rows_avx512vnni(uint32_t type, const void *w, size_t row_bytes, int64_t n_rows, int64_t K,
                               const int8_t *xq, const int8_t *xp, const float *xd, const int32_t *xs,
                               const float *xf, const float *bias, float *y);
/* The same for 2..16 tokens with the per-token scales prepared as vectors (K % 64 == 0):
 * sx, cx hold K/4 floats per token (kvl__q8_act_vec from one token's d and s16). */
void kvl__q8_act_vec(const float *xd, const int32_t *s16, int64_t K, float *sx, float *cx);
int kvl__qdot_vec_avx512vnni(uint32_t type, const void *w, int64_t K, const int8_t *xq, const float *sx,
                             const float *cx, int n_tokens, float *out);
/* The same contract on AVX2 (cpu/qdot_avx2.c, vpmaddubsw): the activation quantiser (the
 * same codes, scales and sums as kvl__q8_act) and the products for 1..16 tokens. */
void kvl__q8_act_avx2(const float *x, int64_t K, int8_t *q, float *d, int32_t *s16);
int kvl__qdot_avx2(uint32_t type, const void *w, int64_t K, const int8_t *xq, const float *xd, const int32_t *xs,
                   int n_tokens, float *out);
/* One token and 1..6 tokens (the qdot1 and qdot1n contracts below), and one token against
 * a run of rows (qdot1_rows): Q4_K on the factors xf and Q6_K with its group scales in the
 * integer sums, reading xq in natural order (xp unused: the level has no q8_order); Q8_0
 * and Q5_0 as kvl__qdot_avx2 (whose tokens' results do not depend on each other). */
int kvl__qdot1_avx2(uint32_t type, const void *w, int64_t K, const int8_t *xq, const int8_t *xp, const float *xd,
                    const int32_t *xs, const float *xf, float *out);
int kvl__qdot1_rows_avx2(uint32_t type, const void *w, size_t row_bytes, int64_t n_rows, int64_t K, const int8_t *xq,
                         const int8_t *xp, const float *xd, const int32_t *xs, const float *xf, const float *bias,
                         float *y);
int kvl__qdot1n_avx2(uint32_t type, const void *w, int64_t K, int n_tokens, const int8_t *xq, const int8_t *xp,
                     const float *xd, const int32_t *xs, const float *xf, float *out);
/* The same products on AMX int8 tiles (cpu/qdot_amx.c), a whole matmul at once:
 * y[t*N + r] = row r · token t (+ bias[r]) for N rows of row_bytes and any number of
 * tokens quantised as above; whether the processor and the kernel allow the tiles
 * (KVL_AMX=0: never). */
bool kvl__amx_usable(void);
int kvl__qmatmul_amx(uint32_t type, const void *w, size_t row_bytes, int64_t N, int64_t K, const int8_t *xq,
                     const float *xd, const int32_t *xs, int n_tokens, const float *bias, float *y);
/* The same contract with AVX2 only (cpu/qmatmul_avx2.c): 8 tokens per vector, 4 rows per
 * block, for any number of tokens; batch-invariant like the tiles. */
int kvl__qmatmul_avx2(uint32_t type, const void *w, size_t row_bytes, int64_t N, int64_t K, const int8_t *xq,
                      const float *xd, const int32_t *xs, int n_tokens, const float *bias, float *y);
/* The same with AVX-512 VNNI (cpu/qmatmul_avx512.c): 16 tokens per vector, vpdpbusd. */
int kvl__qmatmul_avx512vnni(uint32_t type, const void *w, size_t row_bytes, int64_t N, int64_t K, const int8_t *xq,
                            const float *xd, const int32_t *xs, int n_tokens, const float *bias, float *y);

/* The tiles of the tiled attention (cpu/cpu.c): runs of consecutive positions of one
 * sequence, at most tq tokens each; tile i is tokens tile[i] .. tile[i+1]-1 (tile holds
 * n_tokens + 1 entries). Returns the number of tiles. */
int kvl__attn_tiles(const struct kvl_attn_args *a, int tq, int *tile);
/* The attention's next step on its way to L1 while this one runs: the rows of KV head kh
 * in the nb blocks from key position j0 (none past `last`) of the block table bt. */
void kvl__attn_prefetch(const struct kvl_attn_args *a, const int32_t *bt, int j0, int nb, int kh, int last);
/* Attention tiled over query rows and KV blocks (cpu/attn_avx512.c, AVX-512F/BW/VL):
 * whether it takes these arguments (head_dim a multiple of 16, at most 256), and the op. */
bool kvl__attention_avx512_fits(const struct kvl_attn_args *a);
void kvl__attention_avx512(const struct kvl_attn_args *a, bool bf16);
/* whether the CPU backend's AVX-512 attention runs its bf16 products (bf16 KV, heads of 64
 * or 128): AVX512_BF16 present and KVL_ATTN not "fp32" */
bool kvl__attn_bf16(void);

/* The same tiling on AVX2 (cpu/attn_avx2.c): head_dim a multiple of 8, at most 512. */
bool kvl__attention_avx2_fits(const struct kvl_attn_args *a);
void kvl__attention_avx2(const struct kvl_attn_args *a);

extern const struct kvl__simd kvl__simd_scalar;
extern const struct kvl__simd kvl__simd_avx2;
extern const struct kvl__simd kvl__simd_avx512;

/* bf16 GEMMs through oneDNN on repacked weights (cpu/gemm_bf16.c): whether this process
 * can run them, y = x·Wᵀ (+ bias) for any number of tokens (64-row blocks: batch-invariant;
 * KVL_ENOTSUP / KVL_ENOMEM: compute it another way), and oneDNN's implementation name. */
bool kvl__bf16_gemm_usable(void);
int kvl__bf16_matmul(const struct kvl__simd *s, const struct kvl_weight *w, const float *x, float *y, int n_tokens);
const char *kvl__bf16_gemm_impl(void);

struct kvl_backend {
  const char *name;                  /* "cpu-avx512", ... */
  const struct kvl_backend_ops *ops;
  const struct kvl__simd *simd;      /* CPU backend: the dispatched level */
  /* CPU backend: int8-activation decode kernels (NULL where the level has none), and the
   * quantiser of their activations (set wherever qdot or qmatmul is) */
  void (*q8_act)(const float *x, int64_t K, int8_t *q, float *d, int32_t *s16);
  int (*qdot)(uint32_t type, const void *w, int64_t K, const int8_t *xq, const float *xd, const int32_t *xs,
              int n_tokens, float *out);
  int (*qdot1)(uint32_t type, const void *w, int64_t K, const int8_t *xq, const int8_t *xp, const float *xd,
               const int32_t *xs, const float *xf, float *out);
  /* one token against n_rows consecutive rows (row_bytes apart), each row's result plus
   * its bias (NULL: none) to y[r], with the bits qdot1 gives that row (xq, xp, xd, xs, xf
   * as qdot1's); nonzero: the format not covered (run qdot1 per row) */
  int (*qdot1_rows)(uint32_t type, const void *w, size_t row_bytes, int64_t n_rows, int64_t K, const int8_t *xq,
                    const int8_t *xp, const float *xd, const int32_t *xs, const float *xf, const float *bias,
                    float *y);
  /* the order qdot1 and qdot1n read a token's codes in, xp (kvl__q8_order); NULL: natural
   * order, xp = xq */
  bool (*q8_order)(uint32_t type, const int8_t *xq, int64_t K, int8_t *xp);
  int (*qdot_vec)(uint32_t type, const void *w, int64_t K, const int8_t *xq, const float *sx, const float *cx,
                  int n_tokens, float *out);
  int (*qdot1n)(uint32_t type, const void *w, int64_t K, int n_tokens, const int8_t *xq, const int8_t *xp,
                const float *xd, const int32_t *xs, const float *xf, float *out);
  bool decode_copies; /* CPU backend: qdot1, qdot1n and qdot1_rows take kvl__decode_copy's types */
  int qdot_max_t; /* CPU backend: the int8 decode kernels take products of up to this many
                   * tokens, fp32 above (0: KVL__QDOT_USE_T); KVL_DECODE_INT8_MAX=N overrides */
  int bf16_min_t; /* CPU backend: products of at least this many tokens in bf16 (0: never) */
  /* CPU backend: products of at least qmatmul_min_t tokens on the int8 formats through
   * qmatmul (AMX tiles, or the AVX2 tokens-in-lanes kernel; 0: never) */
  int (*qmatmul)(uint32_t type, const void *w, size_t row_bytes, int64_t N, int64_t K, const int8_t *xq,
                 const float *xd, const int32_t *xs, int n_tokens, const float *bias, float *y);
  int qmatmul_min_t;
  /* CPU backend: one-token products as fp32 dot products, each row dequantised and dotted
   * along k (the sink twin of the int8 levels, kvl_backend_fp32: the attention sink's rows
   * are computed one per product, so no batch has to match their bits) */
  bool row_dots;
};

#endif
