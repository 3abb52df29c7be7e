"""Collectives over one process group, and agreement among its ranks.

Every collective goes through `Comm.run`: a backend error (a peer rank died, or did not arrive
within the process group's `timeout`, as set in `init_process_group(timeout=...)` or
`new_group(timeout=...)`) becomes a `ReplayError` naming the step, the rank and the likely cause,
and the `Comm` refuses every later collective.

Agreement: a rank that fails before a collective still joins it, with a flag in its row, so no
peer is left waiting there. `agree` then raises the rank's own error on that rank and a
`ReplayError` naming it on the others.

Tables: `gather_rows` collects one float64 row per rank in a single all_reduce: every rank fills
its own row and zeros elsewhere, so a SUM gathers all rows exactly (adding zeros is exact).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Callable

import torch
import torch.distributed as dist

from torchreplay.errors import ReplayError


def fingerprint(text: str) -> float:
    """48 bits of a SHA-256, as a float64 (exact) for the per-call tables."""
    return float(int.from_bytes(hashlib.sha256(text.encode()).digest()[:6], "big"))


def ranks_differing(rows: torch.Tensor, column: int, value: float) -> list[int]:
    """The ranks whose entry in `column` of a gathered table is not `value`."""
    return (rows[:, column] != value).nonzero().flatten().tolist()


class Comm:
    """The collectives of one process group (None: the default group), with the bytes they move:
    `counters["dist_payload_bytes_sent"]` (rollout bytes sent to other ranks) and
    `counters["dist_control_bytes_sent"]` (tables, requests, counts). No collective is run here."""

    def __init__(self, process_group: dist.ProcessGroup | None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ReplayError("DistributedRolloutBuffer needs torch.distributed initialized "
                              "(call torch.distributed.init_process_group first)")
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        backend = str(dist.get_backend(process_group)).lower()
        # NCCL moves only device tensors; the shards themselves stay in host memory.
        self.device = (torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend
                       else torch.device("cpu"))
        self.failed: str | None = None  # the step that failed, once one has
        self.counters: dict[str, float] = {"dist_payload_bytes_sent": 0, "dist_control_bytes_sent": 0}

    def absorb(self, other: "Comm") -> None:
        """Count `other`'s bytes here too (collectives run before this Comm's owner existed)."""
        for key, value in other.counters.items():
            self.counters[key] += value

    def run(self, step: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, group=..., **kwargs)`, a torch.distributed collective; ReplayError on failure."""
        if self.failed is not None:
            raise ReplayError(f"rank {self.rank}: the buffer's process group failed earlier ({self.failed}); "
                              "recreate the process group and the buffer")
        try:
            return fn(*args, group=self.group, **kwargs)
        except RuntimeError as e:  # DistBackendError and gloo/nccl errors are RuntimeErrors
            text = str(e)
            low = text.lower()
            if "timed out" in low or "timeout" in low:
                cause = "a peer rank did not arrive within the process group timeout (stalled or dead)"
            elif "connection" in low or "closed" in low or "reset" in low or "peer" in low:
                cause = "lost the connection to a peer rank (it probably died)"
            else:
                cause = "the backend reported an error"
            self.failed = f"{step}: {cause}"
            raise ReplayError(
                f"torchreplay.distributed: collective {step!r} failed on rank {self.rank} of {self.world_size}: "
                f"{cause}. Backend said: {text.splitlines()[0][:300] if text else type(e).__name__}"
            ) from e

    def gather_rows(self, step: str, row: torch.Tensor) -> torch.Tensor:
        """Every rank's `row` (float64 [K]) as [W, K] on the CPU, in one all_reduce."""
        table = torch.zeros(self.world_size, row.numel(), dtype=torch.float64, device=self.device)
        table[self.rank] = row.to(self.device, torch.float64)
        self.run(step, dist.all_reduce, table)
        self.counters["dist_control_bytes_sent"] += table.numel() * 8
        return table.cpu()

    def max_reduce(self, step: str, values: list[int]) -> list[int]:
        """The elementwise maximum over all ranks of `values` (int64), in one all_reduce."""
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        self.run(step, dist.all_reduce, t, op=dist.ReduceOp.MAX)
        self.counters["dist_control_bytes_sent"] += t.numel() * 8
        return t.cpu().tolist()

    def all_to_all(self, step: str, send: torch.Tensor, send_rows: list[int], recv_rows: list[int],
                   payload: bool) -> torch.Tensor:
        """all_to_all_single of a [rows, ...] tensor split by rows (`send_rows[r]` to rank r);
        returns the received [sum(recv_rows), ...] on the communication device."""
        width = math.prod(send.shape[1:])
        out = torch.empty(sum(recv_rows), *send.shape[1:], dtype=send.dtype, device=self.device)
        # Flattened, so the splits are plain element counts on every backend.
        self.run(step, dist.all_to_all_single, out.view(-1), send.to(self.device).reshape(-1),
                 [r * width for r in recv_rows], [r * width for r in send_rows])
        moved = sum(n for i, n in enumerate(send_rows) if i != self.rank) * width * send.element_size()
        self.counters["dist_payload_bytes_sent" if payload else "dist_control_bytes_sent"] += moved
        return out

    def agree(self, step: str, values: list[float], error: BaseException | None) -> torch.Tensor:
        """One all_reduce of every rank's [ok, *values] row, as [W, 1 + len(values)]. A rank that
        failed locally (`error`) raises it; the others raise ReplayError naming it, so no rank is
        left waiting in a later collective."""
        rows = self.gather_rows(step, torch.tensor([0.0 if error is not None else 1.0, *values], dtype=torch.float64))
        if error is not None:
            raise error
        bad = ranks_differing(rows, 0, 1.0)
        if bad:
            raise ReplayError(f"rank {self.rank}: {step} aborted because rank(s) {bad} failed "
                              "(their own error names the cause)")
        return rows
