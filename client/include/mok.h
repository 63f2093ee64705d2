/* mok.h - libmok, the C client of mokd. A client connects to the daemon's Unix
 * socket, creates or imports shared-memory arenas, describes MoE layers and
 * runs forward and backward steps on tensors that live in those arenas; the
 * outputs come back as tensors in daemon-owned arenas that the client has
 * mapped, so they are read in place.
 *
 * Every call returns 0 or a negative code from mok_errno.h; mok_strerror()
 * explains the code and mok_last_error() gives the daemon's own message for the
 * last failed call on that client. A client is one connection; use it from
 * one thread at a time. */
#ifndef MOK_H
#define MOK_H

#include <stddef.h>
#include <stdint.h>

#include "mok_errno.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The protocol versions this libmok speaks (Hello offers the range; the
 * daemon picks the newest both speak). 2: job ids, ListSessions, Evict, Health,
 * GPUs named by UUID, Backward.weights. 3: imports made of several
 * allocations (ImportBuffer.chunk_bytes). */
#define MOK_PROTOCOL_VERSION 3
#define MOK_PROTOCOL_MIN 1
/* libmok's own version (libmok.so.0.MINOR.PATCH; the soname changes with MAJOR) */
#define MOK_VERSION_MAJOR 0
#define MOK_VERSION_MINOR 5
#define MOK_VERSION_PATCH 0
#define MOK_MAX_DIMS 4
/* A GPU UUID as nvidia-smi -L prints it, with its NUL */
#define MOK_UUID_STRLEN 41

typedef struct mok_client mok_client;

typedef enum { MOK_DTYPE_BF16 = 1, MOK_DTYPE_F32 = 2, MOK_DTYPE_I32 = 3 } mok_dtype;

typedef enum { MOK_GRAD_BF16 = 0, MOK_GRAD_FP32_ACCUM = 1 } mok_grad_mode;

/* Weight order in mok_layer_set_weights and in gradients. */
enum { MOK_W_GATE, MOK_W_UP, MOK_W_DOWN, MOK_S_GATE, MOK_S_UP, MOK_S_DOWN, MOK_NWEIGHTS };

/* A tensor in an arena: what travels on the wire. */
typedef struct mok_tensor {
  uint64_t arena;
  uint64_t offset;
  mok_dtype dtype;
  int ndim;
  int64_t shape[MOK_MAX_DIMS];
} mok_tensor;

typedef struct mok_arena_info {
  uint64_t id;
  void *ptr;     /* mapped in this process: a device address for GPU arenas */
  size_t bytes;
  int device;    /* CUDA device ordinal of a GPU arena; -1 = host memory */
} mok_arena_info;

typedef struct mok_layer_desc {
  int64_t hidden;       /* H */
  int64_t intermediate; /* I */
  int64_t experts;      /* E, over the whole EP group */
  int64_t top_k;        /* K */
  int64_t shared_intermediate; /* I_s, 0 = no shared expert */
  float swiglu_limit;   /* 0 = off */
  uint64_t ep_group;    /* 0 with ep_size 1: no group */
  uint32_t ep_size;     /* P; 0 or 1 = alone */
  uint32_t ep_rank;
  mok_grad_mode grad_mode;
} mok_layer_desc;

/* How a layer's kernels run: speed and memory, never results. Every choice
 * gives the same bits (DESIGN §2), so a job can tune a layer without
 * checking it again. 0 in a field leaves it to the daemon: its defaults,
 * tuned on an H200, pick per GEMM from the rows an expert gets (the
 * daemon's MOKD_GEMM_* environment may change them). The CPU backend runs
 * every choice the same way. Stage counts follow from the tiles (as many as
 * fit in shared memory) and are not chosen apart from them. */
typedef enum {
  MOK_TILES_AUTO = 0,
  MOK_TILES_WIDE,     /* 128 rows x 256 columns, two warpgroups on one tile */
  MOK_TILES_TALL,     /* 256 x 128 (not for weight gradients) */
  MOK_TILES_PINGPONG, /* 128 x 128, each warpgroup its own: one stores while the other computes */
  MOK_TILES_COUNT
} mok_tiles;
typedef enum {
  MOK_CLUSTERS_AUTO = 0,
  MOK_CLUSTERS_NONE,  /* single blocks everywhere */
  MOK_CLUSTERS_DGRAD, /* pairs of blocks sharing an expert's weight tile: the data gradients */
  MOK_CLUSTERS_ALL,   /* and the forward's GEMMs */
  MOK_CLUSTERS_COUNT
} mok_clusters;
typedef enum {
  MOK_ORDER_AUTO = 0,
  MOK_ORDER_DYNAMIC, /* blocks take grouped tiles in order from a counter */
  MOK_ORDER_STATIC,  /* every grid-th tile each */
  MOK_ORDER_COUNT
} mok_order;
typedef enum {
  MOK_TAILS_AUTO = 0,
  MOK_TAILS_OWN,   /* an expert's last rows take an m-tile of their own */
  MOK_TAILS_RIDE,  /* ride on its full m-tiles: split where two run side by side */
  MOK_TAILS_SPLIT, /* ride, split over its last two m-tiles everywhere */
  MOK_TAILS_WHOLE, /* ride, whole on its last m-tile everywhere */
  MOK_TAILS_COUNT
} mok_tails;
typedef enum {
  MOK_DX_AUTO = 0,
  MOK_DX_HALVES, /* the backward's d_x in two column halves: half its fp32 memory */
  MOK_DX_WHOLE,  /* whole rows */
  MOK_DX_COUNT
} mok_dx;
/* dispatch_blocks: where the forward's dispatch (its gathered rows of x)
 * runs. 0: the default (on the CUDA backend, 16 blocks beside gate/up, or
 * MOK_DISPATCH_GATHER on steps of at least 16384 rows over experts of
 * H x I <= 2048 x 1536); n in 1..MOK_DISPATCH_BLOCKS_MAX: on n blocks beside
 * the gate/up GEMM, which waits for an expert's rows only as it reaches
 * them; MOK_DISPATCH_BEFORE: on the whole GPU before it; MOK_DISPATCH_GATHER:
 * nowhere, the gate/up GEMM reading each row out of x itself (Hopper, wide
 * tiles; elsewhere the default's dispatch). The bits are the same. */
#define MOK_DISPATCH_BEFORE (-1)
#define MOK_DISPATCH_GATHER (-2)
#define MOK_DISPATCH_BLOCKS_MAX 1024
typedef struct mok_layer_tuning {
  mok_tiles tiles;       /* the forward's and the data gradients' grouped GEMMs */
  mok_tiles wgrad_tiles; /* the weight gradients' (auto: ping-pong where an expert has at
                          * most 64 rows or at least 1024, wide between) */
  mok_clusters clusters;
  mok_order order;
  mok_tails tails;
  mok_dx dx;
  int32_t dispatch_blocks;
} mok_layer_tuning;

typedef struct mok_timing {
  uint64_t queued_ns;  /* waiting in the daemon before compute started (an EP rank:
                          its wait for the other ranks' requests too) */
  uint64_t compute_ns;
} mok_timing;

typedef struct mok_forward_result {
  uint64_t context;    /* owns out; name it in mok_backward; release it */
  mok_tensor out;      /* bf16 [T, H] */
  void *out_ptr;       /* out, mapped */
  mok_timing timing;
  mok_tensor status;   /* cuda backend: i32 [1], see mok_step_status; else ndim 0 */
} mok_forward_result;

typedef struct mok_backward_result {
  uint64_t result;     /* owns the daemon-allocated tensors below; release it */
  mok_tensor d_x;      /* bf16 [T, H] */
  mok_tensor d_topk_weights; /* f32 [T, K] */
  void *d_x_ptr, *d_topk_weights_ptr;
  int ngrads;          /* 6 with a shared expert, else 3 */
  mok_tensor grads[MOK_NWEIGHTS];
  void *grad_ptrs[MOK_NWEIGHTS];
  mok_timing timing;
  mok_tensor status;   /* as in mok_forward_result */
} mok_backward_result;

typedef struct mok_usage {
  uint64_t sessions, arenas, arena_bytes, layers, contexts, context_bytes, results;
  uint64_t requests, forwards, backwards, errors;
  uint64_t gpu_bytes; /* GPU memory held in daemon-made arenas and contexts */
} mok_usage;

typedef struct mok_stats {
  mok_usage daemon;   /* all sessions */
  mok_usage session;  /* this connection */
  uint64_t uptime_ns;
  char backend[32];
} mok_stats;

typedef struct mok_welcome {
  uint32_t protocol_version;
  char daemon_version[32];
  char backend[32];
  uint64_t session_id;
  uint32_t max_frame_bytes;
  uint64_t max_arena_bytes;
  uint64_t session_quota_bytes;
  uint64_t session_gpu_quota_bytes;
  int ndevices;        /* GPUs the daemon runs on */
  /* The GPU this session runs on, as this process's CUDA numbers it (what
   * cudaSetDevice takes here); -1 on the cpu backend, or when the GPU is not
   * visible in this process (CUDA_VISIBLE_DEVICES). */
  int device;
  int daemon_device;   /* the same GPU as the daemon numbers it; -1 = cpu backend */
  char device_uuid[MOK_UUID_STRLEN]; /* its UUID; "" on the cpu backend */
} mok_welcome;

/* Where the daemon listens by default: $MOKD_SOCKET, else /run/mokd/mokd.sock
 * as root, else $XDG_RUNTIME_DIR/mokd.sock, else /tmp/mokd-UID.sock. */
void mok_default_socket(char *buf, size_t n);

/* path NULL = mok_default_socket(). Sends Hello and waits for Welcome. On
 * failure *out may still be set, so that mok_last_error() can say why; pass it
 * to mok_close() either way. */
int mok_connect(const char *path, const char *client_name, mok_client **out);
/* The same, on this process's CUDA device `device` (an ordinal as this
 * process's CUDA numbers it; -1 = the daemon picks its least used GPU).
 * libmok sends the GPU's UUID, so the daemon finds it whatever the two
 * processes' CUDA_VISIBLE_DEVICES; a GPU the daemon does not run is
 * MOK_EDEVICE. A session computes on one GPU, and its arenas live there;
 * mok_server_info(c) says which. */
int mok_connect_device(const char *path, const char *client_name, int device,
                       mok_client **out);
/* The same, on the GPU with this UUID ("GPU-..." as nvidia-smi -L prints it;
 * NULL = the daemon picks). */
int mok_connect_uuid(const char *path, const char *client_name, const char *gpu_uuid,
                     mok_client **out);
void mok_close(mok_client *c);
const char *mok_last_error(const mok_client *c);
const mok_welcome *mok_server_info(const mok_client *c);

int mok_ping(mok_client *c, uint64_t *rtt_ns);
int mok_stats_get(mok_client *c, mok_stats *out);

/* The version of the libmok that is loaded, "MAJOR.MINOR.PATCH" (which may
 * differ from the header's MOK_VERSION_*); each part, when not NULL. */
const char *mok_version(int *major, int *minor, int *patch);

/* Operators (protocol 2). A session as the daemon sees it. */
typedef struct mok_session_info {
  uint64_t id;
  int32_t pid;
  uint32_t uid, gid;
  char client_name[256]; /* escaped as the daemon's log writes it */
  char job_id[64];       /* Hello's job id: $MOKD_JOB_ID, else $SLURM_JOB_ID; "" = none */
  int device;            /* CUDA ordinal; -1 = cpu backend */
  uint64_t arena_bytes, context_bytes, gpu_bytes;
  uint64_t contexts, layers, requests;
  uint64_t age_ns;
} mok_session_info;

/* The sessions connected (only the caller's uid's unless the caller is root
 * or the daemon's uid), in *out (free() it) and *n. */
int mok_sessions(mok_client *c, mok_session_info **out, size_t *n);
/* Closes every session of job_id (or the session `session` when not 0) and
 * frees what they hold; root or the daemon's uid only (MOK_EPERM). *count
 * (when not NULL): the sessions closed. */
int mok_evict(mok_client *c, const char *job_id, uint64_t session, uint32_t *count);
/* Whether the daemon is ready: a round trip through each of its executors and
 * backends worked and none is stuck. *ready 1 or 0, why not in reason. */
int mok_health(mok_client *c, int *ready, char *reason, size_t reason_len,
               uint64_t *round_trip_ns);

/* A daemon-created arena, mapped here: a memfd on the CPU backend, GPU memory
 * (a cuMem allocation, rounded up to the GPU's granularity) on the CUDA
 * backend. GPU arenas need the CUDA driver, which libmok loads on first use. */
int mok_arena_create(mok_client *c, size_t bytes, mok_arena_info *out);
/* Hands a memfd (or any mmap-able fd) of `bytes` to the daemon; fd stays ours. */
int mok_arena_import(mok_client *c, int fd, size_t bytes, mok_arena_info *out);
/* Hands n sealed memfds to the daemon as one arena, mapped back to back in
 * order (fds[i] holds sizes[i] bytes; every size but the last a multiple of
 * the page size); the fds stay ours. Needs protocol 3. */
int mok_arena_import_chunks(mok_client *c, const int *fds, const size_t *sizes, int n,
                            mok_arena_info *out);
/* Lets the daemon (cuda backend) read and write GPU memory of this process
 * in place: [ptr, ptr + bytes) must lie in one allocation from cudaMalloc
 * (sent as a CUDA IPC handle), or in cuMemCreate allocations with POSIX-fd
 * handles (sent as their fds), one or several mapped back to back (PyTorch's
 * expandable_segments; several need protocol 3). The whole allocations
 * become one arena, imported on the first call and found again on later
 * ones, so registering weights or passing tensors of a caching allocator
 * costs no request once seen; an allocation freed and made again at the same
 * address is imported anew. *arena and *offset locate ptr for
 * mok_tensor_make. A range that overlaps arenas imported before is imported
 * with them as one arena, and the old ones are destroyed once no layer's
 * weights, no live forward context and no call since the last request name
 * them: call again for each request instead of keeping (*arena, *offset)
 * across requests. MOK_EZEROSIZE for bytes 0, MOK_EOVERFLOW for a range that
 * runs past the end of the address space, whatever the backend; then
 * MOK_ENOTSUP on the cpu backend. */
int mok_arena_import_cuda(mok_client *c, const void *ptr, size_t bytes, uint64_t *arena,
                          uint64_t *offset);
int mok_arena_destroy(mok_client *c, uint64_t arena);
/* The mapped address of a tensor in any arena this client knows, or NULL. */
void *mok_tensor_ptr(const mok_client *c, const mok_tensor *t);

/* Copies a tensor's bytes in from src or out to dst, host memory on the other
 * side; works for host and GPU arenas alike. */
int mok_tensor_write(mok_client *c, const mok_tensor *t, const void *src);
int mok_tensor_read(mok_client *c, const mok_tensor *t, void *dst);

/* A tensor at `offset` of `arena`; shape[0..ndim). */
mok_tensor mok_tensor_make(uint64_t arena, uint64_t offset, mok_dtype dtype, int ndim,
                           const int64_t *shape);
size_t mok_tensor_bytes(const mok_tensor *t);

/* With ep_size > 1 the layer is rank ep_rank of EP group ep_group: every rank
 * creates it in its own session (its own mok_client, usually its own
 * process) with the same shape, and the call returns once all ep_size ranks
 * have joined, or fails with MOK_ETIMEDOUT after the daemon's
 * group_timeout_ms. A joiner whose shape, options or size differ, or whose
 * rank is taken, is refused (MOK_ESHAPE, MOK_EGROUP, MOK_EEXIST) and the
 * others wait on. See mok_layer_desc_ep. */
int mok_layer_create(mok_client *c, const mok_layer_desc *d, uint64_t *layer);
/* mok_layer_create with kernel options (t NULL: all defaults). A choice
 * out of range is refused (MOK_EINVAL) with the daemon's message; ranks of
 * one EP group must choose alike. */
int mok_layer_create_tuned(mok_client *c, const mok_layer_desc *d, const mok_layer_tuning *t,
                           uint64_t *layer);
/* Reads options from text as "key=value" items separated by commas or
 * spaces, into t (zeroed first): tiles=auto|wide|tall|pingpong,
 * wgrad_tiles=auto|wide|pingpong,
 * clusters=auto|none|dgrad|all, order=auto|dynamic|static,
 * tails=auto|own|ride|split|whole, dx=auto|halves|whole,
 * dispatch=auto|before|gather|N (N blocks beside gate/up, 1..1024). NULL or ""
 * gives the defaults. MOK_EINVAL with a message in err (MOK_ERRLEN bytes,
 * may be NULL) naming the bad item. */
int mok_layer_tuning_parse(mok_layer_tuning *t, const char *text, char *err);
/* Writes t as mok_layer_tuning_parse reads it, only the fields not left to
 * the daemon ("" when none is set). Returns the length it needed, as
 * snprintf does, or MOK_EINVAL when t holds a value out of range. */
int mok_layer_tuning_format(const mok_layer_tuning *t, char *buf, size_t n);
/* Makes d (its sizes already set) the layer of rank `rank` of EP group
 * `group` of `size` ranks; group ids are chosen by the job and are per user.
 * Rank r's weights are then experts [r * E/size, (r + 1) * E/size):
 * w_gate and w_up [E/size, I, H], w_down [E/size, H, I], plus its own copy of
 * the shared expert (the same on every rank). Each step of the group runs
 * once every rank has sent it, all with the same T, and each rank gets its
 * own tokens' outputs, its experts' gradients and the shared expert's
 * gradient over all ranks' tokens; the bits equal one rank running the
 * concatenated batch with all experts. If a rank leaves (mok_close,
 * mok_layer_destroy, its process dies) or is group_timeout_ms late, the
 * others' waiting calls fail (MOK_EGROUP, MOK_ETIMEDOUT) and so does every
 * later step: destroy the layers and form a new group. 0, or MOK_EINVAL
 * (size 0, rank >= size) or MOK_EEPSIZE (experts do not divide by size). */
int mok_layer_desc_ep(mok_layer_desc *d, uint64_t group, uint32_t size, uint32_t rank);
int mok_layer_destroy(mok_client *c, uint64_t layer);
/* w[MOK_S_*] must be absent (ndim 0) without a shared expert. The weights are
 * read in place every step, so updates made to them between steps are seen. */
int mok_layer_set_weights(mok_client *c, uint64_t layer, const mok_tensor *w);

/* Stream ordering (cuda backend). With a stream set (a CUstream or
 * cudaStream_t of this process, on the daemon's device), mok_forward and
 * mok_backward record an event on it before the request leaves, the daemon's
 * step waits for that event on the GPU, and the stream is made to wait for
 * the step's done event before the call returns: the call returns while the
 * GPU still works, and whatever is queued on the stream afterwards sees the
 * outputs. Errors only the GPU can see are then read with mok_step_status.
 * NULL (the default): the ready event is recorded on the legacy default
 * stream, and the calls return once the outputs are complete, with such
 * errors as their result. */
int mok_set_stream(mok_client *c, void *stream);
/* Waits for the step that returned `status` (a result's status tensor) and
 * returns 0, or the error it met (MOK_EEXPERT: an expert id out of range,
 * those pairs dropped). 0 at once for steps without a status (CPU backend). */
int mok_step_status(mok_client *c, const mok_tensor *status);

/* topk_ids: int32 [T, K] expert ids in [0, E), or -1 for a pair with no route
 * (as DeepEP and Megatron mark one): the pair is absent, adds nothing to out,
 * and its d_topk_weights is 0.
 * inference != 0 keeps no state for a backward (the context still owns out);
 * otherwise the context reads x and the weights again in the backward: keep
 * them unchanged until then (or name where the weights are now:
 * mok_backward_weights).
 * A step that fails after the daemon made its result releases it again. */
int mok_forward(mok_client *c, uint64_t layer, const mok_tensor *x,
                const mok_tensor *topk_ids, const mok_tensor *topk_weights, int inference,
                mok_forward_result *res);
/* grads: NULL, or ngrads tensors (fp32 to add into for MOK_GRAD_FP32_ACCUM,
 * bf16 to write otherwise). NULL in bf16 mode: the daemon returns them. */
int mok_backward(mok_client *c, uint64_t context, const mok_tensor *d_out,
                 const mok_tensor *grads, int ngrads, mok_backward_result *res);
/* The same, reading the weights where they are now: weights is NULL (where
 * the forward read them, as mok_backward does) or MOK_NWEIGHTS tensors in
 * the order of mok_layer_set_weights (the shared expert's absent, ndim 0,
 * without one), checked as that call checks them. For weights that moved
 * since the forward but hold the same values: FSDP frees its gathered
 * weights after the forward and gathers them again, elsewhere, before the
 * backward. The daemon then no longer reads the forward's weight memory. */
int mok_backward_weights(mok_client *c, uint64_t context, const mok_tensor *d_out,
                         const mok_tensor *grads, int ngrads, const mok_tensor *weights,
                         mok_backward_result *res);
/* Flags of mok_backward_flags. MOK_BACKWARD_LAST: the context's last
 * backward, as autograd's without retain_graph: the daemon may write over
 * what the forward saved, and the backward needs less GPU memory at its
 * peak (the cuda backend: T K H 2 bytes, or more, less); the results are
 * the same bits. Once the daemon has accepted it, a later backward naming
 * the context fails with MOK_ECONTEXT, whether this one succeeded or not.
 * The context still owns out until released. */
#define MOK_BACKWARD_LAST 1u
/* mok_backward_weights with flags (0 or MOK_BACKWARD_LAST; MOK_EINVAL for
 * others). */
int mok_backward_flags(mok_client *c, uint64_t context, const mok_tensor *d_out,
                       const mok_tensor *grads, int ngrads, const mok_tensor *weights,
                       unsigned flags, mok_backward_result *res);
/* Releases contexts and backward results (and the outputs they own). */
int mok_release(mok_client *c, const uint64_t *ids, int n);

#ifdef __cplusplus
}
#endif

#endif
