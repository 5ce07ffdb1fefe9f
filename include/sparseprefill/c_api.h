/* SPDX-License-Identifier: Apache-2.0
 * The C ABI of sparseprefill (libsparseprefill_c): run() over plain C types, for ctypes, cffi
 * and the Python binding. No C++ type and no exception crosses it; every fallible call
 * returns an sp_status code and leaves a message for sp_last_error(). Host-only C99. */
#ifndef SPARSEPREFILL_C_API_H_
#define SPARSEPREFILL_C_API_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define SP_C_API __attribute__((visibility("default")))
#else
#define SP_C_API
#endif

/* Bumped whenever a struct below changes layout or a function changes meaning; loaders
 * compare it with sp_abi_version() before their first call. */
#define SP_ABI_VERSION 5
#define SP_MAX_RANK 4

/* Status codes: the values of sparseprefill::StatusCode. */
typedef enum sp_status {
  SP_OK = 0,
  SP_ERR_INVALID_ARGUMENT = 1, /* a caller's argument is malformed; the message names it */
  SP_ERR_UNSUPPORTED = 2,      /* well-formed, but no backend implements the combination */
  SP_ERR_IO = 3,
  SP_ERR_CORRUPT_DATA = 4,
  SP_ERR_CUDA = 5,
  SP_ERR_INTERNAL = 6 /* a broken invariant or an exception inside the library */
} sp_status;

typedef enum sp_dtype {
  SP_DTYPE_BF16 = 0,
  SP_DTYPE_FP16 = 1,
  SP_DTYPE_FP32 = 2,
  SP_DTYPE_INT32 = 3,
  SP_DTYPE_FP8_E4M3 = 4 /* OCP E4M3 "fn" (torch.float8_e4m3fn): q, k, v only, with descales */
} sp_dtype;

typedef enum sp_device_type { SP_DEVICE_CPU = 0, SP_DEVICE_CUDA = 1 } sp_device_type;

typedef enum sp_backend {
  SP_BACKEND_AUTO = 0, /* CPU tensors -> CPU backend, CUDA tensors -> CUDA backend */
  SP_BACKEND_REFERENCE = 1,
  SP_BACKEND_CPU = 2,
  SP_BACKEND_CUDA = 3
} sp_backend;

/* A non-owning tensor view. rank == 0 (with data == NULL) stands for an absent optional
 * tensor. Strides are in elements; dtype is an sp_dtype, device_type an sp_device_type. */
typedef struct sp_tensor {
  void* data;
  int32_t dtype;
  int32_t device_type;
  int32_t device_index; /* CUDA ordinal; 0 for the CPU */
  int32_t rank;
  int64_t shape[SP_MAX_RANK];
  int64_t stride[SP_MAX_RANK];
} sp_tensor;

/* One attention call, with the layouts of sparseprefill::AttentionProblem (problem.h):
 *   batched: q [b, s_q, h_q, d], k/v [b, s_k, h_kv, d]
 *   varlen:  q [total_q, h_q, d] + cu_seqlens_q [b+1]; k/v [total_k, h_kv, d] + cu_seqlens_k
 *   paged:   k/v [num_pages, page_size, h_kv, d] + block_table [b, max_pages] + seqused_k [b]
 * Causal is bottom-right aligned; scale 0 means 1/sqrt(d). FP8 inputs (q, k and v all
 * SP_DTYPE_FP8_E4M3) may carry fp32 descales [b, h_kv] on q's device: attention runs on
 * q · q_descale[b, h / group], k · k_descale[b, kv head], v · v_descale[b, kv head] (an absent
 * descale is 1); descales with any other input dtype are refused. */
typedef struct sp_problem {
  sp_tensor q;
  sp_tensor k;
  sp_tensor v;
  sp_tensor cu_seqlens_q;
  sp_tensor cu_seqlens_k;
  sp_tensor seqused_k;
  sp_tensor block_table;
  sp_tensor q_descale; /* fp32 [b, h_kv], optional (FP8 inputs only) */
  sp_tensor k_descale;
  sp_tensor v_descale;
  int32_t causal; /* nonzero: causal */
  double scale;
  /* Model-family features (ABI 4, attention_chunk ABI 5; docs/semantics.md §1). Zero-initialised:
   * none of them. */
  int32_t local;        /* nonzero: the window below applies (FlashAttention's window_size) */
  int32_t window_left;  /* with local: query at position a sees keys >= a - window_left; -1: no bound */
  int32_t window_right; /* with local: keys <= a + window_right; -1: no bound */
  int32_t attention_chunk; /* 0: none; else > 0: keys of the query's own chunk of that many positions */
  double softcap;       /* 0: none; else finite > 0: every score s becomes softcap * tanh(s / softcap) */
  sp_tensor sinks;      /* fp32 [h_q] on q's device, optional: learned sink logits (gpt-oss) */
} sp_problem;

/* O has q's shape with v's head dim last, q's dtype (bf16 for FP8 inputs) and device; LSE is
 * fp32 [b, h_q, s_q] (varlen: [h_q, total_q]) and may be absent (rank 0). */
typedef struct sp_output {
  sp_tensor o;
  sp_tensor lse;
} sp_output;

typedef struct sp_options {
  int32_t backend;     /* sp_backend */
  int32_t num_threads; /* CPU backend: 0 = every core */
  void* cuda_stream;   /* cudaStream_t for the CUDA backend; NULL = the default stream */
  /* How a CUDA call executes (sparseprefill::ExecutionOverrides; 0 everywhere = the library's
   * choice after the environment's SPARSEPREFILL_* variables): */
  int32_t cuda_path;   /* 0 auto, 1 portable, 2 hopper (an error where the Hopper kernels cannot run) */
  int32_t pack_gqa;    /* 0 auto, 1 always, 2 never */
  int32_t kv_staging;  /* 0 auto, 1 always, 2 never */
  int32_t gate_passes; /* 0 auto, 1 or 2 (exact_gate) */
} sp_options;

/* Work accounting of one (batch, query head); see sparseprefill::HeadStats. */
typedef struct sp_head_stats {
  int64_t visible_blocks;
  int64_t kept_blocks;
  int64_t corrected_blocks;
  int64_t visible_pairs;
  int64_t computed_pairs;
} sp_head_stats;

/* Filled by sp_run when non-NULL (collecting statistics may synchronise the stream). The
 * totals are summed over every (batch, query head). When `heads` is non-NULL and
 * heads_capacity >= batch * h_q, the per-head entries are written row-major [batch, h_q];
 * num_heads always receives batch * h_q. */
typedef struct sp_stats {
  sp_head_stats total;
  double density;      /* kept / visible blocks */
  double pair_density; /* computed / visible pairs */
  int32_t batch;
  int32_t h_q;
  int64_t num_heads;
  sp_head_stats* heads;   /* in: optional caller-owned buffer */
  int64_t heads_capacity; /* in: its length in entries */
  /* What ran (sparseprefill::ExecutionInfo); static strings, valid for the process: */
  const char* path;              /* "reference", "cpu", "cuda-portable", "cuda-hopper" */
  const char* instance;          /* the attention kernel instance, or "" on the host backends */
  const char* decision_instance; /* the kernel deciding ahead of it, or "" */
  int32_t passes;                /* exact_gate: 2 with a decision kernel ahead of attention */
  int32_t q_pack;                /* query heads per tile (GQA packing) */
} sp_stats;

/* A policy: name + key=value settings (as the CLI's --set), plus tensor attachments. Opaque;
 * immutable during sp_run, so several threads may run with one policy at once. */
typedef struct sp_policy sp_policy;

typedef struct sp_setting {
  const char* key;
  const char* value;
} sp_setting;

/* A block mask as CSR over rows (b, h, qb) in row-major order, host memory, copied in:
 * indptr has num_rows + 1 entries, num_rows = batch * heads * num_q_blocks (heads = h_q, or
 * h_kv when per_kv_head); each row's key-block indices ascending, full and partial merged (the
 * problem's geometry recovers the split). */
typedef struct sp_block_mask_csr {
  int32_t block_q;
  int32_t block_k;
  int32_t per_kv_head; /* nonzero: one selection per KV head */
  int64_t num_rows;
  const int32_t* indptr;
  int64_t num_indices;
  const int32_t* indices;
} sp_block_mask_csr;

/* Builds a policy from its name ("dense", "block_sparse", "exact_gate", "softmax_skip",
 * "estimate_select", "permute_stop") and settings; *out receives a new handle that the caller
 * releases with sp_policy_destroy. */
SP_C_API int sp_policy_create(const char* name, const sp_setting* settings, int32_t num_settings,
                              sp_policy** out);
SP_C_API void sp_policy_destroy(sp_policy* policy);

/* exact_gate: the threshold table, fp32 [h_q, positions] on q's device. The policy keeps a
 * view: the memory must outlive every sp_run with this policy. */
SP_C_API int sp_policy_set_thresholds(sp_policy* policy, const sp_tensor* thresholds);

/* estimate_select under chunked prefill (EstimateSelectParams, docs/semantics.md §1):
 * prompt_len, host int32 [b]: each prompt's whole length, so that `tail` counts the prompt's
 * last query tiles (NULL or rank 0: the call is the prompt). The block-means cache:
 * k_means, v_means [b, h_kv, max_blocks, d] in the input dtype on q's device, and valid, host
 * int32 [b], the leading blocks they hold; every run reads the valid blocks and writes the
 * blocks it completes (NULL or rank 0 for all three: no cache). The policy keeps views: the
 * memory must outlive every run and plan with this policy, and runs that share a cache must
 * not overlap. */
SP_C_API int sp_policy_set_prompt_len(sp_policy* policy, const sp_tensor* prompt_len);
SP_C_API int sp_policy_set_block_means(sp_policy* policy, const sp_tensor* k_means, const sp_tensor* v_means,
                                       const sp_tensor* valid);

/* block_sparse: the mask to execute, checked against `problem`'s geometry (only the shapes
 * and layout of `problem` are read, never its data). */
SP_C_API int sp_policy_set_block_mask(sp_policy* policy, const sp_problem* problem,
                                      const sp_block_mask_csr* mask);

/* One line naming the policy and every parameter; owned by the handle, valid until it is
 * changed or destroyed. */
SP_C_API const char* sp_policy_describe(const sp_policy* policy);

/* A block mask read in place (sparseprefill::DeviceBlockMask: FlexAttention's four tensors, or
 * CSR; on q's device, no copy, no synchronisation; checked on the device as the call runs, its
 * offences reported by sp_check_device_errors and by calls that synchronise). Rank-0 tensors
 * are absent. The policy views the tensors: they must outlive its runs. */
typedef struct sp_device_block_mask {
  sp_tensor kv_num_blocks;      /* int32 [B, H, Q] (partial blocks) */
  sp_tensor kv_indices;         /* int32 [B, H, Q, K] */
  sp_tensor full_kv_num_blocks; /* optional */
  sp_tensor full_kv_indices;    /* optional */
  sp_tensor csr_indptr;         /* or CSR: int32 [rows + 1] */
  sp_tensor csr_indices;        /* int32 [nnz] */
  int32_t block_q;
  int32_t block_k;
  int32_t per_kv_head;
} sp_device_block_mask;
SP_C_API int sp_policy_set_device_block_mask(sp_policy* policy, const sp_device_block_mask* mask);
/* estimate_select's selection into `out`'s four Flex tensors on the device (sparseprefill::
 * select_into), enqueued on options->cuda_stream without synchronising. */
SP_C_API int sp_select_into(const sp_problem* problem, const sp_policy* policy, const sp_options* options,
                            const sp_device_block_mask* out);
/* The first offence of a device block mask check on CUDA device `device` since the last report
 * (SP_ERR_INVALID_ARGUMENT, sp_last_error names it), clearing it; synchronises the device. */
SP_C_API int sp_check_device_errors(int32_t device);

/* Computes O (and LSE) for `problem` under `policy`. options and stats may be NULL. Never
 * allocates output memory. */
SP_C_API int sp_run(const sp_problem* problem, const sp_policy* policy, const sp_output* output,
                    const sp_options* options, sp_stats* stats);

/* ---- Select, plan, run (include/sparseprefill/plan.h) and decisions ----------------------
 *
 * Ownership: everything a call returns lives in a library-owned handle the caller creates
 * and destroys (sp_decisions, sp_plan); views into an sp_decisions stay valid until the handle
 * is filled again or destroyed. Nothing is freed by the caller except through *_destroy. */

/* What a policy decided (sparseprefill::Decisions): kept blocks (and estimate_select's mean-
 * correction blocks) as CSR masks, permute_stop's tiles and query order. Filled by sp_select,
 * sp_run_decisions and sp_plan_run; empty until then. */
typedef struct sp_decisions sp_decisions;

typedef enum sp_mask_kind {
  SP_MASK_KEPT = 0,     /* blocks whose keys entered the softmax */
  SP_MASK_CORRECTED = 1 /* estimate_select with mean correction: blocks added as pseudo-tokens */
} sp_mask_kind;

/* A BlockMask as CSR, read-only, in memory the sp_decisions owns: rows (b, h, qb) row-major,
 * num_rows = batch * heads * num_q_blocks (heads = h_q, or h_kv when per_kv_head), indptr
 * [num_rows + 1], each row's key-block indices ascending (full and partial merged). A mask the
 * policy does not produce (corrected without mean correction, any mask of permute_stop) has
 * num_rows = 0 and NULL pointers, as does a dense run (nothing to record: every visible block was
 * computed). */
typedef struct sp_block_mask_view {
  int32_t batch;
  int32_t heads;
  int32_t num_q_blocks;
  int32_t num_k_blocks;
  int32_t block_q;
  int32_t block_k;
  int32_t per_kv_head;
  int64_t num_rows;
  const int32_t* indptr;
  int64_t num_indices;
  const int32_t* indices;
} sp_block_mask_view;

/* permute_stop's decision for one query tile (sparseprefill::PermuteTile). */
typedef struct sp_permute_tile {
  int32_t batch;
  int32_t head;
  int32_t segment;
  int32_t tile;
  int32_t chunks_visited;
  int32_t chunks_total;
} sp_permute_tile;

SP_C_API int sp_decisions_create(sp_decisions** out);
SP_C_API void sp_decisions_destroy(sp_decisions* decisions);
/* The policy name of the last fill ("" before any); owned by the handle. */
SP_C_API const char* sp_decisions_policy(const sp_decisions* decisions);
/* *out receives a view of mask `which` (an sp_mask_kind). */
SP_C_API int sp_decisions_mask(const sp_decisions* decisions, int32_t which, sp_block_mask_view* out);
/* permute_stop: tiles sorted by (batch, head, segment, tile); NULL and 0 for other policies. */
SP_C_API int sp_decisions_tiles(const sp_decisions* decisions, const sp_permute_tile** tiles, int64_t* count);
/* permute_stop: [batch, h_q, max s_q], for each slot the call-relative row it holds (-1 past a
 * sequence's end); NULL and 0 for other policies. */
SP_C_API int sp_decisions_query_order(const sp_decisions* decisions, const int32_t** order, int64_t* count);

/* Runs the policy's selector alone (no attention) into `decisions`; `stats` (may be NULL)
 * receives the work attending with the selection would do. dense: every visible block as a
 * 128 x 128 mask; block_sparse: its mask; estimate_select: the selector's mask (on CUDA the GPU
 * selector's device mask, copied back: synchronises options->cuda_stream). exact_gate,
 * softmax_skip and permute_stop decide during attention: SP_ERR_UNSUPPORTED (use
 * sp_run_decisions). options and stats may be NULL. */
SP_C_API int sp_select(const sp_problem* problem, const sp_policy* policy, const sp_options* options,
                       sp_decisions* decisions, sp_stats* stats);

/* sp_run that also fills `decisions` (when non-NULL; on CUDA that synchronises the stream and
 * is refused under graph capture). */
SP_C_API int sp_run_decisions(const sp_problem* problem, const sp_policy* policy, const sp_output* output,
                              const sp_options* options, sp_stats* stats, sp_decisions* decisions);

/* A plan: the problem's shape and the policy checked once (a block_sparse mask validated, and
 * on CUDA compacted and uploaded into device memory the plan owns), for many sp_plan_run
 * calls. The plan copies the policy (later changes to the sp_policy do not reach it) but only
 * views an exact_gate threshold table, which must outlive the plan. Only the shapes, layout
 * and index tensors of `problem` are read. options->backend picks the backend and
 * options->cuda_stream orders the uploads (complete when the call returns); NULL options: auto.
 * Immutable: several threads may run one plan at once. */
typedef struct sp_plan sp_plan;
SP_C_API int sp_plan_create(const sp_problem* problem, const sp_policy* policy, const sp_options* options,
                            sp_plan** out);
/* On CUDA, frees the plan's device memory (after work already enqueued with it completes);
 * a captured CUDA graph that used the plan must not be replayed afterwards. */
SP_C_API void sp_plan_destroy(sp_plan* plan);
/* The plan's policy, as sp_policy_describe. */
SP_C_API const char* sp_plan_describe(const sp_plan* plan);
/* sp_run with the plan's policy, skipping its validation and (CUDA) the mask upload. The
 * problem must have the plan's shape (SP_ERR_INVALID_ARGUMENT names the first difference);
 * options->backend must be AUTO or the plan's. options, stats and decisions may be NULL. */
SP_C_API int sp_plan_run(const sp_plan* plan, const sp_problem* problem, const sp_output* output,
                         const sp_options* options, sp_stats* stats, sp_decisions* decisions);

/* SP_OK when `backend` (an sp_backend) can run the combination; otherwise the code and a
 * message that says what is compiled. */
SP_C_API int sp_can_run(const sp_problem* problem, const sp_policy* policy, int32_t backend);

/* ---- Calibration: one sparseprefill::CalibrationRun (calibration.h). Each layer's q and k go
 * in with sp_calibrator_add: CUDA tensors are reduced to statistics on the GPU (bf16/fp16,
 * d 64/128, exact_gate/softmax_skip blocks 64 or 128, estimate_select block 128), host tensors
 * on the CPU; sp_calibrator_save fits every factor and writes the calibration file. Opaque;
 * one thread at a time per handle. */
typedef struct sp_calibrator sp_calibrator;

/* What to calibrate; a list of length 0 leaves its policy out (at least one is needed).
 * estimate_select's other parameters (sink, window, tail, no correction, per query head) are
 * the policy's defaults, as `sparseprefill calibrate` uses them. */
typedef struct sp_calibration_targets {
  int32_t layers;
  int32_t heads;        /* query heads; required with budgets */
  int32_t block_q;      /* exact_gate and softmax_skip blocks */
  int32_t block_k;
  int32_t select_block; /* estimate_select block */
  const int32_t* budgets; /* exact_gate budgets, ascending */
  int32_t num_budgets;
  const double* skip_targets; /* softmax_skip target skip fractions, ascending */
  int32_t num_skip_targets;
  const double* density_targets; /* estimate_select target densities, ascending */
  int32_t num_density_targets;
} sp_calibration_targets;

SP_C_API int sp_calibrator_create(const sp_calibration_targets* targets, sp_calibrator** out);
SP_C_API void sp_calibrator_destroy(sp_calibrator* calibrator);
/* Adds q and k of `layer` (causal; sample->v is not read and may repeat k). CUDA work runs on
 * options->cuda_stream (options NULL: the default stream), which is synchronised. */
SP_C_API int sp_calibrator_add(sp_calibrator* calibrator, int32_t layer, const sp_problem* sample,
                               const sp_options* options);
/* Fits every factor per layer and target and writes the calibration file at `path`, with the
 * metadata pairs (keys the format reserves are rejected). */
SP_C_API int sp_calibrator_save(const sp_calibrator* calibrator, const char* path,
                                const sp_setting* metadata, int32_t num_metadata);

/* ---- Synthetic inputs: the structured generator (sparseprefill/generator.h, docs/generator.md)
 * for benchmarks and tests without model activations. */
typedef struct sp_generator_config {
  int32_t batch;
  int32_t seq_q;  /* queries: the last seq_q of seq_k positions */
  int32_t seq_k;
  int32_t h_q;
  int32_t h_kv;
  int32_t d;
  uint64_t seed;
  double peakedness; /* 0: near-uniform attention; larger: sharper heads (default 1) */
} sp_generator_config;

/* Fills host tensors q [batch, seq_q, h_q, d], k and v [batch, seq_k, h_kv, d], contiguous, all
 * of one dtype (bf16, fp16 or fp32: the generator's dtype), with the generator's values for
 * `config`; bit-identical to sparseprefill::generate. */
SP_C_API int sp_generate(const sp_generator_config* config, const sp_tensor* q, const sp_tensor* k,
                         const sp_tensor* v);

/* The message of the last call on this thread that failed; "" after a call that succeeded.
 * Valid until the thread's next call into this library. */
SP_C_API const char* sp_last_error(void);
/* "ok", "invalid argument", ... for any code (unknown codes give "unknown"). */
SP_C_API const char* sp_status_name(int32_t code);
/* Version, compiled backends, CUDA architectures and kernel variants, one item per line. */
SP_C_API const char* sp_build_info(void);
SP_C_API int32_t sp_abi_version(void);

#ifdef __cplusplus
}
#endif

#endif /* SPARSEPREFILL_C_API_H_ */
