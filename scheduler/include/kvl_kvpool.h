/* kvl_kvpool.h — one model's paged KV cache: block pool with byte budgets, lines (block
 * tables) with per-position provenance, a provenance-aware prefix index, and two tiers
 * (hot = attention-ready arena, cold = host copies). SQLite's page cache is the model:
 * blocks are pinned by reference, a shared block is never written in place, and a
 * sanity checker (kvl_pool_check) runs in tests and debug asserts.
 *
 *   struct kvl_pool_config c = {.layout = kvl_model_kv_layout(m, KVL_KV_BF16),
 *                               .hot_bytes = 512 << 20, .cold_bytes = 2ull << 30};
 *   kvl_pool_t *p;
 *   kvl_pool_new(&c, &p);
 *   kvl_line_t *l = kvl_line_new(p);
 *   struct kvl_prefix_hit hit;
 *   kvl_line_attach_prefix(l, prompt, n, KVL_REUSE_NATIVE_ONLY, &hit);  // shares cached blocks
 *   kvl_line_append(l, prompt + hit.n_tokens, n - hit.n_tokens, KVL_WRITER_NATIVE);
 *   ... forward over positions hit.n_tokens .. n-1 with kvl_line_block_table(l) ...
 *   kvl_line_commit(l);                    // full blocks become findable by others
 *   kvl_line_free(l);                      // blocks stay cached (evictable) until needed
 *
 * Provenance. Every position has a writer: KVL_WRITER_NATIVE (the model's own forward
 * computed it) or a translator id (it was translated from another model's native
 * position). A line keeps writers as runs. The index key of a full block is
 * hash(parent key, its 16 token ids, its 16 writers): native and translated versions of
 * the same tokens never alias. Lookup can be restricted to native blocks; and
 * kvl_line_native_span refuses any span holding a translated position, so a translated
 * position can never become a translation source.
 *
 * Tiers. Unreferenced cached blocks are evicted LRU from the hot arena into the cold
 * tier (copied, still indexed) when room is needed; the cold tier passes its own LRU
 * blocks on to the disk tier (a spill file of fixed-size slots, when configured), which
 * drops its LRU blocks when full. A disk block that cannot be read back is forgotten (and
 * counted), never trusted. A line can be offloaded (all its blocks to cold) and restored;
 * attaching a prefix restores cold blocks it finds. Running out of room is an error
 * (KVL_EFULL) the scheduler answers by waiting or preempting — never a crash.
 *
 * Disk I/O never happens on the pool's thread (DESIGN.md: the compute thread never does
 * I/O): a pool with a disk tier has an I/O thread. A block passed on to the disk is copied
 * into a bounded write-behind buffer and written by that thread (a full write-behind drops
 * the block instead: an eviction, never a wait). Attaching a prefix uses only what is in
 * memory, and stops at a block that is on disk; kvl_pool_prefetch asks the I/O thread to
 * read such blocks back into hot slots, and kvl_pool_io_poll applies what finished:
 *
 *   if (kvl_pool_prefetch(p, prompt, n, policy) > 0) ... wait (the scheduler retries next step)
 *   kvl_line_attach_prefix(l, prompt, n, policy, &hit);   // now finds them hot
 *
 * Threads: a pool and its lines belong to one thread (the engine's compute thread).
 */
#ifndef KVL_KVPOOL_H
#define KVL_KVPOOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvl_kernels.h"

typedef uint16_t kvl_writer_t;
#define KVL_WRITER_NATIVE ((kvl_writer_t)0) /* other values: translator ids (T(S->M)) */

typedef struct kvl_pool kvl_pool_t;
typedef struct kvl_line kvl_line_t;

struct kvl_pool_config {
  struct kvl_kv_layout layout;
  size_t hot_bytes;   /* hot arena budget: floor(hot_bytes / block bytes) blocks, >= 1 */
  size_t cold_bytes;  /* host-copy budget (0: no cold tier, eviction drops) */
  size_t disk_bytes;  /* spill-file budget behind the cold tier (0: none) */
  const char *disk_path; /* the spill file (created 0600, truncated, unlinked once open: no name while in use) */
  int32_t disk_writeback_blocks; /* write-behind buffers for the disk tier (0: KVL_DISK_WRITEBACK_DEFAULT) */
  bool prefault;      /* fault the hot arena in at creation (kvl_huge_prefault): a block's first
                       * use then pays no page fault on the request path */
};

#define KVL_DISK_WRITEBACK_DEFAULT 32

struct kvl_pool_stats {
  int32_t hot_blocks, hot_used, hot_cached;   /* capacity, referenced, cached-unreferenced */
  int32_t cold_blocks, cold_used;
  int32_t disk_blocks, disk_used;
  int32_t disk_in_flight;                     /* disk reads and writes queued or running */
  uint64_t evicted_to_cold, spilled_to_disk, dropped, restored, restored_from_disk, disk_errors, cow_copies;
  uint64_t disk_busy; /* blocks dropped instead of spilled: the write-behind was full */
  double prefault_ms;  /* the hot arena's prefault at creation (0: not asked) */
};

int kvl_pool_new(const struct kvl_pool_config *c, kvl_pool_t **out);
/* Frees the pool; every line must have been freed first (asserted). */
void kvl_pool_free(kvl_pool_t *p);
/* Pin the pool's hot arena for the backend that computes on it (kvl_backend_host_register):
 * every copy of blocks between it and a device — a restored or host-written block's
 * upload, a translation's target coming back — then runs asynchronously from pinned
 * memory. The cold arena is not pinned: no device copies from it (a restore copies the
 * block into a hot slot on the host first), so it would only lock memory. Kept until
 * kvl_pool_free. Returns whether it was pinned (false on the CPU backend). Call once. */
bool kvl_pool_pin(kvl_pool_t *p, kvl_backend_t *be);
/* The pinning backend may leave copies into the hot arena running past an op's return (a
 * translation's target, written back while the next step runs: kvl_backend_host_sync).
 * The pool waits for them before its own host copies of a block (offload, restore, copy on
 * write, spill); a reader or writer of the arena's host bytes on another backend (the CPU's
 * translation, a test) calls this first. A no-op where `reader` is the pinning backend,
 * which orders its own ops after its copies. */
void kvl_pool_host_sync(kvl_pool_t *p, kvl_backend_t *reader);
/* The hot arena, as the forward's kvl_kv_view.base. */
void *kvl_pool_base(kvl_pool_t *p);
const struct kvl_kv_layout *kvl_pool_layout(const kvl_pool_t *p);
/* The hot arena's write stamps, one per hot block (kvl_pool_hot_blocks of them), as the
 * forward's kvl_kv_view.stamps: a slot's stamp changes whenever the pool writes or hands
 * out the slot (a restore from the cold or disk tier, a copy on write, a new block), at
 * kvl_line_written, and when a backend without a copy of the pool writes rows
 * (kvl_kv_put). A device backend keeps its copy of a block while the stamp is the one it
 * copied under. */
uint64_t *kvl_pool_stamps(kvl_pool_t *p);
int32_t kvl_pool_hot_blocks(const kvl_pool_t *p);
/* The caller writes (or wrote) the host bytes of positions [from, to) of the hot line l
 * other than by a forward pass through kvl_kv_put (translation, a test's own rows): their
 * blocks get new stamps. Before a translation (kvl_line_translate does it), so that a
 * device backend writing its copy as well records the new stamps with it. */
void kvl_line_written(kvl_line_t *l, int32_t from, int32_t to);
void kvl_pool_stats(const kvl_pool_t *p, struct kvl_pool_stats *s);
/* Free hot slots available now, counting cached blocks that could be evicted. */
int32_t kvl_pool_available(const kvl_pool_t *p);
/* Sanity checker: every invariant of blocks, lines, lists and the index. Returns 0 or
 * KVL_EINVAL with a description in err. Costly: tests and debug asserts only. */
int kvl_pool_check(const kvl_pool_t *p, char *err, size_t errlen);

/* ---- lines ---------------------------------------------------------------------- */

kvl_line_t *kvl_line_new(kvl_pool_t *p);
/* Release the line's references; its committed blocks stay cached. NULL is fine. */
void kvl_line_free(kvl_line_t *l);
/* A new line sharing all of l's blocks (copy on write at the next append). */
kvl_line_t *kvl_line_fork(const kvl_line_t *l);

kvl_pool_t *kvl_line_pool(const kvl_line_t *l);
int32_t kvl_line_len(const kvl_line_t *l);
const int32_t *kvl_line_tokens(const kvl_line_t *l);
kvl_writer_t kvl_line_writer(const kvl_line_t *l, int32_t pos);
/* Physical hot block ids, one per started block; valid until the next call that may
 * move blocks (append, attach, offload, restore, evict). KVL_ASSERTs the line is hot. */
const int32_t *kvl_line_block_table(const kvl_line_t *l);
bool kvl_line_is_hot(const kvl_line_t *l);

/* Reserve n positions after the end for tokens written by `writer`: allocates blocks
 * (evicting cached ones if needed) and copies a shared tail block first. The caller then
 * fills the positions' K/V (forward or translation). KVL_EFULL when the hot arena cannot
 * hold them even after eviction: nothing changes then. */
int kvl_line_append(kvl_line_t *l, const int32_t *tokens, int32_t n, kvl_writer_t writer);
/* Drop positions >= len (fork at an edited turn). */
int kvl_line_truncate(kvl_line_t *l, int32_t len);

/* ---- prefix cache ---------------------------------------------------------------- */

enum kvl_reuse {
  KVL_REUSE_NATIVE_ONLY, /* only blocks whose every position is native */
  KVL_REUSE_ANY,         /* translated blocks too (cross-model reuse, by policy) */
};

struct kvl_prefix_hit {
  int32_t n_tokens;      /* positions now shared from the cache (a multiple of 16) */
  int32_t n_native;      /* of which written natively */
  int32_t n_translated;  /* of which translated */
  int32_t n_restored;    /* blocks brought back from the cold tier */
};

/* On an empty line: share the longest indexed chain of full blocks matching tokens[0..n)
 * (preferring, at each block, the native entry). Cold blocks found are restored
 * (KVL_EFULL if there is no room: the line is left empty). The chain stops at a block on
 * disk (unless its write is still in flight: then it comes from the write-behind);
 * kvl_pool_prefetch first to have it. */
int kvl_line_attach_prefix(kvl_line_t *l, const int32_t *tokens, int32_t n, enum kvl_reuse policy,
                           struct kvl_prefix_hit *hit);
/* Start reading back the disk blocks of the chain attach would find for tokens[0..n)
 * into hot slots (reserved while the read is in flight; as far as the hot arena has
 * room). Returns how many of the chain's blocks are still being read (0: attach finds
 * everything the cache holds). Never blocks. */
int32_t kvl_pool_prefetch(kvl_pool_t *p, const int32_t *tokens, int32_t n, enum kvl_reuse policy);
/* Apply the disk I/O that finished (a block read back becomes a cached hot block; a
 * failed read or write forgets its block); cheap when there is none. prefetch polls too. */
void kvl_pool_io_poll(kvl_pool_t *p);
/* Wait up to timeout_ms (< 0: no limit) for disk I/O to finish, and apply it: false at
 * once when none is in flight. kvl_pool_io_drain: wait for all of it. */
bool kvl_pool_io_wait(kvl_pool_t *p, int timeout_ms);
void kvl_pool_io_drain(kvl_pool_t *p);
/* Tests: while held, the I/O thread starts nothing new (operations queue up), so the
 * states of I/O in flight can be reached on purpose. Do not drain while held. */
void kvl_pool_io_hold(kvl_pool_t *p, bool hold);

/* Index the line's full blocks written so far (call once their K/V is computed). */
void kvl_line_commit(kvl_line_t *l);

/* Succeeds only when every position in [from, to) is native: the only way to name a
 * span as a translation source. */
int kvl_line_native_span(const kvl_line_t *l, int32_t from, int32_t to);

/* ---- translation (DESIGN.md "Translation", the multi-turn protocol) ---------------- */

struct kvl_translator;
struct kvl_rope;

/* Extend line `dst` (of the target model's pool) by the source line's positions
 * [from, to), translated by `t` and recorded with writer `writer` (the translator's id,
 * != KVL_WRITER_NATIVE): dst must hold exactly `from` positions and agree with src's
 * tokens there is the caller's business (same tokenizer: positions map one to one). The
 * span must be native in src (kvl_line_native_span): a translated position is never
 * translated again. Both lines must be hot. Runs kvl_translator_apply_on(t, be) on the two
 * pools (be: the target model's backend; NULL or the CPU: the host's sgemms, one per
 * layer and chunk); on any failure dst is left as it was. Returns 0,
 * KVL_EINVAL (not native, bad range, writer 0, dst length != from), KVL_EFULL (no room
 * in dst's pool), or the translator's error, with a message. */
int kvl_line_translate(kvl_line_t *dst, const kvl_line_t *src, const struct kvl_translator *t, kvl_backend_t *be,
                       kvl_writer_t writer, int32_t from, int32_t to, const struct kvl_rope *src_rope,
                       const struct kvl_rope *dst_rope, char *err, size_t errlen);

/* ---- tiers ------------------------------------------------------------------------ */

/* Move up to n unreferenced cached hot blocks to the cold tier (LRU first). Returns how
 * many hot slots were freed. */
int32_t kvl_pool_evict(kvl_pool_t *p, int32_t n);
/* Move every block only this line references to the cold tier now (the multi-turn
 * protocol's "offload the outgoing line"). KVL_EFULL if the cold tier cannot take them. */
int kvl_line_offload(kvl_line_t *l);
/* Bring the line's cold blocks back to the hot arena (KVL_EFULL if no room). */
int kvl_line_restore(kvl_line_t *l);

/* ---- persistence (the spill file) ---------------------------------------------------
 * A snapshot of every indexed block (cached or in use), written atomically (temporary
 * file + rename, mode 0600) and read back at start into the cold tier, re-indexed, so
 * cached lines survive a restart. The file is keyed by `fingerprint` (the caller's
 * identity of model + translator: architecture, weights hash, translator id), the KV
 * layout and dtype, and the block size; every record is checksummed. A file that does
 * not match or is damaged anywhere is refused whole (KVL_EMISMATCH / KVL_EFORMAT with the
 * reason in err): never trusted in part. Blocks that do not fit in the cold tier are
 * skipped (oldest chains first kept). */
int kvl_pool_save(const kvl_pool_t *p, const char *path, const char *fingerprint, char *err, size_t errlen);
/* Load into an empty pool's cold tier. *n_loaded (optional) gets the blocks indexed. */
int kvl_pool_load(kvl_pool_t *p, const char *path, const char *fingerprint, int32_t *n_loaded, char *err,
                  size_t errlen);
/* The same from a file already in memory; `name` is the file's name for the messages. */
int kvl_pool_load_mem(kvl_pool_t *p, const uint8_t *buf, size_t size, const char *name, const char *fingerprint,
                      int32_t *n_loaded, char *err, size_t errlen);

#endif /* KVL_KVPOOL_H */
