"""Reference EP dispatch/combine over a Communicator's variable-size all-to-all (gloo on CPU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inferhal.core.ops.params import DispatchResult, EPParams


@dataclass
class EPHandle:
    src: torch.Tensor  # [N_sent] flat (t*K + k) index of each sent row, grouped by destination rank
    send_counts: list[int]
    recv_counts: list[int]
    num_tokens: int
    top_k: int


def moe_dispatch(x: torch.Tensor, ids: torch.Tensor, comm, p: EPParams) -> DispatchResult:
    # x: [T, D]; ids: [T, K] physical slot ids (-1 = skip)
    t, k = ids.shape
    if p.ep_size != comm.layout.world_size:
        raise ValueError(f"moe.dispatch: EPParams.ep_size={p.ep_size} but the communicator has "
                         f"world_size={comm.layout.world_size}")
    flat = ids.reshape(-1).long()
    if flat.numel() and int(flat.max()) >= p.num_physical:
        raise ValueError(f"moe.dispatch: physical id {int(flat.max())} outside [0, {p.num_physical})")
    src = torch.nonzero(flat >= 0).flatten()
    dest = flat[src] // p.slots_per_rank
    order = torch.argsort(dest, stable=True)  # by destination rank, then by (t, k)
    src, dest = src[order], dest[order]
    send_counts = torch.bincount(dest, minlength=p.ep_size).tolist()
    send_x = x[src // k]
    send_e = flat[src] % p.slots_per_rank
    recv_x = comm.all_to_all(list(send_x.split(send_counts)))
    recv_e = comm.all_to_all(list(send_e.split(send_counts)))
    recv_counts = [int(c.shape[0]) for c in recv_x]
    return DispatchResult(torch.cat(recv_x), torch.cat(recv_e), EPHandle(src, send_counts, recv_counts, t, k))


def moe_combine(y_local: torch.Tensor, weights: torch.Tensor, handle: EPHandle, comm, p: EPParams) -> torch.Tensor:
    # y_local: [R, D] unweighted expert outputs, in dispatch's receive order; weights: [T, K]
    back = torch.cat(comm.all_to_all(list(y_local.split(handle.recv_counts))))  # [N_sent, D]
    t, k = handle.num_tokens, handle.top_k
    contrib = torch.zeros(t * k, y_local.shape[1], dtype=torch.float32, device=y_local.device)
    contrib[handle.src] = back.float() * weights.reshape(-1)[handle.src, None].float()
    return contrib.view(t, k, y_local.shape[1]).sum(dim=1).to(y_local.dtype)  # fixed order: k = 0..K-1


OPS = {"moe.dispatch": moe_dispatch, "moe.combine": moe_combine}
