/* kvl_kernels.h — the compute operations of a forward pass, behind one backend
 * interface (ggml-backend is the model), and their scalar references.
 *
 *   kvl_backend_t *be = kvl_backend_cpu();           // runtime-dispatched SIMD
 *   struct kvl_weight w = {KVL_TYPE_Q4_K, 1536, 256, data, NULL};
 *   kvl_matmul(be, &w, x, y, n_tokens);              // y[T][256] = x[T][1536] · Wᵀ (+ bias)
 *   kvl_matmul_ref(&w, x, y_ref, n_tokens);          // the slow truth, for tests
 *
 * Conventions. Activations are fp32, row-major, one row per token: x[T][n]. A weight
 * is GGUF's: `rows` rows of `cols` elements (ne[0] = cols), y = x · Wᵀ. The KV cache
 * is paged: a block holds KVL_KV_BLOCK tokens of every layer (block-major, so a block is
 * the unit of copying between tiers), keys stored after RoPE. A block table maps a
 * sequence's logical block i (positions 16i .. 16i+15) to a physical block of the pool.
 *
 * Ownership: every function writes only its output arguments; none allocates memory
 * the caller must free, except kvl_backend_* handles (static, never freed).
 */
#ifndef KVL_KERNELS_H
#define KVL_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvl_quant.h"

#define KVL_KV_BLOCK 16 /* tokens per KV block */

/* A weight matrix, used in place (usually from the GGUF mapping). */
/* Where a backend may keep its own repacked copy of a weight (the CPU level "avx512bf16":
 * bf16 in oneDNN's blocked layout, made at the weight's first prefill-sized product; the
 * int8 levels with AVX-512 VNNI: Q5_0 rearranged for decode, kvl_backend_prepare). One
 * copy per slot: a backend that finds another's copy there does without its own. The
 * weight's owner provides a zeroed slot and releases it (kvl_model_free does). */
struct kvl_wpack {
  void *impl;
  size_t bytes;        /* what the copy takes */
  const void *owner;   /* which backend made it (another one leaves the slot alone) */
  void (*release)(struct kvl_wpack *p); /* set by the owner; kvl_wpack_release calls it */
};
void kvl_wpack_release(struct kvl_wpack *p);
/* Bytes of every repacked host copy alive in the process (for reports and /metrics). */
size_t kvl_wpack_total_bytes(void);

struct kvl_weight {
  uint32_t type;       /* enum kvl_type */
  int64_t cols;        /* elements per row (GGUF ne[0]); the input width */
  int64_t rows;        /* number of rows (ne[1]); the output width */
  const void *data;    /* rows * kvl_row_size(type, cols) bytes */
  const float *bias;   /* optional, `rows` values added to every output row */
  struct kvl_wpack *pack; /* optional: a slot for a backend's repacked copy (NULL: none kept) */
};

/* Storage type of the KV pool. */
enum kvl_kv_dtype { KVL_KV_F32 = 0, KVL_KV_BF16 = 1 };

/* Geometry of one model's KV pool. */
struct kvl_kv_layout {
  int n_layer;          /* layers, each with K and V */
  int n_kv_head;        /* KV heads */
  int head_dim;         /* elements per head */
  enum kvl_kv_dtype dtype;
};

/* Bytes of one block (all layers, K and V, KVL_KV_BLOCK tokens). */
size_t kvl_kv_block_bytes(const struct kvl_kv_layout *l);

/* Large zeroed memory (a KV pool's arena, a model's weights) in private anonymous pages
 * aligned to 2 MiB and advised as huge pages (MADV_HUGEPAGE: used where transparent huge
 * pages are in "madvise" or "always" mode, plain 4 KiB pages otherwise). *mapped gets the
 * size to give kvl_huge_free (bytes rounded up to 2 MiB). NULL with errno on failure. */
void *kvl_huge_alloc(size_t bytes, size_t *mapped);
void kvl_huge_free(void *p, size_t mapped);

/* Fault in every page of [p, p + bytes) for writing now (MADV_POPULATE_WRITE, Linux 5.14;
 * older kernels: a write to each 4 KiB page, of the byte already there), so a later first
 * write does not pay the page fault: up to ~2 ms per MiB on a VM, with the kernel zeroing
 * and, for huge pages, compacting. Contents are unchanged. Runs on up to 4 short-lived
 * threads of its own (no OpenMP team is left behind on the caller's thread); returns the
 * milliseconds it took. */
double kvl_huge_prefault(void *p, size_t bytes);

/* RoPE, neox layout (pairs i and i + d/2), as Qwen2 uses it. inv_freq[i] =
 * theta^(-2i/d) for i < d/2, computed once; angles are pos * inv_freq[i]. */
struct kvl_rope {
  int head_dim;
  float theta;
  float inv_freq[256]; /* head_dim / 2 used; head_dim <= 512 */
};
int kvl_rope_init(struct kvl_rope *r, int head_dim, float theta);
/* cos/sin of position `pos` for every pair: the one table generator used by the
 * forward rotation, its inverse, and the oracles. */
void kvl_rope_table(const struct kvl_rope *r, int32_t pos, float *cos_out, float *sin_out);
/* Rotate x[T][n_heads * head_dim] with tables made by kvl_rope_table: cos_t, sin_t are
 * [T][head_dim / 2] (one row per token). The same arithmetic as kvl_rope; for callers that
 * rotate many rows at the same positions (translation: every layer, every source layer)
 * and should not recompute the sines each time. */
void kvl_rope_tab(const float *cos_t, const float *sin_t, float *x, int n_tokens, int n_heads, int head_dim,
                  bool inverse);

/* One attention call: for every token t of the batch, its query heads attend over the
 * positions 0 .. pos[t] of its sequence in the cache (causal), reading through the
 * sequence's block table. The tokens' own K/V must already be stored. */
struct kvl_attn_args {
  int n_tokens;
  const float *q;              /* [T][n_head * head_dim], already rotated */
  float *out;                  /* [T][n_head * head_dim] */
  const int32_t *pos;          /* [T] position of each token */
  const int32_t *seq;          /* [T] sequence index of each token */
  const int32_t *const *block_tables; /* [n_seqs] -> physical block ids */
  int n_head;                  /* query heads (a multiple of n_kv_head: grouped KV) */
  int layer;
  const struct kvl_kv_layout *kv;
  const void *kv_base;         /* the pool: block b at kv_base + b * kvl_kv_block_bytes */
  float scale;                 /* usually 1/sqrt(head_dim) */
  /* Optional: the pool's write stamps, one per physical block (kv_blocks of them), for a
   * backend that keeps a copy of the pool on its device. A block's stamp changes (to a new
   * value from kvl_kv_stamp_new) whenever its host bytes are written other than into both
   * the host and the copy: kvl_kv_put on a backend that keeps no copy of this pool (the
   * CPU's) renews the stamps of the blocks it writes. The backend copies a block again
   * when its stamp is not the one it copied. NULL: no copy kept, the blocks are read from
   * the host pool. */
  uint64_t *kv_stamps;
  int32_t kv_blocks;
};

/* A write stamp never handed out before in this process (never 0), so a copy made under
 * one stamp cannot match a block written since, even in another pool at the same address. */
uint64_t kvl_kv_stamp_new(void);
/* The same marked fresh (KVL_KV_STAMP_FRESH set): the block was handed out new, and no row
 * of it is read before the forward writes it through kvl_kv_put (into the host pool and a
 * device's copy alike), so a device need not copy the block's old bytes in. */
#define KVL_KV_STAMP_FRESH (1ull << 63)
uint64_t kvl_kv_stamp_fresh(void);
/* The pool whose host arena is at base is about to be freed: a backend that keeps a copy of
 * it (kv_stamps) lets the copy go now instead of when another pool needs the room. The
 * pool's owner calls it (kvl_pool_free does). */
void kvl_kv_pool_gone(const void *base);
/* New stamps for the blocks a's tokens are in (a->kv_stamps; nothing where NULL): their rows
 * were written in the host pool only. */
void kvl_kv_stamp_rows(const struct kvl_attn_args *a);

/* Where one (block, layer) keeps its keys and values. */
void *kvl_kv_k_ptr(const struct kvl_kv_layout *l, void *base, int32_t block, int layer);
void *kvl_kv_v_ptr(const struct kvl_kv_layout *l, void *base, int32_t block, int layer);

/* Store K and V rows ([T][n_kv_head*head_dim], fp32) of one layer at (seq, pos). */
void kvl_kv_store(const struct kvl_kv_layout *l, void *base, int layer, int n_tokens,
                  const float *k, const float *v, const int32_t *pos, const int32_t *seq,
                  const int32_t *const *block_tables);
/* Read back the K and V rows of one position (fp32), e.g. to un-rotate keys. */
void kvl_kv_load(const struct kvl_kv_layout *l, const void *base, int layer, int32_t pos,
                 const int32_t *block_table, float *k, float *v);
/* The same as bf16, the keys rotated back first (inverse RoPE with this position's
 * tables, head_dim / 2 each, from kvl_rope_table): translation's source rows. The same
 * bits as kvl_kv_load + kvl_rope_tab(inverse) + rounding to bf16; values are copied as
 * they are when the cache is bf16. Either output may be NULL. */
void kvl_kv_load_unrotated_bf16(const struct kvl_kv_layout *l, const void *base, int layer, int32_t pos,
                                const int32_t *block_table, const float *cos_t, const float *sin_t, uint16_t *k,
                                uint16_t *v);

/* ---- backends ---------------------------------------------------------------------- */

typedef struct kvl_backend kvl_backend_t;

enum kvl_op {
  KVL_OP_MATMUL,
  KVL_OP_RMSNORM,
  KVL_OP_ROPE,
  KVL_OP_SWIGLU,
  KVL_OP_EMBED,
  KVL_OP_ATTENTION,
  KVL_OP_COUNT_
};

/* The CPU backend with the best SIMD path this processor has (AMX int8 tiles for prefill
 * and batched decode with the VNNI kernels for single tokens; AVX-512 VNNI with int8
 * activations for prefill and batches of 7+ (tokens in lanes) and its per-token int8
 * kernels below; AVX2 the same way from 6 tokens; or plain C), or the one forced by
 * KVL_CPU=scalar|avx2|avx2int8|avx2int8mm|avx512|avx512vnni|avx512vnnimm|amx|avx512bf16
 * (an unsupported choice falls back with a warning; avx2int8 and avx512vnni: the
 * per-token int8 kernels up to 16 tokens, fp32 above and for prefill). "avx512bf16" adds
 * bf16 prefill GEMMs (oneDNN; AMX tiles where present) on repacked weights; it is chosen
 * only when asked for. Static: never freed. */
kvl_backend_t *kvl_backend_cpu(void);
/* Denormals flushed to zero (FTZ and DAZ) on the calling thread and its OpenMP team,
 * once per thread: every forward pass calls it (kvl_model_forward). KVL_DENORMALS=keep
 * turns it off. */
void kvl_cpu_flush_denormals(void);
/* A CPU backend with an explicit level ("scalar", "avx2", "avx2int8", "avx2int8mm", "avx512",
 * "avx512vnni", "avx512vnnimm", "amx", "avx512bf16"), or NULL if this processor cannot run
 * it. For tests and benchmarks. */
kvl_backend_t *kvl_backend_cpu_level(const char *level);
/* The level kvl_backend_cpu picks when KVL_CPU does not say: the first this processor runs
 * of amx, avx512vnnimm, avx512vnni, avx512, avx2int8mm, avx2, scalar. */
kvl_backend_t *kvl_backend_cpu_auto(void);
/* The CUDA backend (kernels/cuda/: cuBLASLt bf16 GEMMs on weights dequantised at first
 * use, own kernels for the other ops) on device KVL_CUDA_DEVICE (default 0), with a device
 * arena of KVL_CUDA_MEM_MIB (default 80% of the free memory); or NULL with the reason in
 * why (built without CUDA, no device, a device older than compute 8.0). The interface's
 * arrays stay host arrays (kvl_backend_begin: kept on the device between ops); a pool
 * whose attention calls carry write stamps is copied to the device block by block and
 * kept there (kvl_attn_args), otherwise attention copies the blocks it reads each call.
 * Static: never freed. */
kvl_backend_t *kvl_backend_cuda(char *why, size_t whylen);
/* The scalar references (kernels/ref/) behind the backend interface: a whole forward
 * pass on the slow truth, for tests. */
kvl_backend_t *kvl_backend_ref(void);
const char *kvl_backend_name(const kvl_backend_t *be);
/* The products of this backend's attention over a cache of kv_bf16 ? bf16 : fp32 values,
 * for logs and benchmark records: "bf16" on the CPU's AVX-512 levels where the processor
 * has AVX512_BF16 (bf16 cache, heads of 64 and 128; KVL_ATTN=fp32 turns it off), "fp32"
 * on the other CPU levels; NULL for other backends. */
const char *kvl_backend_attention(const kvl_backend_t *be, bool kv_bf16);
/* The same backend for batches whose numerics should not depend on how they were batched
 * (prefill chunks, the attention sink): the CPU levels drop their int8 decode kernels
 * (fp32), except the AMX level, whose tiles are batch-invariant (a row's result depends on
 * its own activations only) and take every size. Returns be itself when it has nothing to
 * drop. */
kvl_backend_t *kvl_backend_exact(kvl_backend_t *be);
/* The same backend computing in fp32 throughout (no int8 activations, no bf16 GEMMs):
 * for the attention sink's rows (position 0: every later position attends to it) and for
 * the captures that translators are fitted and distilled on. */
kvl_backend_t *kvl_backend_fp32(kvl_backend_t *be);
bool kvl_backend_supports(const kvl_backend_t *be, enum kvl_op op, uint32_t weight_type);

/* y[T][rows] = x[T][cols] · Wᵀ + bias */
void kvl_matmul(kvl_backend_t *be, const struct kvl_weight *w, const float *x, float *y, int n_tokens);
/* Make now the copy of w that be would make at w's first products (kept in w->pack; a
 * no-op where be makes none): the CPU levels with AVX-512 VNNI rearrange Q5_0 for their
 * one-token kernels (KVL_DECODE_REPACK=0: not; =all: Q4_K and Q8_0 too). A loader calls
 * it so that the first request does not pay for it. */
void kvl_backend_prepare(kvl_backend_t *be, const struct kvl_weight *w);
/* y[T][n] = x / sqrt(mean(x²) + eps) * w, row by row (y may be x) */
void kvl_rmsnorm(kvl_backend_t *be, const float *x, const float *w, float *y, int n_tokens, int n, float eps);
/* rotate x[T][n_heads * head_dim] in place at pos[T]; inverse = rotate back */
void kvl_rope(kvl_backend_t *be, const struct kvl_rope *r, float *x, const int32_t *pos, int n_tokens,
              int n_heads, bool inverse);
/* y[i] = silu(gate[i]) * up[i] */
void kvl_swiglu(kvl_backend_t *be, const float *gate, const float *up, float *y, int64_t n);
/* y[T][cols] = rows ids[T] of the (possibly quantised) table */
void kvl_embed(kvl_backend_t *be, const struct kvl_weight *table, const int32_t *ids, float *y, int n_tokens);
void kvl_attention(kvl_backend_t *be, const struct kvl_attn_args *a);
/* h[i] += x[i] */
void kvl_add(kvl_backend_t *be, float *h, const float *x, int64_t n);
/* Store the K and V rows k, v ([T][n_kv_head * head_dim], fp32) of a's tokens at layer
 * a->layer (a's n_tokens, pos, seq, block_tables, layer, kv, kv_base; q and out unused):
 * into the host pool, as kvl_kv_store, and, where the backend keeps a device copy of the
 * pool (a->kv_stamps given), into that copy too, so the block stays current there; a
 * backend without a copy renews the blocks' stamps (kvl_kv_stamp_rows). Within a
 * begin/end bracket k and v may be an op's outputs still on the device, and on a device
 * backend the host pool may get them only at kvl_backend_end. */
void kvl_kv_put(kvl_backend_t *be, const struct kvl_attn_args *a, const float *k, const float *v);

/* Activations kept on a backend's device between ops. Between kvl_backend_begin and
 * kvl_backend_end (on one thread; no nesting), an op's output may stay on the device with
 * the host buffer it names stale, and a later op reading that buffer takes the device's
 * copy. So within the bracket the caller reads an op's output on the host only after
 * kvl_backend_fetch of its range, writes no buffer an op wrote (kvl_add instead), and
 * frees none before kvl_backend_end. end brings the range [keep, keep + bytes) to the
 * host and drops the rest: any other buffer an op wrote in the bracket and that was not
 * fetched since holds stale bytes (scratch, for the caller). Outside the bracket, and on
 * backends that keep nothing (the CPU's: no-ops), every op's output is in host memory
 * when it returns. */
void kvl_backend_begin(kvl_backend_t *be);
void kvl_backend_fetch(kvl_backend_t *be, const void *p, size_t bytes);
void kvl_backend_end(kvl_backend_t *be, const void *keep, size_t bytes);
/* A backend's copies between host and device since it started, their bytes, and its waits
 * for the device; false (t zeroed) for a backend without a device (the CPU's). */
struct kvl_backend_traffic {
  unsigned long long copies_in, copies_out, bytes_in, bytes_out, waits;
  unsigned long long bytes_pageable; /* of bytes_in and bytes_out: to or from host memory that was
                                        not pinned (no staging ring, no kvl_backend_host_register) */
};

/* Host memory that the backend's device copies to and from often (a KV pool's arenas:
 * kvl_pool_pin) made pinned — page-locked and mapped for the device's DMA — so those
 * copies run asynchronously at the bus's speed instead of through the driver's pageable
 * staging. True where it is; false, nothing done, where the backend has no device (the
 * CPU's), the driver refused (the copies then take the pageable path, as before), or
 * KVL_CUDA_PIN_POOLS=0. Unregister before the memory is freed. */
bool kvl_backend_host_register(kvl_backend_t *be, void *p, size_t bytes);
void kvl_backend_host_unregister(kvl_backend_t *be, void *p);
/* A backend may leave copies into registered memory running when an op returns (the CUDA
 * backend: a translation's target blocks, written back on a second stream while the next
 * step runs); it orders its own later ops after them. Before anyone else reads or writes
 * host bytes in [p, p + bytes) (p NULL: all registered memory) kvl_backend_host_sync
 * waits for those copies (the pool calls it for its own host copies: kvl_kvpool.h). */
void kvl_backend_host_sync(kvl_backend_t *be, const void *p, size_t bytes);
/* An op may also return with its device work still queued (the CUDA backend's
 * translation into a kept pool: the next op runs after it in the device's order).
 * kvl_backend_sync returns when everything queued on the backend's device has run (not
 * the copies kvl_backend_host_sync waits for); on the CPU at once. For timings. */
void kvl_backend_sync(kvl_backend_t *be);
bool kvl_backend_traffic(const kvl_backend_t *be, struct kvl_backend_traffic *t);

/* A row of logits summarised for sampling, so that a decode step's logits can stay on a
 * device and only this crosses (552 bytes instead of 4 x n_vocab): the row's
 * KVL_LOGIT_TOP largest entries, its log-partition and its entropy. The entries are
 * taken as the sampler takes logits: NaN as -inf, +inf as FLT_MAX; val holds them so
 * cleaned (-0 kept), the order is descending with the lower id first on ties (-0 and +0
 * tie), and of tied entries at the cut the lower ids are kept. lse and entropy sum in
 * double over the whole row; a row without a finite entry has lse -inf, entropy 0. */
#define KVL_LOGIT_TOP 64
/* a logit as the sampler and the summaries take it: NaN -> -inf, +inf -> FLT_MAX */
static inline float kvl_logit_clean(float x) { /* (builtins: this header pulls in no math.h) */
  if (x != x) return -__builtin_inff();
  return x > __FLT_MAX__ ? __FLT_MAX__ : x;
}
struct kvl_logit_top {
  float lse;     /* log sum_i exp(l_i): l_i - lse is log_softmax(l)_i */
  float entropy; /* -sum_i p_i log p_i of softmax(l), nats */
  int32_t n;     /* entries in val/id: min(KVL_LOGIT_TOP, n_vocab) */
  int32_t full;  /* kvl_model_forward_top: nonzero when the row itself was written instead */
  /* A draw from the whole row at a temperature, where asked (in: temperature > 0 and u in
   * [0, 1)): with p_i = expf((l_i - max) / temperature), the first token, in id order,
   * whose cumulative p passes u x sum p (the sampler's draw without truncation); the
   * cumulative sums in double, in chunks of consecutive ids, so the device's may differ
   * from the host's in the last bits (a different token only where u falls within
   * rounding of a boundary). drawn -1 where not asked. */
  float temperature; /* in */
  int32_t drawn;     /* out: the token */
  double u;          /* in */
  float drawn_val;   /* out: its (cleaned) logit */
  int32_t drawn_rank; /* out: 1 + the number of entries larger than it */
  float val[KVL_LOGIT_TOP];
  int32_t id[KVL_LOGIT_TOP];
};
/* The summary of one row of n_vocab logits, on the host (the reference); the draw where
 * out->temperature > 0 (out->u read). */
void kvl_logits_top_ref(const float *row, int n_vocab, struct kvl_logit_top *out);
/* The summaries of logits [n_rows][n_vocab] into top[n_rows] (their `full` untouched; the
 * draw of row r where temperature[r] > 0, at u[r]: both NULL for none), and
 * the rows with full[r] nonzero (full NULL: none) copied, in order, to rows
 * [n_full][n_vocab], on a backend with a device, where within a begin/end bracket logits
 * may be the output head's result still there and top and rows are outputs as any op's.
 * Returns false, doing nothing, on a backend without the op (the CPU's: its logits are on
 * the host already, and kvl_logits_top_ref summarises a row there), for n_rows 0, or where
 * the backend declines (CUDA with KVL_CUDA_LOGITS_TOP=0). */
bool kvl_logits_top(kvl_backend_t *be, const float *logits, int n_rows, int n_vocab, const int8_t *full,
                    const float *temperature, const double *u, struct kvl_logit_top *top, float *rows);

/* Translation on a backend's own device (DESIGN.md "Translation"): what translator/ hands a
 * backend that has the op. Every target layer's K and V rows of the span are
 *   y = sum_j unrotate(src K or V row of layer sources[j]) . w_j (+ bias),
 * the keys rotated with the target's RoPE, stored at the target positions; source rows
 * rounded to bf16, maps in bf16, products accumulated in fp32 (as kvl_translator_use_bf16
 * on the CPU). A backend without the op (the CPU's: translator/apply.c does the work there)
 * answers KVL_ENOTSUP. */
struct kvl_tr_map_ref {
  int32_t nu;             /* source layers read */
  const int32_t *sources; /* nu source layer ids, in concatenation order */
  const float *w;         /* [nu * w_src][w_dst] row-major fp32 */
  const float *bias;      /* [w_dst] intercept, or NULL */
};
struct kvl_tr_args {
  const struct kvl_kv_layout *src_layout, *dst_layout;
  const void *src_base;            /* the source pool (host memory) */
  void *dst_base;                  /* the target pool (host memory; written) */
  const int32_t *src_table, *dst_table; /* one sequence each: logical -> physical block */
  const int32_t *src_pos, *dst_pos;     /* [n] */
  int32_t n;
  const struct kvl_rope *src_rope, *dst_rope;
  const struct kvl_tr_map_ref *maps; /* [dst_layout->n_layer * 2]: layer l's K at 2l, V at 2l + 1 */
  struct kvl_wpack *pack;          /* the backend's copy of these maps, kept across calls (NULL:
                                      made for the call); the caller releases it when the maps change */
  const uint64_t *src_stamps, *dst_stamps; /* optional: kvl_translate_span's */
  int32_t src_blocks, dst_blocks;
};
int kvl_backend_translate(kvl_backend_t *be, const struct kvl_tr_args *a, char *err, size_t errlen);
bool kvl_backend_can_translate(const kvl_backend_t *be);

/* C[M][N] = alpha · op(A) · op(B) + beta · C, row-major fp32, op = transpose where asked:
 * the dense products of translation and training (cpu/sgemm.c: oneDNN, OpenBLAS as the
 * fallback or with KVL_SGEMM=openblas). */
void kvl_sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
               const float *B, int64_t ldb, float beta, float *C, int64_t ldc);

/* C[M][N] = A·B (+ bias[N]) with A [M][K] and B [K][N] in bf16, row-major with leading
 * dimensions lda and ldb, accumulated in fp32 into C [M][N] (ldc = N): oneDNN's matmul on
 * AVX512-BF16, or on AMX tiles where present (cpu/gemm_bf16.c). The products of
 * translation when its maps are kept in bf16 (kvl_translator_use_bf16). Each distinct
 * (M, N, K, lda, ldb, bias) compiles one primitive, kept for the process (at most 64):
 * callers round M to a few sizes. kvl_gemm_bf16_usable() says whether this processor can;
 * kvl_gemm_bf16 returns 0, or KVL_ENOTSUP when it cannot (compute it in fp32 then). */
bool kvl_gemm_bf16_usable(void);
int kvl_gemm_bf16(int64_t M, int64_t N, int64_t K, const uint16_t *A, int64_t lda, const uint16_t *B, int64_t ldb,
                  const float *bias, float *C, int64_t ldc);

/* ---- scalar references (kernels/ref/): plain C, double accumulation ---------------- */

void kvl_matmul_ref(const struct kvl_weight *w, const float *x, float *y, int n_tokens);
void kvl_rmsnorm_ref(const float *x, const float *w, float *y, int n_tokens, int n, float eps);
void kvl_rope_ref(const struct kvl_rope *r, float *x, const int32_t *pos, int n_tokens, int n_heads, bool inverse);
void kvl_swiglu_ref(const float *gate, const float *up, float *y, int64_t n);
void kvl_embed_ref(const struct kvl_weight *table, const int32_t *ids, float *y, int n_tokens);
void kvl_attention_ref(const struct kvl_attn_args *a);

#endif /* KVL_KERNELS_H */
