"""A stand-in for the parts of torch that sdpa.py uses, for tests without a GPU.

Tensors carry only their shape. scaled_dot_product_attention refuses what
the real backends refuse in the cases the tests use: flash above head dim
256 and with an attn_mask tensor, cuDNN with enable_gqa, and every backend
but math under deterministic mode for a backward. Events read the host clock.
"""

import contextlib
import sys
import time
import types

__version__ = "0.0-fake"
bfloat16, float16, float32 = "bf16", "fp16", "fp32"


def __getattr__(name):
    # torch.bool, answered here so that the builtin bool stays usable in this module
    if name == "bool":
        return "bool"
    raise AttributeError(name)

_state = {"deterministic": False, "backends": None}


class Tensor:
    def __init__(self, shape):
        self.shape = tuple(shape)
        self.requires_grad = False

    def requires_grad_(self, flag=True):
        self.requires_grad = flag
        return self

    def repeat_interleave(self, n, dim):
        s = list(self.shape)
        s[dim] *= n
        return Tensor(s)

    def contiguous(self):
        return self

    def tril(self, diagonal=0):
        return self

    def __invert__(self):
        return self

    def masked_fill(self, mask, value):
        return Tensor(self.shape)


class Generator:
    def __init__(self, device=None):
        self.seed = 0

    def manual_seed(self, s):
        self.seed = s


def randn(*shape, device=None, dtype=None, generator=None):
    return Tensor(shape)


def ones(*shape, device=None, dtype=None):
    return Tensor(shape)


@contextlib.contextmanager
def no_grad():
    yield


def are_deterministic_algorithms_enabled():
    return _state["deterministic"]


def use_deterministic_algorithms(flag, warn_only=False):
    _state["deterministic"] = bool(flag)


class _OOM(RuntimeError):
    pass


class _Event:
    def __init__(self, enable_timing=False):
        self.t = 0.0

    def record(self, stream=None):
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


class _Props:
    name = "Fake GPU"
    L2_cache_size = 1 << 20


cuda = types.ModuleType("torch.cuda")
cuda.is_available = lambda: True
cuda.get_device_properties = lambda i: _Props()
cuda.synchronize = lambda: None
cuda.empty_cache = lambda: None
cuda.Event = _Event
cuda.OutOfMemoryError = _OOM

version = types.ModuleType("torch.version")
version.cuda = "0.0"

backends = types.ModuleType("torch.backends")
backends.cudnn = types.SimpleNamespace(version=lambda: 0)


class SDPBackend:
    FLASH_ATTENTION = "flash"
    CUDNN_ATTENTION = "cudnn"
    EFFICIENT_ATTENTION = "mem_eff"
    MATH = "math"


@contextlib.contextmanager
def sdpa_kernel(kinds):
    prev = _state["backends"]
    _state["backends"] = list(kinds)
    try:
        yield
    finally:
        _state["backends"] = prev


def scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False):
    kind = (_state["backends"] or ["math"])[0]
    if kind == "flash" and q.shape[-1] > 256:
        raise RuntimeError("No available kernel. Aborting execution.")
    if kind == "flash" and isinstance(attn_mask, Tensor):
        raise RuntimeError("No available kernel. Aborting execution.")
    if kind == "cudnn" and enable_gqa:
        raise RuntimeError("No available kernel. Aborting execution.")
    if k.shape[1] != q.shape[1] and not enable_gqa:
        raise RuntimeError("heads of q and k differ")
    out = Tensor(q.shape[:-1] + v.shape[-1:])
    out.kind = kind
    return out


def _grad(outputs, inputs, grad_outputs=None, retain_graph=None):
    if _state["deterministic"] and getattr(outputs, "kind", "math") != "math":
        raise RuntimeError("this backward does not have a deterministic implementation")
    return tuple(Tensor(x.shape) for x in inputs)


autograd = types.SimpleNamespace(grad=_grad)

nn = types.ModuleType("torch.nn")
functional = types.ModuleType("torch.nn.functional")
functional.scaled_dot_product_attention = scaled_dot_product_attention
attention = types.ModuleType("torch.nn.attention")
attention.SDPBackend = SDPBackend
attention.sdpa_kernel = sdpa_kernel
bias = types.ModuleType("torch.nn.attention.bias")
bias.causal_lower_right = lambda n, m: ("causal_lower_right", n, m)
nn.functional, nn.attention, attention.bias = functional, attention, bias

for _name, _mod in {"torch.cuda": cuda, "torch.version": version, "torch.backends": backends, "torch.nn": nn,
                    "torch.nn.functional": functional, "torch.nn.attention": attention,
                    "torch.nn.attention.bias": bias}.items():
    sys.modules[_name] = _mod
