"""Position vectors of one axis (``0 .. n-1``, ``1 .. n``, ``n .. 1``), made once per (n, dtype, device).

The readers are dispatch-bound on CPU, so they keep these instead of calling ``arange`` per batch, and find the
first / last True position of a mask as one multiply and one max (instead of ``where`` + ``amin``). Reductions over
int64 are several times slower on CPU than over int32 or int16, hence the narrow default dtype.
"""

from __future__ import annotations

import torch


class Positions:
    """``at`` = 0 .. n-1, ``plus1`` = 1 .. n, ``rev`` = n .. 1, each ``(N,)`` in ``dtype`` on ``device``."""

    _cache: dict = {}
    _MAX_CACHED = 64  # completion lengths vary from batch to batch: keep the cache small

    def __init__(self, n: int, device: torch.device, dtype: torch.dtype = torch.int32):
        self.n = n
        self.at = torch.arange(n, device=device, dtype=dtype)  # (N,)
        self.plus1 = self.at + 1
        self.rev = n - self.at

    @classmethod
    def of(cls, n: int, device: torch.device, dtype: torch.dtype = torch.int32) -> Positions:
        """The cached positions of an ``n``-long axis."""
        key = (n, device, dtype)
        found = cls._cache.get(key)
        if found is None:
            found = cls(n, device, dtype)
            if type(found.at) is torch.Tensor:  # not a FakeTensor (made while tracing): it must not outlive the trace
                if len(cls._cache) >= cls._MAX_CACHED:
                    cls._cache.clear()
                cls._cache[key] = found
        return found

    def first(self, mask: torch.Tensor) -> torch.Tensor:
        """Position of the first True per row, N where none. # (B, N) -> (B,)"""
        return self.n - (mask * self.rev).amax(dim=1)

    def last(self, mask: torch.Tensor) -> torch.Tensor:
        """Position of the last True per row, -1 where none. # (B, N) -> (B,)"""
        return (mask * self.plus1).amax(dim=1) - 1

    def lt(self, f: torch.Tensor) -> torch.Tensor:
        """``position < f[b]``. # (B,) -> (B, N) bool"""
        return self.at < f[:, None]
