"""The compiled CPU kernel of :class:`~trl_async.rewards.MathAnswerReward`'s default read (``last_box.c``).

On a CPU the torch-op path of the box read is ~150 small ops whose cost is mostly dispatch; the same computation as
one C loop per row is several times faster. The kernel is optional: it is built on first use with the system C
compiler (``$CC``, default ``cc``; ~0.1 s, plain C99, no Python or torch headers) into
``$TRL_ASYNC_CACHE/native`` (default ``~/.cache/trl_async/native``), named by a hash of its source and build
command, so later processes only load it. Where it cannot be built (no compiler, Windows, a read-only cache) the
reward uses its torch-op path; ``TRL_ASYNC_NATIVE=0`` forces that path on every reward made while it is set.

Invariants: the kernel returns what the torch-op path returns (tested on fuzzed and real completions); it reads the
tables the torch path owns (no copy, kept alive by :class:`LastBoxKernel`; only a 19 KB bitmap of the tokens that
matter is its own); it allocates nothing and holds no global state; called through ``ctypes.CDLL`` it runs without
the GIL (as ctypes documents), so the generation thread keeps running while it scores; under ``torch.compile`` it is
the opaque custom op ``trl_async::last_box``, so the score still traces in one graph.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("last_box.c")
FLAGS = ("-O2", "-std=c99", "-ffp-contract=off", "-shared", "-fPIC")  # no FMA: the same rounding as torch
MAX_WINDOW = 256  # pieces the kernel reads after an opener (a stack array in last_box.c)


class NativeUnavailable(RuntimeError):
    """The compiled kernel cannot be used here; the message says why and what to change."""


class BoxTables(ctypes.Structure):
    """``BoxTables`` of ``last_box.c``: pointers into the torch tables, field for field."""

    _fields_ = [
        ("code", ctypes.c_void_p),
        ("relevant", ctypes.c_void_p),
        ("full_after", ctypes.c_void_p),
        ("crossing_end", ctypes.c_void_p),
        ("vocab_size", ctypes.c_int64),
        ("suffix_base", ctypes.c_void_p),
        ("closing_base", ctypes.c_void_p),
        ("function", ctypes.c_void_p),
        ("depth_change", ctypes.c_void_p),
        ("lowest", ctypes.c_void_p),
        ("caret", ctypes.c_void_p),
        ("n_digits", ctypes.c_void_p),
        ("digit_value", ctypes.c_void_p),
        ("after_dot", ctypes.c_void_p),
        ("minus_first", ctypes.c_void_p),
        ("n_pieces", ctypes.c_int64),
        ("compose", ctypes.c_void_p),
        ("accepts", ctypes.c_void_p),
        ("n_functions", ctypes.c_int64),
    ]


# The dtype each table must have, as last_box.c reads it.
_DTYPES = {
    "code": torch.int32, "relevant": torch.uint8, "full_after": torch.int64, "crossing_end": torch.int64, "suffix_base": torch.int32,
    "closing_base": torch.int32, "function": torch.int32, "depth_change": torch.int32, "lowest": torch.int32,
    "caret": torch.int32, "n_digits": torch.int32, "digit_value": torch.int64, "after_dot": torch.int32,
    "minus_first": torch.int32, "compose": torch.int32, "accepts": torch.bool,
}  # fmt: skip

_POINTER_FIELDS = {name for name, kind in BoxTables._fields_ if kind is ctypes.c_void_p}
_READER_TABLES = ("suffix_base", "closing_base", "function", "depth_change", "lowest", "caret", "n_digits")
_READER_TABLES += ("digit_value", "after_dot", "minus_first")

_LIBRARY: ctypes.CDLL | None = None
_LIBRARY_ERROR: str | None = None
_LOCK = threading.Lock()


def compiler() -> list[str] | None:
    """The C compiler command to build with (``$CC``, which may carry flags or a wrapper such as ``ccache gcc``,
    else ``cc``), or None when its program is not on PATH."""
    command = shlex.split(os.environ.get("CC", "cc"))
    program = shutil.which(command[0]) if command else None
    return [program, *command[1:]] if program else None


def library_path(cc: list[str]) -> Path:
    """Where the built kernel is cached: named by its source, build command and machine."""
    from trl_async.offline_assets import cache_dir

    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join([*cc, *FLAGS, sys.platform, platform.machine()]).encode())
    return cache_dir() / "native" / f"last_box-{digest.hexdigest()[:16]}.so"


def _build() -> ctypes.CDLL:
    if sys.platform == "win32":
        raise NativeUnavailable("The compiled kernel is built on Linux and macOS only.")
    cc = compiler()
    if cc is None:
        named = os.environ.get("CC", "cc").strip() or "(an empty $CC)"
        raise NativeUnavailable(f"no C compiler: `{named}` is not on PATH (set $CC to one).")
    path = library_path(cc)
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise NativeUnavailable(f"Cannot create {path.parent} ({error}); set $TRL_ASYNC_CACHE.") from error
        partial = path.with_name(f"{path.stem}.{os.getpid()}.{threading.get_ident()}.tmp")
        command = [*cc, *FLAGS, str(SOURCE), "-o", str(partial)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as error:
            partial.unlink(missing_ok=True)
            raise NativeUnavailable(f"`{' '.join(command)}` failed: {error}") from error
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            raise NativeUnavailable(f"`{' '.join(command)}` failed:\n{done.stderr.strip()}")
        os.replace(partial, path)  # atomic: processes building at once each replace it with the same library
    try:
        library = ctypes.CDLL(str(path))  # not PyDLL: CDLL calls release the GIL
    except OSError as error:  # e.g. a cache shared by machines with different C libraries
        raise NativeUnavailable(f"Cannot load {path} ({error}); delete it to rebuild.") from error
    pointer, size, real = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
    library.trl_last_box.argtypes = [ctypes.POINTER(BoxTables), pointer, pointer, size, size, size]
    library.trl_last_box.argtypes += [pointer, real, real, pointer, pointer, pointer]
    library.trl_last_box.restype = ctypes.c_int
    return library


def library() -> ctypes.CDLL:
    """The built kernel library (built or loaded once per process; a failure is remembered until :func:`reset`).
    Raises :class:`NativeUnavailable`, also whenever ``TRL_ASYNC_NATIVE=0`` is set."""
    global _LIBRARY, _LIBRARY_ERROR
    if os.environ.get("TRL_ASYNC_NATIVE", "1") == "0":
        raise NativeUnavailable("TRL_ASYNC_NATIVE=0 turns the compiled kernel off.")
    with _LOCK:
        if _LIBRARY is None and _LIBRARY_ERROR is None:
            try:
                _LIBRARY = _build()
            except NativeUnavailable as error:
                _LIBRARY_ERROR = str(error)
        if _LIBRARY is None:
            raise NativeUnavailable(_LIBRARY_ERROR)
        return _LIBRARY


def reset() -> None:
    """Forget the loaded library (or the reason it could not be built): the next use builds or loads it again."""
    global _LIBRARY, _LIBRARY_ERROR
    with _LOCK:
        _LIBRARY, _LIBRARY_ERROR = None, None


_KERNELS: weakref.WeakValueDictionary[int, LastBoxKernel] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


class LastBoxKernel:
    """The last box of each row, read by ``last_box.c`` on CPU tensors: :meth:`read` and :meth:`score`.

    Args:
        packed: the ``\\boxed{`` opener's :class:`~trl_async.rewards.literal.PackedLiteral` (EOS ids folded in).
        reader: the vocabulary's :class:`~trl_async.rewards.boxed_tokens.BoxedTokenReader`.
        window: pieces read from the opener's last token on (``max_answer_tokens``), at most :data:`MAX_WINDOW`.
    """

    def __init__(self, packed, reader, window: int, required: bool = False):
        if not 1 <= window <= MAX_WINDOW:
            raise NativeUnavailable(f"The compiled kernel reads at most {MAX_WINDOW} tokens; got {window}.")
        self._function = library().trl_last_box
        self.packed, self.reader, self.window, self.required = packed, reader, window, required
        code, full_after, crossing_end = packed.on(torch.device("cpu"))
        compose, accepts = reader.automaton.on(torch.device("cpu"))
        tensors = dict(code=code, relevant=_bitmap(code[1 : packed.vocab_size + 1] != 0))
        tensors.update(full_after=full_after, crossing_end=crossing_end, compose=compose, accepts=accepts)
        tensors.update({name: getattr(reader, name) for name in _READER_TABLES})
        assert set(tensors) == set(_DTYPES) == _POINTER_FIELDS  # a table left out would be a NULL pointer in C
        for name, tensor in tensors.items():
            if tensor.dtype != _DTYPES[name] or not tensor.is_contiguous() or tensor.device.type != "cpu":
                raise TypeError(f"Table {name} must be a contiguous CPU {_DTYPES[name]} tensor, got {tensor.dtype}.")
        self._tensors = tensors  # keeps the memory the pointers below point into alive
        self._tables = BoxTables(
            **{name: tensor.data_ptr() for name, tensor in tensors.items()},
            vocab_size=packed.vocab_size,
            n_pieces=reader.n_pieces,
            n_functions=reader.automaton.n_functions,
        )
        self._tables_pointer = ctypes.pointer(self._tables)
        self.handle = next(_HANDLES)  # how the custom op finds this kernel (an int traces as a constant)
        _KERNELS[self.handle] = self

    def __reduce__(self):  # pickle / deepcopy (a reward sent to another process): rebuilt there from its tables
        return _rebuilt, (self.packed, self.reader, self.window, self.required)

    def read(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids`` (B, L) and ``mask`` (B, L) on the CPU -> ``(value (B,) float64, found (B,) bool)``; value is 0
        where no box holds a number."""
        value, found, _ = self._call(ids, mask, None, 0.0, 0.0)
        return value, found

    def score(self, ids, mask, target: torch.Tensor, abs_tol: float, rel_tol: float) -> torch.Tensor:
        """1.0 where the box's value is within ``abs_tol + rel_tol * |target|`` of ``target`` (B,) float64, else
        0.0 (a NaN target never matches). # (B,) float32"""
        return self._call(ids, mask, target, abs_tol, rel_tol)[2]

    def _call(self, ids, mask, target, abs_tol, rel_tol):
        if type(ids) is torch.Tensor and not torch.compiler.is_compiling():  # a plain tensor, run eagerly: direct
            return self.run(ids, mask, target, abs_tol, rel_tol)
        # fake tensors, tensor subclasses, tracing: the custom op, which they see as one opaque call with known shapes
        return torch.ops.trl_async.last_box(ids, mask, self.handle, target, abs_tol, rel_tol)

    def run(self, ids, mask, target, abs_tol, rel_tol):
        """The C call itself, on real CPU tensors. -> ``(value, found, reward)``, reward empty without a target."""
        ids = ids.to(torch.int64).contiguous()  # (B, L) no copy when it already is
        mask = mask.to(torch.bool).expand(ids.shape).contiguous().view(torch.uint8)  # (B, L) broadcast as torch does
        batch, length = ids.shape
        value = torch.empty(batch, dtype=torch.float64)  # (B,)
        found = torch.empty(batch, dtype=torch.bool)  # (B,)
        if target is None:
            reward = torch.empty(0, dtype=torch.float32)
            target_pointer = reward_pointer = None
        else:
            target = target.to(torch.float64).contiguous()  # (B,) an expanded column becomes a real one
            if target.shape != (batch,):
                raise ValueError(f"target must have shape ({batch},), got {tuple(target.shape)}.")
            reward = torch.empty(batch, dtype=torch.float32)  # (B,)
            target_pointer, reward_pointer = target.data_ptr(), reward.data_ptr()
        status = self._function(
            self._tables_pointer, ids.data_ptr(), mask.data_ptr(), batch, length, self.window, target_pointer,
            abs_tol, rel_tol, value.data_ptr(), found.data_ptr(), reward_pointer,
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"last_box.c failed with status {status} (window {self.window}).")
        return value, found, reward


def _rebuilt(packed, reader, window: int, required: bool) -> LastBoxKernel | None:
    """The kernel again in the process that unpickles it; where it cannot be built there, None (the torch-op path),
    or, for a reward made with ``cpu_kernel=True``, :class:`NativeUnavailable`."""
    try:
        return LastBoxKernel(packed, reader, window, required)
    except NativeUnavailable as error:
        if required:
            raise NativeUnavailable(f"cpu_kernel=True, but {error}") from error
        logger.info("MathAnswerReward reads on CPU with torch ops (%s)", error)
        return None


def _bitmap(bits: torch.Tensor) -> torch.Tensor:
    """(N,) bool -> (ceil(N / 8),) uint8 with bit ``i & 7`` of byte ``i >> 3`` set where ``bits[i]``."""
    padded = torch.nn.functional.pad(bits.to(torch.int32), (0, -len(bits) % 8)).view(-1, 8)  # (N / 8, 8)
    return (padded << torch.arange(8, dtype=torch.int32)).sum(dim=1).to(torch.uint8)


@torch.library.custom_op("trl_async::last_box", mutates_args=())
def _last_box_op(
    ids: torch.Tensor, mask: torch.Tensor, handle: int, target: torch.Tensor | None, abs_tol: float, rel_tol: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kernel = _KERNELS.get(handle)
    if kernel is None:
        raise RuntimeError(
            f"trl_async::last_box: kernel {handle} is gone from this process (a graph traced elsewhere, or its reward "
            "was deleted); trace the reward's score again."
        )
    return kernel.run(ids, mask, target, abs_tol, rel_tol)


@_last_box_op.register_fake
def _(ids, mask, handle, target, abs_tol, rel_tol):
    batch = ids.shape[0]
    reward = ids.new_empty(0 if target is None else batch, dtype=torch.float32)
    return ids.new_empty(batch, dtype=torch.float64), ids.new_empty(batch, dtype=torch.bool), reward
