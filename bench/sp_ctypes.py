# SPDX-License-Identifier: Apache-2.0
"""ctypes loader for libsparseprefill_c (include/sparseprefill/c_api.h), for the benchmarks.

Mirrors the C structs field for field; takes raw pointers, shapes and strides, so it needs
neither torch nor numpy (`tensor_from_torch` imports torch only when called).
"""
import ctypes
import os

ABI_VERSION = 5
MAX_RANK = 4

OK, ERR_INVALID_ARGUMENT, ERR_UNSUPPORTED = 0, 1, 2
DTYPE_BF16, DTYPE_FP16, DTYPE_FP32, DTYPE_INT32, DTYPE_FP8_E4M3 = 0, 1, 2, 3, 4
DEVICE_CPU, DEVICE_CUDA = 0, 1
BACKEND_AUTO, BACKEND_REFERENCE, BACKEND_CPU, BACKEND_CUDA = 0, 1, 2, 3


class Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int32),
                ("device_type", ctypes.c_int32), ("device_index", ctypes.c_int32),
                ("rank", ctypes.c_int32), ("shape", ctypes.c_int64 * MAX_RANK),
                ("stride", ctypes.c_int64 * MAX_RANK)]


class Problem(ctypes.Structure):
    _fields_ = [("q", Tensor), ("k", Tensor), ("v", Tensor), ("cu_seqlens_q", Tensor),
                ("cu_seqlens_k", Tensor), ("seqused_k", Tensor), ("block_table", Tensor),
                ("q_descale", Tensor), ("k_descale", Tensor), ("v_descale", Tensor),
                ("causal", ctypes.c_int32), ("scale", ctypes.c_double),
                ("local", ctypes.c_int32), ("window_left", ctypes.c_int32), ("window_right", ctypes.c_int32),
                ("attention_chunk", ctypes.c_int32),
                ("softcap", ctypes.c_double), ("sinks", Tensor)]


class Output(ctypes.Structure):
    _fields_ = [("o", Tensor), ("lse", Tensor)]


class Options(ctypes.Structure):
    _fields_ = [("backend", ctypes.c_int32), ("num_threads", ctypes.c_int32),
                ("cuda_stream", ctypes.c_void_p), ("cuda_path", ctypes.c_int32), ("pack_gqa", ctypes.c_int32),
                ("kv_staging", ctypes.c_int32), ("gate_passes", ctypes.c_int32)]


class HeadStats(ctypes.Structure):
    _fields_ = [("visible_blocks", ctypes.c_int64), ("kept_blocks", ctypes.c_int64),
                ("corrected_blocks", ctypes.c_int64), ("visible_pairs", ctypes.c_int64),
                ("computed_pairs", ctypes.c_int64)]


class Stats(ctypes.Structure):
    _fields_ = [("total", HeadStats), ("density", ctypes.c_double),
                ("pair_density", ctypes.c_double), ("batch", ctypes.c_int32),
                ("h_q", ctypes.c_int32), ("num_heads", ctypes.c_int64),
                ("heads", ctypes.POINTER(HeadStats)), ("heads_capacity", ctypes.c_int64),
                ("path", ctypes.c_char_p), ("instance", ctypes.c_char_p), ("decision_instance", ctypes.c_char_p),
                ("passes", ctypes.c_int32), ("q_pack", ctypes.c_int32)]


class DeviceBlockMask(ctypes.Structure):
    _fields_ = [("kv_num_blocks", Tensor), ("kv_indices", Tensor), ("full_kv_num_blocks", Tensor),
                ("full_kv_indices", Tensor), ("csr_indptr", Tensor), ("csr_indices", Tensor),
                ("block_q", ctypes.c_int32), ("block_k", ctypes.c_int32), ("per_kv_head", ctypes.c_int32)]


class Setting(ctypes.Structure):
    _fields_ = [("key", ctypes.c_char_p), ("value", ctypes.c_char_p)]


class BlockMaskCsr(ctypes.Structure):
    _fields_ = [("block_q", ctypes.c_int32), ("block_k", ctypes.c_int32),
                ("per_kv_head", ctypes.c_int32), ("num_rows", ctypes.c_int64),
                ("indptr", ctypes.c_void_p), ("num_indices", ctypes.c_int64),
                ("indices", ctypes.c_void_p)]


class BlockMaskView(ctypes.Structure):
    _fields_ = [("batch", ctypes.c_int32), ("heads", ctypes.c_int32), ("num_q_blocks", ctypes.c_int32),
                ("num_k_blocks", ctypes.c_int32), ("block_q", ctypes.c_int32), ("block_k", ctypes.c_int32),
                ("per_kv_head", ctypes.c_int32), ("num_rows", ctypes.c_int64),
                ("indptr", ctypes.POINTER(ctypes.c_int32)), ("num_indices", ctypes.c_int64),
                ("indices", ctypes.POINTER(ctypes.c_int32))]


class PermuteTile(ctypes.Structure):
    _fields_ = [("batch", ctypes.c_int32), ("head", ctypes.c_int32), ("segment", ctypes.c_int32),
                ("tile", ctypes.c_int32), ("chunks_visited", ctypes.c_int32), ("chunks_total", ctypes.c_int32)]


class GeneratorConfig(ctypes.Structure):
    _fields_ = [("batch", ctypes.c_int32), ("seq_q", ctypes.c_int32), ("seq_k", ctypes.c_int32),
                ("h_q", ctypes.c_int32), ("h_kv", ctypes.c_int32), ("d", ctypes.c_int32),
                ("seed", ctypes.c_uint64), ("peakedness", ctypes.c_double)]


MASK_KEPT, MASK_CORRECTED = 0, 1


class SparsePrefillError(RuntimeError):
    def __init__(self, code, name, message):
        super().__init__(f"{name}: {message}")
        self.code = code


def tensor(data_ptr, dtype, device_type, device_index, shape, stride):
    """A Tensor view; shape and stride (in elements) of equal length, at most 4."""
    t = Tensor()
    t.data = data_ptr
    t.dtype = dtype
    t.device_type = device_type
    t.device_index = device_index
    t.rank = len(shape)
    for i, (n, s) in enumerate(zip(shape, stride)):
        t.shape[i] = n
        t.stride[i] = s
    return t


def tensor_from_torch(t):
    import torch
    codes = {torch.bfloat16: DTYPE_BF16, torch.float16: DTYPE_FP16,
             torch.float32: DTYPE_FP32, torch.int32: DTYPE_INT32, torch.float8_e4m3fn: DTYPE_FP8_E4M3}
    device_type = DEVICE_CUDA if t.is_cuda else DEVICE_CPU
    return tensor(t.data_ptr(), codes[t.dtype], device_type, t.device.index or 0,
                  list(t.shape), list(t.stride()))


class Policy:
    """An sp_policy handle; destroyed with the object."""

    def __init__(self, lib, name, settings=None):
        self._lib = lib
        self.handle = ctypes.c_void_p()
        items = list((settings or {}).items())
        arr = (Setting * max(1, len(items)))()
        for i, (k, v) in enumerate(items):
            arr[i] = Setting(str(k).encode(), str(v).encode())
        lib.check(lib.dll.sp_policy_create(name.encode(), arr, len(items),
                                           ctypes.byref(self.handle)))
        self.name = name
        self.keep_alive = []  # tensors the policy holds views of

    def set_thresholds(self, t, owner=None):
        """t: a Tensor view; owner: the object holding its memory, kept alive with the policy."""
        self._lib.check(self._lib.dll.sp_policy_set_thresholds(self.handle, ctypes.byref(t)))
        self.keep_alive.append(owner)

    def set_prompt_len(self, t, owner=None):
        """estimate_select under chunked prefill: t, a host int32 [b] Tensor view of each
        prompt's whole length; owner as in set_thresholds."""
        self._lib.check(self._lib.dll.sp_policy_set_prompt_len(self.handle, ctypes.byref(t)))
        self.keep_alive.append(owner)

    def set_block_mask(self, problem, block_q, block_k, indptr_ptr, num_rows, indices_ptr,
                       num_indices, per_kv_head=False):
        csr = BlockMaskCsr(block_q, block_k, int(per_kv_head), num_rows, indptr_ptr,
                           num_indices, indices_ptr)
        self._lib.check(self._lib.dll.sp_policy_set_block_mask(
            self.handle, ctypes.byref(problem), ctypes.byref(csr)))

    def describe(self):
        return self._lib.dll.sp_policy_describe(self.handle).decode()

    def __del__(self):
        if self.handle:
            self._lib.dll.sp_policy_destroy(self.handle)
            self.handle = ctypes.c_void_p()


class Decisions:
    """An sp_decisions handle (filled by Library.select / run_decisions / plan_run)."""

    def __init__(self, lib):
        self._lib = lib
        self.handle = ctypes.c_void_p()
        lib.check(lib.dll.sp_decisions_create(ctypes.byref(self.handle)))

    def policy(self):
        return self._lib.dll.sp_decisions_policy(self.handle).decode()

    def mask(self, which=MASK_KEPT):
        """A BlockMaskView into memory the handle owns (num_rows 0 when absent)."""
        view = BlockMaskView()
        self._lib.check(self._lib.dll.sp_decisions_mask(self.handle, which, ctypes.byref(view)))
        return view

    def tiles(self):
        ptr, n = ctypes.POINTER(PermuteTile)(), ctypes.c_int64()
        self._lib.check(self._lib.dll.sp_decisions_tiles(self.handle, ctypes.byref(ptr), ctypes.byref(n)))
        return [ptr[i] for i in range(n.value)]

    def __del__(self):
        if self.handle:
            self._lib.dll.sp_decisions_destroy(self.handle)
            self.handle = ctypes.c_void_p()


class Plan:
    """An sp_plan handle (Library.plan); destroyed with the object."""

    def __init__(self, lib, handle, policy):
        self._lib = lib
        self.handle = handle
        self.keep_alive = policy.keep_alive  # the plan views the policy's threshold table

    def describe(self):
        return self._lib.dll.sp_plan_describe(self.handle).decode()

    def __del__(self):
        if self.handle:
            self._lib.dll.sp_plan_destroy(self.handle)
            self.handle = ctypes.c_void_p()


class Library:
    def __init__(self, path):
        self.dll = ctypes.CDLL(os.path.abspath(path))
        d = self.dll
        d.sp_abi_version.restype = ctypes.c_int32
        d.sp_abi_version.argtypes = []
        if d.sp_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{path}: ABI version {d.sp_abi_version()}, expected {ABI_VERSION}")
        d.sp_policy_create.restype = ctypes.c_int
        d.sp_policy_create.argtypes = [ctypes.c_char_p, ctypes.POINTER(Setting), ctypes.c_int32,
                                       ctypes.POINTER(ctypes.c_void_p)]
        d.sp_policy_destroy.restype = None
        d.sp_policy_destroy.argtypes = [ctypes.c_void_p]
        d.sp_policy_set_thresholds.restype = ctypes.c_int
        d.sp_policy_set_thresholds.argtypes = [ctypes.c_void_p, ctypes.POINTER(Tensor)]
        d.sp_policy_set_prompt_len.restype = ctypes.c_int
        d.sp_policy_set_prompt_len.argtypes = [ctypes.c_void_p, ctypes.POINTER(Tensor)]
        d.sp_policy_set_block_mask.restype = ctypes.c_int
        d.sp_policy_set_block_mask.argtypes = [ctypes.c_void_p, ctypes.POINTER(Problem),
                                               ctypes.POINTER(BlockMaskCsr)]
        d.sp_policy_describe.restype = ctypes.c_char_p
        d.sp_policy_describe.argtypes = [ctypes.c_void_p]
        d.sp_run.restype = ctypes.c_int
        d.sp_run.argtypes = [ctypes.POINTER(Problem), ctypes.c_void_p, ctypes.POINTER(Output),
                             ctypes.POINTER(Options), ctypes.POINTER(Stats)]
        d.sp_can_run.restype = ctypes.c_int
        d.sp_can_run.argtypes = [ctypes.POINTER(Problem), ctypes.c_void_p, ctypes.c_int32]
        d.sp_last_error.restype = ctypes.c_char_p
        d.sp_last_error.argtypes = []
        d.sp_status_name.restype = ctypes.c_char_p
        d.sp_status_name.argtypes = [ctypes.c_int32]
        d.sp_build_info.restype = ctypes.c_char_p
        d.sp_build_info.argtypes = []
        # Select, plan, run and decisions.
        d.sp_decisions_create.restype = ctypes.c_int
        d.sp_decisions_create.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        d.sp_decisions_destroy.restype = None
        d.sp_decisions_destroy.argtypes = [ctypes.c_void_p]
        d.sp_decisions_policy.restype = ctypes.c_char_p
        d.sp_decisions_policy.argtypes = [ctypes.c_void_p]
        d.sp_decisions_mask.restype = ctypes.c_int
        d.sp_decisions_mask.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(BlockMaskView)]
        d.sp_decisions_tiles.restype = ctypes.c_int
        d.sp_decisions_tiles.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.POINTER(PermuteTile)),
                                         ctypes.POINTER(ctypes.c_int64)]
        d.sp_select.restype = ctypes.c_int
        d.sp_select.argtypes = [ctypes.POINTER(Problem), ctypes.c_void_p, ctypes.POINTER(Options), ctypes.c_void_p,
                                ctypes.POINTER(Stats)]
        d.sp_run_decisions.restype = ctypes.c_int
        d.sp_run_decisions.argtypes = [ctypes.POINTER(Problem), ctypes.c_void_p, ctypes.POINTER(Output),
                                       ctypes.POINTER(Options), ctypes.POINTER(Stats), ctypes.c_void_p]
        d.sp_plan_create.restype = ctypes.c_int
        d.sp_plan_create.argtypes = [ctypes.POINTER(Problem), ctypes.c_void_p, ctypes.POINTER(Options),
                                     ctypes.POINTER(ctypes.c_void_p)]
        d.sp_plan_destroy.restype = None
        d.sp_plan_destroy.argtypes = [ctypes.c_void_p]
        d.sp_plan_describe.restype = ctypes.c_char_p
        d.sp_plan_describe.argtypes = [ctypes.c_void_p]
        d.sp_plan_run.restype = ctypes.c_int
        d.sp_plan_run.argtypes = [ctypes.c_void_p, ctypes.POINTER(Problem), ctypes.POINTER(Output),
                                  ctypes.POINTER(Options), ctypes.POINTER(Stats), ctypes.c_void_p]
        d.sp_generate.restype = ctypes.c_int
        d.sp_generate.argtypes = [ctypes.POINTER(GeneratorConfig), ctypes.POINTER(Tensor),
                                  ctypes.POINTER(Tensor), ctypes.POINTER(Tensor)]

    def check(self, code):
        if code != OK:
            raise SparsePrefillError(code, self.dll.sp_status_name(code).decode(),
                                     self.dll.sp_last_error().decode())

    def build_info(self):
        return self.dll.sp_build_info().decode()

    def policy(self, name, settings=None):
        return Policy(self, name, settings)

    def run(self, problem, policy, output, options=None, stats=None):
        """Returns the status code (no exception): callers decide what unsupported means."""
        return self.dll.sp_run(ctypes.byref(problem), policy.handle, ctypes.byref(output),
                               ctypes.byref(options) if options is not None else None,
                               ctypes.byref(stats) if stats is not None else None)

    def select(self, problem, policy, options=None, stats=None):
        """The policy's selection alone (sp_select) as a Decisions; raises on failure."""
        decisions = Decisions(self)
        self.check(self.dll.sp_select(ctypes.byref(problem), policy.handle,
                                      ctypes.byref(options) if options is not None else None, decisions.handle,
                                      ctypes.byref(stats) if stats is not None else None))
        return decisions

    def generate(self, config, q, k, v):
        """The structured generator (sp_generate) into host Tensors q, k, v; raises on failure."""
        self.check(self.dll.sp_generate(ctypes.byref(config), ctypes.byref(q), ctypes.byref(k), ctypes.byref(v)))

    def plan(self, problem, policy, options=None):
        """An sp_plan for problems shaped like `problem` (raises on failure)."""
        handle = ctypes.c_void_p()
        self.check(self.dll.sp_plan_create(ctypes.byref(problem), policy.handle,
                                           ctypes.byref(options) if options is not None else None,
                                           ctypes.byref(handle)))
        return Plan(self, handle, policy)

    def plan_run(self, plan, problem, output, options=None, stats=None, decisions=None):
        """Returns the status code (no exception), as run()."""
        return self.dll.sp_plan_run(plan.handle, ctypes.byref(problem), ctypes.byref(output),
                                    ctypes.byref(options) if options is not None else None,
                                    ctypes.byref(stats) if stats is not None else None,
                                    decisions.handle if decisions is not None else None)

    def can_run(self, problem, policy, backend):
        return self.dll.sp_can_run(ctypes.byref(problem), policy.handle, backend)

    def last_error(self):
        return self.dll.sp_last_error().decode()

    def status_name(self, code):
        return self.dll.sp_status_name(code).decode()
