/* snapshot.c — the prefix caches survive a restart (issue [kv-scheduler], DESIGN.md "KV
 * cache"): at shutdown, once drained, each model's indexed blocks are saved to
 * <spill_dir>/<model>.snapshot (kvl_pool_save: written whole to a temporary file, synced,
 * renamed; mode 0600; a CRC per record); at start they are loaded back into the model's
 * cold tier and re-indexed (kvl_pool_load), so the first request sharing a cached prefix
 * restores it instead of prefilling.
 *
 * The file is keyed by what makes its blocks valid: the model file (path, size, mtime),
 * the KV dtype and block size (checked by the pool), and the translators loaded, in order
 * (their files' path, size, mtime: translated blocks carry the writer id of the
 * translator that wrote them). A file that does not match, or is damaged anywhere, is
 * removed with a warning and never trusted in part. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon.h"
#include "kvl_error.h"

static void file_id(char *out, size_t n, const char *path) {
  struct stat st;
  if (stat(path, &st) == 0)
    snprintf(out, n, "%s:%lld:%lld", path, (long long)st.st_size, (long long)st.st_mtime);
  else
    snprintf(out, n, "%s:missing", path);
}

void kvld_snapshot_fingerprint(const struct kvld *d, int mi, char *fp, size_t n) {
  const struct kvld_model *m = &d->models[mi];
  char id[1400];
  file_id(id, sizeof(id), m->path);
  size_t at = (size_t)snprintf(fp, n, "kvlingod-snapshot-1|model %s|%s|kv %s|translators", m->name, id, m->kv_dtype);
  for (int i = 0; i < d->n_translators && at < n; i++) {
    file_id(id, sizeof(id), d->translators[i].path);
    at += (size_t)snprintf(fp + at, n - at, "|%s", id);
  }
}

void kvld_snapshot_path(const struct kvld *d, int mi, char *out, size_t n) {
  snprintf(out, n, "%s/%s.snapshot", d->cfg.spill_dir, d->models[mi].name);
}

void kvld_snapshot_load_all(struct kvld *d, kvl_sched_t *s) {
  if (!d->cfg.cache_snapshot) return;
  for (int i = 0; i < d->n_models; i++) {
    if (!d->models[i].active) continue;
    char path[1200], fp[8192], err[512];
    kvld_snapshot_path(d, i, path, sizeof(path));
    if (access(path, F_OK) != 0) continue;
    kvld_snapshot_fingerprint(d, i, fp, sizeof(fp));
    int32_t n = 0;
    double t0 = kvld_now();
    int rc = kvl_pool_load(kvl_sched_pool(s, d->models[i].sched_id), path, fp, &n, err, sizeof(err));
    if (rc < 0) {
      kvld_log(KVLD_WARN, "snapshot_discarded", "\"model\":\"%s\",\"file\":\"%s\",\"reason\":\"%s\"", d->models[i].name,
               path, err);
      unlink(path);
      continue;
    }
    kvld_log(KVLD_INFO, "snapshot_loaded", "\"model\":\"%s\",\"file\":\"%s\",\"blocks\":%d,\"seconds\":%.3f",
             d->models[i].name, path, n, kvld_now() - t0);
  }
}

/* On the compute thread (kvl_engine_run), between steps: after the drain nothing runs. */
int kvld_snapshot_save_all(kvl_sched_t *s, void *arg) {
  struct kvld *d = arg;
  if (!d->cfg.cache_snapshot) return 0;
  int failed = 0;
  for (int i = 0; i < d->n_models; i++) {
    if (!d->models[i].active) continue;
    char path[1200], fp[8192], err[512];
    kvld_snapshot_path(d, i, path, sizeof(path));
    kvld_snapshot_fingerprint(d, i, fp, sizeof(fp));
    double t0 = kvld_now();
    int rc = kvl_pool_save(kvl_sched_pool(s, d->models[i].sched_id), path, fp, err, sizeof(err));
    if (rc < 0) {
      kvld_log(KVLD_WARN, "snapshot_failed", "\"model\":\"%s\",\"file\":\"%s\",\"reason\":\"%s\"", d->models[i].name, path,
               err);
      failed++;
      continue;
    }
    struct stat st;
    kvld_log(KVLD_INFO, "snapshot_saved", "\"model\":\"%s\",\"file\":\"%s\",\"bytes\":%lld,\"seconds\":%.3f",
             d->models[i].name, path, stat(path, &st) == 0 ? (long long)st.st_size : -1LL, kvld_now() - t0);
  }
  return failed ? KVL_EIO : 0;
}
