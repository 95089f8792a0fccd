/* kvl_translator.h — KV translators S→T in memory, and their files (safetensors).
 *
 * A translator maps the KV cache of a source model S into the KV cache of a target
 * model T (DESIGN.md "Translation"). For each target layer ℓ it holds, separately for
 * keys and values, the ν source layers it reads (`k_sources`, `v_sources`, in
 * concatenation order) and a map of shape (ν·w_S [+1 if affine]) × w_T, where
 * w = n_kv_head·head_dim of a whole layer. Applied to one position:
 *
 *     x = [ k_S[src_0] | k_S[src_1] | ... | k_S[src_ν-1] | 1 (affine only) ]   (1, ν·w_S [+1])
 *     k_T[ℓ] = x · K_ℓ                                                      (1, w_T)
 *
 * so row r of K_ℓ multiplies input element r; with `affine` the last row is the
 * intercept. Maps are held here in fp32 (row-major, rows × cols) whatever the file
 * stored; a bf16 file is widened at load.
 *
 * Reading a file, and refusing it for the wrong pair of models:
 *
 *   char err[256];
 *   kvl_translator_t *t;
 *   int rc = kvl_translator_load("coder-0.5b-to-1.5b.safetensors", &t, err, sizeof(err));
 *   if (rc < 0) { fprintf(stderr, "translator: %s (%s)\n", err, kvl_strerror(rc)); return rc; }
 *   struct kvl_model_fingerprint src, dst;
 *   kvl_fingerprint_from_gguf(small_gguf, &src, err, sizeof(err));
 *   kvl_fingerprint_from_gguf(large_gguf, &dst, err, sizeof(err));
 *   if (kvl_translator_check_models(t, &src, &dst, err, sizeof(err)) < 0)
 *     fprintf(stderr, "%s\n", err);   // "target n_layer: translator 28, model 24"
 *   struct kvl_translator_map k;
 *   kvl_translator_get_map(t, 0, KVL_TRANSLATOR_K, &k);
 *   ... k.nu, k.sources[0..nu), k.data[k.rows * k.cols] ...
 *   kvl_translator_free(t);
 *
 * Writing one (what `kvlingo fit` does):
 *
 *   kvl_translator_new(&src, &dst, true, &t, err, sizeof(err));
 *   for (int l = 0; l < dst.n_layer; l++) {
 *     kvl_translator_set_map(t, l, KVL_TRANSLATOR_K, ksrc, 2, kmap);  // copied
 *     kvl_translator_set_map(t, l, KVL_TRANSLATOR_V, vsrc, 2, vmap);
 *   }
 *   kvl_translator_set_fit_json(t, "{\"method\":\"ridge\",\"lambda\":0.01}");
 *   kvl_translator_save(t, "out.safetensors", KVL_TRANSLATOR_BF16, err, sizeof(err));
 *   kvl_translator_free(t);
 *
 * File format (safetensors): an 8-byte little-endian header length N, N bytes of JSON
 * (may be padded with spaces), then the data section. The header maps each tensor name
 * to {"dtype", "shape", "data_offsets": [begin, end)} (offsets into the data section,
 * which the tensors must cover exactly, without gaps or overlaps) plus "__metadata__",
 * a flat map of strings. Tensors, for every target layer ℓ and nothing else:
 *   layers.<ℓ>.k_sources, layers.<ℓ>.v_sources   I32 [ν]
 *   layers.<ℓ>.k, layers.<ℓ>.v                   F32 or BF16 [ν·w_S (+1), w_T]
 * Metadata (keys outside the `kvlingo.` namespace are ignored, unknown ones inside it
 * refused):
 *   kvlingo.format_version  "1"
 *   kvlingo.source          fingerprint of S as a JSON object (see below)
 *   kvlingo.target          fingerprint of T
 *   kvlingo.affine          "true" | "false"
 *   kvlingo.dtype           "F32" | "BF16" (the dtype of every map tensor)
 *   kvlingo.fit             optional JSON object: fit provenance
 *   kvlingo.scores          optional JSON object: held-out scores
 * A fingerprint is {"architecture": str, "n_layer": int, "n_kv_head": int,
 * "head_dim": int, "kv_width": int (= n_kv_head·head_dim), "rope_theta": number,
 * "rope_scaling": str ("none" when none; null reads as "none"), "tokenizer_hash": hex
 * str, "name": str}; no other keys.
 *
 * Every function that can fail returns 0 or a negative KVL_E* code (kvl_error.h); those
 * with err/errlen write a message naming the problem there (tensor, key, expected and
 * found values). A translator is not thread-safe while being written; once complete,
 * any number of threads may read it.
 */
#ifndef KVL_TRANSLATOR_H
#define KVL_TRANSLATOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct kvl_gguf; /* kvl_gguf.h (engine/) */

#define KVL_TRANSLATOR_FORMAT_VERSION 1

/* Sizes of the fingerprint's string fields, NUL included. */
#define KVL_FP_ARCH_LEN 64
#define KVL_FP_SCALING_LEN 64
#define KVL_FP_HASH_LEN 132 /* up to 128 hex digits (a SHA-512 fits) */
#define KVL_FP_NAME_LEN 256

/* What a translator must agree on with a model: enough to refuse the wrong model with a
 * message, not a cryptographic identity. Plain data: copy it freely. */
struct kvl_model_fingerprint {
  char architecture[KVL_FP_ARCH_LEN];     /* GGUF general.architecture ("qwen2") */
  int32_t n_layer;                        /* transformer blocks */
  int32_t n_kv_head;                      /* KV heads per layer */
  int32_t head_dim;                       /* elements per KV head */
  double rope_theta;                      /* RoPE base frequency */
  char rope_scaling[KVL_FP_SCALING_LEN];  /* "none", or "<type>:<factor>" ("linear:4") */
  char tokenizer_hash[KVL_FP_HASH_LEN];   /* lowercase hex, computed by the caller */
  char name[KVL_FP_NAME_LEN];             /* human-readable (general.name); not compared */
};

/* A qwen2 fingerprint from shapes alone (no model file): RoPE scaling "none", tokenizer
 * hash "0", `name` as given. For tools and tests that make translators of a model's shape
 * (bench-translate --shapes, the GPU checks). */
void kvl_fingerprint_of_shape(struct kvl_model_fingerprint *fp, int32_t n_layer, int32_t n_kv_head, int32_t head_dim,
                              double rope_theta, const char *name);

/* n_kv_head · head_dim: the width of one layer's K (or V) row. */
int64_t kvl_fingerprint_kv_width(const struct kvl_model_fingerprint *fp);

/* Check a fingerprint's fields (ranges, non-empty architecture, hex hash); 0 or
 * KVL_EINVAL with a message. */
int kvl_fingerprint_validate(const struct kvl_model_fingerprint *fp, char *err, size_t errlen);

/* Fill *fp from a GGUF model: general.architecture, <arch>.block_count,
 * <arch>.attention.head_count_kv, head_dim = <arch>.attention.key_length if present
 * else <arch>.embedding_length / <arch>.attention.head_count, <arch>.rope.freq_base
 * (10000 when absent), rope scaling from <arch>.rope.scaling.type/.factor, name from
 * general.name, and tokenizer_hash = FNV-1a 64 (16 lowercase hex digits) over every
 * string of tokenizer.ggml.tokens in order, each fed as its length (u64 little-endian)
 * then its bytes. The GGUF is only read; *fp owns nothing. KVL_EFORMAT / KVL_ENOTSUP
 * with a message when a key is missing or inconsistent. */
int kvl_fingerprint_from_gguf(const struct kvl_gguf *g, struct kvl_model_fingerprint *fp, char *err,
                              size_t errlen);

/* ---- the in-memory translator ---------------------------------------------------- */

typedef struct kvl_translator kvl_translator_t;

enum kvl_translator_dtype {
  KVL_TRANSLATOR_F32 = 0,
  KVL_TRANSLATOR_BF16 = 1,
};

enum kvl_translator_kv {
  KVL_TRANSLATOR_K = 0,
  KVL_TRANSLATOR_V = 1,
};

/* One map of one target layer, as the translator holds it. Pointers are owned by the
 * translator and live until kvl_translator_free (or the next set_map of that slot). */
struct kvl_translator_map {
  int32_t nu;              /* source layers read (ν >= 1) */
  const int32_t *sources;  /* ν source layer ids, in concatenation order */
  int64_t rows;            /* ν·w_S (+1 when affine) */
  int64_t cols;            /* w_T */
  const float *data;       /* (rows, cols) row-major fp32 */
};

/* An empty translator for S→T, maps unset. Both fingerprints are copied and validated.
 * *out is owned by the caller (kvl_translator_free). */
int kvl_translator_new(const struct kvl_model_fingerprint *src, const struct kvl_model_fingerprint *dst,
                       bool affine, kvl_translator_t **out, char *err, size_t errlen);

/* Free a translator and everything it owns; NULL is fine. */
void kvl_translator_free(kvl_translator_t *t);

/* Set the K or V map of target layer `layer`: `nu` source layer ids (distinct, each in
 * 0..n_layer_S-1) and `map` of (nu·w_S [+1 if affine]) × w_T fp32, row-major; both are
 * copied. Replaces an earlier map of that slot. KVL_ERANGE for a layer or id out of
 * range, KVL_EINVAL for nu < 1, a repeated id or a non-finite map value. */
int kvl_translator_set_map(kvl_translator_t *t, int32_t layer, enum kvl_translator_kv which,
                           const int32_t *sources, int32_t nu, const float *map);

/* Attach fit provenance / held-out scores, each a JSON object given as text (copied,
 * stored as written). NULL removes. KVL_EINVAL when the text is not a JSON object. */
int kvl_translator_set_fit_json(kvl_translator_t *t, const char *json);
int kvl_translator_set_scores_json(kvl_translator_t *t, const char *json);

/* ---- accessors (the translator keeps ownership of everything returned) ----------- */

const struct kvl_model_fingerprint *kvl_translator_source(const kvl_translator_t *t);
const struct kvl_model_fingerprint *kvl_translator_target(const kvl_translator_t *t);
bool kvl_translator_affine(const kvl_translator_t *t);
/* The dtype the maps were stored in (F32 for a translator built in memory). */
enum kvl_translator_dtype kvl_translator_dtype(const kvl_translator_t *t);
/* Target layers (= the target fingerprint's n_layer). */
int32_t kvl_translator_n_layer(const kvl_translator_t *t);
/* JSON text or NULL when absent. */
const char *kvl_translator_fit_json(const kvl_translator_t *t);
const char *kvl_translator_scores_json(const kvl_translator_t *t);

/* The K or V map of a target layer: 0, KVL_ERANGE (layer out of range) or KVL_ENOENT
 * (not set yet; never for a loaded translator). */
int kvl_translator_get_map(const kvl_translator_t *t, int32_t layer, enum kvl_translator_kv which,
                           struct kvl_translator_map *out);

/* Does this translator fit source model `src` and target model `dst`? 0, or
 * KVL_EMISMATCH with every difference named, "; "-separated, e.g.
 * "target n_layer: translator 28, model 24". Compared: architecture, n_layer,
 * n_kv_head, head_dim, rope_theta (relative 1e-6), rope_scaling, tokenizer_hash; the
 * name is informational and not compared. Either model may be NULL to skip it. */
int kvl_translator_check_models(const kvl_translator_t *t, const struct kvl_model_fingerprint *src,
                                const struct kvl_model_fingerprint *dst, char *err, size_t errlen);

/* ---- applying a translator to a span (DESIGN.md "Translation") -------------------- */

struct kvl_kv_layout; /* kvl_kernels.h (kernels/) */
struct kvl_rope;

/* n positions of a source cache translated into n positions of a target cache. Caches
 * are paged pools read and written through one block table each (kvl_kernels.h). */
struct kvl_translate_span {
  const struct kvl_kv_layout *src_layout; /* must match the translator's source */
  const void *src_base;                   /* the source pool */
  const int32_t *src_table;               /* source sequence: logical -> physical block */
  const struct kvl_rope *src_rope;        /* the source model's RoPE (kvl_model_rope) */
  const int32_t *src_pos;                 /* [n] source positions (native only: the caller
                                             checks with kvl_line_native_span) */
  const struct kvl_kv_layout *dst_layout; /* must match the translator's target */
  void *dst_base;                         /* the target pool (written) */
  const int32_t *dst_table;               /* target sequence: logical -> physical block */
  const struct kvl_rope *dst_rope;        /* the target model's RoPE */
  const int32_t *dst_pos;                 /* [n] target positions */
  int32_t n;                              /* positions; 0 does nothing */
  /* Optional: the pools' write stamps (kvl_attn_args.kv_stamps; src_blocks and dst_blocks
   * of them). A device backend then reads the source from its copy of the source pool and
   * writes the target into its copy of the target pool as well as into the host's, so the
   * target model's next attention finds its blocks current. The caller gives the target
   * span's blocks new stamps before the call (kvl_line_written). */
  const uint64_t *src_stamps, *dst_stamps;
  int32_t src_blocks, dst_blocks;
};

/* Translate a span: for every target layer ℓ and token i, read the K rows of ℓ's
 * k_sources at src_pos[i], rotate them back with the source RoPE (pre-RoPE keys: exact
 * for architectures without a k-norm), concatenate (+ a 1 when affine), multiply by
 * K_ℓ, rotate with the target RoPE at dst_pos[i]; V likewise without RoPE; store both
 * at dst_pos[i] of the target cache. Batched: per layer, tokens in chunks, one GEMM
 * per chunk, map and run of consecutive source layers (kvl_sgemm in fp32, a chunk per
 * thread), or per chunk and map (kvl_gemm_bf16 after kvl_translator_use_bf16).
 * The caches may be fp32 or bf16.
 * Only the target positions are written. Returns 0, KVL_EINVAL (NULL pointer, negative
 * n or position, RoPE head_dim not the layout's), KVL_EMISMATCH (a layout that does not
 * fit the translator's fingerprints), KVL_ENOENT (a map not set), KVL_ENOTSUP (an
 * architecture other than qwen2: k-norm targets are not supported yet) or KVL_ENOMEM,
 * each with a message; on failure nothing is written. */
int kvl_translator_apply(const kvl_translator_t *t, const struct kvl_translate_span *s, char *err, size_t errlen);

/* The same on backend `be` where it translates on its own device (kvl_backend_can_translate:
 * the CUDA backend; products in bf16 with fp32 accumulation there, whatever
 * kvl_translator_use_bf16 says), else exactly kvl_translator_apply (be NULL, the CPU). The
 * device keeps its copy of the maps in the translator until a map is set again or the
 * translator is freed (maps changed in place through kvl_translator_get_map are not seen,
 * as with use_bf16). Same checks and returns as kvl_translator_apply. */
typedef struct kvl_backend kvl_backend_t;
int kvl_translator_apply_on(const kvl_translator_t *t, kvl_backend_t *be, const struct kvl_translate_span *s,
                            char *err, size_t errlen);

/* Apply this translator's products in bf16 from now on (on = true), or in fp32 again:
 * the maps are rounded to bf16 once, here (the intercept row stays fp32, as the GEMM's
 * bias), the source rows (un-rotated keys, values) at each apply; products accumulate in
 * fp32. Faster on some processors with AVX512-BF16 or AMX (kvl_gemm_bf16; a Zen 4:
 * 1.6-1.9x), slower on others (an Intel Xeon without AMX: kvl_translator_pick_precision
 * measures which), at the price of those roundings (docs/translators.md, "Precision"); a translator between a
 * model and itself is then no longer exactly the identity. Returns 0, KVL_ENOTSUP (this
 * processor cannot: the translator stays fp32) or KVL_ENOMEM. Setting a map afterwards
 * (kvl_translator_set_map) returns the translator to fp32; maps changed in place through
 * kvl_translator_get_map are not seen by the bf16 copy — call this after the maps are
 * final. */
int kvl_translator_use_bf16(kvl_translator_t *t, bool on, char *err, size_t errlen);
/* Use whichever precision computes this translator's products faster on this processor:
 * its deepest map's product for one chunk of positions is timed in fp32 and in bf16 (a few
 * milliseconds; the best of five each) and bf16 is kept only if it won. Where bf16 is
 * slower (an Intel Xeon whose AVX512-BF16 runs at a quarter of its fp32 FMA rate,
 * bench/README.md) or absent, the translator stays fp32. *ms_fp32 and *ms_bf16 (either
 * may be NULL) get the two times, 0 where not measured. Returns 0 (whatever was chosen)
 * or KVL_ENOMEM. Call after the maps are final, like kvl_translator_use_bf16. */
int kvl_translator_pick_precision(kvl_translator_t *t, double *ms_fp32, double *ms_bf16, char *err, size_t errlen);
/* Whether apply runs in bf16 (kvl_translator_use_bf16 took effect). */
bool kvl_translator_is_bf16(const kvl_translator_t *t);

/* The same, one token and one layer at a time, with double accumulation and the scalar
 * RoPE reference: the slow truth for tests. */
int kvl_translator_apply_ref(const kvl_translator_t *t, const struct kvl_translate_span *s, char *err,
                             size_t errlen);

/* A translator from a model to itself for tests: target layer ℓ reads source layer ℓ
 * (ν = 1) for K and V, maps = I, intercept row 0 when affine. *out owned by the caller. */
int kvl_translator_identity(const struct kvl_model_fingerprint *fp, bool affine, kvl_translator_t **out,
                            char *err, size_t errlen);

/* ---- files ------------------------------------------------------------------------ */

/* Read and validate a translator file (see the format above). On success *out is a new
 * translator owned by the caller; on failure *out is NULL and err names the problem. */
int kvl_translator_load(const char *path, kvl_translator_t **out, char *err, size_t errlen);

/* The same from bytes in memory (not retained: the translator copies what it keeps). */
int kvl_translator_load_mem(const void *buf, size_t len, kvl_translator_t **out, char *err, size_t errlen);

/* Serialise a complete translator (every map of every layer set) with its maps stored
 * as `dtype` (bf16: rounded to nearest even). _save_mem gives a malloc'd buffer the
 * caller frees; _save writes `path` through a temporary file renamed into place, so a
 * crash never leaves a partial file under that name. Output is deterministic. */
int kvl_translator_save_mem(const kvl_translator_t *t, enum kvl_translator_dtype dtype, void **buf,
                            size_t *len, char *err, size_t errlen);
int kvl_translator_save(const kvl_translator_t *t, const char *path, enum kvl_translator_dtype dtype,
                        char *err, size_t errlen);

#endif /* KVL_TRANSLATOR_H */
