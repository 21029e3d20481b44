"""mamba_ssm's `Mamba3` module on sonata's kernels: `from mamba_ssm.modules.mamba3 import Mamba3`
(after `sonata.interop.mamba_ssm.install()`, where mamba_ssm is not installed) builds and runs on
a CPU with the released module's argument names, parameter names and shapes, and inference
cache (`allocate_inference_cache`, `step`, `forward(..., inference_params=)`).

`Mamba3` is sonata's released-form Mamba-3 layer (`sonata.model.mamba3.Mamba3Mixer`) built from
mamba_ssm's arguments; each maps one to one:

    d_model, d_state, expand, headdim, ngroups   model.d_model, d_state, expand, headdim, ngroups
    rope_fraction (0.5 or 1.0, as mamba_ssm)     model.rope_fraction
    dt_min, dt_max, dt_init_floor                model.dt_min, dt_max, dt_init_floor
    A_floor                                      model.a_min
    is_outproj_norm                              model.outproj_norm
    is_mimo, mimo_rank                           model.mimo_rank (1 when is_mimo is false)
    chunk_size                                   model.chunk_size (the result does not depend on it)
    fuse_pregate_headwise_norm                   a kernel fusion in mamba_ssm: the same values
    dropout, layer_idx, n_layer, device, dtype   as mamba_ssm (dropout is accepted and unused)

The cache is mamba_ssm's four tensors, (angle_dt_state (b, h, n_angles) float32, ssm_state
(b, h, headdim, d_state) float32, k_state (b, R, h, d_state), v_state (b, h, headdim)), and the
scan reads and writes them as sonata's state (the angle is kept modulo 2 pi). Not built (one
clear ValueError each): variable-length packing (`cu_seqlens`); `seq_idx` is accepted and
unused, as in mamba_ssm's module.
"""
from __future__ import annotations

import math

import torch

from sonata.core.config import ModelConfig
from sonata.model.mamba3 import Mamba3Mixer, heavy_tail


def heavy_tail_activation(x: torch.Tensor) -> torch.Tensor:
    """mamba_ssm's name for the activation of the data-dependent A (sonata.model.mamba3.heavy_tail)."""
    return heavy_tail(x)


class Mamba3(Mamba3Mixer):
    """mamba_ssm.modules.mamba3.Mamba3 on sonata's kernels (module docstring)."""

    def __init__(self, d_model, d_state=128, expand=2, headdim=64, ngroups=1, rope_fraction=0.5, dt_min=0.001,
                 dt_max=0.1, dt_init_floor=1e-4, A_floor=1e-4, is_outproj_norm=False, is_mimo=False, mimo_rank=4,
                 fuse_pregate_headwise_norm=True, chunk_size=64, dropout=0.0, layer_idx=None, n_layer=None,
                 device=None, dtype=None, **kwargs):
        d_inner = int(expand * d_model)
        if d_inner % headdim:
            raise ValueError(f"Mamba3: headdim {headdim} must divide d_inner = expand x d_model = {d_inner}")
        if rope_fraction not in (0.5, 1.0):
            raise ValueError(f"Mamba3: rope_fraction must be 0.5 or 1.0 (mamba_ssm's choices), not {rope_fraction}")
        if int(d_state * rope_fraction) // 2 < 1:
            raise ValueError(f"Mamba3: d_state {d_state} x rope_fraction {rope_fraction} rotates no pair")
        if (d_inner // headdim) % ngroups:
            raise ValueError(f"Mamba3: ngroups {ngroups} must divide the {d_inner // headdim} heads")
        rank = mimo_rank if is_mimo else 1
        if rank < 1:
            raise ValueError(f"Mamba3: mimo_rank must be at least 1, not {mimo_rank}")
        cfg = ModelConfig(arch="mamba3", d_model=d_model, d_state=d_state, expand=expand, headdim=headdim,
                          ngroups=ngroups, chunk_size=chunk_size, rope_fraction=rope_fraction, dt_min=dt_min,
                          dt_max=dt_max, dt_init_floor=dt_init_floor, a_min=A_floor, mamba3_form="released",
                          mimo_rank=rank, outproj_norm=bool(is_outproj_norm), norm_eps=1e-5)
        super().__init__(cfg)
        self.d_model, self.d_state, self.expand, self.headdim = d_model, d_state, expand, headdim
        self.chunk_size, self.layer_idx, self.A_floor = chunk_size, layer_idx, A_floor
        self.is_outproj_norm, self.is_mimo, self.mimo_rank = bool(is_outproj_norm), bool(is_mimo), rank
        self.d_inner, self.nheads, self.num_bc_heads = d_inner, d_inner // headdim, ngroups
        self.num_rope_angles = self.n_angles
        self.to(device=device, dtype=dtype)

    def forward(self, u, seq_idx=None, cu_seqlens=None, inference_params=None):
        """u (batch, seqlen, d_model) -> (batch, seqlen, d_model); with `inference_params` (an
        object with key_value_memory_dict and seqlen_offset, mamba_ssm's InferenceParams) the
        prompt fills this layer's cache, and a later call (seqlen_offset > 0) is one step."""
        if cu_seqlens is not None:
            raise ValueError("Mamba3 on sonata's kernels: variable-length packing (cu_seqlens) is not built")
        if inference_params is None:
            return super().forward(u)
        cache = self.cache_states(inference_params, u.shape[0])
        if inference_params.seqlen_offset > 0:
            return self.step(u[:, -1], *cache)[0][:, None]
        out, new = super().forward(u, return_state=True)          # a prompt starts from zero, as in mamba_ssm
        self.write_back(cache, new)
        return out

    @staticmethod
    @torch.no_grad()
    def write_back(cache, new):
        angle, ssm, k, v = cache
        angle.copy_(torch.remainder(new[0], 2 * math.pi))
        ssm.copy_(new[1])
        k.copy_(new[2])
        v.copy_(new[3])

    def step(self, u, angle_state, ssm_state, k_state, v_state, **kwargs):
        """One token, mamba_ssm's signature: u (batch, d_model) -> (out (batch, d_model), angle,
        ssm, k, v states), the states updated in place."""
        cache = (angle_state, ssm_state, k_state, v_state)
        state = tuple(t.clone() for t in cache)
        out, new = super().step(u, state)
        self.write_back(cache, new)
        return (out, *cache)

    def allocate_inference_cache(self, batch_size, max_seqlen, device=None, dtype=None, **kwargs):
        device = self.in_proj.weight.device if device is None else device
        dtype = self.in_proj.weight.dtype if dtype is None else dtype
        h, p, n = self.nheads, self.headdim, self.d_state
        return (torch.zeros(batch_size, h, self.num_rope_angles, device=device, dtype=torch.float32),
                torch.zeros(batch_size, h, p, n, device=device, dtype=torch.float32),
                torch.zeros(batch_size, self.mimo_rank, h, n, device=device, dtype=dtype),
                torch.zeros(batch_size, h, p, device=device, dtype=dtype))

    def cache_states(self, inference_params, batch_size):
        if self.layer_idx is None:
            raise ValueError("Mamba3: an inference cache needs layer_idx (the layer's key in the cache)")
        memory = inference_params.key_value_memory_dict
        if self.layer_idx not in memory:
            memory[self.layer_idx] = self.allocate_inference_cache(batch_size, 0)
        return memory[self.layer_idx]


__all__ = ["Mamba3", "heavy_tail_activation"]
