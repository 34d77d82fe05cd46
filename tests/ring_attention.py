"""Ring attention on gloo (tests/context_parallel_worker.py's ``ring`` job, tests/test_context_parallel.py).

diffusers' ring attention (``TemplatedRingAttention``) asks its attention backend for each chunk's log-sum-exp; the
only backend that runs on CPU, ``native``, refuses (``return_lse=True``), so flowalign refuses ``ring > 1`` on CPU.
What gloo can run is the rest: the ring's own collectives (``all_gather_tensor`` of the keys and values forward,
``permute_tensor`` of their gradients backward) and its merging of the chunks. ``ring_check`` runs diffusers' ring
over the processes with the textbook attention as its forward and backward op (``math_forward_op`` /
``math_backward_op``: softmax attention with its log-sum-exp, and the flash-attention backward from the global
log-sum-exp, Dao et al. 2022, Algorithm 4), and compares the output and the gradients with one process's attention.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def math_forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
    """``softmax(q k^T s) v`` on ``[B, S, H, D]`` tensors, with the log-sum-exp ``[B, S, H]`` of each query's scores."""
    if _save_ctx:
        ctx.save_for_backward(query, key, value)
        ctx.scale = scale
    s = query.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bqhd,bkhd->bhqk", query, key) * s
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(scores - lse[..., None]), value)
    return (out, lse.permute(0, 2, 1)) if return_lse else out


def math_backward_op(ctx, grad_out, *args, query=None, key=None, value=None, out=None, lse=None, **kwargs):
    """The gradients of one key/value chunk's share of attention, from the whole output and log-sum-exp:
    ``P = exp(q k^T s - lse)``, ``dV = P^T dO``, ``dS = P (dO v^T - rowsum(dO o))``, ``dQ = dS k s``,
    ``dK = dS^T q s``."""
    s = query.shape[-1] ** -0.5 if ctx.scale is None else ctx.scale
    p = torch.exp(torch.einsum("bqhd,bkhd->bhqk", query, key) * s - lse.permute(0, 2, 1)[..., None])
    grad_value = torch.einsum("bhqk,bqhd->bkhd", p, grad_out)
    delta = (grad_out * out).sum(-1).permute(0, 2, 1)[..., None]
    ds = p * (torch.einsum("bqhd,bkhd->bhqk", grad_out, value) - delta)
    return (torch.einsum("bhqk,bkhd->bqhd", ds, key) * s, torch.einsum("bhqk,bqhd->bkhd", ds, query) * s, grad_value)


def ring_config(degree: int):
    """diffusers' parallel config of ring attention over ``degree`` processes, resolved on the CPU."""
    from diffusers import ContextParallelConfig
    from diffusers.models._modeling_parallel import ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (degree, 1), mesh_dim_names=("ring", "ulysses"))
    config = ParallelConfig(context_parallel_config=ContextParallelConfig(ring_degree=degree, mesh=mesh))
    config.setup(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), mesh=mesh)
    return config


def ring_check() -> dict[str, torch.Tensor]:
    """On every process (collective): the native backend's refusal, and diffusers' ring with the math ops against
    one process's attention (relative differences of the output and of the query, key and value gradients)."""
    from diffusers.models.attention_dispatch import TemplatedRingAttention, _native_attention

    if not dist.is_initialized():  # the first job of its launch (torchrun's environment)
        dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    config = ring_config(world)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 8 * world, 2, 8, generator=generator, dtype=torch.float64) for _ in range(3))
    grad = torch.randn(2, 8 * world, 2, 8, generator=generator, dtype=torch.float64)
    local = [x.chunk(world, dim=1)[rank].clone().requires_grad_(True) for x in (q, k, v)]
    refused = False
    try:
        _native_attention(*[x.detach() for x in local], _parallel_config=config)
    except ValueError as error:
        refused = "return_lse" in str(error)
    out = TemplatedRingAttention.apply(*local, None, 0.0, False, None, False, False, math_forward_op,
                                       math_backward_op, config)
    out.backward(grad.chunk(world, dim=1)[rank])
    whole = [x.clone().requires_grad_(True) for x in (q, k, v)]
    reference = torch.nn.functional.scaled_dot_product_attention(*(x.permute(0, 2, 1, 3) for x in whole))
    reference = reference.permute(0, 2, 1, 3)
    reference.backward(grad)
    pairs = [(out, reference)] + [(x.grad, w.grad) for x, w in zip(local, whole)]
    errors = torch.tensor([float((a - b.chunk(world, dim=1)[rank]).norm() / b.chunk(world, dim=1)[rank].norm())
                           for a, b in pairs], dtype=torch.float64)
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    flag = torch.tensor([1.0 if refused else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return {"ring/errors": errors, "ring/native_refused": flag}
