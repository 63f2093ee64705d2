/* arenas.c - requests about a session's memory: CreateArena (memory the
 * daemon makes on the session's backend and shares, its fd going back with
 * the reply), ImportBuffer (client memory mapped once) and DestroyArena. The
 * memory itself is the registry's (registry.c) and the backend's. */
#include <stdint.h>
#include <unistd.h>

#include "log.h"
#include "mokd.h"

int mokd_h_create_arena(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds,
                        char *err)
{
  Mokd__Response r = MOKD__RESPONSE__INIT;
  Mokd__ArenaCreated ac = MOKD__ARENA_CREATED__INIT;
  mokd_arena *a;
  int rc;

  (void)fds, (void)nfds;
  if (q->create_arena->bytes > SIZE_MAX / 2)
    return mokk_fail(err, MOK_EOVERFLOW, "arena size %llu overflows",
                     (unsigned long long)q->create_arena->bytes);
  if ((rc = mokd_arena_new(&s->reg, (size_t)q->create_arena->bytes, ARENA_DAEMON, &a, err)))
    return rc;
  ac.arena = a->id;
  ac.bytes = a->bytes;
  ac.device = a->device + 1; /* the wire: ordinal + 1, 0 = host */
  r.id = q->id;
  r.body_case = MOKD__RESPONSE__BODY_ARENA_CREATED;
  r.arena_created = &ac;
  mokd_send(s, &r, &a->fd, 1);
  close(a->fd); /* the client has it now; the mapping keeps the memory */
  a->fd = -1;
  LOG_DEBUG(SESS, SESS_FMT "arena %llu of %zu bytes", SESS_ARGS(s), (unsigned long long)a->id,
            a->bytes);
  return 0;
}

/* A memfd or a cuMem allocation comes as an fd; a CUDA IPC handle in the body;
 * a chunked import brings one fd a chunk (more than a message may carry are
 * refused by the handler). */
int mokd_import_fds(const Mokd__Request *q)
{
  const Mokd__ImportBuffer *ib = q->import_buffer;
  Mokd__ImportKind k = ib->kind;
  if (ib->n_chunk_bytes > 0 || ib->continues != 0)
    return ib->n_chunk_bytes > MOKW_MAX_FDS ? MOKW_MAX_FDS : (int)ib->n_chunk_bytes;
  return k == MOKD__IMPORT_KIND__IMPORT_MEMFD || k == MOKD__IMPORT_KIND__IMPORT_CUMEM_FD;
}

int mokd_import_continues(const mokd_session *s, const Mokd__Request *q)
{
  return q != NULL && q->body_case == MOKD__REQUEST__BODY_IMPORT_BUFFER &&
         s->reg.pending != NULL && q->import_buffer->continues == s->reg.pending->id;
}

static void reply_imported(mokd_session *s, uint64_t id, const mokd_arena *a, int incomplete)
{
  Mokd__Response r = MOKD__RESPONSE__INIT;
  Mokd__BufferImported bi = MOKD__BUFFER_IMPORTED__INIT;

  bi.arena = a->id;
  bi.device = a->device + 1; /* the wire: ordinal + 1, 0 = host */
  bi.incomplete = incomplete;
  r.id = id;
  r.body_case = MOKD__RESPONSE__BODY_BUFFER_IMPORTED;
  r.buffer_imported = &bi;
  mokd_send(s, &r, NULL, 0);
}

/* ImportBuffer with chunk_bytes: one frame of a chunked import. */
static int import_chunks(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds,
                         char *err)
{
  const Mokd__ImportBuffer *ib = q->import_buffer;
  size_t sizes[MOKW_MAX_FDS];
  mokk_import_kind kind;
  mokd_arena *a;
  int rc;

  if (s->proto < 3)
    rc = mokk_fail(err, MOK_EPROTO, "an ImportBuffer of several chunks needs protocol 3; "
                   "this session chose %u at Hello (upgrade the client)", s->proto);
  else if (ib->kind != MOKD__IMPORT_KIND__IMPORT_MEMFD &&
           ib->kind != MOKD__IMPORT_KIND__IMPORT_CUMEM_FD)
    rc = mokk_fail(err, MOK_EINVAL, "an ImportBuffer of several chunks takes kind IMPORT_MEMFD "
                   "or IMPORT_CUMEM_FD, not %d", (int)ib->kind);
  else if (ib->n_chunk_bytes == 0)
    rc = mokk_fail(err, MOK_EINVAL, "an ImportBuffer that continues import %llu brings no "
                   "chunks", (unsigned long long)ib->continues);
  else if (ib->n_chunk_bytes > MOKW_MAX_FDS)
    rc = mokk_fail(err, MOK_EINVAL, "%zu chunks on one frame; a frame carries at most %d "
                   "fds: send the rest in ImportBuffers that continue the import",
                   ib->n_chunk_bytes, MOKW_MAX_FDS);
  else if (nfds != (int)ib->n_chunk_bytes)
    rc = mokk_fail(err, MOK_EINVAL, "ImportBuffer names %zu chunks and %d fds came; one fd a "
                   "chunk, in order", ib->n_chunk_bytes, nfds);
  else if (ib->bytes > SIZE_MAX / 2)
    rc = mokk_fail(err, MOK_EOVERFLOW, "buffer size overflows");
  else
    rc = 0;
  for (size_t i = 0; rc == 0 && i < ib->n_chunk_bytes; i++)
    if ((sizes[i] = (size_t)ib->chunk_bytes[i]) != ib->chunk_bytes[i] || sizes[i] > SIZE_MAX / 2)
      rc = mokk_fail(err, MOK_EOVERFLOW, "chunk size overflows");
  if (rc != 0)
    return rc; /* dispatch drops an import under way on any error */
  kind = ib->kind == MOKD__IMPORT_KIND__IMPORT_MEMFD ? MOKK_IMPORT_HOST_FD : MOKK_IMPORT_CUMEM_FD;
  if ((rc = mokd_import_chunks(&s->reg, kind, ib->continues, (size_t)ib->bytes, fds, sizes,
                               nfds, &a, err))) {
    mokd_server_reap(s->srv); /* what it had mapped goes once the device is past it */
    return rc;
  }
  reply_imported(s, q->id, a, a == s->reg.pending);
  if (a != s->reg.pending)
    LOG_DEBUG(SESS, SESS_FMT "imported arena %llu of %zu bytes in %d chunks", SESS_ARGS(s),
              (unsigned long long)a->id, a->bytes, a->maps);
  return 0;
}

int mokd_h_import_buffer(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds,
                         char *err)
{
  const Mokd__ImportBuffer *ib = q->import_buffer;
  mokk_import src = {0};
  mokd_arena *a;
  int rc;

  if (ib->n_chunk_bytes > 0 || ib->continues != 0)
    return import_chunks(s, q, fds, nfds, err);
  switch (ib->kind) {
  case MOKD__IMPORT_KIND__IMPORT_MEMFD: src.kind = MOKK_IMPORT_HOST_FD; break;
  case MOKD__IMPORT_KIND__IMPORT_CUMEM_FD: src.kind = MOKK_IMPORT_CUMEM_FD; break;
  case MOKD__IMPORT_KIND__IMPORT_CUDA_IPC: src.kind = MOKK_IMPORT_CUDA_IPC; break;
  default:
    return mokk_fail(err, MOK_EINVAL, "ImportBuffer kind %d is not one this daemon knows",
                     (int)ib->kind);
  }
  if (src.kind == MOKK_IMPORT_CUDA_IPC && ib->cuda_ipc_handle.len != MOKK_IPC_BYTES)
    return mokk_fail(err, MOK_EINVAL, "cuda_ipc_handle holds %zu bytes; a cudaIpcMemHandle_t "
                     "has %d", ib->cuda_ipc_handle.len, MOKK_IPC_BYTES);
  if (ib->bytes > SIZE_MAX / 2)
    return mokk_fail(err, MOK_EOVERFLOW, "buffer size overflows");
  src.fd = nfds > 0 ? fds[0] : -1;
  src.ipc_handle = ib->cuda_ipc_handle.data;
  src.bytes = (size_t)ib->bytes;
  if ((rc = mokd_arena_import(&s->reg, &src, &a, err)))
    return rc;
  reply_imported(s, q->id, a, 0);
  return 0;
}

int mokd_h_destroy_arena(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds,
                         char *err)
{
  mokd_arena *a = mokd_arena_find(&s->reg, q->destroy_arena->arena);

  (void)fds, (void)nfds;
  if (a == NULL)
    return mokk_fail(err, MOK_ENOENT, "arena %llu is not an arena of this session",
                     (unsigned long long)q->destroy_arena->arena);
  if (a->kind == ARENA_OUTPUT)
    return mokk_fail(err, MOK_EPERM, "arena %llu holds daemon outputs; release their "
                     "contexts and results instead", (unsigned long long)a->id);
  if (a->users > 0)
    return mokk_fail(err, MOK_EBUSY, "arena %llu holds weights or inputs of %d live forward "
                     "context%s; release %s first", (unsigned long long)a->id, a->users,
                     a->users == 1 ? "" : "s", a->users == 1 ? "it" : "them");
  mokd_arena_free(&s->reg, a);
  mokd_server_reap(s->srv);
  mokd_send_done(s, q->id);
  return 0;
}
