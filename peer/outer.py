"""The outer optimizer of one fragment: a global fp32 copy on CPU and SGD with Nesterov.

DiLoCo's outer step, for the parameters theta of one fragment:

    delta   = theta_global - theta_local          # the pseudo-gradient, one per worker
    avg     = weighted mean of delta over workers (by tokens trained)
    theta_global <- SGD(lr, momentum, nesterov).step(grad=avg)
    theta_local  <- alpha * theta_local + (1 - alpha) * theta_global   # Streaming DiLoCo merge

The global copy is one flat fp32 tensor (with per-parameter views), so a pseudo-gradient is a
single subtraction and the optimizer steps one tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from protocol.config import OuterConfig


_NORM_CHUNK = 1 << 20


def _norm64(t: torch.Tensor) -> float:
    """The L2 norm of a 1-D tensor, accumulated in float64 a chunk at a time (a whole float64
    copy of a 1b fragment would be gigabytes)."""
    squares = sum(float(torch.linalg.vector_norm(t[i:i + _NORM_CHUNK], dtype=torch.float64)) ** 2
                  for i in range(0, t.numel(), _NORM_CHUNK))
    return squares ** 0.5


class OuterFragment:
    def __init__(self, params: list[torch.nn.Parameter], cfg: OuterConfig, global_flat: torch.Tensor | None = None):
        """``global_flat``: the initial global copy (default: a copy of ``params``), owned from now."""
        self.params = params
        self.numel = sum(p.numel() for p in params)
        with torch.no_grad():
            # (N,) fp32 on CPU: the run's shared state, identical on every peer after a round
            self.global_flat = self.local_flat() if global_flat is None else global_flat
        if self.global_flat.shape != (self.numel,) or self.global_flat.dtype != torch.float32:
            raise ValueError(f"a global copy of {self.numel} fp32 values expected, got {self.global_flat.dtype} "
                             f"{tuple(self.global_flat.shape)}")
        momentum = cfg.momentum
        self.opt = torch.optim.SGD([self.global_flat], lr=cfg.lr, momentum=momentum,
                                   nesterov=cfg.nesterov and momentum > 0)

    def local_flat(self) -> torch.Tensor:
        """The worker's current values of this fragment, as a new (N,) fp32 CPU tensor."""
        return torch.cat([p.detach().reshape(-1).float().cpu() for p in self.params])

    def pseudo_gradient(self) -> torch.Tensor:
        """delta = theta_global - theta_local, (N,) fp32: what this worker contributes."""
        return self.global_flat - self.local_flat()

    _shared: bool = False

    def momentum(self) -> torch.Tensor | None:
        """The outer momentum buffer (None before the first outer step)."""
        return self.opt.state.get(self.global_flat, {}).get("momentum_buffer")

    def share(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The global copy and momentum buffer themselves, to be read elsewhere (a state server
        serves and hashes them) while this fragment goes on. They are never changed again:
        the fragment's next change copies them first (copy on write), so sharing costs no
        memory until then, and then one fragment's worth while the reader holds the old."""
        self._shared = True
        m = self.momentum()
        return self.global_flat.detach(), None if m is None else m.detach()

    @torch.no_grad()
    def _own(self) -> None:
        """Before an in-place change: fresh tensors where the current ones are shared."""
        if not self._shared:
            return
        self.global_flat.set_(self.global_flat.clone())  # the same tensor (the optimizer's key), new memory
        state = self.opt.state.get(self.global_flat)
        if state and state.get("momentum_buffer") is not None:
            state["momentum_buffer"] = state["momentum_buffer"].clone()
        self._shared = False

    @torch.no_grad()
    def load(self, global_flat: torch.Tensor, momentum: torch.Tensor | None) -> None:
        """global copy <- ``global_flat``; momentum <- a copy of ``momentum`` (None: cleared)."""
        self._own()
        self.global_flat.copy_(global_flat)
        if momentum is None:
            self.opt.state.pop(self.global_flat, None)
        else:
            self.opt.state[self.global_flat] = {"momentum_buffer": momentum.detach().to(torch.float32).clone()}

    largest_update_norm: float = 0.0
    """At most how far (L2) one outer step of this process moved the global copy (0 before the
    first): the scale against which a downloaded state's distance is judged."""

    @torch.no_grad()
    def step(self, avg_delta: torch.Tensor) -> None:
        """Apply the averaged pseudo-gradient to the global copy."""
        if avg_delta.shape != self.global_flat.shape:
            raise ValueError(f"averaged delta has shape {tuple(avg_delta.shape)}, expected {tuple(self.global_flat.shape)}")
        grad = avg_delta.to(torch.float32)
        self._own()
        self.global_flat.grad = grad
        self.opt.step()
        self.global_flat.grad = None
        # a bound on how far this step moved the global copy, without a copy of it: SGD moves it
        # by lr * (g + m * buf) with Nesterov, lr * buf with plain momentum, lr * g without
        group = self.opt.param_groups[0]
        lr, m = group["lr"], group["momentum"]
        g = _norm64(grad)
        buf = self.momentum()
        b = 0.0 if buf is None else _norm64(buf)
        moved = lr * (g + m * b if group["nesterov"] else b if m > 0 else g)
        self.largest_update_norm = max(self.largest_update_norm, moved)

    @torch.no_grad()
    def set_local(self, flat: torch.Tensor) -> None:
        """local <- ``flat``, an (N,) tensor in the layout of ``local_flat``."""
        offset = 0
        for p in self.params:
            p.copy_(flat[offset: offset + p.numel()].view_as(p).to(device=p.device, dtype=p.dtype))
            offset += p.numel()

    _fell_back: tuple[tuple[int, int], ...] = ()  # where the last sync's averaging fell back

    def carry(self, fell_back: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
        """Of the element ranges ``[start, end)`` where this sync's averaging fell back (no agreed
        mean), those whose local values stay (``merge_into_local(keep=...)``): the inner steps'
        progress there goes into the next pseudo-gradient instead of being thrown away. Not
        where the last sync fell back too: a part that falls back round after round (a liar
        that reduces it every time) let the local weights there drift from the global copy
        without bound while the rest of the model was averaged around them, a global model
        mixing weights that do not fit together (a review's repro: held-out loss 5.57 against
        4.73 with the reset every time). A lone fallback is carried; a run of them is reset
        from its second sync on, as before, on every member alike."""
        fell_back = tuple(fell_back)
        kept = _minus(fell_back, self._fell_back)
        self._fell_back = fell_back
        return kept

    @torch.no_grad()
    def merge_into_local(self, alpha: float, keep: Sequence[tuple[int, int]] = ()) -> None:
        """local <- alpha * local + (1 - alpha) * global (alpha = 0 replaces local), except in
        the element ranges ``keep`` (``[start, end)``, ``carry``), whose local values stay."""
        if keep:
            self._merge_keeping(alpha, keep)
            return
        offset = 0
        for p in self.params:
            g = self.global_flat[offset: offset + p.numel()].view_as(p).to(device=p.device, dtype=p.dtype)
            if alpha == 0.0:
                p.copy_(g)
            else:
                p.mul_(alpha).add_(g, alpha=1.0 - alpha)
            offset += p.numel()

    @torch.no_grad()
    def _merge_keeping(self, alpha: float, keep: Sequence[tuple[int, int]]) -> None:
        """``merge_into_local`` with ranges kept: on the whole fragment's values at once."""
        local = self.local_flat()
        merged = self.global_flat.clone() if alpha == 0.0 else local * alpha + self.global_flat * (1.0 - alpha)
        for start, end in keep:
            merged[start:end] = local[start:end]
        self.set_local(merged)

    def state_dict(self) -> dict:
        return {"global_flat": self.global_flat.detach().clone(), "opt": self.opt.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._own()
        with torch.no_grad():
            self.global_flat.copy_(state["global_flat"])
        self.opt.load_state_dict(state["opt"])


def _minus(ranges: tuple[tuple[int, int], ...], cut: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """The parts of the ranges ``[start, end)`` that no range of ``cut`` covers."""
    out: list[tuple[int, int]] = []
    for start, end in ranges:
        pieces = [(start, end)]
        for cs, ce in cut:
            pieces = [q for a, b in pieces for q in ((a, min(b, cs)), (max(a, ce), b)) if q[0] < q[1]]
        out += pieces
    return tuple(out)
